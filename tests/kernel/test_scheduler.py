"""FlowState, driven event by event: ADR-0023 D2-D6 and ADR-0033 D3-D5, one behaviour per test.

Every test builds a small graph, starts it through the ``drive`` fixture (which runs
``validate()`` after each step) and plays the executor: it completes or fails the
dispatched operations and checks the instructions that come back.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from opgraph.kernel import (
    DEFAULT_MAX_CONCURRENCY,
    AdmissionDecided,
    CancelOperation,
    CancelRequested,
    CloneBranch,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    EdgeCondition,
    EdgeConditionError,
    EmitSignal,
    EscalationRequest,
    EscalationRequested,
    EvaluateConditions,
    FinishRun,
    FlowStarted,
    FlowState,
    Graph,
    InjectRequested,
    OperationError,
    OperationFinished,
    OperationGraphBuilder,
    OperatorMessageReceived,
    PauseRequested,
    ReplaceHistory,
    ResumeRequested,
    SpawnRequest,
    SpawnRequested,
    create_operation,
    role_node_builder,
)


# -- helpers ------------------------------------------------------------------------
def build(*names: str, edges: tuple[tuple[str, str], ...] = ()) -> tuple[Graph, SimpleNamespace]:
    """Nodes named ``names`` (instruction "do <name>") and unconditional ``edges``."""
    graph = Graph()
    ids = {}
    for name in names:
        node = create_operation("chat", {"instruction": f"do {name}"}, metadata={"reference_id": name})
        graph.add_node(node)
        ids[name] = node.id
    for head, tail in edges:
        graph.add_edge(ids[head], ids[tail])
    return graph, SimpleNamespace(**ids)


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


def context_of(driver, node_id: str) -> dict[str, Any]:
    return driver.dispatched()[node_id].parameters["context"]


def non_signals(instructions: list[Any]) -> list[Any]:
    return [i for i in instructions if not isinstance(i, EmitSignal)]


STEER_HEADER = (
    "[OPERATOR STEER]\n"
    "A human operator sent these live corrections while this flow is running.\n"
    "Attend to them before continuing. Most recent last.\n"
)


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


# -- context ----------------------------------------------------------------------------
def test_each_predecessor_result_appears_under_its_uuid_result_key(drive):
    """a, b -> c; a returns a mapping, b a scalar string."""
    graph, n = build("a", "b", "c", edges=(("a", "c"), ("b", "c")))
    driver = drive(graph, context={"topic": "graphs"})
    driver.complete(n.a, {"answer": 42})
    driver.complete(n.b, "plain text")
    assert context_of(driver, n.c) == {
        f"{n.a}_result": {"answer": 42},
        f"{n.b}_result": "plain text",
        "topic": "graphs",
    }


def test_shared_context_is_applied_after_predecessor_keys(drive):
    """a -> b; the shared context holds a key equal to a's result key, and wins."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph, context={f"{n.a}_result": "shared wins"})
    driver.complete(n.a, {"answer": 42})
    assert context_of(driver, n.b)[f"{n.a}_result"] == "shared wins"


def test_a_non_mapping_own_context_is_kept_under_original_context(drive):
    """root, with parameters context="some notes"."""
    graph = Graph()
    node = graph.add_node(create_operation("chat", {"instruction": "go", "context": "some notes"}))
    driver = drive(graph, context={"topic": "graphs"})
    assert context_of(driver, node.id) == {"original_context": "some notes", "topic": "graphs"}


