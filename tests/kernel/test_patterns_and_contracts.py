"""Role-task graph builders, ordinal dependencies and the emission contracts (ADR-0033 D2-D3)."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
from pydantic import BaseModel

from opgraph.kernel import (
    SPAWN_ALLOWED_OPERATIONS,
    EscalationRequest,
    OperationError,
    OperationGraphBuilder,
    RoutingError,
    SpawnRequest,
    TaskAssignment,
    build_dag_graph,
    build_fanout_graph,
    create_operation,
    default_node_builder,
    extract_requests,
    normalise_dependency_ordinals,
    request_problem,
    request_sightings,
    role_node_builder,
    to_mapping,
)
from opgraph.kernel.graph import _restored
from opgraph.kernel.patterns import DependencyReferenceWarning

ROLES = {"writer": "br-writer", "critic": None}


def task(name: str, assignee: str = "writer", depends_on: tuple[str, ...] = (), **extra) -> TaskAssignment:
    return TaskAssignment(task=name, assignee=assignee, depends_on=list(depends_on), **extra)


# -- normalise_dependency_ordinals -------------------------------------------------------
def test_ordinals_are_stripped_parsed_and_made_zero_based():
    assert normalise_dependency_ordinals([" 2 ", "3"], index=0, count=3) == [1, 2]


def test_a_forward_reference_is_kept():
    assert normalise_dependency_ordinals(["3"], index=0, count=3) == [2]


def test_duplicate_references_are_kept():
    assert normalise_dependency_ordinals(["1", " 1"], index=2, count=3) == [0, 0]


@pytest.mark.parametrize(
    ("ref", "reason"),
    [("1", "itself"), ("0", "out of range"), ("4", "out of range"), ("two", "not an integer"),
     ("1.5", "not an integer")],
)
def test_a_bad_reference_is_dropped_with_a_warning(ref, reason):
    with pytest.warns(DependencyReferenceWarning, match=reason):
        assert normalise_dependency_ordinals([ref, "2"], index=0, count=3) == [1]


# -- build_fanout_graph ----------------------------------------------------------------------
def test_a_fanout_without_synthesis_has_no_edges():
    graph, ids = build_fanout_graph([task("a"), task("b", "critic")], ROLES)
    assert graph.edges == {}
    assert graph.heads() == ids
    writer, critic = (graph.nodes[i] for i in ids)
    assert (writer.branch_id, writer.metadata["assignee"]) == ("br-writer", "writer")
    assert (critic.branch_id, critic.metadata["assignee"]) == (None, "critic")


def test_a_fanout_node_carries_the_task_exit_criteria_and_inputs():
    graph, (node_id,) = build_fanout_graph([task("write", exit_criteria="500 words", inputs=["notes"])], ROLES)
    node = graph.nodes[node_id]
    assert node.operation == "operate"
    assert node.parameters == {"instruction": "write\n\nExit criteria: 500 words", "inputs": ["notes"]}


def test_a_fanout_synthesis_node_aggregates_every_task():
    """a, b -> synthesis."""
    graph, ids = build_fanout_graph([task("a"), task("b")], ROLES, synthesis_role="critic")
    *tasks, synthesis = ids
    node = graph.nodes[synthesis]
    assert graph.predecessors(synthesis) == tasks
    assert all(edge.label == ["aggregate"] for edge in graph.in_edges(synthesis))
    assert node.metadata["aggregation_sources"] == tasks
    assert node.parameters["aggregation_sources"] == tasks and node.parameters["aggregation_count"] == 2
    assert node.metadata["reference_id"] == "synthesis"
    assert node.metadata["assignee"] == "critic"


def test_a_fanout_skips_assignments_with_unknown_roles():
    graph, ids = build_fanout_graph([task("a"), task("lost", "ghost"), task("b")], ROLES)
    assert len(ids) == 2 and len(graph) == 2


def test_a_fanout_with_no_routable_assignment_raises():
    with pytest.raises(ValueError, match="no assignment maps"):
        build_fanout_graph([task("lost", "ghost")], ROLES)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: build_fanout_graph("writer", {"writer": None}), "a list of TaskAssignment objects, got str"),
        (lambda: build_fanout_graph([{"task": "t", "assignee": "writer"}], {"writer": None}),
         "TaskAssignment objects, got dict"),
        (lambda: build_dag_graph([TaskAssignment(task="t", assignee="writer")], ["writer"]),
         "roles must map role names to branch ids, got list"),
        (lambda: role_node_builder(["writer"]), "roles must map role names to branch ids"),
    ],
    ids=["assignments as a string", "assignments as dicts", "roles as a list", "builder roles as a list"],
)
def test_role_task_builders_refuse_the_wrong_shape_of_input_clearly(build, message):
    with pytest.raises(OperationError, match=message):
        build()


@pytest.mark.parametrize("items", ["abc", None], ids=["a string", "nothing"])
def test_expanding_from_something_other_than_a_list_of_items_is_refused(items):
    builder = OperationGraphBuilder()
    source = builder.add_operation("chat")
    with pytest.raises(OperationError, match="items must be a list of items to expand") as caught:
        builder.expand_from_result(items, source_node_id=source, operation="chat")
    assert caught.value.node_id == source
    assert len(builder.get_graph().nodes) == 1


def test_a_fanout_with_an_unknown_synthesis_role_raises():
    with pytest.raises(ValueError, match="synthesis role"):
        build_fanout_graph([task("a")], ROLES, synthesis_role="ghost")


# -- build_dag_graph ---------------------------------------------------------------------------
def test_a_dag_keeps_a_placeholder_so_ordinals_stay_aligned():
    """1: a, 2: lost (unknown role), 3: c depends on 1 and 2 -> only a -> c."""
    graph, ids = build_dag_graph([task("a"), task("lost", "ghost"), task("c", depends_on=("1", "2"))], ROLES)
    a, placeholder, c = ids
    assert placeholder is None
    assert graph.predecessors(c) == [a]
    assert graph.in_edges(c)[0].label == ["depends_on"]


def test_a_dag_draws_edges_from_ordinals_including_forward_references():
    """1: a depends on 2; 2: b -> edge b -> a."""
    graph, (a, b) = build_dag_graph([task("a", depends_on=("2",)), task("b")], ROLES)
    assert graph.predecessors(a) == [b]
    assert graph.predecessors(b) == []


def test_a_dag_with_a_bad_reference_warns_and_drops_it():
    with pytest.warns(DependencyReferenceWarning):
        graph, (a,) = build_dag_graph([task("a", depends_on=("1",))], ROLES)
    assert graph.edges == {}


def test_a_dag_with_no_routable_assignment_raises():
    with pytest.raises(ValueError):
        build_dag_graph([task("lost", "ghost")], ROLES)


# -- extract_requests --------------------------------------------------------------------------
class Envelope(BaseModel):
    note: str = ""
    request: SpawnRequest | None = None
    more: list[EscalationRequest] = []


def nest(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


def test_requests_are_found_in_lists_tuples_and_dict_values():
    first, second, third = (SpawnRequest(instruction=str(i)) for i in range(3))
    found = extract_requests({"a": [first, (second,)], "b": {"deep": third},
                              first.instruction: "keys are not searched"})
    assert found == [first, second, third]


def test_a_direct_request_is_found():
    request = SpawnRequest(instruction="me")
    assert extract_requests(request) == [request]


def test_requests_are_found_in_pydantic_model_fields():
    spawn, escalation = SpawnRequest(instruction="s"), EscalationRequest(reason="r")
    assert extract_requests(Envelope(request=spawn, more=[escalation])) == [spawn, escalation]


def test_a_request_four_levels_deep_is_found():
    request = SpawnRequest(instruction="deep")
    assert extract_requests(nest(request, 4)) == [request]


def test_a_request_five_levels_deep_is_not_found():
    assert extract_requests(nest(SpawnRequest(instruction="too deep"), 5)) == []


def test_the_same_object_is_returned_once():
    request = SpawnRequest(instruction="twice")
    assert extract_requests([request, {"again": request}]) == [request]


def test_sightings_keep_order_and_first_ordinals_and_extract_agrees():
    first, second = SpawnRequest(instruction="1"), EscalationRequest(reason="2")
    value = {"a": [first, (second, first)], "b": Envelope(more=[second])}
    assert request_sightings(value) == [(first, 0), (second, 1), (first, 0), (second, 1)]
    assert extract_requests(value) == [first, second]


def test_walking_a_response_leaves_no_reference_cycle():
    """Every non-plain response is walked on a worker; a cycle left per walk (a closure that
    called itself) filled the collector's youngest generation and stalled the worker."""
    value = {"text": "plain", "items": [{"n": i} for i in range(3)], "spawn": SpawnRequest(instruction="x")}
    gc.collect()
    gc.disable()
    try:
        for _ in range(100):
            request_sightings(value)
            extract_requests(value)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert unreachable == 0


