"""A Graph pickles as rows of plain fields and comes back equal, node for node and edge for edge."""

from __future__ import annotations

import copy
import pickle

from opgraph.kernel import Edge, EdgeCondition, Graph, Operation, create_operation, settle_completed


class AlwaysTrue(EdgeCondition):
    def apply(self, input):  # noqa: A002 - the record's name
        return True


class TaggedOperation(Operation):
    tag: str = "x"


def sample_graph() -> Graph:
    graph = Graph("sample")
    a = graph.add_node(create_operation("chat", {"instruction": "a"}, metadata={"reference_id": "a"}))
    b = graph.add_node(create_operation("operate", {"instruction": "b"}, branch_id="br-1"))
    c = graph.add_node(Operation(operation="chat", status="completed", response={"ok": [1, 2]}))
    d = graph.add_node(create_operation("chat"))
    graph.add_edge(a.id, b.id, label=["first"])
    graph.add_edge(a.id, c.id, condition=AlwaysTrue())
    graph.add_edge(b.id, d.id)
    graph.add_edge(c.id, d.id)
    return graph


def round_trip(graph: Graph) -> Graph:
    return pickle.loads(pickle.dumps(graph))


def test_a_pickled_graph_has_the_same_nodes_edges_and_fields():
    graph = sample_graph()
    restored = round_trip(graph)
    assert restored.name == "sample"
    assert list(restored.nodes) == list(graph.nodes)
    assert list(restored.edges) == list(graph.edges)
    for node_id, node in graph.nodes.items():
        assert restored.nodes[node_id] == node
        assert restored.nodes[node_id].model_fields_set == node.model_fields_set
    for edge_id, edge in graph.edges.items():
        twin = restored.edges[edge_id]
        assert (twin.head, twin.tail, twin.label) == (edge.head, edge.tail, edge.label)
        assert type(twin.condition) is type(edge.condition)


def test_a_pickled_graph_rebuilds_adjacency_in_the_original_edge_order():
    graph = sample_graph()
    a, b, c, d = graph.nodes
    extra = graph.add_edge(a, d)
    graph.remove_edge(graph._in[d][0])  # b -> d goes; order of what is left must hold
    graph.add_edge(b, d)
    restored = round_trip(graph)
    assert restored._in == graph._in
    assert restored._out == graph._out
    assert restored.predecessors(d) == graph.predecessors(d) == [c, a, b]
    assert extra.id in restored.edges


def test_restored_nodes_are_independent_models_that_track_assignments():
    graph = sample_graph()
    restored = round_trip(graph)
    node_id = next(iter(graph.nodes))
    restored.nodes[node_id].status = "running"
    restored.nodes[node_id].parameters["instruction"] = "changed"
    assert graph.nodes[node_id].status == "pending"
    assert graph.nodes[node_id].parameters["instruction"] == "a"
    assert "status" in restored.nodes[node_id].model_fields_set
    assert "status" not in graph.nodes[node_id].model_fields_set


def test_subclassed_nodes_and_extra_graph_attributes_survive_pickling():
    graph = sample_graph()
    tagged = graph.add_node(TaggedOperation(operation="chat", tag="keep"))
    graph.owner = "team-a"
    restored = round_trip(graph)
    assert type(restored.nodes[tagged.id]) is TaggedOperation
    assert restored.nodes[tagged.id].tag == "keep"
    assert restored.owner == "team-a"


def test_a_restored_graph_accepts_new_nodes_and_edges():
    restored = round_trip(sample_graph())
    node = restored.add_node(create_operation("chat"))
    edge = restored.add_edge(next(iter(restored.nodes)), node.id, check_cycle=True)
    assert isinstance(edge, Edge)
    assert restored.predecessors(node.id) == [edge.head]
    assert restored.is_acyclic()


def test_copy_shares_nodes_and_deepcopy_does_not():
    graph = sample_graph()
    shallow, deep = copy.copy(graph), copy.deepcopy(graph)
    node_id = next(iter(graph.nodes))
    assert shallow.nodes[node_id] is graph.nodes[node_id]
    assert deep.nodes[node_id] is not graph.nodes[node_id]
    assert deep.nodes[node_id] == graph.nodes[node_id]
    assert deep._in == graph._in


