"""The durable run log: a state rebuilt from any prefix of a run's records finishes as the run did.

Hypothesis draws DAGs (conditions sync and async, failures, shared-context writes with a
reducer, spawns returned and sent as events, higher-tier escalations, restored nodes) and
completion orders. The original run records its batches; then, for a cut anywhere in
them, a FlowState rebuilt from the batches before the cut (through the codec, as the
executor stores them), recovered and driven to the end in another order, must produce
the same envelope. Node builders here are deterministic, as a child's identity must be
for the comparison; the rebuild itself never calls them for a restored child.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_graphs import CONDITIONS

from opgraph.kernel import (
    AppendRecords,
    ConditionsEvaluated,
    DispatchOperation,
    EscalationRequest,
    EvaluateConditions,
    FinishRun,
    FlowStarted,
    FlowState,
    Graph,
    OperationError,
    OperationFinished,
    Restored,
    SpawnRequest,
    SpawnRequested,
    compact_envelope,
    create_operation,
    decode_records,
    encode_records,
    expand_envelope,
)

STEP_LIMIT = 5_000


def _test_key() -> bytes:
    """The run-log key the codec signs pickled values with (the runtime's lives outside the database)."""
    return b"a test key, never a real one: 32+"




@dataclass(frozen=True)
class Node:
    fails: bool
    writes: str | None  # a shared key it writes
    spawns: int
    spawns_as_events: bool
    escalates: bool
    restored: str | None


@dataclass(frozen=True)
class Spec:
    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int, str], ...]
    capacity: int


@st.composite
def specs(draw) -> Spec:
    count = draw(st.integers(1, 12))
    nodes = tuple(Node(fails=draw(st.booleans()) and draw(st.booleans()),
                       writes=draw(st.sampled_from([None, "alpha", "beta"])),
                       spawns=draw(st.integers(0, 2)), spawns_as_events=draw(st.booleans()),
                       escalates=draw(st.integers(0, 5)) == 0,
                       restored=draw(st.sampled_from([None, None, None, None, "completed", "failed"])))
                  for _ in range(count))
    edges = []
    for tail in range(1, count):
        for head in draw(st.sets(st.integers(0, tail - 1), max_size=2)):
            edges.append((head, tail, draw(st.sampled_from(sorted(CONDITIONS)))))
    return Spec(nodes, tuple(edges), draw(st.integers(1, 4)))


def node_id(index: int) -> str:
    return f"node-{index}"


def build(spec: Spec) -> Graph:
    graph = Graph("logged")
    for index, node in enumerate(spec.nodes):
        operation = create_operation("chat", {"instruction": f"do {index}"})
        operation.id = node_id(index)
        if node.restored:
            operation.status = node.restored
            operation.response = {"result": f"restored {index}"} if node.restored == "completed" else None
        graph.add_node(operation)
    for head, tail, condition in spec.edges:
        factory = CONDITIONS[condition]
        graph.add_edge(node_id(head), node_id(tail), condition=factory() if factory else None)
    return graph


def deterministic_builder(request: SpawnRequest, emitter: Any) -> Any:
    child = create_operation("chat", {"instruction": request.instruction})
    child.id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"{getattr(emitter, 'id', None)}/{request.instruction}"))
    return child


def collect(old: Any, new: Any) -> Any:
    return sorted([*(old if isinstance(old, list) else [old]), new], key=repr)


def options() -> dict[str, Any]:
    return {"run_id": "logged", "reactive": True, "max_spawn": 1000, "node_builder": deterministic_builder,
            "reducers": {"beta": collect}, "durable": True}


def outcome(spec: Spec, dispatch: DispatchOperation, now: float) -> OperationFinished:
    """The scripted outcome of a dispatch: the same for a node whatever its attempt."""
    if not dispatch.node_id.startswith("node-"):
        instruction = dispatch.parameters["instruction"]
        return OperationFinished(now=now, node_id=dispatch.node_id, attempt=dispatch.attempt,
                                 response={"result": f"child did {instruction}"})
    index = int(dispatch.node_id.removeprefix("node-"))
    node = spec.nodes[index]
    if node.fails:
        return OperationFinished(now=now, node_id=dispatch.node_id, attempt=dispatch.attempt, status="failed",
                                 error=f"node {index} failed", error_type="Scripted")
    response: dict[str, Any] = {"result": f"result {index}"}
    if node.writes:
        response["context"] = {node.writes: index}
    requests = [SpawnRequest(instruction=f"child {n} of {index}", independent=n % 2 == 1) for n in range(node.spawns)]
    events: tuple = ()
    if node.spawns_as_events:
        events = tuple(SpawnRequested(now=now, emitter_id=dispatch.node_id, request=request,
                                      dedupe_key=(dispatch.node_id, n)) for n, request in enumerate(requests))
    else:
        response["spawn"] = requests
    if node.escalates:
        response["escalate"] = EscalationRequest(reason=f"node {index} is stuck")
    return OperationFinished(now=now, node_id=dispatch.node_id, attempt=dispatch.attempt, response=response,
                             requests=events)