def test_a_mapping_own_context_is_extended_not_replaced(drive):
    """a -> b, b has its own context mapping."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    graph.nodes[n.b].parameters["context"] = {"mine": True}
    driver = drive(graph)
    driver.complete(n.a, {"answer": 1})
    assert context_of(driver, n.b) == {"mine": True, f"{n.a}_result": {"answer": 1}}


def test_a_response_context_is_deep_merged_into_the_final_context(drive):
    """a, with initial context cfg={a:1, nested:{x:1}}; a returns cfg.nested.y=2."""
    graph, n = build("a")
    driver = drive(graph, context={"cfg": {"a": 1, "nested": {"x": 1}}})
    driver.complete(n.a, {"text": "ok", "context": {"cfg": {"nested": {"y": 2}}, "new": "key"}})
    assert driver.envelope["final_context"] == {"cfg": {"a": 1, "nested": {"x": 1, "y": 2}}, "new": "key"}
    assert driver.envelope["context_collisions"] == []


def test_a_downstream_node_sees_the_merged_shared_context(drive):
    """a -> b; a writes found=yes, b's context carries it."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.complete(n.a, {"context": {"found": "yes"}})
    assert context_of(driver, n.b)["found"] == "yes"


def test_a_dispatched_context_is_a_snapshot_later_merges_do_not_change(drive):
    """a, b (parallel roots), initial cfg={x:1}; a's later write must not reach b's dispatch."""
    graph, n = build("a", "b")
    driver = drive(graph, context={"cfg": {"x": 1}})
    dispatched_b = driver.dispatched()[n.b]
    driver.complete(n.a, {"context": {"cfg": {"x": 2}}})
    assert dispatched_b.parameters["context"]["cfg"] == {"x": 1}
    assert driver.state.shared.data["cfg"] == {"x": 2}


def test_a_non_mapping_response_context_fails_the_node(drive):
    """a -> b; a "completes" with context="oops": a is failed, not completed."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.complete(n.a, {"text": "hi", "context": "oops"})
    assert driver.state.status_of(n.a) == "failed"
    assert driver.state.results[n.a]["error_type"] == "ContextUpdateError"
    assert driver.signals("failed", op_id=n.a) and not driver.signals("completed", op_id=n.a)
    driver.complete(n.b)
    assert driver.envelope["failed_operations"] == [n.a]
    assert driver.envelope["status"] == "failed"
    assert driver.envelope["final_context"] == {}


@pytest.fixture
def two_writers(drive):
    """Run a, b (parallel roots) with the given responses, finishing in the given order."""

    def run(first: str, responses: dict[str, Any], **options: Any):
        graph, n = build("a", "b")
        driver = drive(graph, **options)
        order = [n.a, n.b] if first == "a" else [n.b, n.a]
        for node_id in order:
            driver.complete(node_id, responses["a" if node_id == n.a else "b"])
        return driver.envelope, n

    return run


def test_parallel_writers_of_one_key_give_the_same_result_in_either_order(two_writers):
    """a, b (parallel) both write k; b was inserted later and wins, whoever finishes first."""
    responses = {"a": {"context": {"k": "from a"}}, "b": {"context": {"k": "from b"}}}
    for first in ("a", "b"):
        envelope, n = two_writers(first, responses)
        assert envelope["final_context"] == {"k": "from b"}
        (collision,) = envelope["context_collisions"]
        assert collision["key"] == "k"
        assert set(collision["writers"]) == {n.a, n.b}
        assert collision["winner"] == n.b


def test_parallel_nested_and_scalar_writes_resolve_by_insertion_order(drive):
    """p, q, r parallel roots: p and r write alpha.x, q writes alpha as a scalar.

    Replaying all writes in insertion order gives alpha={x: "r"}; every completion
    order must give that.
    """
    responses = {
        "p": {"context": {"alpha": {"x": "p"}}},
        "q": {"context": {"alpha": "q"}},
        "r": {"context": {"alpha": {"x": "r"}}},
    }
    finals = {}
    for order in itertools.permutations("pqr"):
        graph, n = build("p", "q", "r")
        driver = drive(graph)
        for name in order:
            driver.complete(getattr(n, name), responses[name])
        finals[order] = driver.envelope["final_context"]
    assert all(final == {"alpha": {"x": "r"}} for final in finals.values()), finals


def test_a_causal_follower_overwrites_without_a_collision(drive):
    """a -> b, both write k: b simply follows a."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.complete(n.a, {"context": {"k": "from a"}})
    driver.complete(n.b, {"context": {"k": "from b"}})
    assert driver.envelope["final_context"] == {"k": "from b"}
    assert driver.envelope["context_collisions"] == []


