"""Failures that belong to one node stay with that node, and bad input is refused typed.

An unpicklable result, an unpicklable emission, a malformed spawn request, a graph that
names a missing node, operations that ignore cancellation: each fails (or is dropped, or
refused, or cancelled) alone, with a typed error or entry naming what it concerns, and the
run goes on.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
import ray
from running import run

from opgraph.actors import Session
from opgraph.kernel import Edge, Graph, SpawnRequest, UnknownNodeError, create_operation

TIMEOUT = 60.0


class Unpicklable:
    """Holds a lock: it cannot cross to the executor."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


async def unpicklable_result(branch: Any, **parameters: Any) -> Any:
    return {"handle": Unpicklable()}


async def unpicklable_emission(branch: Any, **parameters: Any) -> dict[str, Any]:
    """Emit one request that cannot be pickled, wait past the live emission window, and say where
    this worker's stderr goes and how long it was before (what the worker printed is read there)."""
    stderr = os.readlink("/proc/self/fd/2")
    offset = os.path.getsize(stderr)
    request = SpawnRequest(instruction="carry a lock")
    object.__setattr__(request, "reason", threading.Lock())  # as a model_construct'ed field would
    branch.emit(request)
    await asyncio.sleep(0.05)  # the live send is tried meanwhile
    return {"stderr": stderr, "offset": offset}


async def fine(branch: Any, **parameters: Any) -> str:
    return "fine"


def test_an_unpicklable_result_fails_only_its_node_and_its_batch_neighbours_complete(session):
    """bad | 29 x fine, one batch: bad fails UnserialisableOutcome naming it and the type; the rest complete."""
    session.register_operation("unpicklable_result", unpicklable_result, record_turn=False)
    session.register_operation("fine", fine, record_turn=False)
    graph = Graph("unpicklable")
    bad = graph.add_node(create_operation("unpicklable_result", {"instruction": "bad"}))
    good = [graph.add_node(create_operation("fine", {"instruction": f"n{i}"})) for i in range(29)]

    envelope = run(session.flow(graph, max_concurrent=30))

    assert envelope["failed_operations"] == [bad.id]
    assert {envelope["operation_statuses"][node.id] for node in good} == {"completed"}
    result = envelope["operation_results"][bad.id]
    assert result["error_type"] == "UnserialisableOutcome"
    assert bad.id in result["error"] and "dict" in result["error"] and "lock" in result["error"]
    assert "\x1b[" not in result["error"]


def test_an_unpicklable_emission_is_one_dropped_spawn_and_one_line(session):
    """bad | good: bad emits a spawn request holding a lock, which cannot be pickled to the executor.

    The request is a dropped spawn naming its emitter and the reason, bad and good complete,
    and bad's worker printed one line naming the node and the reason, no traceback
    (issue #32: about 60 lines of Ray's serialisation traceback, and bad failed).
    """
    session.register_operation("unpicklable_emission", unpicklable_emission, record_turn=False)
    session.register_operation("fine", fine, record_turn=False)
    graph = Graph("unpicklable-emission")
    bad = graph.add_node(create_operation("unpicklable_emission", {"instruction": "bad"}))
    good = graph.add_node(create_operation("fine", {"instruction": "good"}))

    envelope = run(session.flow(graph, reactive=True, max_concurrent=2))

    assert envelope["operation_statuses"] == {bad.id: "completed", good.id: "completed"}
    [dropped] = envelope["dropped_spawns"]
    assert (dropped["reason"], dropped["emitter_id"]) == ("invalid_request", bad.id)
    assert "SpawnRequest" in dropped["error"] and "cannot pickle '_thread.lock' object" in dropped["error"]
    where = envelope["operation_results"][bad.id]
    with open(where["stderr"], errors="replace") as printed:
        printed.seek(where["offset"])
        lines = [line for line in printed.read().splitlines() if line.strip()]
    assert len(lines) == 1, "\n".join(lines[:80])
    assert bad.id in lines[0] and "cannot pickle '_thread.lock' object" in lines[0]


async def malformed_requests(branch: Any, **parameters: Any) -> dict[str, Any]:
    return {"spawn": [SpawnRequest.model_construct(instruction=None),
                      SpawnRequest.model_construct(instruction="x" * 1_000_000),
                      SpawnRequest(instruction="a real one")]}


