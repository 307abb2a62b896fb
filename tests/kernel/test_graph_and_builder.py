"""The graph model and OperationGraphBuilder against ADR-0023 D1 (and ADR-0033 delta 1)."""

from __future__ import annotations

import uuid

import pytest
from pydantic import BaseModel

from opgraph.kernel import (
    EdgeCondition,
    EdgeConditionError,
    ExpansionStrategy,
    Graph,
    GraphCycleError,
    Operation,
    OperationError,
    OperationGraphBuilder,
    UnknownNodeError,
    create_operation,
)


class Params(BaseModel):
    instruction: str
    temperature: float = 0.0


class Item(BaseModel):
    title: str
    priority: int


def graph_of(*names: str) -> tuple[Graph, dict[str, str]]:
    graph = Graph()
    ids = {}
    for name in names:
        node = create_operation("chat", metadata={"reference_id": name})
        graph.add_node(node)
        ids[name] = node.id
    return graph, ids


def snapshot(graph: Graph) -> tuple:
    return (
        list(graph.nodes),
        {e.id: (e.head, e.tail, tuple(e.label)) for e in graph.edges.values()},
        {n: (graph.predecessors(n), graph.successors(n)) for n in graph.nodes},
    )


# -- Operation and create_operation --------------------------------------------------
def test_an_operation_id_is_a_fresh_uuid_string():
    first, second = create_operation("chat"), create_operation("chat")
    assert str(uuid.UUID(first.id)) == first.id
    assert first.id != second.id


def test_request_is_a_plain_copy_of_the_parameters():
    node = create_operation("chat", {"instruction": "hi"})
    request = node.request
    request["instruction"] = "changed"
    assert node.request == {"instruction": "hi"}


def test_pydantic_parameters_are_dumped_to_a_mapping():
    node = create_operation("operate", Params(instruction="go"))
    assert node.parameters == {"instruction": "go", "temperature": 0.0}
    assert node.request == {"instruction": "go", "temperature": 0.0}


def test_create_operation_passes_keyword_fields_through():
    node = create_operation("chat", branch_id="br-1", metadata={"reference_id": "plan"})
    assert node.branch_id == "br-1"
    assert node.reference_id == "plan"
    assert node.display_name == "plan"
    assert node.status == "pending" and not node.is_terminal


@pytest.mark.parametrize("name", ["", None, 3])
def test_an_operation_name_must_be_a_non_empty_string(name):
    with pytest.raises(OperationError):
        create_operation(name)


def test_parameters_that_are_neither_mapping_nor_model_are_rejected():
    with pytest.raises(OperationError, match="mapping or pydantic model"):
        create_operation("chat", ["not", "a", "mapping"])


# -- Graph ------------------------------------------------------------------------
def test_predecessors_and_successors_are_distinct_in_edge_order():
    """a -> c, b -> c, a -> c (a duplicate edge)."""
    graph, n = graph_of("a", "b", "c")
    graph.add_edge(n["a"], n["c"])
    graph.add_edge(n["b"], n["c"])
    graph.add_edge(n["a"], n["c"])
    assert graph.predecessors(n["c"]) == [n["a"], n["b"]]
    assert graph.successors(n["a"]) == [n["c"]]
    assert len(graph.in_edges(n["c"])) == 3


def test_heads_and_tails_follow_insertion_order():
    """a -> c, b (alone)."""
    graph, n = graph_of("a", "b", "c")
    graph.add_edge(n["a"], n["c"])
    assert graph.heads() == [n["a"], n["b"]]
    assert graph.tails() == [n["b"], n["c"]]


def test_a_graph_with_a_cycle_is_not_acyclic():
    """a -> b -> a (added without a cycle check)."""
    graph, n = graph_of("a", "b")
    graph.add_edge(n["a"], n["b"])
    assert graph.is_acyclic()
    graph.add_edge(n["b"], n["a"])
    assert not graph.is_acyclic()