def test_a_graph_whose_edge_names_a_missing_node_unpickles_and_is_refused_with_unknown_node():
    """a -> (missing): the edge was put in by hand; unpickling keeps it, the flow refuses it typed."""
    import pytest

    from opgraph.kernel import FlowState, UnknownNodeError

    graph = Graph("dangling")
    a = graph.add_node(create_operation("chat", {"instruction": "a"}))
    edge = Edge(head=a.id, tail="missing")
    graph.edges[edge.id] = edge
    copied = pickle.loads(pickle.dumps(graph))
    with pytest.raises(UnknownNodeError) as caught:
        copied.check_references()
    assert caught.value.node_id == "missing" and caught.value.edge_id == edge.id
    with pytest.raises(UnknownNodeError):
        FlowState(copied)


def test_nodes_built_alike_share_a_fields_set_until_one_is_assigned():
    """Unpickled nodes a, b (built alike) share one fields-set and the empty adjacency; assigning
    a field of a gives a its own set, and b's fields-set, its dump and pickled shape stay as they were."""
    graph = Graph("fan-out")
    for index in range(2):
        graph.add_node(create_operation("sleep", {"result": index}))
    a, b = round_trip(graph).nodes.values()
    assert a.__pydantic_fields_set__ is b.__pydantic_fields_set__
    a.status = "completed"
    assert a.model_fields_set == {"operation", "parameters", "status"}
    assert b.model_fields_set == {"operation", "parameters"}
    assert b.model_dump(exclude_unset=True) == {"operation": "sleep", "parameters": {"result": 1}}
    copied = b.model_copy(update={"status": "failed"})
    assert copied.model_fields_set == {"operation", "parameters", "status"}
    assert b.model_fields_set == {"operation", "parameters"}
    restored = round_trip(graph)
    edge = restored.add_edge(*restored.nodes)  # the first edge of each end gets a list of its own
    head, tail = restored.nodes
    assert restored._out[head] == [edge.id] and restored._in[tail] == [edge.id]
    assert restored._in[head] == () and restored._out[tail] == ()
    restored.remove_edge(edge.id)
    assert restored._out == round_trip(graph)._out and restored._in == round_trip(graph)._in


def test_settling_a_node_writes_what_assignment_would_and_leaves_its_twin_alone():
    """a, b share a fields-set; a.settle("completed", response=...) stores and marks both fields as
    assignment does, b is untouched; a subclass is settled through its own assignments."""
    graph = Graph("fan-out")
    for index in range(2):
        graph.add_node(create_operation("sleep", {"result": index}))
    a, b = round_trip(graph).nodes.values()
    twin = a.model_copy()
    a.settle("completed", response={"answer": 42})
    twin.status, twin.response = "completed", {"answer": 42}
    assert a.model_dump() == twin.model_dump() and a.model_fields_set == twin.model_fields_set
    assert a.model_fields_set == {"operation", "parameters", "status", "response"}
    assert b.model_fields_set == {"operation", "parameters"} and b.status == "pending"
    b.settle("failed", error="boom")
    assert (b.status, b.error, b.response) == ("failed", "boom", None)

    class Guarded(Operation):
        def __setattr__(self, name, value):
            super().__setattr__(name, value.upper() if name == "error" else value)

    guarded = Guarded(operation="sleep")
    guarded.settle("failed", error="boom")
    assert (guarded.status, guarded.error) == ("failed", "BOOM")


def test_settle_completed_is_settle_for_a_completed_node_and_shares_the_settled_fields_set():
    """Nodes a, b, c built alike share a fields-set. ``settle_completed`` on a and b writes what
    ``settle("completed", response=...)`` writes (dump and fields-set); a and b then share one
    settled set, c keeps the unsettled one, and assigning to a afterwards leaves b alone. A node
    with a set of its own, and a subclass, settle as ``settle`` does."""
    graph = Graph("fan-out")
    for index in range(3):
        graph.add_node(create_operation("sleep", {"result": index}))
    a, b, c = round_trip(graph).nodes.values()
    twin = a.model_copy()
    twin.settle("completed", response={"answer": 42})
    settle_completed(a, {"answer": 42})
    settle_completed(b, 7)
    assert a.model_dump() == twin.model_dump() and a.model_fields_set == twin.model_fields_set
    assert a.__pydantic_fields_set__ is b.__pydantic_fields_set__
    assert (b.status, b.response) == ("completed", 7)
    assert c.model_fields_set == {"operation", "parameters"} and c.status == "pending"
    a.error = "late"
    assert "error" in a.model_fields_set and "error" not in b.model_fields_set

    own = Operation(operation="sleep", branch_id=None)
    settle_completed(own, "done")
    assert own.model_fields_set == {"operation", "branch_id", "status", "response"}

    class Guarded(Operation):
        def __setattr__(self, name, value):
            super().__setattr__(name, value.upper() if name == "response" else value)

    guarded = Guarded(operation="sleep")
    settle_completed(guarded, "yes")
    assert (guarded.status, guarded.response) == ("completed", "YES")