def test_a_declared_reducer_combines_parallel_writes(two_writers):
    """a, b (parallel) both append to notes; the reducer keeps both."""
    responses = {"a": {"context": {"notes": ["a"]}}, "b": {"context": {"notes": ["b"]}}}
    for first in ("a", "b"):
        envelope, _ = two_writers(first, responses, reducers={"notes": lambda old, new: (old or []) + new})
        assert sorted(envelope["final_context"]["notes"]) == ["a", "b"]


# -- operator steer ---------------------------------------------------------------------
def test_a_steer_message_is_rendered_as_the_exact_block_before_the_instruction(drive):
    """a -> b; a steer arrives while a runs and is rendered into b's instruction."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(OperatorMessageReceived(text="text", ts=1700000000))
    driver.complete(n.a)
    assert driver.dispatched()[n.b].parameters["instruction"] == (
        "[OPERATOR STEER]\n"
        "A human operator sent these live corrections while this flow is running.\n"
        "Attend to them before continuing. Most recent last.\n"
        "- 2023-11-14T22:13:20Z: text\n"
        "[/OPERATOR STEER]\n"
        "\n"
        "do b"
    )


def test_a_steer_message_is_consumed_once_with_a_breadcrumb(drive):
    """a -> b -> c; the steer lands in b only, and records b as its consumer."""
    graph, n = build("a", "b", "c", edges=(("a", "b"), ("b", "c")))
    driver = drive(graph)
    driver.handle(OperatorMessageReceived(text="be brief", ts=1700000000))
    driver.complete(n.a)
    assert driver.dispatched()[n.b].parameters["instruction"].startswith(STEER_HEADER)
    driver.complete(n.b)
    assert driver.dispatched()[n.c].parameters["instruction"] == "do c"
    (entry,) = driver.state.shared.data["operator_messages"]
    assert entry["rendered_into_op"] == n.b


def test_the_steer_queue_is_never_passed_in_the_context(drive):
    """a -> b, with a pending steer and one already in the initial context."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph, context={"operator_messages": [{"ts": 1, "text": "early"}], "topic": "t"})
    assert "operator_messages" not in context_of(driver, n.a)
    driver.handle(OperatorMessageReceived(text="late", ts=2))
    driver.complete(n.a)
    assert "operator_messages" not in context_of(driver, n.b)
    assert context_of(driver, n.b)["topic"] == "t"


def test_a_non_numeric_steer_timestamp_is_rendered_as_text(drive):
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(OperatorMessageReceived(text="hello", ts="yesterday noon"))
    driver.complete(n.a)
    assert "- yesterday noon: hello\n[/OPERATOR STEER]" in driver.dispatched()[n.b].parameters["instruction"]


def test_non_dict_steer_entries_are_ignored(drive):
    """root, with a queue holding a raw string and one dict entry."""
    graph, n = build("root")
    driver = drive(graph, context={"operator_messages": ["raw string", {"ts": 1700000000, "text": "real"}]})
    instruction = driver.dispatched()[n.root].parameters["instruction"]
    assert instruction == STEER_HEADER + "- 2023-11-14T22:13:20Z: real\n[/OPERATOR STEER]\n\ndo root"
    assert "raw string" not in instruction


def test_several_steers_render_in_arrival_order(drive):
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    driver.handle(OperatorMessageReceived(text="first", ts=0), OperatorMessageReceived(text="second", ts=60))
    driver.complete(n.a)
    instruction = driver.dispatched()[n.b].parameters["instruction"]
    assert "- 1970-01-01T00:00:00Z: first\n- 1970-01-01T00:01:00Z: second\n" in instruction


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


def test_a_restored_failed_node_settles_with_its_error(drive):
    """a (restored: failed) -> b."""
    graph, n = build("a", "b", edges=(("a", "b"),))
    restored = graph.nodes[n.a]
    restored.status, restored.error = "failed", "timed out last time"
    driver = drive(graph)
    assert context_of(driver, n.b)[f"{n.a}_result"] == {"error": "timed out last time"}