@dataclass
class Driven:
    envelope: dict[str, Any]
    batches: list[tuple]


def drive(state: FlowState, spec: Spec, first: list[Any], choose: Callable[[int], int], start: int = 0) -> Driven:
    """Answer dispatches and condition requests, 1-2 per handle(), until FinishRun."""
    in_flight: dict[str, DispatchOperation] = {}
    evaluations: dict[str, EvaluateConditions] = {}
    batches: list[tuple] = []
    envelope: dict[str, Any] | None = None
    instructions = first
    for step in range(start + 1, start + STEP_LIMIT):
        for instruction in instructions:
            if isinstance(instruction, AppendRecords):
                batches.append(instruction.records)
            elif isinstance(instruction, DispatchOperation):
                in_flight[instruction.node_id] = instruction
            elif isinstance(instruction, EvaluateConditions):
                evaluations[instruction.node_id] = instruction
            elif isinstance(instruction, FinishRun):
                envelope = instruction.envelope
        if envelope is not None:
            return Driven(envelope, batches)
        outstanding = [("d", key) for key in in_flight] + [("c", key) for key in evaluations]
        assert outstanding, "stalled"
        events = []
        for _ in range(1 + choose(2)):
            kind, key = outstanding.pop(choose(len(outstanding)))
            if kind == "d":
                events.append(outcome(spec, in_flight.pop(key), float(step)))
            else:
                request = evaluations.pop(key)
                results = tuple((edge_id, state.graph.edges[edge_id].condition.verdict) for edge_id, _ in request.edges)
                events.append(ConditionsEvaluated(now=float(step), node_id=key, results=results))
            if not outstanding:
                break
        instructions = state.handle(*events)
    raise AssertionError("no FinishRun")


def comparable(envelope: dict[str, Any]) -> dict[str, Any]:
    shown = dict(envelope)
    for key in ("completed_operations", "skipped_operations", "failed_operations", "cancelled_operations",
                "escalated_operations"):
        shown[key] = sorted(shown.get(key, []))
    shown["dropped_spawns"] = sorted(map(repr, shown.get("dropped_spawns", [])))
    shown["context_collisions"] = sorted(map(repr, shown.get("context_collisions", [])))
    return shown


def stored(batches: list[tuple]) -> list[list]:
    """The batches as the executor keeps them: through the run-log codec."""
    return [decode_records(encode_records(batch, key=_test_key), key=_test_key) for batch in batches]


@settings(max_examples=200, deadline=None)
@given(spec=specs(), seed=st.integers(0, 2**32), cut=st.floats(0.0, 1.0), resume_seed=st.integers(0, 2**32))
def test_a_state_rebuilt_from_any_prefix_of_the_log_finishes_with_the_same_envelope(spec, seed, cut, resume_seed):
    original_state = FlowState(build(spec), **options())
    original = drive(original_state, spec, original_state.handle(FlowStarted(now=0.0)), random.Random(seed).randrange)

    prefix = original.batches[: int(cut * len(original.batches))]
    rebuilt = FlowState.rebuild(build(spec), stored(prefix), started_at=0.0, **options())
    rebuilt.validate()
    resumed = drive(rebuilt, spec, rebuilt.recover(now=1e6), random.Random(resume_seed).randrange, start=10**6)

    assert comparable(resumed.envelope) == comparable(original.envelope)


@settings(max_examples=100, deadline=None)
@given(spec=specs(), seed=st.integers(0, 2**32))
def test_a_run_rebuilt_from_its_whole_log_is_finished_and_needs_nothing_more(spec, seed):
    state = FlowState(build(spec), **options())
    original = drive(state, spec, state.handle(FlowStarted(now=0.0)), random.Random(seed).randrange)
    rebuilt = FlowState.rebuild(build(spec), stored(original.batches), **options())
    assert rebuilt.finished and not rebuilt.running
    assert comparable(rebuilt.envelope()) == comparable(original.envelope)


def test_a_rebuild_never_calls_the_node_builder_for_a_restored_child():
    """a spawns one child; the log is replayed with a builder that refuses everything: the child is back."""
    spec = Spec((Node(False, None, 1, False, False, None),), (), 1)
    state = FlowState(build(spec), **options())
    original = drive(state, spec, state.handle(FlowStarted(now=0.0)), random.Random(0).randrange)

    def refuses(request, emitter):
        raise AssertionError("the builder was called during a rebuild")

    rebuilt = FlowState.rebuild(build(spec), stored(original.batches), **{**options(), "node_builder": refuses})
    assert rebuilt.spawned_ids == state.spawned_ids and rebuilt.finished


