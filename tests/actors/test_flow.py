"""Session.flow end to end: capacity, order, conditions, context and signals across processes.

Every test runs real operations in the OperationWorker pool, driven by the shared
GraphExecutor; what a test asserts is measured inside the operations themselves.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray
from gauged_operations import gauged_operation
from running import run

from opgraph.actors import flow_stream
from opgraph.kernel import (
    EdgeCondition,
    Graph,
    OperationError,
    OperationGraphBuilder,
    OpGraphError,
    SpawnRequest,
    create_operation,
)


async def timed(branch: Any, seconds: float = 0.05, **parameters: Any) -> dict[str, Any]:
    """Report when the operation started and ended (one clock: every process is on this host)."""
    started = time.time()
    await asyncio.sleep(seconds)
    return {"start": started, "end": time.time()}


class ResultSays(EdgeCondition):
    """Pass when the predecessor's result has ``verdict`` equal to ``expected`` (a sync apply)."""

    def __init__(self, expected: str) -> None:
        self.expected = expected

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        return input["result"]["verdict"] == self.expected


def fan_out(operation: str, count: int, **parameters: Any) -> Graph:
    builder = OperationGraphBuilder("fan-out")
    for _ in range(count):
        builder.add_operation(operation, depends_on=[], **parameters)
    return builder.get_graph()


def test_fan_out_in_flight_is_bounded_by_max_concurrent(session, gauge):
    """Twelve independent roots, max_concurrent=3: exactly three run at once, never more."""
    session.register_operation("gauged_fan_out", gauged_operation(gauge, 0.2), record_turn=False)
    graph = fan_out("gauged_fan_out", 12, key="fan-out-3")

    envelope = run(session.flow(graph, max_concurrent=3))

    assert envelope["status"] == "completed"
    assert len(envelope["completed_operations"]) == 12
    assert ray.get(gauge.snapshot.remote("fan-out-3")) == {"in_flight": 0, "peak": 3, "entered": 12}


def test_sequential_flow_runs_one_operation_at_a_time(session, gauge):
    """Four independent roots with parallel=False: the peak in flight is one."""
    session.register_operation("gauged_sequential", gauged_operation(gauge, 0.05), record_turn=False)
    graph = fan_out("gauged_sequential", 4, key="sequential")

    envelope = run(session.flow(graph, parallel=False, max_concurrent=5))

    assert envelope["status"] == "completed"
    assert ray.get(gauge.snapshot.remote("sequential")) == {"in_flight": 0, "peak": 1, "entered": 4}


def test_dependents_start_after_their_dependency_ends(session):
    """a -> b -> c: each starts only after its predecessor has finished."""
    session.register_operation("timed", timed, record_turn=False)
    builder = OperationGraphBuilder("chain")
    a = builder.add_operation("timed")
    b = builder.add_operation("timed")
    c = builder.add_operation("timed")

    envelope = run(session.flow(builder.get_graph(), max_concurrent=5))

    results = envelope["operation_results"]
    assert envelope["completed_operations"] == [a, b, c]
    assert results[b]["start"] >= results[a]["end"]
    assert results[c]["start"] >= results[b]["end"]


def test_false_condition_skips_the_node_and_its_only_descendant(session):
    """check -(verdict == yes)-> yes ; check -(verdict == no)-> no -> after_no.

    ``check`` says yes: ``yes`` runs; ``no`` is skipped, and so is ``after_no``, whose
    only incoming path is skipped. on_progress reports "skipped", never "failed".
    """

    async def check(branch: Any, **parameters: Any) -> dict[str, str]:
        return {"verdict": "yes"}

    async def branch_taken(branch: Any, **parameters: Any) -> str:
        return "ran"

    session.register_operation("check", check, record_turn=False)
    session.register_operation("branch_taken", branch_taken, record_turn=False)
    graph = Graph("conditional")
    check_node = graph.add_node(create_operation("check"))
    yes = graph.add_node(create_operation("branch_taken"))
    no = graph.add_node(create_operation("branch_taken"))
    after_no = graph.add_node(create_operation("branch_taken"))
    graph.add_edge(check_node, yes, condition=ResultSays("yes"))
    graph.add_edge(check_node, no, condition=ResultSays("no"))
    graph.add_edge(no, after_no)
    progress: dict[str, list[str]] = {}

    def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        progress.setdefault(op_id, []).append(status)

    envelope = run(session.flow(graph, on_progress=on_progress))

    statuses = envelope["operation_statuses"]
    assert statuses == {check_node.id: "completed", yes.id: "completed", no.id: "skipped", after_no.id: "skipped"}
    assert envelope["skipped_operations"] == [no.id, after_no.id]
    assert envelope["operation_results"][yes.id] == "ran"
    assert no.id not in envelope["operation_results"]
    assert progress[no.id] == ["queued", "skipped"]
    assert progress[after_no.id] == ["queued", "skipped"]
    assert all("failed" not in seen for seen in progress.values())