# -- branches -------------------------------------------------------------------------------
def test_an_explicit_known_branch_is_reused(drive):
    """root -> a, where a names the known branch br-a."""
    graph, n = build("root", "a", edges=(("root", "a"),))
    graph.nodes[n.a].branch_id = "br-a"
    driver = drive(graph, default_branch_id="default", known_branches=["br-a"])
    assert [c.node_id for c in driver.of_type(CloneBranch)] == []
    driver.complete(n.root)
    assert driver.dispatched()[n.a].branch_id == "br-a"


def test_a_dependent_node_gets_a_clone_of_the_default_branch(drive):
    """root -> a."""
    graph, n = build("root", "a", edges=(("root", "a"),))
    driver = drive(graph, default_branch_id="default")
    (clone,) = driver.of_type(CloneBranch)
    assert (clone.node_id, clone.source, clone.reactive) == (n.a, "default", False)
    assert clone.branch_id != "default"
    driver.complete(n.root)
    assert driver.dispatched()[n.a].branch_id == clone.branch_id


def test_a_root_without_inheritance_runs_on_the_default_branch(drive):
    graph, n = build("root")
    driver = drive(graph, default_branch_id="default")
    assert driver.of_type(CloneBranch) == []
    assert driver.dispatched()[n.root].branch_id == "default"


def test_an_unknown_explicit_branch_falls_back_to_the_normal_rules(drive):
    """ghost-root (root, unknown branch) -> ghost-child (unknown branch)."""
    graph, n = build("root", "child", edges=(("root", "child"),))
    graph.nodes[n.root].branch_id = "ghost"
    graph.nodes[n.child].branch_id = "ghost"
    driver = drive(graph, default_branch_id="default", known_branches=["br-1"])
    assert driver.dispatched()[n.root].branch_id == "default"
    (clone,) = driver.of_type(CloneBranch)
    assert clone.node_id == n.child and clone.source == "default"


def test_a_root_that_inherits_context_gets_its_own_clone(drive):
    graph, n = build("root")
    graph.nodes[n.root].metadata["inherit_context"] = True
    driver = drive(graph, default_branch_id="default")
    (clone,) = driver.of_type(CloneBranch)
    assert driver.dispatched()[n.root].branch_id == clone.branch_id


def test_primary_dependency_history_is_replaced_just_before_dispatch(drive):
    """plan -> draft (inherit_context, primary = plan)."""
    builder = OperationGraphBuilder()
    plan = builder.add_operation("chat", instruction="Plan.")
    draft = builder.add_operation("chat", depends_on=[plan], inherit_context=True, instruction="Draft.")
    driver = drive(builder.get_graph(), default_branch_id="default")
    (clone,) = driver.of_type(CloneBranch)
    assert driver.of_type(ReplaceHistory) == []
    driver.complete(plan, {"text": "the plan"})
    replace, dispatch = non_signals(driver.last)
    assert replace == ReplaceHistory(draft, 1, clone.branch_id, "default")
    assert isinstance(dispatch, DispatchOperation) and dispatch.node_id == draft


def test_no_history_is_replaced_without_inherit_context(drive):
    """plan -> draft (no inheritance)."""
    graph, n = build("plan", "draft", edges=(("plan", "draft"),))
    driver = drive(graph, default_branch_id="default")
    driver.complete(n.plan)
    assert driver.of_type(ReplaceHistory) == []


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


# -- reactive admission -------------------------------------------------------------------
def reactive(drive, *names: str, edges=(), **options: Any):
    graph, n = build(*names, edges=edges)
    options.setdefault("default_branch_id", "default")
    return drive(graph, reactive=True, **options), n


def spawned_children(driver) -> list[str]:
    return list(driver.state.spawned_ids)