def test_a_durable_run_records_one_batch_first_in_each_handle_and_none_when_not_durable():
    spec = Spec((Node(False, "alpha", 0, False, False, None),), (), 1)
    state = FlowState(build(spec), **options())
    started = state.handle(FlowStarted(now=0.0))
    assert not any(isinstance(instruction, AppendRecords) for instruction in started)  # nothing changed yet
    (dispatch,) = [i for i in started if isinstance(i, DispatchOperation)]
    finished = state.handle(outcome(spec, dispatch, 1.0))
    assert isinstance(finished[0], AppendRecords)
    assert [record[0] for record in finished[0].records] == ["finished"]
    quiet = FlowState(build(spec), **{**options(), "durable": False})
    (dispatch,) = [i for i in quiet.handle(FlowStarted(now=0.0)) if isinstance(i, DispatchOperation)]
    assert not any(isinstance(i, AppendRecords) for i in quiet.handle(outcome(spec, dispatch, 1.0)))


def test_a_restored_event_from_anywhere_but_a_rebuild_is_refused():
    state = FlowState(build(Spec((Node(False, None, 0, False, False, None),), (), 1)), **options())
    state.handle(FlowStarted(now=0.0))
    try:
        state.handle(Restored(record=("seen", "k")))
    except OperationError as refused:
        assert "run log" in refused.message
    else:
        raise AssertionError("a Restored event was applied to a live run")


# -- the envelope as the run log stores it (compact_envelope / expand_envelope) ------------------

_STATUSES = ("completed", "failed", "skipped", "cancelled", "pending", "running")


@st.composite
def _envelopes(draw: Any) -> dict[str, Any]:
    """Envelopes as the kernel builds them, then perhaps with one field that no longer matches its derivation."""
    ids = [f"n{index}" for index in range(draw(st.integers(0, 12)))]
    statuses = {node_id: draw(st.sampled_from(_STATUSES)) for node_id in ids}
    with_result = [node_id for node_id in ids if draw(st.booleans())]
    results = {node_id: draw(st.one_of(st.none(), st.integers(), st.text(max_size=3))) for node_id in with_result}
    envelope = {
        "completed_operations": [node_id for node_id in results if statuses[node_id] != "skipped"],
        "operation_results": results,
        "final_context": {"k": 1},
        "skipped_operations": [node_id for node_id in ids if statuses[node_id] == "skipped"],
        "failed_operations": [node_id for node_id in ids if statuses[node_id] == "failed"],
        "cancelled_operations": [node_id for node_id in ids if statuses[node_id] == "cancelled"],
        "operation_statuses": statuses,
        "status": "completed",
    }
    if draw(st.booleans()):  # a field edited after the kernel built it: kept as it is
        key = draw(st.sampled_from(["completed_operations", "skipped_operations", "failed_operations"]))
        envelope[key] = [*envelope[key], "extra"]
    if draw(st.booleans()):
        envelope["operation_results"] = dict([*reversed(list(results.items())), ("elsewhere", 1)])
    return envelope


@settings(max_examples=150, deadline=None)
@given(_envelopes())
def test_a_compacted_envelope_expands_to_the_same_envelope(envelope):
    rest, columns = compact_envelope(envelope)
    back = expand_envelope(*decode_records(encode_records([[rest, columns]], key=_test_key), key=_test_key)[0])
    assert back == envelope and list(back) == list(envelope)  # equal, keys in their order


def test_an_all_completed_run_stores_each_node_id_once():
    """The common large run: every list and map of nodes is derived from the ids, the results one list."""
    graph = Graph("fan")
    for index in range(20):
        graph.add_node(create_operation("noop", {"instruction": str(index)}))
    state = FlowState(graph, run_id="r", write_back=False)
    instructions = state.handle(FlowStarted(now=1.0))
    while not any(type(i) is FinishRun for i in instructions):
        instructions = state.handle(*[OperationFinished(2.0, i.node_id, i.attempt, "completed", int(
            i.parameters["instruction"])) for i in instructions if type(i) is DispatchOperation])
    envelope = next(i for i in instructions if type(i) is FinishRun).envelope
    rest, columns = compact_envelope(envelope)
    assert columns["ids"] == list(graph.nodes) and columns["statuses"] == "completed"
    assert columns["results"] == list(range(20))
    assert sorted(columns["derived"]) == ["cancelled_operations", "completed_operations", "failed_operations",
                                          "skipped_operations"]
    assert all(rest[key] is None for key in (*columns["derived"], "operation_results", "operation_statuses"))
    assert expand_envelope(rest, columns) == envelope
    assert compact_envelope({"status": "error"}) == ({"status": "error"}, {})  # nothing per node: kept whole


