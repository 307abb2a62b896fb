"""FlowState, driven event by event: the life of a run (ADR-0023 D2, D5, D6), one behaviour per test.

Validation before work, settlement and OR-path gating (sync and async conditions),
restored nodes, pause and backpressure, capacity and stale attempts, cancellation, the
envelope and the lifecycle signals. Every test builds a small graph, starts it through
the ``drive`` fixture (which runs ``validate()`` after each step) and plays the executor:
it completes or fails the dispatched operations and checks the instructions that come back.
"""

from __future__ import annotations

from typing import Any

import pytest
from kernel_graphs import build, context_of, nested, reactive  # tests/support: shared kernel test graphs

from opgraph.kernel import (
    DEFAULT_MAX_CONCURRENCY,
    CancelOperation,
    CancelRequested,
    CloneBranch,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    EdgeCondition,
    EdgeConditionError,
    EmitSignal,
    EvaluateConditions,
    FinishRun,
    FlowStarted,
    FlowState,
    OperationError,
    OperationFinished,
    PauseRequested,
    ResumeRequested,
    SpawnRequest,
)


# -- edge conditions ------------------------------------------------------------------
class Const(EdgeCondition):
    def __init__(self, verdict: bool) -> None:
        self.verdict = verdict

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - the record's name
        return self.verdict


class ResultSaysGo(EdgeCondition):
    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002
        return input["result"].get("go") is True


class Raises(EdgeCondition):
    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002
        raise RuntimeError("condition exploded")


class AsyncGate(EdgeCondition):
    async def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - never awaited here
        return True


# -- validation before work ------------------------------------------------------------
def test_a_cyclic_graph_is_rejected_before_any_dispatch():
    """a -> b -> a."""
    graph, n = build("a", "b", edges=(("a", "b"), ("b", "a")))
    state = FlowState(graph)
    with pytest.raises(OperationError) as caught:
        state.handle(FlowStarted())
    assert caught.value.message == "Graph must be acyclic for flow execution"
    assert str(caught.value) == "Graph must be acyclic for flow execution"
    assert state.counters["dispatched"] == 0


def test_an_edge_condition_without_apply_is_rejected_before_any_dispatch():
    """root -> a with a condition that is a bare object (smuggled past add_edge)."""
    graph, n = build("root", "a")
    edge = graph.add_edge(n.root, n.a)
    edge.condition = object()
    state = FlowState(graph)
    with pytest.raises(EdgeConditionError) as caught:
        state.handle(FlowStarted())
    assert caught.value.edge_id == edge.id
    assert state.counters["dispatched"] == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"context": [("k", 1)]}, "context must be a mapping, got list"),
        ({"reducers": {"total": 5}}, "reducer for context key 'total' is not callable"),
        ({"max_spawn": -1}, "max_spawn must be a whole number of at least 0, got -1"),
        ({"max_spawn": 2.5}, "max_spawn must be a whole number"),
    ],
    ids=["context", "reducer", "negative max_spawn", "fractional max_spawn"],
)
def test_bad_run_options_are_refused_with_what_was_wrong(options, message):
    graph, _ = build("a")
    with pytest.raises(OperationError, match=message):
        FlowState(graph, **options)


def test_something_other_than_a_graph_is_refused():
    with pytest.raises(OperationError, match="a flow runs a Graph, got dict"):
        FlowState({"nodes": []})


def test_max_concurrent_below_one_is_refused():
    graph, _ = build("a")
    with pytest.raises(OperationError):
        FlowState(graph, max_concurrent=0)


# -- settlement and gating ------------------------------------------------------------
def test_an_aggregation_waits_for_all_of_its_predecessors(drive):
    """(a, b) -> agg."""
    graph, n = build("a", "b", "agg", edges=(("a", "agg"), ("b", "agg")))
    driver = drive(graph)
    assert set(driver.dispatched()) == {n.a, n.b}
    driver.complete(n.a, {"v": 1})
    assert n.agg not in driver.dispatched()
    driver.complete(n.b, {"v": 2})
    assert n.agg in driver.dispatched()