def test_reaches_follows_directed_paths_only():
    """a -> b -> c."""
    graph, n = graph_of("a", "b", "c")
    graph.add_edge(n["a"], n["b"])
    graph.add_edge(n["b"], n["c"])
    assert graph.reaches(n["a"], n["c"])
    assert not graph.reaches(n["c"], n["a"])


def test_a_cycle_closing_edge_is_refused_and_leaves_the_graph_unchanged():
    """a -> b -> c; proposing c -> a must fail and change nothing.

    This is the rollback the scheduler's reactive admission relies on; see the note in
    test_reactive_admission.py on why admission itself cannot be driven into a cycle.
    """
    graph, n = graph_of("a", "b", "c")
    graph.add_edge(n["a"], n["b"])
    graph.add_edge(n["b"], n["c"])
    before = snapshot(graph)
    with pytest.raises(GraphCycleError) as caught:
        graph.add_edge(n["c"], n["a"], check_cycle=True)
    assert caught.value.edge_id is not None
    assert snapshot(graph) == before
    assert graph.is_acyclic()


def test_a_self_loop_is_a_cycle():
    graph, n = graph_of("a")
    with pytest.raises(GraphCycleError):
        graph.add_edge(n["a"], n["a"], check_cycle=True)
    assert graph.edges == {}


def test_an_edge_to_an_unknown_node_is_refused():
    graph, n = graph_of("a")
    with pytest.raises(UnknownNodeError) as caught:
        graph.add_edge(n["a"], "missing")
    assert caught.value.node_id == "missing"
    assert graph.edges == {}


def test_an_edge_condition_without_apply_is_refused_and_not_added():
    graph, n = graph_of("a", "b")
    with pytest.raises(EdgeConditionError):
        graph.add_edge(n["a"], n["b"], condition=object())
    assert graph.edges == {} and graph.predecessors(n["b"]) == []


def test_an_object_with_apply_that_is_no_edge_condition_is_refused_before_any_work():
    """ADR-0023 D2: invalid condition types fail validation; a duck-typed apply is not enough."""

    class LooksLikeOne:
        def apply(self, input):  # noqa: A002 - EdgeCondition.apply's name in the record
            return True

    graph, n = graph_of("a", "b")
    with pytest.raises(EdgeConditionError) as caught:
        graph.add_edge(n["a"], n["b"], condition=LooksLikeOne())
    assert "LooksLikeOne" in caught.value.message and graph.edges == {}


def test_an_edge_condition_with_apply_is_accepted():
    class Always(EdgeCondition):
        def apply(self, input):  # noqa: A002 - EdgeCondition.apply's name in the record
            return True

    graph, n = graph_of("a", "b")
    edge = graph.add_edge(n["a"], n["b"], condition=Always(), label=["gate"])
    assert edge.label == ["gate"] and isinstance(edge.condition, Always)


def test_a_node_cannot_be_added_twice():
    graph, n = graph_of("a")
    with pytest.raises(OperationError):
        graph.add_node(graph.nodes[n["a"]])


def test_only_operations_can_be_graph_nodes():
    with pytest.raises(OperationError):
        Graph().add_node({"operation": "chat"})


def test_removing_a_node_removes_its_edges_in_both_directions():
    """a -> b -> c; removing b leaves a and c unconnected."""
    graph, n = graph_of("a", "b", "c")
    graph.add_edge(n["a"], n["b"])
    graph.add_edge(n["b"], n["c"])
    removed = graph.remove_node(n["b"])
    assert removed.id == n["b"]
    assert graph.edges == {}
    assert graph.successors(n["a"]) == [] and graph.predecessors(n["c"]) == []
    assert n["b"] not in graph and len(graph) == 2


def test_adding_then_removing_restores_the_graph():
    """a -> b; add c with b -> c, then remove c: the graph is as before."""
    graph, n = graph_of("a", "b")
    graph.add_edge(n["a"], n["b"])
    before = snapshot(graph)
    extra = graph.add_node(create_operation("chat"))
    edge = graph.add_edge(n["b"], extra.id)
    graph.remove_edge(edge.id)
    graph.remove_node(extra.id)
    assert snapshot(graph) == before