def test_dependent_sees_its_predecessor_result_under_its_uuid_key(session):
    """a -> b: b's context holds ``<a>_result`` with a's response."""

    async def produce(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"answer": 42}

    async def show_context(branch: Any, context: dict[str, Any], **parameters: Any) -> dict[str, Any]:
        return {"seen": context}

    session.register_operation("produce", produce, record_turn=False)
    session.register_operation("show_context", show_context, record_turn=False)
    builder = OperationGraphBuilder("context-keys")
    a = builder.add_operation("produce")
    b = builder.add_operation("show_context")

    envelope = run(session.flow(builder.get_graph()))

    seen = envelope["operation_results"][b]["seen"]
    assert seen[f"{a}_result"] == {"answer": 42}


def test_response_context_merges_into_shared_context_for_later_nodes(session):
    """a -> b with context={"tenant": "acme"}: a's ``{"context": {...}}`` reaches b and final_context."""

    async def plan(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"context": {"plan": "three steps"}, "value": 1}

    async def show_context(branch: Any, context: dict[str, Any], **parameters: Any) -> dict[str, Any]:
        return {"seen": context}

    session.register_operation("plan", plan, record_turn=False)
    session.register_operation("show_context", show_context, record_turn=False)
    builder = OperationGraphBuilder("shared-context")
    builder.add_operation("plan")
    b = builder.add_operation("show_context")

    envelope = run(session.flow(builder.get_graph(), context={"tenant": "acme"}))

    seen = envelope["operation_results"][b]["seen"]
    assert seen["plan"] == "three steps"
    assert seen["tenant"] == "acme"
    assert envelope["final_context"] == {"tenant": "acme", "plan": "three steps"}


def test_cyclic_graph_raises_the_typed_operation_error(session):
    """a -> b -> a: flow raises OperationError (translated, not a Ray error)."""
    graph = Graph("cycle")
    a = graph.add_node(create_operation("noop"))
    b = graph.add_node(create_operation("noop"))
    graph.add_edge(a, b)
    graph.add_edge(b, a)

    with pytest.raises(OperationError) as raised:
        run(session.flow(graph))

    assert type(raised.value) is OperationError
    assert raised.value.message == "Graph must be acyclic for flow execution"
    assert raised.value.run_id is not None and raised.value.actor.startswith("opgraph-executor-")


@pytest.mark.parametrize("not_a_graph", [OperationGraphBuilder(), {"nodes": {}}, None],
                         ids=["builder", "dict", "None"])
def test_flow_refuses_what_is_not_a_graph_with_the_typed_error(session, not_a_graph):
    """flow(builder), flow(dict), flow(None): the kernel's OperationError, never AttributeError.

    A regression (issue #32) read ``graph.nodes`` in the driver before anything checked the
    type; the refusal is the kernel's own, and nothing reaches an executor.
    """
    kind = type(not_a_graph).__name__
    with pytest.raises(OperationError, match=f"a flow runs a Graph, got {kind}") as raised:
        run(session.flow(not_a_graph))
    assert type(raised.value) is OperationError
    with pytest.raises(OperationError, match=f"a flow runs a Graph, got {kind}"):
        run(session.submit(not_a_graph))

    async def first_event() -> Any:
        async for event in flow_stream(session, not_a_graph):
            return event

    with pytest.raises(OperationError, match=f"a flow runs a Graph, got {kind}"):
        run(first_event())