def test_one_passing_incoming_path_is_enough_to_run(drive):
    """a -[false]-> c, b -[true]-> c: c runs (OR of incoming paths)."""
    graph, n = build("a", "b", "c")
    graph.add_edge(n.a, n.c, condition=Const(False))
    graph.add_edge(n.b, n.c, condition=Const(True))
    driver = drive(graph)
    driver.complete(n.a)
    driver.complete(n.b)
    assert n.c in driver.dispatched()


def test_a_passing_path_still_waits_for_every_predecessor(drive):
    """a -[true]-> c, b -> c: c does not start when only a has settled."""
    graph, n = build("a", "b", "c", edges=(("b", "c"),))
    graph.add_edge(n.a, n.c, condition=Const(True))
    driver = drive(graph)
    driver.complete(n.a)
    assert n.c not in driver.dispatched()
    driver.complete(n.b)
    assert n.c in driver.dispatched()


def test_a_condition_reads_the_predecessor_result(drive):
    """a -[result.go]-> yes, b -[result.go]-> no; a says go, b does not."""
    graph, n = build("a", "b", "yes", "no")
    graph.add_edge(n.a, n.yes, condition=ResultSaysGo())
    graph.add_edge(n.b, n.no, condition=ResultSaysGo())
    driver = drive(graph)
    driver.complete(n.a, {"go": True})
    driver.complete(n.b, {"go": False})
    assert n.yes in driver.dispatched()
    assert driver.state.status_of(n.no) == "skipped"


def test_a_node_whose_conditions_all_fail_is_skipped(drive):
    """a -[false]-> b."""
    graph, n = build("a", "b")
    graph.add_edge(n.a, n.b, condition=Const(False))
    driver = drive(graph)
    driver.complete(n.a)
    envelope = driver.envelope
    assert envelope["skipped_operations"] == [n.b]
    assert envelope["operation_statuses"][n.b] == "skipped"
    assert n.b not in envelope["operation_results"]
    assert [s.op_id for s in driver.signals("skipped")] == [n.b]


def test_a_node_whose_only_predecessor_was_skipped_is_skipped(drive):
    """a -[false]-> b -> c: c's only head was skipped, so c is skipped too."""
    graph, n = build("a", "b", "c", edges=(("b", "c"),))
    graph.add_edge(n.a, n.b, condition=Const(False))
    driver = drive(graph)
    driver.complete(n.a)
    assert driver.envelope["skipped_operations"] == [n.b, n.c]
    assert driver.envelope["status"] == "completed"


def test_an_edge_from_a_skipped_head_is_ignored_when_another_path_is_live(drive):
    """a -[false]-> b -> d, c -> d: d runs through c."""
    graph, n = build("a", "b", "c", "d", edges=(("b", "d"), ("c", "d")))
    graph.add_edge(n.a, n.b, condition=Const(False))
    driver = drive(graph)
    driver.complete(n.a)
    driver.complete(n.c)
    assert n.d in driver.dispatched()
    assert f"{n.b}_result" not in context_of(driver, n.d)