def test_removing_unknown_nodes_and_edges_raises():
    graph = Graph()
    with pytest.raises(UnknownNodeError):
        graph.remove_node("missing")
    with pytest.raises(OperationError):
        graph.remove_edge("missing")


# -- OperationGraphBuilder.add_operation -------------------------------------------
def test_a_builder_node_id_is_a_reference_not_the_identity():
    builder = OperationGraphBuilder()
    node_id = builder.add_operation("chat", node_id="plan", instruction="Plan.")
    node = builder.get_graph().nodes[node_id]
    assert node_id != "plan" and str(uuid.UUID(node_id)) == node_id
    assert node.metadata["reference_id"] == "plan"
    assert node.parameters == {"instruction": "Plan."}


def test_omitted_depends_on_chains_after_the_current_heads_with_a_sequential_label():
    """a -> b (no depends_on given for b)."""
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat")
    b = builder.add_operation("chat")
    graph = builder.get_graph()
    assert graph.predecessors(b) == [a]
    assert graph.in_edges(b)[0].label == ["sequential"]
    assert builder.current_heads == [b]


def expanded_in_two() -> tuple[OperationGraphBuilder, str, str]:
    """A builder holding src -> (x, y) by expansion; x and y are its current heads."""
    builder = OperationGraphBuilder()
    x, y = builder.expand_from_result(["x", "y"], builder.add_operation("chat"), "chat")
    return builder, x, y


def test_omitted_depends_on_chains_after_every_current_head():
    """src -> (x, y) by expansion, then z chains after both x and y."""
    builder, x, y = expanded_in_two()
    z = builder.add_operation("chat")
    graph = builder.get_graph()
    assert graph.predecessors(z) == [x, y]
    assert all(edge.label == ["sequential"] for edge in graph.in_edges(z))


def test_an_empty_depends_on_makes_an_independent_root():
    """a, then b with depends_on=[]: both are roots (the deliberate change)."""
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat")
    b = builder.add_operation("chat", depends_on=[])
    assert builder.get_graph().heads() == [a, b]
    assert builder.current_heads == [b]


def test_a_fan_out_loop_with_empty_depends_on_is_not_serialised():
    builder = OperationGraphBuilder()
    ids = [builder.add_operation("chat", depends_on=[]) for _ in range(4)]
    assert builder.get_graph().heads() == ids
    assert builder.get_graph().edges == {}


def test_depends_on_adds_labelled_edges_and_ignores_unknown_ids():
    """a -> c, b -> c; 'nope' is not a builder id and is ignored."""
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat")
    b = builder.add_operation("chat", depends_on=[])
    c = builder.add_operation("chat", depends_on=[a, "nope", b])
    graph = builder.get_graph()
    assert graph.predecessors(c) == [a, b]
    assert all(edge.label == ["depends_on"] for edge in graph.in_edges(c))


@pytest.mark.parametrize("method", ["add_operation", "add_aggregation"])
def test_a_single_id_given_as_a_string_is_refused_not_read_as_characters(method):
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat")
    keyword = "depends_on" if method == "add_operation" else "source_node_ids"
    with pytest.raises(OperationError, match=f"{keyword} must be a list of node ids"):
        getattr(builder, method)("chat", **{keyword: a})
    assert len(builder.get_graph().nodes) == 1  # nothing was added


def test_only_unknown_dependencies_leave_a_root():
    builder = OperationGraphBuilder()
    builder.add_operation("chat")
    lonely = builder.add_operation("chat", depends_on=["nope"])
    assert builder.get_graph().predecessors(lonely) == []


def test_inherit_context_records_the_first_dependency_as_primary():
    """b -> c, a -> c; c inherits b's conversation because b is listed first."""
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat")
    b = builder.add_operation("chat", depends_on=[])
    c = builder.add_operation("chat", depends_on=[b, a], inherit_context=True)
    metadata = builder.get_graph().nodes[c].metadata
    assert metadata["inherit_context"] is True
    assert metadata["primary_dependency"] == b


def test_inherit_context_without_dependencies_records_no_primary():
    builder = OperationGraphBuilder()
    root = builder.add_operation("chat", depends_on=[], inherit_context=True)
    assert "primary_dependency" not in builder.get_graph().nodes[root].metadata