def test_malformed_spawn_requests_are_dropped_with_a_reason_and_the_good_one_runs(session):
    """emitter returns two malformed requests and one good one: only the good child is admitted."""
    session.register_operation("malformed_requests", malformed_requests, record_turn=False)
    session.register_operation("operate", fine, record_turn=False)
    graph = Graph("malformed")
    graph.add_node(create_operation("malformed_requests", {"instruction": "go"}))

    envelope = run(session.flow(graph, reactive=True))

    assert envelope["status"] == "completed" and envelope["spawned_operations"] == 1
    assert [entry["reason"] for entry in envelope["dropped_spawns"]] == ["invalid_request", "invalid_request"]
    assert "1,000,000 characters" in envelope["dropped_spawns"][1]["error"]


def test_a_graph_with_an_edge_to_a_missing_node_is_refused_before_anything_is_shipped(session):
    graph = Graph("dangling")
    a = graph.add_node(create_operation("noop", {"instruction": "a"}))
    edge = Edge(head=a.id, tail="nowhere")
    graph.edges[edge.id] = edge
    before = ray.get(session.runtime.executor.statistics.remote())["runs_started"]

    with pytest.raises(UnknownNodeError) as refused:
        run(session.flow(graph))

    assert refused.value.node_id == "nowhere" and refused.value.edge_id == edge.id
    assert ray.get(session.runtime.executor.statistics.remote())["runs_started"] == before


def stubborn_operation(gauge: Any):
    async def stubborn(branch: Any, key: str = "", **parameters: Any) -> str:
        """Tells the Gauge it runs, then ignores cancellation: swallows it and keeps sleeping."""
        await gauge.enter.remote(key)
        return await _ignore_cancellation()

    return stubborn


async def _ignore_cancellation() -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue
    return "finally"


def test_operations_that_ignore_cancellation_are_reported_cancelled_after_the_grace_period(session, gauge):
    """stubborn x2 run, then ignore the cancel: flow returns once the 0.5 s grace has passed, both
    cancelled, and on_progress says cancelled for each (it had said queued and started)."""
    with Session(cancel_grace=0.5) as own:
        own.register_operation("stubborn", stubborn_operation(gauge), record_turn=False)
        graph = Graph("stubborn")
        nodes = [graph.add_node(create_operation("stubborn", {"instruction": f"n{i}", "key": "stubborn"}))
                 for i in range(2)]
        seen: list[tuple[str, str]] = []
        executor_ref: dict[str, Any] = {}

        def progress(op_id: str, name: str, status: str, elapsed: float) -> None:
            seen.append((op_id, status))

        async def scenario() -> tuple[dict[str, Any], float]:
            flow = asyncio.create_task(own.flow(graph, max_concurrent=2, executor_ref=executor_ref,
                                                on_progress=progress))
            await asyncio.wait_for(gauge.wait_entered.remote("stubborn", 2), TIMEOUT)  # both really run
            cancelled_at = time.monotonic()
            await executor_ref["executor"].cancel()
            return await flow, time.monotonic() - cancelled_at

        envelope, seconds = run(scenario())

    assert 0.4 < seconds < 5.0
    assert envelope["status"] == "cancelled"
    assert set(envelope["cancelled_operations"]) == {node.id for node in nodes}
    for node in nodes:
        assert [status for op_id, status in seen if op_id == node.id] == ["queued", "started", "cancelled"]
    with pytest.raises(Exception, match="cancel_grace"):
        Session(cancel_grace=0)


def test_a_node_cancelled_while_running_is_reported_cancelled_to_on_progress(session):
    graph = Graph("cancelled-mid-run")
    node = graph.add_node(create_operation("sleep", {"seconds": 30.0}))
    seen: list[tuple[str, str]] = []
    started = asyncio.Event()
    executor_ref: dict[str, Any] = {}

    def progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        seen.append((op_id, status))
        if status == "started":
            started.set()

    async def scenario() -> dict[str, Any]:
        flow = asyncio.create_task(session.flow(graph, executor_ref=executor_ref, on_progress=progress))
        await asyncio.wait_for(started.wait(), TIMEOUT)
        await executor_ref["executor"].cancel()
        return await flow

    envelope = run(scenario())
    assert envelope["operation_statuses"] == {node.id: "cancelled"}
    assert seen == [(node.id, "queued"), (node.id, "started"), (node.id, "cancelled")]