class LabelledRequest(SpawnRequest):
    label: str = "mine"


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_requests_pickle_compactly_and_come_back_equal_with_their_own_fields_set(protocol):
    spawn = SpawnRequest(instruction="go", assignee="coder")
    escalation = EscalationRequest(reason="stuck", summary=None)
    blob = pickle.dumps([spawn, escalation, spawn], protocol=protocol)
    again, escalated, same = pickle.loads(blob)
    assert again == spawn and escalated == escalation and same is again
    assert type(again) is SpawnRequest and type(escalated) is EscalationRequest
    assert again.model_fields_set == {"instruction", "assignee"}
    assert escalated.model_fields_set == {"reason", "summary"}
    # The compact form, not pydantic's (which carries a state dict and the fields-set's class).
    assert spawn.__reduce_ex__(protocol)[0] is _restored
    assert b"__pydantic_fields_set__" not in blob
    # Each request owns its fields: an assignment marks its own set and leaves the original be.
    other = pickle.loads(blob)[0]
    again.reason = "later"
    assert "reason" in again.model_fields_set and "reason" not in other.model_fields_set
    assert spawn.reason is None and "reason" not in spawn.model_fields_set
    assert again.__dict__ is not spawn.__dict__ and again.__pydantic_fields_set__ is not other.__pydantic_fields_set__