def test_a_spawn_request_in_a_response_admits_a_dependent_child(drive):
    """a (on branch br-a) spawns child: a -[spawn]-> child, child clones br-a."""
    graph, n = build("a")
    graph.nodes[n.a].branch_id = "br-a"
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(n.a, {"text": "more", "requests": [SpawnRequest(instruction="dig deeper")]})
    (child_id,) = spawned_children(driver)
    child = driver.graph.nodes[child_id]
    (edge,) = driver.graph.in_edges(child_id)
    assert (edge.head, edge.label) == (n.a, ["spawn"])
    assert child.metadata["parent_id"] == n.a and child.metadata["spawned"] is True
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "br-a" and clone.reactive is True
    dispatch = driver.dispatched()[child_id]
    assert dispatch.branch_id == clone.branch_id
    assert dispatch.parameters["instruction"] == "dig deeper"
    assert dispatch.parameters["context"][f"{n.a}_result"]["text"] == "more"
    (spawned,) = driver.signals("spawned")
    assert (spawned.op_id, spawned.parent_id, spawned.independent) == (child_id, n.a, False)


def test_an_independent_spawn_has_no_edge_and_clones_the_default_branch(drive):
    graph, n = build("a")
    graph.nodes[n.a].branch_id = "br-a"
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="side quest", independent=True)]})
    (child_id,) = spawned_children(driver)
    assert driver.graph.in_edges(child_id) == []
    assert "parent_id" not in driver.graph.nodes[child_id].metadata
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "default"
    driver.complete(child_id)
    assert driver.envelope["spawned_operations"] == 1


def test_spawns_beyond_max_spawn_are_dropped(drive):
    driver, n = reactive(drive, "a", max_spawn=1)
    driver.complete(n.a, [SpawnRequest(instruction="one"), SpawnRequest(instruction="two")])
    assert len(spawned_children(driver)) == 1
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "max_spawn_exceeded" and dropped["emitter_id"] == n.a
    assert "op_id" in dropped


def test_the_same_request_seen_twice_is_recorded_as_a_duplicate(drive):
    """a, running, sends one request live and again (same dedupe key)."""
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once", assignee=None)
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    assert len(spawned_children(driver)) == 1
    assert [d["reason"] for d in driver.state.dropped_spawns] == ["duplicate"]


def test_a_request_sent_live_and_found_in_the_response_is_a_duplicate(drive):
    """a sends a request over the bus, then returns the same object in its response."""
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once")
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key=("object", id(request))))
    driver.complete(n.a, {"requests": [request]})
    assert len(spawned_children(driver)) == 1
    assert [d["reason"] for d in driver.state.dropped_spawns] == ["duplicate"]


def test_a_shell_redelivery_of_a_request_is_ignored_silently(drive):
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once")
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k", redelivery=True))
    assert len(spawned_children(driver)) == 1
    assert driver.state.dropped_spawns == []


def test_equal_but_distinct_request_objects_are_both_admitted(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a, [SpawnRequest(instruction="same"), SpawnRequest(instruction="same")])
    assert len(spawned_children(driver)) == 2


def test_a_raising_node_builder_is_recorded_as_builder_error_truncated(drive):
    def builder(request, emitter):
        raise RuntimeError("x" * 1000)

    driver, n = reactive(drive, "a", node_builder=builder)
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="writer")]})
    (dropped,) = driver.envelope["dropped_spawns"]
    assert dropped["reason"] == "builder_error"
    assert dropped["error"] == "x" * 500
    assert (dropped["assignee"], dropped["emitter_id"]) == ("writer", n.a)
    assert driver.envelope["status"] == "completed"


def test_an_unknown_assignee_from_the_role_builder_is_a_builder_error(drive):
    driver, n = reactive(drive, "a", node_builder=role_node_builder({"writer": None}))
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="ghost")]})
    (dropped,) = driver.envelope["dropped_spawns"]
    assert dropped["reason"] == "builder_error" and "ghost" in dropped["error"]


def test_a_role_routed_child_clones_its_role_branch(drive):
    driver, n = reactive(drive, "a", node_builder=role_node_builder({"writer": "br-writer"}))
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="writer")]})
    (child_id,) = spawned_children(driver)
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "br-writer"
    assert driver.graph.nodes[child_id].metadata["reference_id"] == "spawn-1"


