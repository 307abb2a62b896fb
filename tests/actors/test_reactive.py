"""Reactive runs end to end: spawns, the cap, duplicates, injection, routing errors, escalation.

Requests leave an operation in a worker process (returned in its response, or sent live
with ``branch.emit``) and are admitted by the GraphExecutor's scheduler. Children run
the ``operate`` operation registered here. Cycle rollback cannot be reached through a
spawn (a new node has no out-edges); the kernel tests cover it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray
from running import run

from opgraph.kernel import (
    EscalationRequest,
    Graph,
    SpawnRequest,
    create_operation,
    role_node_builder,
)

SIGNAL_TIMEOUT = 30.0


async def operate(branch: Any, instruction: str = "", **parameters: Any) -> dict[str, str]:
    """What spawned children run: echo the instruction they were given."""
    return {"handled": instruction}


def held_operation(gauge: Any):
    """An operation that stays in flight until the test releases its ``hold`` latch."""

    async def held(branch: Any, hold: str, **parameters: Any) -> str:
        await gauge.wait_released.remote(hold)
        return "released"

    return held


def single_node(operation: str, **parameters: Any) -> tuple[Graph, str]:
    graph = Graph("reactive")
    node = graph.add_node(create_operation(operation, parameters))
    return graph, node.id


def workers_counted(session: Any, counter: str) -> int:
    """A counter of the workers' ``statistics()``, summed over the runtime's workers."""
    return sum(ray.get(worker.statistics.remote())[counter] for worker in session.runtime.workers)


def children_of(envelope: dict[str, Any], graph: Graph) -> list[str]:
    """Node ids the run added to the graph (the caller's graph keeps only its own nodes)."""
    return [node_id for node_id in envelope["operation_statuses"] if node_id not in graph.nodes]


def test_spawn_request_in_a_response_runs_a_child(session):
    """emitter => child: one SpawnRequest in the response becomes one completed child."""

    async def spawn_one(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"summary": "needs a helper", "spawn": SpawnRequest(instruction="write the helper")}

    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("spawn_one", spawn_one, record_turn=False)
    graph, emitter = single_node("spawn_one")

    envelope = run(session.flow(graph, reactive=True))

    [child] = children_of(envelope, graph)
    assert envelope["spawned_operations"] == 1
    assert envelope["dropped_spawns"] == []
    assert envelope["operation_statuses"] == {emitter: "completed", child: "completed"}
    assert envelope["operation_results"][child] == {"handled": "write the helper"}


def test_spawns_past_max_spawn_are_dropped_with_the_cap_reason(session):
    """emitter => four requests, max_spawn=2: two children run, two ledger entries."""

    async def spawn_four(branch: Any, **parameters: Any) -> list[SpawnRequest]:
        return [SpawnRequest(instruction=f"task {index}") for index in range(4)]

    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("spawn_four", spawn_four, record_turn=False)
    graph, emitter = single_node("spawn_four")

    envelope = run(session.flow(graph, reactive=True, max_spawn=2))

    children = children_of(envelope, graph)
    assert envelope["spawned_operations"] == 2
    assert len(children) == 2
    assert all(envelope["operation_statuses"][child] == "completed" for child in children)
    assert [entry["reason"] for entry in envelope["dropped_spawns"]] == ["max_spawn_exceeded"] * 2
    assert all(entry["emitter_id"] == emitter for entry in envelope["dropped_spawns"])


@pytest.mark.parametrize("linger", [0.1, 0.0], ids=["live-first", "racing-outcome"])
def test_request_emitted_live_and_returned_is_admitted_once(session, linger):
    """emitter => child: the same request sent by ``branch.emit`` and returned counts once.

    With ``linger`` the live message lands while the emitter still runs; without it, it
    races the outcome. Either order admits one child and records one duplicate.
    """

    async def emit_and_return(branch: Any, **parameters: Any) -> dict[str, Any]:
        request = SpawnRequest(instruction="only once")
        branch.emit(request)
        await asyncio.sleep(linger)
        return {"spawn": request}

    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("emit_and_return", emit_and_return, record_turn=False)
    graph, emitter = single_node("emit_and_return")

    envelope = run(session.flow(graph, reactive=True))

    assert envelope["spawned_operations"] == 1
    assert len(children_of(envelope, graph)) == 1
    assert envelope["dropped_spawns"] == [{"reason": "duplicate", "assignee": None, "emitter_id": emitter}]


def counted_operate(gauge: Any, key: str):
    """The children's ``operate``: handles the instruction, then tells the Gauge it is done."""

    async def operate_and_count(branch: Any, instruction: str = "", **parameters: Any) -> dict[str, str]:
        await gauge.enter.remote(key)
        return {"handled": instruction}

    return operate_and_count


def test_live_emissions_are_admitted_while_the_emitter_runs_and_travel_together(session, gauge):
    """emitter => 200 independent children sent by ``branch.emit``: they run before the
    emitter ends (it waits until all 200 have run), and reach the executor in a few
    messages, not one per request."""
    width = 200
    order: list[tuple[str, str]] = []

    async def emit_many(branch: Any, **parameters: Any) -> int:
        for index in range(width):
            branch.emit(SpawnRequest(instruction=f"live {index}", independent=True))
        await gauge.wait_entered.remote("live-many", width)  # every child ran while this one waited
        return width

    session.register_operation("operate", counted_operate(gauge, "live-many"), record_turn=False)
    session.register_operation("emit_many", emit_many, record_turn=False)
    graph, emitter = single_node("emit_many")

    envelope = run(session.flow(graph, reactive=True, max_spawn=width, max_concurrent=1000,
                                on_progress=lambda op_id, name, status, elapsed: order.append((op_id, status))))

    children = children_of(envelope, graph)
    assert envelope["spawned_operations"] == width and envelope["dropped_spawns"] == []
    assert {envelope["operation_statuses"][child] for child in children} == {"completed"}
    # Every child ran (entered the Gauge) before the emitter returned, so each was dispatched
    # while the emitter still ran: admitted live, not from its outcome.
    emitter_done = order.index((emitter, "completed"))
    assert all(order.index((child, "started")) < emitter_done for child in children)
    # Live requests, dispatches and outcome streams together: far fewer than one per child (sent
    # one per request, the live requests alone would be 200). Outcomes leave a worker each turn
    # of its loop rather than each millisecond, so a few more messages than before: 57 once.
    assert envelope["scheduler_messages"] < width // 2


def test_a_request_emitted_from_a_thread_is_sent_at_once_and_admitted_live(session, gauge):
    """emitter => child, where the emitter calls ``branch.emit`` from a worker thread (off its
    event loop): the request cannot wait for the loop's window, so it is sent on its own,
    and the independent child runs while the emitter still waits for it."""
    order: list[tuple[str, str]] = []

    async def emit_from_thread(branch: Any, **parameters: Any) -> str:
        await asyncio.to_thread(branch.emit, SpawnRequest(instruction="from a thread", independent=True))
        await gauge.wait_entered.remote("from-thread", 1)
        return "emitted"

    session.register_operation("operate", counted_operate(gauge, "from-thread"), record_turn=False)
    session.register_operation("emit_from_thread", emit_from_thread, record_turn=False)
    graph, emitter = single_node("emit_from_thread")

    envelope = run(session.flow(graph, reactive=True,
                                on_progress=lambda op_id, name, status, elapsed: order.append((op_id, status))))

    [child] = children_of(envelope, graph)
    assert envelope["operation_results"][child] == {"handled": "from a thread"}
    assert order.index((child, "started")) < order.index((emitter, "completed"))
    assert envelope["spawned_operations"] == 1
    assert envelope["dropped_spawns"] == []  # the outcome's redelivered copy is no duplicate


def test_requests_emitted_by_an_operation_that_returns_at_once_travel_once_in_its_outcome(session):
    """emitter => 50 children emitted live, and it returns in the same turn of the loop: the
    live message is taken back before it leaves, since the outcome carries every request,
    and the 50 are admitted once from there."""
    width = 50

    async def emit_and_return(branch: Any, **parameters: Any) -> int:
        for index in range(width):
            branch.emit(SpawnRequest(instruction=f"planned {index}"))
        return width

    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("emit_and_return", emit_and_return, record_turn=False)
    graph, _ = single_node("emit_and_return")
    before = workers_counted(session, "live_withdrawn")

    envelope = run(session.flow(graph, reactive=True, max_spawn=width))

    children = children_of(envelope, graph)
    assert envelope["spawned_operations"] == width and envelope["dropped_spawns"] == []
    assert sorted(envelope["operation_results"][child]["handled"] for child in children) == sorted(
        f"planned {index}" for index in range(width))
    assert workers_counted(session, "live_withdrawn") - before == width


@pytest.mark.parametrize("width, words, fetched", [(200, 40, True), (20, 1, False)], ids=["large", "small"])
def test_a_planners_result_reaches_each_child_whole_and_large_ones_cross_to_a_worker_once(session, width, words,
                                                                                          fetched):
    """planner => N children, each given the planner's result in its context. A large result
    (200 requests of 40 words, over 16 KiB pickled) is fetched by each worker once for the
    run, not sent in every call; a small one travels in the calls. Either way every child
    sees all N requests."""

    async def plan(branch: Any, **parameters: Any) -> list[SpawnRequest]:
        return [SpawnRequest(instruction=" ".join([f"step-{index}"] * words)) for index in range(width)]

    async def look(branch: Any, instruction: str = "", context: Any = None, **parameters: Any) -> int:
        [result] = [value for key, value in context.items() if key.endswith("_result")]
        assert [request["instruction"] for request in result] == [
            " ".join([f"step-{index}"] * words) for index in range(width)]
        return len(result)

    session.register_operation("operate", look, record_turn=False)
    session.register_operation("plan", plan, record_turn=False)
    graph, _ = single_node("plan")
    before = workers_counted(session, "shared_fetches")

    envelope = run(session.flow(graph, reactive=True, max_spawn=width, max_concurrent=50))

    children = children_of(envelope, graph)
    assert len(children) == width
    assert {envelope["operation_results"][child] for child in children} == {width}
    if fetched:
        assert 1 <= workers_counted(session, "shared_fetches") - before <= len(session.runtime.workers)
    else:
        assert workers_counted(session, "shared_fetches") == before


def test_inject_admits_a_prebuilt_operation_once_and_only_while_running(session, gauge):
    """root (held) + injected: inject -> True; the same op again -> False (duplicate); after -> False."""
    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("held", held_operation(gauge), record_turn=False)
    graph, root = single_node("held", hold="inject")
    injected = create_operation("operate", {"instruction": "injected work"})
    executor_ref: dict[str, Any] = {}
    started = asyncio.Event()

    def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        if op_id == root and status == "started":
            started.set()

    async def scenario() -> tuple[list[bool], dict[str, Any], bool]:
        flow = asyncio.create_task(
            session.flow(graph, reactive=True, executor_ref=executor_ref, on_progress=on_progress)
        )
        await asyncio.wait_for(started.wait(), SIGNAL_TIMEOUT)
        control = executor_ref["executor"]
        during = [await control.inject(injected), await control.inject(injected)]
        await gauge.release.remote("inject")
        envelope = await flow
        after = await control.inject(create_operation("operate", {"instruction": "too late"}))
        return during, envelope, after

    during, envelope, after = run(scenario())

    assert during == [True, False]
    assert after is False
    assert envelope["spawned_operations"] == 1
    assert envelope["operation_statuses"][injected.id] == "completed"
    assert envelope["operation_results"][injected.id] == {"handled": "injected work"}
    assert [(entry["reason"], entry["op_id"]) for entry in envelope["dropped_spawns"]] == [
        ("duplicate", injected.id)
    ]


def test_inject_into_a_run_that_is_not_reactive_is_refused(session, gauge):
    """root (held), reactive=False: inject answers False and the graph is unchanged."""
    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("held", held_operation(gauge), record_turn=False)
    graph, root = single_node("held", hold="inject-refused")
    executor_ref: dict[str, Any] = {}
    started = asyncio.Event()

    def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        if status == "started":
            started.set()

    async def scenario() -> tuple[bool, dict[str, Any]]:
        flow = asyncio.create_task(session.flow(graph, executor_ref=executor_ref, on_progress=on_progress))
        await asyncio.wait_for(started.wait(), SIGNAL_TIMEOUT)
        accepted = await executor_ref["executor"].inject(create_operation("operate", {"instruction": "x"}))
        await gauge.release.remote("inject-refused")
        return accepted, await flow

    accepted, envelope = run(scenario())

    assert accepted is False
    assert list(envelope["operation_statuses"]) == [root]


def test_unknown_assignee_is_a_builder_error_in_the_ledger(session):
    """emitter => writer child; a request for an unknown role is dropped as builder_error."""

    async def assign(branch: Any, **parameters: Any) -> list[SpawnRequest]:
        return [
            SpawnRequest(instruction="draft it", assignee="writer"),
            SpawnRequest(instruction="haunt it", assignee="ghost"),
        ]

    session.register_operation("operate", operate, record_turn=False)
    session.register_operation("assign", assign, record_turn=False)
    graph, emitter = single_node("assign")

    envelope = run(session.flow(graph, reactive=True, node_builder=role_node_builder({"writer": None})))

    [child] = children_of(envelope, graph)
    assert envelope["spawned_operations"] == 1
    assert envelope["operation_results"][child] == {"handled": "draft it"}
    [dropped] = envelope["dropped_spawns"]
    assert dropped["reason"] == "builder_error"
    assert dropped["assignee"] == "ghost"
    assert dropped["emitter_id"] == emitter
    assert "unknown assignee 'ghost'" in dropped["error"]


def test_higher_tier_escalation_runs_an_independent_retry_with_the_notice(session):
    """emitter => retry: the emitter escalates; a child of the same operation runs with the notice."""

    async def solve(branch: Any, instruction: str = "", **parameters: Any) -> Any:
        if instruction.startswith("[ESCALATION]"):
            return {"solved_with": instruction}
        return EscalationRequest(reason="too hard", route="higher_tier")

    session.register_operation("solve", solve, record_turn=False)
    graph, emitter = single_node("solve", instruction="prove the lemma")

    envelope = run(session.flow(graph, reactive=True))

    [retry] = children_of(envelope, graph)
    assert envelope["escalated_operations"] == [emitter]
    assert envelope["operation_statuses"][retry] == "completed"
    notice = envelope["operation_results"][retry]["solved_with"]
    assert "too hard" in notice
    assert notice.endswith("prove the lemma")


def test_children_past_the_capacity_run_on_clones_of_their_emitters_branch_made_before_they_start(session):
    """emitter (writes a note to its branch) => 12 children at max_concurrent=2: only the first
    children's clones are waited for before the first dispatch, the rest are made behind them.
    Every child, the last one dispatched too, reads the emitter's note on a branch of its own
    and appends to it without reaching another child's branch."""

    async def note_and_spawn(branch: Any, **parameters: Any) -> list[SpawnRequest]:
        await branch.append({"role": "assistant", "content": "note from the emitter"})
        return [SpawnRequest(instruction=f"task {index}") for index in range(12)]

    async def read_and_write(branch: Any, instruction: str = "", **parameters: Any) -> dict[str, Any]:
        seen = [message["content"] for message in await branch.messages()]
        await branch.append({"role": "assistant", "content": instruction})
        return {"branch": branch.id, "seen": seen}

    session.register_operation("note_and_spawn", note_and_spawn, record_turn=False)
    session.register_operation("operate", read_and_write, record_turn=False)
    graph, emitter = single_node("note_and_spawn")
    graph.nodes[emitter].branch_id = None

    envelope = run(session.flow(graph, reactive=True, max_spawn=12, max_concurrent=2, isolated=True))

    children = children_of(envelope, graph)
    results = [envelope["operation_results"][child] for child in children]
    assert len(children) == 12 and all(envelope["operation_statuses"][child] == "completed" for child in children)
    assert all(result["seen"] == ["note from the emitter"] for result in results)
    assert len({result["branch"] for result in results}) == 12