def test_a_failed_predecessor_still_satisfies_an_unconditional_edge(drive):
    """a -> b; a fails, b runs and sees a's error mapping."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.fail(n.a, error="boom")
    assert context_of(driver, n.b)[f"{n.a}_result"] == {"error": "boom"}


def test_a_raising_condition_fails_the_node_not_the_run(drive):
    """a -[raises]-> b, a -> c: b fails with an EdgeConditionError entry, c still runs."""
    graph, n = build("a", "b", "c", edges=(("a", "c"),))
    edge = graph.add_edge(n.a, n.b, condition=Raises())
    driver = drive(graph)
    driver.complete(n.a)
    assert n.c in driver.dispatched()
    result = driver.state.results[n.b]
    assert result["error_type"] == "EdgeConditionError"
    assert result["edge_id"] == edge.id
    assert "condition exploded" in result["error"]


def test_aggregation_sources_are_waited_on_even_without_an_edge(drive):
    """a, b, agg; agg names a in aggregation_sources but has no edge from it."""
    graph, n = build("a", "b", "agg")
    graph.nodes[n.agg].metadata["aggregation_sources"] = [n.a]
    driver = drive(graph)
    assert set(driver.dispatched()) == {n.a, n.b}
    driver.complete(n.b)
    assert n.agg not in driver.dispatched()
    driver.complete(n.a)
    assert n.agg in driver.dispatched()


# -- async conditions -------------------------------------------------------------------------
def test_an_async_condition_is_handed_to_the_shell_and_its_verdict_settles_the_node(drive):
    """a -[async]-> b."""
    graph, n = build("a", "b")
    edge = graph.add_edge(n.a, n.b, condition=AsyncGate())
    driver = drive(graph)
    driver.complete(n.a, {"go": True})
    (evaluate,) = driver.of_type(EvaluateConditions)
    assert evaluate.node_id == n.b
    assert evaluate.edges == ((edge.id, {"go": True}),)
    assert n.b not in driver.dispatched()
    driver.handle(ConditionsEvaluated(node_id=n.b, results=((edge.id, True),)))
    assert n.b in driver.dispatched()


def test_an_async_condition_whose_input_cannot_be_prepared_fails_the_node(drive):
    """a -[async]-> b, a's result nests past the recursion limit: b fails, the run ends."""
    graph, n = build("a", "b")
    graph.add_edge(n.a, n.b, condition=AsyncGate())
    driver = drive(graph)
    driver.complete(n.a, nested(5_000))
    assert driver.of_type(EvaluateConditions) == []
    assert driver.state.results[n.b]["error_type"] == "EdgeConditionError"
    assert "could not be prepared" in driver.state.results[n.b]["error"]
    assert driver.envelope["operation_statuses"] == {n.a: "completed", n.b: "failed"}


def test_an_async_condition_that_fails_skips_the_node(drive):
    graph, n = build("a", "b")
    edge = graph.add_edge(n.a, n.b, condition=AsyncGate())
    driver = drive(graph)
    driver.complete(n.a)
    driver.handle(ConditionsEvaluated(node_id=n.b, results=((edge.id, False),)))
    assert driver.envelope["skipped_operations"] == [n.b]


def test_an_async_condition_error_fails_the_node(drive):
    graph, n = build("a", "b")
    graph.add_edge(n.a, n.b, condition=AsyncGate())
    driver = drive(graph)
    driver.complete(n.a)
    driver.handle(ConditionsEvaluated(node_id=n.b, error="remote check crashed"))
    assert driver.envelope["failed_operations"] == [n.b]
    assert driver.envelope["operation_results"][n.b]["error_type"] == "EdgeConditionError"


# -- restored terminal nodes ------------------------------------------------------------
def test_a_restored_completed_node_short_circuits_and_its_dependents_run(drive):
    """a (restored: completed) -> b."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    restored = graph.nodes[n.a]
    restored.status, restored.response = "completed", {"answer": "cached"}
    driver = drive(graph)
    assert list(driver.dispatched()) == [n.b]
    assert context_of(driver, n.b)[f"{n.a}_result"] == {"answer": "cached"}
    driver.complete(n.b)
    assert driver.envelope["operation_results"][n.a] == {"answer": "cached"}
    assert n.a in driver.envelope["completed_operations"]
    assert driver.signals("started", op_id=n.a) == []


def test_a_restored_failed_node_is_reported_failed_and_its_dependent_skipped_with_the_reason(drive):
    """a (restored: failed) -> b: a is failed (not completed), its error reaches nobody, b is skipped."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    restored = graph.nodes[n.a]
    restored.status, restored.error = "failed", "timed out last time"
    driver = drive(graph)
    envelope = driver.envelope
    assert driver.dispatched() == {}
    assert envelope["operation_statuses"] == {n.a: "failed", n.b: "skipped"}
    assert envelope["failed_operations"] == [n.a]
    assert n.a not in envelope["completed_operations"]
    assert n.a not in envelope["operation_results"]
    assert envelope["skipped_operations"] == [n.b]
    (skipped,) = driver.signals("skipped", op_id=n.b)
    assert skipped.reason == f"no incoming path passed: dependency {n.a} was restored as failed"
    assert driver.state.story(n.b)[-1][2] == skipped.reason