def test_a_node_builder_returning_none_is_recorded_as_null_child(drive):
    driver, n = reactive(drive, "a", node_builder=lambda request, emitter: None)
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go")]})
    assert [d["reason"] for d in driver.envelope["dropped_spawns"]] == ["null_child"]


# Cycle rollback in admission cannot be driven through public events: an admitted node
# is always new, and a new node has no out-edges, so ``after -> child`` can never close
# a cycle. The "cycle" ledger reason is therefore unreachable from FlowState today; the
# rollback primitive it would use is covered by
# test_graph_and_builder.py::test_a_cycle_closing_edge_is_refused_and_leaves_the_graph_unchanged.


def test_an_injected_operation_after_a_node_is_admitted(drive):
    driver, n = reactive(drive, "a")
    extra = create_operation("chat", {"instruction": "injected"})
    driver.handle(InjectRequested(operation=extra, after=n.a, token="t-1"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision == AdmissionDecided("t-1", True, extra.id, None)
    assert driver.graph.predecessors(extra.id) == [n.a]
    assert extra.id not in driver.dispatched()
    driver.complete(n.a)
    assert extra.id in driver.dispatched()


def test_reinjecting_an_existing_operation_is_a_duplicate_and_not_dispatched_twice(drive):
    driver, n = reactive(drive, "a", "b")
    driver.handle(InjectRequested(operation=driver.graph.nodes[n.b], after=n.a, token="again"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert (decision.accepted, decision.reason) == (False, "duplicate")
    assert driver.state.dropped_spawns[-1]["reason"] == "duplicate"
    driver.run_to_end()
    assert [d.node_id for d in driver.of_type(DispatchOperation)].count(n.b) == 1
    assert driver.envelope["spawned_operations"] == 0


def test_injecting_into_a_non_reactive_run_is_refused(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(InjectRequested(operation=create_operation("chat"), token="t"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision.accepted is False and decision.token == "t"


def test_injecting_after_the_run_finished_is_refused(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a)
    driver.handle(InjectRequested(operation=create_operation("chat"), token="late"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision.accepted is False


def test_a_higher_tier_escalation_reruns_the_operation_independently(drive):
    """a escalates: a new independent node runs a's operation with a notice."""
    graph = Graph()
    a = graph.add_node(create_operation("operate", {"instruction": "solve it", "context": {"x": 1}, "tools": True}))
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(a.id, {"requests": [EscalationRequest(reason="too hard")]})
    (child_id,) = spawned_children(driver)
    child = driver.graph.nodes[child_id]
    assert child.operation == "operate"
    assert child.parameters == {
        "instruction": "[ESCALATION] The previous attempt escalated this task to a higher tier. "
        "Reason: too hard\n\nsolve it",
        "tools": True,
    }
    assert driver.graph.in_edges(child_id) == []
    assert child.metadata["escalated_from"] == a.id
    (escalated,) = driver.signals("escalated")
    assert (escalated.op_id, escalated.route, escalated.child_id) == (a.id, "higher_tier", child_id)
    driver.complete(child_id)
    assert driver.envelope["escalated_operations"] == [a.id]


def test_other_escalation_routes_are_only_recorded(drive):
    driver, n = reactive(drive, "a")
    driver.handle(EscalationRequested(emitter_id=n.a, request=EscalationRequest(reason="ask", route="human")))
    assert spawned_children(driver) == []
    (escalated,) = driver.signals("escalated")
    assert escalated.child_id is None and escalated.route == "human"
    driver.complete(n.a)
    assert driver.envelope["escalated_operations"] == [n.a]
    assert driver.envelope["spawned_operations"] == 0


def test_the_spawned_signal_truncates_the_instruction_but_the_child_keeps_it(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a, [SpawnRequest(instruction="y" * 600)])
    (spawned,) = driver.signals("spawned")
    assert spawned.instruction == "y" * 512
    assert driver.graph.nodes[spawned.op_id].parameters["instruction"] == "y" * 600


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
