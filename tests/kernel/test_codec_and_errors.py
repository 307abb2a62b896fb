"""The msgpack codec round-trips kernel values; every error class pickles with its ids."""

from __future__ import annotations

import inspect
import pickle

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import opgraph.kernel.errors as errors
from opgraph.kernel import (
    CODEC_SCHEMA_VERSION,
    CodecError,
    EdgeCondition,
    EscalationRequest,
    Graph,
    NodeCompleted,
    NodeEscalated,
    NodeFailed,
    NodeQueued,
    NodeSpawned,
    OpGraphError,
    SpawnRequest,
    TaskAssignment,
    UnsafeExpressionError,
    create_operation,
    decode,
    encode,
    register_condition,
)


def round_trip(value):
    return decode(encode(value))


# -- the codec ---------------------------------------------------------------------------
def test_an_operation_round_trips_with_every_field():
    node = create_operation(
        "operate",
        {"instruction": "go", "nested": {"list": [1, 2.5, None]}},
        branch_id="br-1",
        metadata={"reference_id": "plan", "primary_dependency": "x"},
    )
    node.status, node.response, node.error = "failed", {"partial": True}, "boom"
    assert round_trip(node) == node


def test_a_graph_round_trips_with_nodes_edges_and_labels():
    """a -> b [depends_on], a -> c [if_true, extra]."""
    graph = Graph("named")
    a, b, c = (graph.add_node(create_operation("chat", {"instruction": n})) for n in "abc")
    graph.add_edge(a, b, label=["depends_on"])
    graph.add_edge(a, c, label=["if_true", "extra"])
    restored = round_trip(graph)
    assert isinstance(restored, Graph) and restored.name == "named"
    assert restored.nodes == graph.nodes
    assert list(restored.nodes) == list(graph.nodes)
    assert {e.id: (e.head, e.tail, e.label) for e in restored.edges.values()} == {
        e.id: (e.head, e.tail, e.label) for e in graph.edges.values()
    }
    assert restored.successors(a.id) == [b.id, c.id]
    assert restored.predecessors(c.id) == [a.id]
    assert restored.heads() == [a.id]


@pytest.mark.parametrize(
    "value",
    [
        SpawnRequest(instruction="go", assignee="writer", operation="chat", independent=True, reason="r"),
        TaskAssignment(task="t", assignee="writer", inputs=["i"], depends_on=["1"], modes=["m"], exit_criteria="e"),
        EscalationRequest(reason="too hard", route="human", summary="s"),
        NodeQueued(run_id="r", op_id="o", name="n", elapsed=1.5, parent_id="p", depends_on=["d"]),
        NodeCompleted(op_id="o"),
        NodeFailed(op_id="o", error="boom"),
        NodeSpawned(op_id="o", parent_id="p", independent=True, assignee="a", instruction="i"),
        NodeEscalated(op_id="o", route="higher_tier", reason="r", child_id="c"),
    ],
    ids=lambda value: type(value).__name__,
)
def test_contracts_and_signals_round_trip(value):
    restored = round_trip(value)
    assert type(restored) is type(value)
    assert restored == value


def test_a_signal_keeps_its_schema_version():
    assert round_trip(NodeQueued(op_id="o")).schema_version == 1


def test_tuples_stay_tuples_even_when_nested():
    value = {"pair": (1, "two"), "list": [(3, (4, 5))]}
    assert round_trip(value) == value
    assert isinstance(round_trip(value)["list"][0][1], tuple)


@pytest.mark.parametrize(
    "lookalike",
    [
        {"__opgraph_tuple__": [1, 2]},
        {"__opgraph_model__": "Operation", "data": {"operation": "chat"}},
        {"__opgraph_graph__": {"name": "g", "nodes": [], "edges": []}},
    ],
    ids=["tuple", "model", "graph"],
)
def test_a_mapping_shaped_like_a_schema_1_tag_comes_back_as_that_mapping(lookalike):
    """Model output is user data: no key it may hold turns it into another kind of value."""
    assert round_trip({"response": lookalike}) == {"response": lookalike}


def test_an_unknown_extension_type_is_refused_on_decode():
    payload = msgpack.packb({"v": CODEC_SCHEMA_VERSION, "body": msgpack.ExtType(99, msgpack.packb(1))})
    with pytest.raises(CodecError, match="extension type 99"):
        decode(payload)