def test_lifecycle_signals_are_drained_before_flow_returns(session):
    """root -> (x1..x4) -> join: every node's queued, started, completed arrive before return."""
    builder = OperationGraphBuilder("signals")
    root = builder.add_operation("sleep", seconds=0.02)
    middle = [builder.add_operation("sleep", depends_on=[root], seconds=0.02) for _ in range(4)]
    builder.add_aggregation("sleep", source_node_ids=middle, seconds=0.02)
    graph = builder.get_graph()
    progress: dict[str, list[str]] = {}

    def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        progress.setdefault(op_id, []).append(status)

    async def flow_then_snapshot() -> dict[str, list[str]]:
        await session.flow(graph, on_progress=on_progress)
        # No await between return and snapshot: nothing may arrive later.
        return {node_id: list(seen) for node_id, seen in progress.items()}

    snapshot = run(flow_then_snapshot())

    assert snapshot == {node_id: ["queued", "started", "completed"] for node_id in graph.nodes}


def test_graph_objects_reflect_the_settled_run(session):
    """a -> b: the caller's Operation objects carry status and response after flow."""

    async def answer(branch: Any, **parameters: Any) -> str:
        return "forty-two"

    session.register_operation("answer", answer, record_turn=False)
    builder = OperationGraphBuilder("write-back")
    a = builder.add_operation("answer")
    b = builder.add_operation("answer")
    graph = builder.get_graph()

    run(session.flow(graph))

    assert [graph.nodes[n].status for n in (a, b)] == ["completed", "completed"]
    assert graph.nodes[b].response == "forty-two"


class AsyncResultSays(EdgeCondition):
    """An ``async def apply``: evaluated by the executor shell, not inside the scheduler."""

    def __init__(self, expected: str) -> None:
        self.expected = expected

    async def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        await asyncio.sleep(0)
        if input["result"]["verdict"] == "explode":
            raise RuntimeError("condition blew up")
        return input["result"]["verdict"] == self.expected


def test_async_conditions_gate_and_their_errors_fail_the_node(session):
    """check -(async yes)-> yes ; check -(async no)-> no ; explode -(async yes)-> broken.

    The executor evaluates async conditions: ``yes`` runs, ``no`` is skipped, and a
    condition that raises fails ``broken`` with error_type EdgeConditionError.
    """

    async def verdict(branch: Any, says: str, **parameters: Any) -> dict[str, str]:
        return {"verdict": says}

    async def branch_taken(branch: Any, **parameters: Any) -> str:
        return "ran"

    session.register_operation("verdict", verdict, record_turn=False)
    session.register_operation("branch_taken", branch_taken, record_turn=False)
    graph = Graph("async-conditions")
    check = graph.add_node(create_operation("verdict", {"says": "yes"}))
    explode = graph.add_node(create_operation("verdict", {"says": "explode"}))
    yes, no, broken = (graph.add_node(create_operation("branch_taken")) for _ in range(3))
    graph.add_edge(check, yes, condition=AsyncResultSays("yes"))
    graph.add_edge(check, no, condition=AsyncResultSays("no"))
    graph.add_edge(explode, broken, condition=AsyncResultSays("yes"))

    envelope = run(session.flow(graph))

    statuses = envelope["operation_statuses"]
    assert (statuses[yes.id], statuses[no.id], statuses[broken.id]) == ("completed", "skipped", "failed")
    failure = envelope["operation_results"][broken.id]
    assert failure["error_type"] == "EdgeConditionError"
    assert "condition blew up" in failure["error"]


async def _registrable(branch: Any, **parameters: Any) -> str:
    return "ok"


def _not_async(branch: Any, **parameters: Any) -> str:
    return "ok"


@pytest.mark.parametrize(
    ("name", "fn", "timeout", "message"),
    [
        ("", _registrable, None, "non-empty string"),
        (None, _registrable, None, "non-empty string"),
        ("sync", _not_async, None, "must be an async function"),
        ("slow", _registrable, 0, "timeout must be a number of seconds above 0"),
        ("slow", _registrable, "5", "timeout must be a number of seconds above 0"),
    ],
    ids=["empty name", "no name", "not async", "zero timeout", "text timeout"],
)
def test_a_bad_registration_is_refused_and_registers_nothing(session, name, fn, timeout, message):
    before = dict(session.operations)
    with pytest.raises(OpGraphError, match=message):
        session.register_operation(name, fn, timeout=timeout)
    assert session.operations == before