def test_a_dependent_with_another_live_path_runs_beside_a_restored_failure(drive):
    """a (restored: failed) -> c <- b: b's path passes, so c runs, without a's error in its context."""
    graph, n = build("a", "b", "c", edges=(("a", "c"), ("b", "c")))
    graph.nodes[n.a].status = "failed"
    driver = drive(graph)
    driver.complete(n.b, "fine")
    context = context_of(driver, n.c)
    assert f"{n.a}_result" not in context and context[f"{n.b}_result"] == "fine"


# -- pause and backpressure ---------------------------------------------------------------
def test_nothing_new_is_dispatched_while_paused_but_in_flight_work_completes(drive):
    """a -> b; pause while a runs: a settles, b waits and is announced paused."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(PauseRequested())
    driver.complete(n.a)
    assert driver.state.status_of(n.a) == "completed"
    assert driver.dispatched() == {}
    assert [s.op_id for s in driver.signals("paused")] == [n.b]


def test_pausing_announces_nodes_already_waiting_for_capacity(drive):
    """a, b roots with capacity 1: b is ready but queued; pausing announces it."""
    graph, n = build("a", "b")
    driver = drive(graph, max_concurrent=1)
    driver.handle(PauseRequested())
    assert [s.op_id for s in driver.signals("paused")] == [n.b]
    driver.complete(n.a)
    assert driver.dispatched() == {}


def test_resume_dispatches_the_waiting_nodes(drive):
    """a -> b; paused while a runs, then resumed."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(PauseRequested())
    driver.complete(n.a)
    driver.handle(ResumeRequested())
    assert list(driver.dispatched()) == [n.b]


def test_a_held_dispatch_queue_waits_silently_and_resumes_on_release(drive):
    """a, b roots with capacity 1; the shell holds dispatch while a runs."""
    graph, n = build("a", "b")
    driver = drive(graph, max_concurrent=1)
    driver.handle(DispatchHeld(held=True))
    driver.complete(n.a)
    assert driver.dispatched() == {} and driver.signals("paused") == []
    driver.handle(DispatchHeld(held=False))
    assert list(driver.dispatched()) == [n.b]


# -- capacity and attempts -----------------------------------------------------------------
def test_never_more_than_max_concurrent_operations_are_in_flight(drive):
    """Ten independent roots, capacity 3."""
    graph, _ = build(*(f"n{i}" for i in range(10)))
    driver = drive(graph, max_concurrent=3)
    peak = len(driver.dispatched())
    while driver.dispatched():
        driver.complete(next(iter(driver.dispatched())))
        peak = max(peak, len(driver.dispatched()))
    assert peak == 3
    assert len(driver.of_type(DispatchOperation)) == 10
    assert len(driver.envelope["completed_operations"]) == 10


def test_parallel_false_means_one_at_a_time(drive):
    graph, _ = build("a", "b", "c")
    driver = drive(graph, parallel=False, max_concurrent=8)
    assert driver.state.capacity == 1
    assert len(driver.dispatched()) == 1


def test_max_concurrent_none_means_the_default_bound(drive):
    graph, _ = build(*(f"n{i}" for i in range(20)))
    driver = drive(graph, max_concurrent=None)
    assert driver.state.capacity == DEFAULT_MAX_CONCURRENCY
    assert len(driver.dispatched()) == 20