def test_a_branch_is_normalised_to_its_id_string():
    class Branch:
        id = uuid.UUID("12345678-1234-5678-1234-567812345678")

    builder = OperationGraphBuilder()
    by_object = builder.add_operation("chat", branch=Branch())
    by_string = builder.add_operation("chat", branch="br-1")
    nodes = builder.get_graph().nodes
    assert nodes[by_object].branch_id == "12345678-1234-5678-1234-567812345678"
    assert nodes[by_string].branch_id == "br-1"


# -- expand_from_result --------------------------------------------------------------
def test_expanding_from_an_unknown_source_raises():
    builder = OperationGraphBuilder()
    with pytest.raises(OperationError) as caught:
        builder.expand_from_result(["x"], "missing", "chat")
    assert caught.value.node_id == "missing"


def test_expansion_dumps_model_items_and_stringifies_other_items():
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    model_child, text_child, number_child = builder.expand_from_result(
        [Item(title="t", priority=2), "plain", 3], src, "operate", shared="yes"
    )
    nodes = builder.get_graph().nodes
    assert nodes[model_child].parameters == {
        "shared": "yes",
        "title": "t",
        "priority": 2,
        "expansion_strategy": "concurrent",
    }
    assert nodes[text_child].parameters == {
        "shared": "yes",
        "item_index": 1,
        "item": "plain",
        "expansion_strategy": "concurrent",
    }
    assert nodes[number_child].parameters["item"] == "3"
    assert nodes[number_child].parameters["item_index"] == 2


def test_expansion_children_hang_off_the_source_with_strategy_labelled_edges_only():
    """src -> (c0, c1, c2), and no edge between the children even for SEQUENTIAL."""
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    children = builder.expand_from_result(["a", "b", "c"], src, "chat", strategy=ExpansionStrategy.SEQUENTIAL)
    graph = builder.get_graph()
    for child in children:
        assert graph.predecessors(child) == [src]
        assert graph.successors(child) == []
        assert graph.in_edges(child)[0].label == ["expansion", "sequential"]
        assert graph.nodes[child].metadata["expansion_source"] == src
        assert graph.nodes[child].metadata["expansion_strategy"] == "sequential"
    assert builder.current_heads == children


def test_chain_context_moves_the_primary_to_the_previous_sequential_child():
    """src -> c0, c1, c2: c0 inherits from src, c1 from c0, c2 from c1."""
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    c0, c1, c2 = builder.expand_from_result(
        ["a", "b", "c"], src, "chat", strategy=ExpansionStrategy.SEQUENTIAL, inherit_context=True, chain_context=True
    )
    nodes = builder.get_graph().nodes
    assert [nodes[c].metadata["primary_dependency"] for c in (c0, c1, c2)] == [src, c0, c1]


@pytest.mark.parametrize(
    "strategy",
    [
        ExpansionStrategy.CONCURRENT,
        ExpansionStrategy.SEQUENTIAL_CONCURRENT_CHUNK,
        ExpansionStrategy.CONCURRENT_SEQUENTIAL_CHUNK,
    ],
)
def test_chain_context_leaves_non_sequential_children_inheriting_from_the_source(strategy):
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    children = builder.expand_from_result(
        ["a", "b"], src, "chat", strategy=strategy, inherit_context=True, chain_context=True
    )
    nodes = builder.get_graph().nodes
    assert [nodes[c].metadata["primary_dependency"] for c in children] == [src, src]


def test_sequential_without_chain_context_inherits_from_the_source():
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    children = builder.expand_from_result(
        ["a", "b"], src, "chat", strategy=ExpansionStrategy.SEQUENTIAL, inherit_context=True
    )
    nodes = builder.get_graph().nodes
    assert [nodes[c].metadata["primary_dependency"] for c in children] == [src, src]