def _same(a, b) -> bool:
    """Equal, and of the same type all the way down (a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


PLAIN_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=20) | st.integers(-3, 3), inner, max_size=4),
    max_leaves=24,
)


@settings(max_examples=300, deadline=None)
@given(PLAIN_VALUES)
def test_any_plain_value_round_trips_with_its_types(value):
    assert _same(round_trip(value), value)


def test_a_payload_from_another_schema_version_is_refused():
    payload = msgpack.packb({"v": CODEC_SCHEMA_VERSION + 1, "body": 1})
    with pytest.raises(CodecError, match="schema version"):
        decode(payload)


def test_a_payload_without_the_version_envelope_is_refused():
    with pytest.raises(CodecError):
        decode(msgpack.packb([1, 2, 3]))


@pytest.mark.parametrize("garbage", [b"\xc1", b"not msgpack at all", b"", b"\x92\x01"])
def test_garbage_bytes_raise_a_codec_error(garbage):
    with pytest.raises(CodecError):
        decode(garbage)


class Plain(EdgeCondition):
    """A Python condition with no wire form."""

    def apply(self, input):  # noqa: A002 - EdgeCondition.apply's name in the record
        return True


class Unregistered(Plain):
    """A wire form whose kind no decoder is registered for."""

    def to_wire(self):
        return {"kind": "nobody-registered-this"}


@pytest.mark.parametrize("condition, step", [(Plain(), encode), (Unregistered(), round_trip)],
                         ids=["a python condition cannot be encoded", "an unknown kind is refused on decode"])
def test_an_edge_condition_the_codec_cannot_carry_is_refused_and_the_error_names_the_edge(condition, step):
    graph = Graph()
    a, b = graph.add_node(create_operation("chat")), graph.add_node(create_operation("chat"))
    edge = graph.add_edge(a, b, condition=condition)
    with pytest.raises(CodecError) as caught:
        step(graph)
    assert caught.value.edge_id == edge.id
    assert edge.id in str(caught.value)


def test_a_condition_with_a_registered_wire_form_round_trips():
    class Threshold(EdgeCondition):
        def __init__(self, limit):
            self.limit = limit

        def apply(self, input):  # noqa: A002 - EdgeCondition.apply's name in the record
            return input["result"]["score"] >= self.limit

        def to_wire(self):
            return {"kind": "test-threshold", "limit": self.limit}

    register_condition("test-threshold", lambda payload: Threshold(payload["limit"]))
    graph = Graph()
    a, b = graph.add_node(create_operation("chat")), graph.add_node(create_operation("chat"))
    graph.add_edge(a, b, condition=Threshold(3))
    (edge,) = round_trip(graph).edges.values()
    assert isinstance(edge.condition, Threshold) and edge.condition.limit == 3


def test_an_unregistered_model_cannot_be_encoded():
    from pydantic import BaseModel

    class Stranger(BaseModel):
        x: int = 1

    with pytest.raises(CodecError, match="not registered"):
        encode(Stranger())


def test_an_unencodable_value_raises_a_codec_error():
    with pytest.raises(CodecError):
        encode(object())


# -- errors ------------------------------------------------------------------------------
# The kernel's error tree, and the error of its expression language (it lives beside the parser).
ERROR_CLASSES = [*(getattr(errors, name) for name in errors.__all__), UnsafeExpressionError]


def test_every_error_is_an_opgraph_error():
    assert ERROR_CLASSES and all(
        inspect.isclass(cls) and issubclass(cls, OpGraphError) for cls in ERROR_CLASSES
    )


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_round_trips_through_pickle_with_its_ids(cls):
    error = cls("something broke", node_id="node-1", branch_id="branch-1", edge_id="edge-1")
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is cls
    assert restored.message == "something broke"
    assert (restored.node_id, restored.branch_id, restored.edge_id) == ("node-1", "branch-1", "edge-1")
    assert str(restored) == str(error)
    assert "node-1" in str(restored)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_an_error_without_ids_is_just_its_message(cls):
    error = cls("plain")
    assert str(pickle.loads(pickle.dumps(error))) == "plain"


def test_a_routing_error_is_still_a_value_error_after_pickling():
    restored = pickle.loads(pickle.dumps(errors.RoutingError("unknown assignee", node_id="n")))
    assert isinstance(restored, ValueError)