def test_a_result_for_a_stale_attempt_is_dropped(drive):
    """a alone; a result arrives for attempt 7, then the real one."""
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(OperationFinished(node_id=n.a, attempt=7, response={"late": True}))
    assert driver.state.counters["stale_results"] == 1
    assert driver.state.status_of(n.a) == "running"
    driver.complete(n.a, {"real": True})
    assert driver.envelope["operation_results"][n.a] == {"real": True}


def test_a_second_report_of_a_settled_attempt_is_dropped(drive):
    graph, n = build("a")
    driver = drive(graph)
    attempt = driver.dispatched()[n.a].attempt
    driver.complete(n.a, {"first": True})
    driver.handle(OperationFinished(node_id=n.a, attempt=attempt, response={"second": True}))
    assert driver.state.counters["stale_results"] == 1
    assert driver.envelope["operation_results"][n.a] == {"first": True}


def test_every_transition_is_in_the_node_story(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.complete(n.a)
    assert [(old, new) for old, new, _, _ in driver.state.story(n.a)] == [
        ("waiting", "ready"),
        ("ready", "running"),
        ("running", "completed"),
    ]


# -- cancellation --------------------------------------------------------------------------
def test_cancel_stops_waiting_work_and_asks_running_work_to_stop(drive):
    """a -> c, b; capacity 1 so a runs while b is ready and c waits."""
    graph, n = build("a", "b", "c", edges=(("a", "c"),))
    driver = drive(graph, max_concurrent=1)
    driver.handle(CancelRequested(reason="operator"))
    assert driver.of_type(CancelOperation, last=True) == [CancelOperation(n.a, 1)]
    assert driver.state.status_of(n.b) == "cancelled" and driver.state.status_of(n.c) == "cancelled"
    assert driver.envelope is None
    driver.cancelled(n.a)
    assert driver.envelope["status"] == "cancelled"
    assert set(driver.envelope["cancelled_operations"]) == {n.a, n.b, n.c}


def test_work_that_finishes_after_cancel_still_ends_a_cancelled_run(drive):
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(CancelRequested())
    driver.complete(n.a, {"late": True})
    assert driver.envelope["status"] == "cancelled"
    assert driver.envelope["operation_statuses"] == {n.a: "completed", n.b: "cancelled"}


def test_a_run_cancelled_before_it_started_dispatches_nothing_and_ends_cancelled(unstarted):
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = unstarted(graph)
    driver.handle(CancelRequested(reason="operator said stop"))
    driver.start()
    assert driver.of_type(DispatchOperation) == []
    assert driver.of_type(CloneBranch) == [] and driver.signals("queued") == []  # nothing announced or cloned
    assert driver.envelope["status"] == "cancelled"
    assert driver.envelope["cancelled_operations"] == [n.a, n.b]
    assert driver.state.story(n.a) == [("waiting", "cancelled", "operator said stop", 0)]


def test_an_outcome_for_a_node_the_run_never_had_is_counted_stale_and_leaves_no_story(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(OperationFinished(node_id="no-such-node", attempt=1, response="?"))
    assert driver.state.counters["stale_results"] == 1
    assert driver.state.story("no-such-node") == []
    assert "no-such-node" not in driver.state._stories
    assert driver.state.status_of(n.a) == "running"


# -- the envelope --------------------------------------------------------------------------
STATIC_KEYS = {
    "completed_operations",
    "operation_results",
    "final_context",
    "skipped_operations",
    "failed_operations",
    "cancelled_operations",
    "operation_statuses",
    "context_collisions",
    "status",
}


def test_the_envelope_has_exactly_the_static_keys(drive):
    graph, _ = build("a")
    assert set(drive(graph).run_to_end()) == STATIC_KEYS


def test_a_reactive_envelope_adds_the_spawn_ledger_keys(drive):
    driver, _ = reactive(drive, "a")
    assert set(driver.run_to_end()) == STATIC_KEYS | {"spawned_operations", "escalated_operations", "dropped_spawns"}


@pytest.mark.parametrize("fail_one", [False, True], ids=["all completed", "one failed"])
def test_the_envelope_lists_nodes_in_registration_order_whatever_order_they_settled_in(drive, fail_one):
    graph, n = build("a", "b", "c")
    driver = drive(graph)
    driver.complete(n.c, "c done")
    if fail_one:
        driver.fail(n.a)
    else:
        driver.complete(n.a, "a done")
    envelope = driver.complete(n.b, "b done") and driver.envelope
    assert list(envelope["operation_results"]) == [n.a, n.b, n.c]
    assert envelope["completed_operations"] == [n.a, n.b, n.c]  # failures included: the record's meaning
    assert list(envelope["operation_statuses"]) == [n.a, n.b, n.c]
    assert envelope["operation_results"][n.b] == "b done"
    assert envelope["failed_operations"] == ([n.a] if fail_one else [])
    assert envelope["status"] == ("failed" if fail_one else "completed")


def test_a_restored_completed_node_without_a_response_has_no_result_entry(drive):
    graph, n = build("a", "b")
    graph.nodes[n.a].status = "completed"  # restored, its response never recorded
    envelope = drive(graph).run_to_end()
    assert envelope["operation_statuses"] == {n.a: "completed", n.b: "completed"}
    assert list(envelope["operation_results"]) == [n.b]
    assert envelope["completed_operations"] == [n.b]


def test_failed_and_skipped_nodes_are_reported_truthfully(drive):
    """a -> ok, a -[false]-> skip, f (fails)."""
    graph, n = build("a", "ok", "skip", "f", edges=(("a", "ok"),))
    graph.add_edge(n.a, n.skip, condition=Const(False))
    driver = drive(graph)
    driver.fail(n.f)
    driver.complete(n.a)
    envelope = driver.run_to_end()
    assert set(envelope["completed_operations"]) == {n.a, n.ok, n.f}  # the record's meaning
    assert envelope["failed_operations"] == [n.f]
    assert envelope["skipped_operations"] == [n.skip]
    assert not set(envelope["completed_operations"]) & set(envelope["skipped_operations"])
    assert envelope["operation_statuses"] == {n.a: "completed", n.ok: "completed", n.skip: "skipped", n.f: "failed"}
    assert envelope["status"] == "failed"
    assert driver.signals("failed", op_id=n.skip) == []
    assert [s.op_id for s in driver.signals("failed")] == [n.f]


def test_finished_nodes_carry_their_final_status_and_response(drive):
    graph, n = build("a", "f")
    driver = drive(graph)
    driver.complete(n.a, {"answer": 1})
    driver.fail(n.f, error="nope")
    assert (graph.nodes[n.a].status, graph.nodes[n.a].response) == ("completed", {"answer": 1})
    assert (graph.nodes[n.f].status, graph.nodes[n.f].error) == ("failed", "nope")


# -- signals -----------------------------------------------------------------------------------
def test_every_node_is_queued_started_and_completed_with_versioned_signals(drive):
    """a -> b."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph, run_id="run-1")
    driver.run_to_end()
    for node_id, name in ((n.a, "a"), (n.b, "b")):
        signals = driver.signals(op_id=node_id)
        assert [s.kind for s in signals] == ["queued", "started", "completed"]
        assert all(s.schema_version == 1 and s.run_id == "run-1" and s.name == name for s in signals)
    assert driver.signals("queued", op_id=n.b)[0].depends_on == [n.a]
    assert len(driver.of_type(FinishRun)) == 1


def test_without_progress_signals_only_settling_signals_are_emitted_and_the_run_is_unchanged(drive):
    """a -> b, with a spawn from a; skipped and failed nodes still signal."""
    def run(progress: bool):
        graph, n = build("a", "b", "f", edges=(("a", "b"),))
        driver = drive(graph, reactive=True, progress_signals=progress)
        driver.complete(n.a, {"requests": [SpawnRequest(instruction="child")]})
        driver.fail(n.f)
        envelope = driver.run_to_end()
        return driver, n, envelope

    quiet, _, envelope = run(False)
    loud, _, loud_envelope = run(True)
    assert {s.kind for s in quiet.signals()} == {"completed", "failed"}
    assert {s.kind for s in loud.signals()} == {"queued", "started", "spawned", "completed", "failed"}
    assert len(quiet.signals("completed")) == len(loud.signals("completed")) == 3  # a, b and the child
    assert envelope["spawned_operations"] == loud_envelope["spawned_operations"] == 1
    assert [type(i) for i in quiet.instructions if not isinstance(i, EmitSignal)] == \
        [type(i) for i in loud.instructions if not isinstance(i, EmitSignal)]


# -- the start of a plain fan-out (registration.plain_roots) ---------------------------------
def _started(graph: Any, monkeypatch: Any = None, **options: Any) -> tuple[FlowState, list]:
    """``graph`` started (the long way when ``monkeypatch`` is given), checked."""
    from opgraph.kernel import scheduler

    if monkeypatch is not None:
        monkeypatch.setattr(scheduler, "plain_roots", lambda graph: False)
    state = FlowState(graph, **options)
    out = state.handle(FlowStarted(now=1.0))
    state.validate()
    return state, out


def _fan_out(change=None):
    def factory():
        from opgraph.kernel import Graph, create_operation

        graph = Graph("fan")
        for index in range(6):
            node = create_operation("leaf", {"index": index})
            if change is not None and index == 3:
                change(node)
            graph.add_node(node)
        return graph
    return factory


def _with_edge():
    graph = _fan_out()()
    first, second = list(graph.nodes)[:2]
    graph.add_edge(first, second)
    return graph


def _snapshot(state: FlowState, out: list) -> tuple:
    return (dict(state.state), {k: list(v) for k, v in state.deps.items()}, dict(state.unsettled),
            dict(state.attempt), list(state.ready), {k: v[0] for k, v in state.running.items()},
            dict(state.branch), state.open_nodes, {k: list(v) for k, v in state.dependents.items()},
            state.story(next(iter(state.state))), out)


@pytest.mark.parametrize("factory, plain", [
    (_fan_out(), True),
    (_fan_out(lambda node: node.metadata.update({"note": "x"})), False),
    (_fan_out(lambda node: node.metadata.update({"inherit_context": True})), False),
    (_fan_out(lambda node: setattr(node, "branch_id", "own-branch")), False),
    (_fan_out(lambda node: node.settle("completed", response=3)), False),
    (_with_edge, False),
], ids=["plain", "metadata", "inherit-context", "own-branch", "restored", "edge"])
@pytest.mark.parametrize("options", [{"max_concurrent": 2}, {"max_concurrent": 10, "progress_signals": True},
                                     {"max_concurrent": 2, "durable": True}], ids=["capacity-2", "signals", "durable"])
def test_a_plain_fan_out_starts_exactly_as_the_long_way_does(monkeypatch, factory, plain, options):
    """Every node a root with nothing to make or restore: registered at once, and the run is in
    the very state (and says the very things) that registering node by node gives."""
    import pickle

    from opgraph.kernel.registration import plain_roots

    graph = factory()
    assert plain_roots(graph) is plain
    fast = _snapshot(*_started(pickle.loads(pickle.dumps(graph)), **options))
    slow = _snapshot(*_started(pickle.loads(pickle.dumps(graph)), monkeypatch, **options))
    assert fast == slow


def test_a_plain_fan_out_then_runs_to_its_end(unstarted):
    """Started the short way, the run dispatches in insertion order, refills as nodes settle,
    and ends with every result."""
    graph = _fan_out()()
    run = unstarted(graph, max_concurrent=4)
    dispatched = [i.node_id for i in run.start() if isinstance(i, DispatchOperation)]
    assert dispatched == list(graph.nodes)[:4]
    for node_id in list(graph.nodes):
        run.complete(node_id, node_id)
    assert run.envelope["status"] == "completed"
    assert run.envelope["operation_results"] == {node_id: node_id for node_id in graph.nodes}
