"""What a dispatched operation is handed (ADR-0023 D3, D4): its context and its branch.

The context holds predecessor results under ``<id>_result``, the operation's own context
and the shared context, with its merges and collisions; the operator steer is rendered
into the instruction; each node runs on a reused or cloned branch and may inherit its
primary's history. Tests start FlowState through the ``drive`` fixture and read the dispatches.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kernel_graphs import build, context_of  # tests/support: shared kernel test graphs

from opgraph.kernel import (
    CloneBranch,
    DispatchOperation,
    EmitSignal,
    Graph,
    OperationError,
    OperationGraphBuilder,
    OperatorMessageReceived,
    ReplaceHistory,
    SharedContext,
    create_operation,
)


# -- helpers ------------------------------------------------------------------------
def non_signals(instructions: list[Any]) -> list[Any]:
    return [i for i in instructions if not isinstance(i, EmitSignal)]


STEER_HEADER = (
    "[OPERATOR STEER]\n"
    "A human operator sent these live corrections while this flow is running.\n"
    "Attend to them before continuing. Most recent last.\n"
)


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


def refuses_three(old, new):
    if new == 3:
        raise ValueError("three is not allowed")
    return (old or 0) + new


@pytest.mark.parametrize("first", ["a", "b"])
def test_a_reducer_that_raises_fails_its_writer_and_undoes_its_whole_update(two_writers, first):
    """a, b (parallel): a's update {note, total: 3} is refused by the total reducer, in
    either order; b's {total: 5} stands, and a's note was never written."""
    responses = {"a": {"context": {"note": "from a", "total": 3}}, "b": {"context": {"total": 5}}}
    envelope, n = two_writers(first, responses, reducers={"total": refuses_three}, context={"total": 1})
    assert envelope["final_context"] == {"total": 6}
    assert envelope["failed_operations"] == [n.a]
    error = envelope["operation_results"][n.a]
    assert error["error_type"] == "ContextUpdateError"
    assert "'total'" in error["error"] and "three is not allowed" in error["error"]
    assert envelope["operation_statuses"] == {n.a: "failed", n.b: "completed"}


def test_a_merge_that_raises_leaves_the_shared_context_as_it_was():
    shared = SharedContext({"kept": {"x": 1}}, reducers={"total": refuses_three})
    shared.merge({"total": 2}, writer="w1", rank=(0,))
    with pytest.raises(OperationError, match="'total'") as caught:
        shared.merge({"kept": {"x": 9, "y": 2}, "total": 3}, writer="w2", rank=(1,))
    assert caught.value.node_id == "w2"
    assert shared.data == {"kept": {"x": 1}, "total": 2}
    assert shared.collisions == []
    shared.merge({"total": 4}, writer="w3", rank=(2,))  # it goes on merging as before
    assert shared.data["total"] == 6


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