def test_operation_failures_are_typed_outcomes_not_raises(session):
    """raises ; unregistered: both settle failed with their error type; flow itself returns."""

    async def raises(branch: Any, **parameters: Any) -> str:
        raise KeyError("missing piece")

    session.register_operation("raises", raises, record_turn=False)
    graph = Graph("failures")
    raising = graph.add_node(create_operation("raises"))
    unregistered = graph.add_node(create_operation("never_registered_anywhere"))
    progress: dict[str, list[str]] = {}

    def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
        progress.setdefault(op_id, []).append(status)

    envelope = run(session.flow(graph, on_progress=on_progress))

    results = envelope["operation_results"]
    assert envelope["status"] == "failed"
    assert envelope["failed_operations"] == [raising.id, unregistered.id]
    assert results[raising.id]["error_type"] == "KeyError"
    assert "missing piece" in results[raising.id]["error"]
    assert results[unregistered.id]["error_type"] == "OperationNotRegistered"
    assert "'never_registered_anywhere' is not registered" in results[unregistered.id]["error"]
    assert progress == {node_id: ["queued", "started", "failed"] for node_id in graph.nodes}
    assert graph.nodes[raising.id].status == "failed"


def test_each_worker_receives_a_runs_operations_with_its_first_call(session):
    """A fan-out of 40: every worker that ran calls of the run received its operations once,
    with its first call, fetched nothing from the executor, and kept none of them once the
    run was forgotten."""
    session.register_operation("timed", timed, record_turn=False)

    def counters() -> list[tuple[int, int, int, int]]:
        return [(stats["resources_shipped"], stats["resource_fetches"], stats["runs"], stats["executed"])
                for stats in ray.get([worker.statistics.remote() for worker in session.runtime.workers])]

    before = counters()
    graph = Graph("shipped")
    for _ in range(40):
        graph.add_node(create_operation("timed", {"seconds": 0.02}))
    envelope = run(session.flow(graph, max_concurrent=40))
    deadline = time.monotonic() + 5.0  # the executor's "forget" tells and this process's reads race
    while (after := counters()) and [a[2] for a in after] != [b[2] for b in before] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert envelope["status"] == "completed" and len(envelope["completed_operations"]) == 40
    ran = [a[3] - b[3] for a, b in zip(after, before, strict=True)]
    assert sum(ran) == 40
    assert [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)] == \
        [(1 if calls else 0, 0) for calls in ran]
    assert [a[2] for a in after] == [b[2] for b in before]  # the run's operations let go with it


@pytest.mark.parametrize("spawning", [False, True])
def test_the_envelope_flow_returns_is_the_one_the_run_log_recorded(session, spawning):
    """flow() receives the envelope without the node ids its graph holds (CompactEnvelope) and
    puts them back: what it returns must equal what the executor recorded, node for node,
    with a completed, a failed and a skipped node, or when the run grew by spawned nodes the
    caller's graph does not hold (then the ids travel)."""

    async def parts(branch: Any, spawn: bool = False, fail: bool = False, n: int = 0, **parameters: Any) -> Any:
        if fail:
            raise ValueError("this one fails")
        if spawn:
            return {"verdict": "yes", "spawn": [SpawnRequest(instruction=f"child {index}") for index in range(3)]}
        return {"verdict": "yes", "n": n}

    session.register_operation("parts", parts, record_turn=False)
    graph = Graph("compact")
    first = graph.add_node(create_operation("parts"))
    failing = graph.add_node(create_operation("parts", {"fail": True}))
    skipped = graph.add_node(create_operation("parts", {"n": 2}))
    graph.add_edge(first, skipped, condition=ResultSays("no"))
    plain = [graph.add_node(create_operation("parts", {"n": index, "spawn": spawning and index == 3}))
             for index in range(3, 8)]
    ids = [first.id, failing.id, skipped.id, *(node.id for node in plain)]
    run_id = f"compact-{spawning}"

    async def both() -> tuple[dict[str, Any], dict[str, Any]]:
        envelope = await session.flow(graph, run_id=run_id, reactive=spawning, max_concurrent=4)
        return envelope, await session.run_control(run_id).result(timeout=30)

    envelope, recorded = run(both())
    assert envelope == recorded
    statuses = envelope["operation_statuses"]
    assert list(statuses)[:8] == ids and len(statuses) == 8 + (3 if spawning else 0)
    assert [statuses[node_id] for node_id in ids[:3]] == ["completed", "failed", "skipped"]
    assert envelope["operation_results"][plain[-1].id] == {"verdict": "yes", "n": 7}
    assert plain[1].response == {"verdict": "yes", "n": 4} and failing.status == "failed"