def test_an_operation_pickles_as_its_fields_and_comes_back_equal_with_the_same_fields_set():
    """A plain Operation (what a spawn admits and the run log records) round-trips at every pickle
    protocol, equal and with its fields-set; two alike share one fields-set after; a subclass
    still pickles whole, its own field included."""
    node = create_operation("sleep", {"seconds": 0.05, "pair": (1, 2)})
    node.metadata["spawned"] = True
    twin = create_operation("sleep", {"seconds": 0.05})
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        restored, restored_twin = pickle.loads(pickle.dumps([node, twin], protocol=protocol))
        assert type(restored) is Operation and restored == node
        assert restored.model_fields_set == node.model_fields_set
        assert restored.parameters["pair"] == (1, 2)
        assert restored.__pydantic_fields_set__ is restored_twin.__pydantic_fields_set__
        restored.status = "completed"  # assigning gives it a set of its own
        assert "status" not in restored_twin.model_fields_set
    tagged = pickle.loads(pickle.dumps(TaggedOperation(operation="sleep", tag="y")))
    assert type(tagged) is TaggedOperation and tagged.tag == "y"
    assert tagged.model_fields_set == {"operation", "tag"}


def test_plain_edges_travel_as_columns_and_come_back_equal_in_order_each_with_a_label_of_its_own():
    """A fan-in of plain edges (no condition): pickled as columns, not rows; restored, every edge
    equals its original with the same fields-set, the adjacency is in the original order, and two
    edges that had equal labels hold separate lists. An edge built by hand (a fields-set of its
    own, another label) travels in the same columns."""
    graph = Graph("fan-in")
    sources = [graph.add_node(create_operation("sleep", {"result": index})).id for index in range(5)]
    sink = graph.add_node(create_operation("merge")).id
    for source in sources:
        graph.add_edge(source, sink, label=["aggregate"])
    by_hand = Edge(head=sources[0], tail=sources[1], label=["note", "extra"])
    graph._attach(by_hand)
    graph.add_edge(sources[2], sources[3])
    assert type(graph.__reduce__()[1][3]) is tuple  # columns
    restored = round_trip(graph)
    assert list(restored.edges) == list(graph.edges)
    for edge_id, edge in graph.edges.items():
        twin = restored.edges[edge_id]
        assert type(twin) is Edge and twin.model_dump() == edge.model_dump()
        assert twin.model_fields_set == edge.model_fields_set
    assert restored._in == graph._in and restored._out == graph._out
    assert restored.predecessors(sink) == sources
    first, second = (restored.edges[edge_id] for edge_id in restored._in[sink][:2])
    first.label.append("changed")
    assert second.label == ["aggregate"]
    assert restored.is_acyclic() and restored.check_references() is None


# -- nodes as columns (issue #18) -------------------------------------------------------------
class RaisingEquality:
    """A response that will not be compared (as a numpy array would answer ``== None``)."""

    def __init__(self, value=0):
        self.value = value

    def __eq__(self, other):
        raise ValueError("the truth value is ambiguous")

    __hash__ = object.__hash__


class Status(str):
    pass


def _pickled_nodes(graph: Graph):
    """What ``Graph.__reduce__`` sends for the nodes: columns (a tuple) or rows (a list)."""
    return graph.__reduce__()[1][2]


def test_plain_nodes_travel_as_columns_and_come_back_equal_each_with_its_own_metadata():
    graph = Graph("fan-out")
    for index in range(3):
        graph.add_node(create_operation("sleep", {"result": index}))
    columns = _pickled_nodes(graph)
    assert type(columns) is tuple and columns[4] == {}  # nothing but the defaults beyond the three columns
    restored = round_trip(graph)
    assert list(restored.nodes) == list(graph.nodes)
    for node_id, node in graph.nodes.items():
        twin = restored.nodes[node_id]
        assert twin == node and twin.model_fields_set == node.model_fields_set
        assert list(twin.__dict__) == list(node.__dict__)  # field order, as pydantic keeps it
    a, b, _ = restored.nodes.values()
    a.metadata["seen"] = True
    assert b.metadata == {} and a.metadata is not b.metadata