def test_a_subclassed_request_pickles_whole_and_copies_are_independent():
    labelled = LabelledRequest(instruction="go", label="kept")
    again = pickle.loads(pickle.dumps(labelled))
    assert type(again) is LabelledRequest and again.label == "kept" and again == labelled
    spawn = SpawnRequest(instruction="go")
    for twin in (copy.copy(spawn), copy.deepcopy(spawn)):
        twin.instruction = "changed"
        assert spawn.instruction == "go" and "changed" == twin.instruction


def test_equal_but_distinct_requests_are_both_returned():
    found = extract_requests([SpawnRequest(instruction="same"), SpawnRequest(instruction="same")])
    assert len(found) == 2


def test_only_the_requested_kinds_are_extracted():
    spawn, escalation = SpawnRequest(instruction="s"), EscalationRequest(reason="r")
    assert extract_requests([spawn, escalation], (EscalationRequest,)) == [escalation]


# -- builders from requests ----------------------------------------------------------------------
def test_the_default_builder_keeps_only_the_instruction():
    child = default_node_builder(SpawnRequest(instruction="go", operation="chat", assignee="x", reason="r"), None)
    assert (child.operation, child.parameters) == ("chat", {"instruction": "go"})


def test_an_operation_outside_the_allowlist_falls_back_to_operate():
    request = SpawnRequest.model_construct(instruction="go", operation="custom_op", assignee=None, independent=False)
    assert "custom_op" not in SPAWN_ALLOWED_OPERATIONS
    assert role_node_builder(ROLES)(request, None).operation == "operate"
    assert default_node_builder(request, None).operation == "operate"


@pytest.mark.parametrize("operation", sorted(SPAWN_ALLOWED_OPERATIONS))
def test_an_allowlisted_operation_is_kept(operation):
    child = role_node_builder(ROLES)(SpawnRequest(instruction="go", operation=operation), None)
    assert child.operation == operation


def test_an_unknown_assignee_raises_a_routing_error_that_is_a_value_error():
    emitter = create_operation("chat")
    with pytest.raises(ValueError) as caught:
        role_node_builder(ROLES)(SpawnRequest(instruction="go", assignee="ghost"), emitter)
    assert isinstance(caught.value, RoutingError)
    assert caught.value.node_id == emitter.id
    assert "critic, writer" in str(caught.value)


def test_spawn_ids_are_monotonic_and_stored_as_spawn_and_reference_id():
    build = role_node_builder(ROLES)
    first = build(SpawnRequest(instruction="1"), None)
    with pytest.raises(RoutingError):
        build(SpawnRequest(instruction="x", assignee="ghost"), None)
    second = build(SpawnRequest(instruction="2"), None)
    assert [c.metadata["spawn_id"] for c in (first, second)] == ["spawn-1", "spawn-2"]
    assert [c.reference_id for c in (first, second)] == ["spawn-1", "spawn-2"]
    assert role_node_builder(ROLES)(SpawnRequest(instruction="3"), None).metadata["spawn_id"] == "spawn-1"