def test_expansion_accepts_the_strategy_value_string():
    builder = OperationGraphBuilder()
    src = builder.add_operation("chat")
    (child,) = builder.expand_from_result(["a"], src, "chat", strategy="sequential_concurrent_chunk")
    assert builder.get_graph().in_edges(child)[0].label == ["expansion", "sequential_concurrent_chunk"]


# -- add_aggregation -------------------------------------------------------------------
def test_aggregation_waits_on_explicit_sources_and_records_them():
    """a, b -> agg (explicit sources)."""
    builder = OperationGraphBuilder()
    a = builder.add_operation("chat", depends_on=[])
    b = builder.add_operation("chat", depends_on=[])
    agg = builder.add_aggregation("chat", node_id="merge", source_node_ids=[a, b], instruction="Merge.")
    graph = builder.get_graph()
    node = graph.nodes[agg]
    assert graph.predecessors(agg) == [a, b]
    assert all(edge.label == ["aggregate"] for edge in graph.in_edges(agg))
    assert node.parameters == {"instruction": "Merge.", "aggregation_sources": [a, b], "aggregation_count": 2}
    assert node.metadata["aggregation_sources"] == [a, b]
    assert node.metadata["reference_id"] == "merge"
    assert builder.current_heads == [agg]


def test_aggregation_defaults_to_the_current_heads():
    """src -> (x, y) -> agg."""
    builder, x, y = expanded_in_two()
    agg = builder.add_aggregation("chat")
    assert builder.get_graph().predecessors(agg) == [x, y]
    assert builder.get_graph().nodes[agg].parameters["aggregation_count"] == 2


def test_aggregation_with_no_sources_and_no_heads_raises():
    with pytest.raises(OperationError, match="aggregation needs"):
        OperationGraphBuilder().add_aggregation("chat")


def test_aggregation_over_an_unknown_source_raises():
    builder = OperationGraphBuilder()
    with pytest.raises(OperationError):
        builder.add_aggregation("chat", source_node_ids=["missing"])


@pytest.mark.parametrize(("index", "expected"), [(0, 0), (1, 1), (2, 2), (99, 2), (-5, 0)])
def test_inherit_from_source_is_clamped_to_the_source_list(index, expected):
    builder = OperationGraphBuilder()
    sources = [builder.add_operation("chat", depends_on=[]) for _ in range(3)]
    agg = builder.add_aggregation("chat", source_node_ids=sources, inherit_context=True, inherit_from_source=index)
    metadata = builder.get_graph().nodes[agg].metadata
    assert metadata["primary_dependency"] == sources[expected]
    assert metadata["inherit_context"] is True


# -- add_conditional_branch ------------------------------------------------------------
def test_conditional_branch_labels_its_true_and_false_edges():
    """check -> true [if_true], check -> false [if_false]."""
    builder = OperationGraphBuilder()
    ids = builder.add_conditional_branch("chat", "operate", "communicate", instruction="Is it ok?")
    graph = builder.get_graph()
    assert set(ids) == {"check", "true", "false"}
    assert graph.nodes[ids["check"]].parameters == {"instruction": "Is it ok?"}
    assert graph.nodes[ids["true"]].operation == "operate"
    assert graph.nodes[ids["false"]].operation == "communicate"
    assert [e.label for e in graph.out_edges(ids["check"])] == [["if_true"], ["if_false"]]
    assert all(e.condition is None for e in graph.out_edges(ids["check"]))
    assert builder.current_heads == [ids["true"], ids["false"]]


def test_conditional_branch_without_a_false_op_has_only_a_true_successor():
    builder = OperationGraphBuilder()
    first = builder.add_operation("chat")
    ids = builder.add_conditional_branch("chat", "operate")
    graph = builder.get_graph()
    assert set(ids) == {"check", "true"}
    assert graph.predecessors(ids["check"]) == [first]
    assert graph.successors(ids["check"]) == [ids["true"]]
    assert builder.current_heads == [ids["true"]]


def test_get_graph_returns_the_built_graph_of_operations():
    builder = OperationGraphBuilder("named")
    builder.add_operation("chat")
    graph = builder.get_graph()
    assert graph.name == "named"
    assert all(isinstance(node, Operation) for node in graph.nodes.values())