def test_columns_carry_only_the_fields_some_node_holds_other_than_at_its_default():
    graph = Graph("mixed")
    plain = graph.add_node(create_operation("chat", {"instruction": "a"}))
    placed = graph.add_node(create_operation("chat", {"instruction": "b"}, branch_id="br-1"))
    tagged = graph.add_node(create_operation("chat", metadata={"reference_id": "c"}))
    done = graph.add_node(Operation(operation="chat", status="completed", response={"ok": [1]}))
    failed = graph.add_node(Operation(operation="chat", status="failed", error="boom"))
    assert set(_pickled_nodes(graph)[4]) == {"branch_id", "metadata", "status", "response", "error"}
    restored = round_trip(graph)
    assert list(restored.nodes) == list(graph.nodes)
    for node in (plain, placed, tagged, done, failed):
        twin = restored.nodes[node.id]
        assert twin == node and twin.model_fields_set == node.model_fields_set
    assert restored.nodes[placed.id].branch_id == "br-1" and restored.nodes[plain.id].branch_id is None
    assert restored.nodes[tagged.id].metadata == {"reference_id": "c"} and restored.nodes[plain.id].metadata == {}
    only_branch = Graph("one field")
    only_branch.add_node(create_operation("chat", branch_id="br-2"))
    only_branch.add_node(create_operation("chat"))
    assert set(_pickled_nodes(only_branch)[4]) == {"branch_id"}


def test_a_value_is_never_compared_to_its_default_nor_replaced_by_an_equal_one():
    graph = Graph("odd values")
    odd = graph.add_node(Operation(operation="chat", status="completed", response=RaisingEquality(7)))
    kept = graph.add_node(create_operation("chat"))
    kept.status = Status("pending")  # equal to the default, not of its type
    restored = round_trip(graph)
    assert type(restored.nodes[odd.id].response) is RaisingEquality
    assert restored.nodes[odd.id].response.value == 7
    assert type(restored.nodes[kept.id].status) is Status


def test_a_graph_with_a_subclassed_node_sends_its_nodes_as_rows_and_rows_still_load():
    graph = sample_graph()
    assert type(_pickled_nodes(graph)) is tuple
    graph.add_node(TaggedOperation(operation="chat", tag="keep"))
    assert type(_pickled_nodes(graph)) is list
    # A run-log header written before nodes travelled as columns holds rows: it still loads.
    from opgraph.kernel.graph import _graph_from_rows, _model_row

    plain = sample_graph()
    shapes: dict = {}
    shared: dict = {}
    rows = [_model_row(node, Operation, shapes, shared) for node in plain.nodes.values()]
    edges = [_model_row(edge, Edge, shapes, shared) for edge in plain.edges.values()]
    loaded = _graph_from_rows(Graph, plain.name, rows, edges, list(shapes), {})
    assert list(loaded.nodes) == list(plain.nodes)
    assert all(loaded.nodes[node_id] == node for node_id, node in plain.nodes.items())
    assert loaded._in == plain._in and loaded._out == plain._out


def test_an_empty_graph_and_a_graph_of_one_node_round_trip():
    empty = round_trip(Graph("empty"))
    assert (empty.name, empty.nodes, empty.edges, empty._in, empty._out) == ("empty", {}, {}, {}, {})
    single = Graph("single")
    node = single.add_node(create_operation("chat"))
    assert round_trip(single).nodes == {node.id: node}


def test_nodes_with_different_fields_sets_keep_each_its_own_after_columns():
    graph = Graph("shapes")
    nodes = [graph.add_node(create_operation("chat")), graph.add_node(Operation(operation="chat", branch_id=None)),
             graph.add_node(create_operation("chat"))]
    restored = round_trip(graph)
    assert [node.model_fields_set for node in restored.nodes.values()] == [node.model_fields_set for node in nodes]
    first, _, third = restored.nodes.values()
    assert first.__pydantic_fields_set__ is third.__pydantic_fields_set__  # alike: one shared set