def test_the_assignee_is_stamped_and_routed_to_its_branch():
    build = role_node_builder(ROLES)
    writer = build(SpawnRequest(instruction="w", assignee="writer"), None)
    critic = build(SpawnRequest(instruction="c", assignee="critic"), None)
    anonymous = build(SpawnRequest(instruction="a"), None)
    assert (writer.metadata["assignee"], writer.branch_id) == ("writer", "br-writer")
    assert (critic.metadata["assignee"], critic.branch_id) == ("critic", None)
    assert "assignee" not in anonymous.metadata and anonymous.branch_id is None


def test_decorate_instruction_receives_the_request_and_its_spawn_id():
    seen = []

    def decorate(request, spawn_id):
        seen.append((request, spawn_id))
        return f"[{spawn_id}] {request.instruction}"

    request = SpawnRequest(instruction="go", assignee="writer")
    child = role_node_builder(ROLES, decorate_instruction=decorate)(request, None)
    assert seen == [(request, "spawn-1")]
    assert child.parameters == {"instruction": "[spawn-1] go"}


# -- the fast paths of request validation and to_mapping agree with the slow ones ------------------
class _Text(str):
    pass


class _TaggedRequest(SpawnRequest):
    tag: int = 0


@pytest.mark.parametrize("fields", [
    {"instruction": "go", "assignee": None, "operation": "operate", "independent": False, "reason": None},
    {"instruction": "go", "assignee": "writer", "operation": "ReAct", "independent": True, "reason": "why"},
    {"instruction": _Text("go"), "assignee": None, "operation": "chat", "independent": False, "reason": None},
    {"instruction": "go", "assignee": None, "operation": "operate", "independent": 1, "reason": None},
    {"instruction": "go", "assignee": None, "operation": "custom_op", "independent": False, "reason": None},
    {"instruction": None, "assignee": None, "operation": "operate", "independent": False, "reason": None},
    {"instruction": "go", "assignee": 5, "operation": "operate", "independent": False, "reason": None},
    {"instruction": "go", "assignee": None, "operation": "operate", "independent": "maybe", "reason": None},
])
def test_a_spawn_request_is_refused_exactly_when_validating_its_fields_fails(fields):
    """Built with model_construct (no validation): request_problem finds a problem if and only if
    SpawnRequest.model_validate of the same fields raises, whichever path it takes."""
    request = SpawnRequest.model_construct(**fields)
    try:
        SpawnRequest.model_validate(fields)
        valid = True
    except ValueError:
        valid = False
    problem = request_problem(request, SpawnRequest)
    assert (problem is None) == valid, problem


def test_the_short_path_checks_every_field_a_spawn_request_has():
    """A field added to SpawnRequest must be added to the short path too, or it would go unchecked."""
    from opgraph.kernel.contracts import _SPAWN_FIELDS_CHECKED

    assert _SPAWN_FIELDS_CHECKED == tuple(SpawnRequest.model_fields)


def test_a_subclass_of_spawn_request_is_validated_whole():
    """Its own field is checked too: a tag that is no int is a problem, though the rest is valid."""
    good = _TaggedRequest.model_construct(instruction="go", assignee=None, operation="operate",
                                          independent=False, reason=None, tag=3)
    bad = _TaggedRequest.model_construct(instruction="go", assignee=None, operation="operate",
                                         independent=False, reason=None, tag="three")
    assert request_problem(good, SpawnRequest) is None
    assert "tag" in request_problem(bad, SpawnRequest)


class _Pair(BaseModel):
    name: str
    pair: tuple[int, int]
    inner: SpawnRequest | None = None


def test_to_mapping_of_a_model_of_scalars_is_its_dump_and_nested_values_are_still_walked():
    request = SpawnRequest(instruction="go", assignee="writer")
    mapped = to_mapping(request)
    assert mapped == request.model_dump() and type(mapped) is dict
    assert to_mapping(_Pair(name="x", pair=(1, 2), inner=request)) == {
        "name": "x", "pair": [1, 2], "inner": request.model_dump()}  # the tuple became a list, as ever
    assert to_mapping([request, {"k": (3,)}]) == [request.model_dump(), {"k": [3]}]