_THREAD_SETTINGS = {"run_id": "r", "durable": True, "default_branch_id": "d", "clone_source_branch_id": "d"}


def _reply_after_the_opening(**reply_options: Any) -> tuple[Graph, str, list[Any], list[Any]]:
    """root -> reply (inherit_context, and ``reply_options``), run durably until root completes:
    (graph, reply's id, the log's batches so far, what root's completion gave out)."""
    from opgraph.kernel import OperationGraphBuilder

    builder = OperationGraphBuilder("threads")
    root = builder.add_operation("opening")
    reply = builder.add_operation("reply", depends_on=[root], inherit_context=True, **reply_options)
    graph = builder.get_graph()
    state = FlowState(graph, **_THREAD_SETTINGS)
    batches: list[Any] = []

    def handle(*events: Any) -> list[Any]:
        out = state.handle(*events)
        batches.extend(i.records for i in out if isinstance(i, AppendRecords))
        return out

    (first,) = [i for i in handle(FlowStarted(now=0.0)) if isinstance(i, DispatchOperation)]
    out = handle(OperationFinished(now=1.0, node_id=first.node_id, attempt=first.attempt, status="completed",
                                   response="opened"))
    return graph, reply, batches, out


def test_an_inheriting_node_in_flight_when_its_executor_died_takes_its_primary_history_again():
    """root -> reply (inherit_context). The log holds reply's dispatch, whose ReplaceHistory may never
    have reached the store before the kill: recovered, reply's new attempt replaces its history again."""
    from opgraph.kernel import ReplaceHistory

    graph, reply, batches, out = _reply_after_the_opening()
    assert [i.node_id for i in out if isinstance(i, ReplaceHistory)] == [reply]
    (second,) = [i for i in out if isinstance(i, DispatchOperation)]

    rebuilt = FlowState.rebuild(graph, stored(batches), **_THREAD_SETTINGS)
    recovered = rebuilt.recover(now=2.0)
    replaced = [i for i in recovered if isinstance(i, ReplaceHistory)]
    (again,) = [i for i in recovered if isinstance(i, DispatchOperation)]
    assert [(i.node_id, i.attempt) for i in replaced] == [(reply, again.attempt)] and again.attempt > second.attempt


def test_an_inheriting_node_sent_back_to_the_queue_takes_its_primary_history_again_after_a_second_rebuild():
    """root -> reply (inherit_context). Paused with reply in flight, the executor dies; the first
    rebuild sends reply back to the queue (it cannot be dispatched while paused), and that executor
    dies too. The second rebuild replays that requeue: reply's next dispatch must replace its
    history again, since no write to the store is known to have done it (the kernel's side of the
    adoption test's "a resumed reply misses the root message"; a first rebuild's re-inheritance
    was not in the log, so a second rebuild lost it)."""
    from opgraph.kernel import PauseRequested, ReplaceHistory, ResumeRequested

    graph, reply, batches, out = _reply_after_the_opening()
    assert [i.node_id for i in out if isinstance(i, DispatchOperation)] == [reply]
    paused = FlowState.rebuild(graph, stored(batches), **_THREAD_SETTINGS)
    batches.extend(i.records for i in paused.handle(PauseRequested(now=1.5)) if isinstance(i, AppendRecords))

    first = FlowState.rebuild(graph, stored(batches), **_THREAD_SETTINGS)
    recovered = first.recover(now=2.0)
    assert not [i for i in recovered if isinstance(i, DispatchOperation)]  # paused: back to the queue only
    batches.extend(i.records for i in recovered if isinstance(i, AppendRecords))

    second = FlowState.rebuild(graph, stored(batches), **_THREAD_SETTINGS)
    second.recover(now=3.0)
    resumed = second.handle(ResumeRequested(now=4.0))
    (dispatched,) = [i for i in resumed if isinstance(i, DispatchOperation)]
    assert [(i.node_id, i.attempt) for i in resumed if isinstance(i, ReplaceHistory)] == [
        (reply, dispatched.attempt)]


def test_an_inheriting_node_on_an_explicit_branch_keeps_it_when_recovered():
    """root -> reply (inherit_context, branch "mine"): reply runs on its own branch, never a replaced
    clone, neither when first dispatched nor when recovered."""
    from opgraph.kernel import ReplaceHistory

    graph, _, batches, out = _reply_after_the_opening(branch="mine")
    assert not [i for i in out if isinstance(i, ReplaceHistory)]
    assert [i.branch_id for i in out if isinstance(i, DispatchOperation)] == ["mine"]
    recovered = FlowState.rebuild(graph, stored(batches), **_THREAD_SETTINGS).recover(now=2.0)
    assert not [i for i in recovered if isinstance(i, ReplaceHistory)]
    assert [i.branch_id for i in recovered if isinstance(i, DispatchOperation)] == ["mine"]
