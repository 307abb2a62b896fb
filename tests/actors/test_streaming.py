"""flow_stream end to end: one FlowEvent per settled operation, and early close.

Closing the generator early must cancel the run's remaining work and await its
settlement before control returns to the caller.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from gauged_operations import gauged_operation
from running import run

from opgraph.actors import flow_stream
from opgraph.kernel import EdgeCondition, Graph, OperationGraphBuilder, SpawnRequest, create_operation


class VerdictIs(EdgeCondition):
    def __init__(self, expected: str) -> None:
        self.expected = expected

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        return input["result"]["verdict"] == self.expected


async def collect(stream: Any) -> list[Any]:
    return [event async for event in stream]


def test_stream_yields_one_event_per_settled_operation(session):
    """ok ; boom ; check -(verdict == yes)-> gated ; spawner => child.

    ok completes, boom fails, gated is skipped, and the spawned child (flow_stream runs
    reactive) completes with ``spawned`` set.
    """

    async def fine(branch: Any, **parameters: Any) -> str:
        return "fine"

    async def boom(branch: Any, **parameters: Any) -> str:
        raise ValueError("boom")

    async def check(branch: Any, **parameters: Any) -> dict[str, str]:
        return {"verdict": "no"}

    async def spawner(branch: Any, **parameters: Any) -> SpawnRequest:
        return SpawnRequest(instruction="child work")

    async def operate(branch: Any, instruction: str = "", **parameters: Any) -> str:
        return instruction

    for name, operation in {"fine": fine, "boom": boom, "check_verdict": check,
                            "spawner": spawner, "operate": operate}.items():
        session.register_operation(name, operation, record_turn=False)
    builder = OperationGraphBuilder("stream")
    ok = builder.add_operation("fine", node_id="ok", depends_on=[])
    failing = builder.add_operation("boom", node_id="failing", depends_on=[])
    check_node = builder.add_operation("check_verdict", depends_on=[])
    spawning = builder.add_operation("spawner", depends_on=[])
    graph: Graph = builder.get_graph()
    gated = graph.add_node(create_operation("fine")).id
    graph.add_edge(check_node, gated, condition=VerdictIs("yes"))

    events = run(collect(flow_stream(session, graph)))

    by_id = {event.operation_id: event for event in events}
    assert len(events) == len(by_id) == 6
    [child] = [node_id for node_id in by_id if node_id not in graph.nodes]
    assert {node_id: event.status for node_id, event in by_id.items()} == {
        ok: "completed", failing: "failed", check_node: "completed", gated: "skipped",
        spawning: "completed", child: "completed",
    }
    assert [node_id for node_id, event in by_id.items() if event.ok] == [
        node_id for node_id in by_id if node_id not in (failing, gated)
    ]
    assert by_id[ok].name == "ok" and by_id[ok].result == "fine"
    assert by_id[failing].result["error_type"] == "ValueError"
    assert by_id[child].spawned is True and by_id[child].result == "child work"
    assert [node_id for node_id, event in by_id.items() if event.spawned] == [child]


def test_closing_the_stream_early_cancels_and_settles_the_rest(session, gauge):
    """Twenty slow roots at max_concurrent=2: leave after the first event.

    The generator's finally cancels the run and awaits its settlement, so when the
    ``async with`` block ends nothing is in flight and most nodes never ran.
    """

    session.register_operation("slow_streamed", gauged_operation(gauge, 0.2), record_turn=False)
    builder = OperationGraphBuilder("early-close")
    for _ in range(20):
        builder.add_operation("slow_streamed", depends_on=[], key="early-close")

    async def scenario() -> tuple[Any, dict[str, Any]]:
        async with contextlib.aclosing(flow_stream(session, builder.get_graph(), max_concurrent=2)) as stream:
            async for event in stream:
                first = event
                break
        return first, await session.runtime.executor.statistics.remote()

    first, statistics = run(scenario())

    assert first.status == "completed"
    assert statistics["active_runs"] == 0
    assert statistics["in_flight"] == 0
    executed = ray.get(gauge.snapshot.remote("early-close"))
    assert executed["in_flight"] == 0
    assert 1 <= executed["entered"] < 20
