"""Emission contracts: planned work, live spawn requests, escalations, and routing (ADR-0033 D3).

Owns the typed request models, their bounded extraction from operation results, and
the routing stage (``role_node_builder``). Routing only turns a request into a
candidate Operation; admission into a running graph belongs to the scheduler.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from .errors import OperationError, RoutingError
from .graph import Operation, _plain_operation, _restored, create_operation

__all__ = [
    "MAX_REQUEST_TEXT",
    "PLAIN_TYPES",
    "SPAWN_ALLOWED_OPERATIONS",
    "SPAWN_EXTRACTION_DEPTH",
    "EscalationRequest",
    "SpawnRequest",
    "TaskAssignment",
    "UnpicklableRequest",
    "default_node_builder",
    "extract_requests",
    "request_problem",
    "request_sightings",
    "role_node_builder",
]

SPAWN_ALLOWED_OPERATIONS: frozenset[str] = frozenset({"operate", "chat", "communicate", "ReAct"})
SPAWN_EXTRACTION_DEPTH = 4
# The longest text a request field may carry: an instruction is a task for one node, and
# a request travels through the scheduler, signals and the run log.
MAX_REQUEST_TEXT = 32_768
# Plain values: one holds no request object (``extract_requests`` need not walk it) and
# no context update, and is handed on as it is, never copied or converted.
PLAIN_TYPES: frozenset[type] = frozenset({str, int, float, bool, type(None), bytes})


class TaskAssignment(BaseModel):
    """One unit of planned work for a named role."""

    task: str
    assignee: str
    inputs: list[str] = Field(default_factory=list)
    exit_criteria: str | None = None
    depends_on: list[str] = Field(default_factory=list)
    modes: list[str] = Field(default_factory=list)


class _CompactlyPickled(BaseModel):
    """Pickles as its field dict and set names, rebuilt by ``_restored`` (graph.py).

    A planner returns its requests as its result, and each is pickled three times before
    its children can run: the worker's check that the outcome can travel, the message,
    the run log. pydantic's own pickling wraps the state in a dict and names the
    fields-set's class: 1,000 requests took 2.7 ms a pickle (59 KB), 1.5 ms so (45 KB),
    issue #18. A subclass, or a request with extras or private attributes, pickles the
    usual way.
    """

    def __reduce_ex__(self, protocol: Any) -> Any:
        cls = type(self)
        if cls not in _COMPACTLY_PICKLED or self.__pydantic_extra__ or self.__pydantic_private__:
            return super().__reduce_ex__(protocol)
        return _restored, (cls, self.__dict__, tuple(self.__pydantic_fields_set__))


class SpawnRequest(_CompactlyPickled):
    """A live request to grow the running graph; not authority to execute."""

    instruction: str
    assignee: str | None = None
    operation: Literal["operate", "chat", "communicate", "ReAct"] = "operate"
    independent: bool = False
    reason: str | None = None


class EscalationRequest(_CompactlyPickled):
    """A request to hand the emitter's work to a different tier or to a human.

    ``route="higher_tier"`` schedules an independent retry of the emitter's operation
    with an escalation notice (ADR-0023 D6); other routes are recorded and signalled.
    """

    reason: str
    route: str = "higher_tier"
    summary: str | None = None


_COMPACTLY_PICKLED = frozenset({SpawnRequest, EscalationRequest})


def extract_requests(
    value: Any,
    kinds: tuple[type, ...] = (SpawnRequest, EscalationRequest),
    *,
    max_depth: int = SPAWN_EXTRACTION_DEPTH,
) -> list[Any]:
    """Find request objects in ``value``: direct, lists, tuples, model fields, dict values.

    Recursion stops at ``max_depth`` nested levels; the same object seen twice (by
    identity) is returned once.
    """
    found: list[Any] = []
    for item, ordinal in request_sightings(value, kinds, max_depth=max_depth):
        if ordinal == len(found):  # its first sighting: ordinals count distinct objects in order
            found.append(item)
    return found


def request_sightings(
    value: Any,
    kinds: tuple[type, ...] = (SpawnRequest, EscalationRequest),
    *,
    max_depth: int = SPAWN_EXTRACTION_DEPTH,
) -> list[tuple[Any, int]]:
    """Every sighting of a request object in ``value``, walked as ``extract_requests`` walks.

    Each sighting comes with the ordinal of its object's first sighting, so the same
    object seen twice yields the same ordinal twice: the scheduler admits it once and
    records the second as a ``duplicate`` (ADR-0023 D6). The ordinal, not ``id()``, goes
    into the de-duplication key, so the key means the same after a restart.
    """
    sightings: list[tuple[Any, int]] = []
    _walk_requests(value, 0, kinds, max_depth, {}, sightings)
    return sightings


def _walk_requests(item: Any, depth: int, kinds: tuple[type, ...], max_depth: int,
                   ordinals: dict[int, int], sightings: list[tuple[Any, int]]) -> None:
    """``request_sightings``' walk, depth first in order. A function of the module, not a
    closure that calls itself: such a closure is a reference cycle, and one left behind by
    every non-plain response made a worker's collector stop it for 7-12 ms in each
    10,000-call run (issue #18)."""
    if isinstance(item, kinds):
        sightings.append((item, ordinals.setdefault(id(item), len(ordinals))))
        return
    if depth >= max_depth:
        return
    if isinstance(item, (list, tuple)):
        children = item
    elif isinstance(item, Mapping):
        children = item.values()
    elif isinstance(item, BaseModel):
        children = [getattr(item, name) for name in type(item).model_fields]
    else:
        return
    for child in children:
        _walk_requests(child, depth + 1, kinds, max_depth, ordinals, sightings)


_SPAWN_OPERATIONS = frozenset(SpawnRequest.model_fields["operation"].annotation.__args__)
_TEXT_OR_NONE = (str, type(None))
# The fields ``_spawn_fields_valid`` checks: every field of SpawnRequest (a test holds them equal).
_SPAWN_FIELDS_CHECKED = ("instruction", "assignee", "operation", "independent", "reason")


def _spawn_fields_valid(fields: dict[str, Any]) -> bool:
    """Whether validating a SpawnRequest's ``fields`` must pass: each is already of its exact type
    (what a validated request holds). Validation cost 5-8 us a request, on the path a planner's
    children wait on (issue #18); anything else is still validated, and fails as it would."""
    return (type(fields["instruction"]) is str and type(fields["assignee"]) in _TEXT_OR_NONE
            and type(fields["operation"]) is str and fields["operation"] in _SPAWN_OPERATIONS
            and type(fields["independent"]) is bool and type(fields["reason"]) in _TEXT_OR_NONE)


@dataclass(frozen=True, slots=True)
class UnpicklableRequest:
    """Stands in for an emitted request that could not be pickled on its way to the executor.

    The worker sends this in its place, under the same de-duplication key, so the request
    is one ``invalid_request`` entry of ``dropped_spawns`` naming its type and the reason,
    whichever route (live, or in the emitter's outcome) it took.
    """

    type_name: str
    problem: str


def request_problem(request: Any, kind: type) -> str | None:
    """Why ``request`` cannot be admitted as a ``kind``, or None when it can.

    A request built with ``model_construct`` skips validation, so fields arrive as
    they were set: an instruction of ``None``, or a megabyte of text. Requests are
    validated again here, before routing, and text fields are bounded by
    ``MAX_REQUEST_TEXT``. Reading a field may run user code (a property), so any
    error becomes the problem text rather than an escape.
    """
    if type(request) is UnpicklableRequest:
        return f"the {request.type_name} it emitted cannot be pickled: {request.problem}"
    try:
        if not isinstance(request, kind):
            return f"expected a {kind.__name__}, got {type(request).__name__}"
        if isinstance(request, BaseModel):
            fields = {name: getattr(request, name) for name in type(request).model_fields}
            if type(request) is not SpawnRequest or not _spawn_fields_valid(fields):
                type(request).model_validate(fields)
            for name, field_value in fields.items():
                if isinstance(field_value, str) and len(field_value) > MAX_REQUEST_TEXT:
                    return f"field {name!r} holds {len(field_value):,} characters (at most {MAX_REQUEST_TEXT:,})"
        return None
    except Exception as exc:  # noqa: BLE001 - user request objects: any failure is the problem found
        try:
            text = str(exc)
        except Exception:  # noqa: BLE001 - an exception that cannot even be shown
            text = "<unprintable>"
        return f"{type(exc).__name__}: {text}"[:500]


def default_node_builder(request: SpawnRequest, emitter: Operation | None) -> Operation:
    """The record's default: the requested operation with only the instruction."""
    operation = request.operation if request.operation in SPAWN_ALLOWED_OPERATIONS else "operate"
    # An allowed name and a one-key mapping: nothing for create_operation to check.
    return _plain_operation(operation, {"instruction": request.instruction})


def role_node_builder(
    roles: Mapping[str, str | None],
    *,
    decorate_instruction: Callable[[SpawnRequest, str], str] | None = None,
) -> Callable[[SpawnRequest, Operation | None], Operation]:
    """Route a SpawnRequest to a role's branch, confined to SPAWN_ALLOWED_OPERATIONS.

    ``roles`` maps a role name to its branch id (``None`` for the default branch);
    roles are referenced by name because branches live in actors. An operation outside
    the allowlist falls back to ``operate``; an unknown assignee raises RoutingError
    (a ValueError). Each routed child gets a monotonic ``spawn-N`` id.
    """
    counter = itertools.count(1)
    if not isinstance(roles, Mapping):
        raise OperationError(f"roles must map role names to branch ids (None: the default branch), "
                             f"got {type(roles).__name__}")
    role_map = dict(roles)

    def build(request: SpawnRequest, emitter: Operation | None) -> Operation:
        operation = request.operation
        if operation not in SPAWN_ALLOWED_OPERATIONS:
            operation = "operate"
        if request.assignee is not None and request.assignee not in role_map:
            known = ", ".join(sorted(role_map)) or "none"
            raise RoutingError(
                f"unknown assignee {request.assignee!r}; known roles: {known}",
                node_id=emitter.id if emitter is not None else None,
            )
        spawn_id = f"spawn-{next(counter)}"
        instruction = request.instruction
        if decorate_instruction is not None:
            instruction = decorate_instruction(request, spawn_id)
        child = create_operation(operation, {"instruction": instruction})
        child.metadata["spawn_id"] = spawn_id
        child.metadata["reference_id"] = spawn_id
        if request.assignee is not None:
            child.metadata["assignee"] = request.assignee
            child.branch_id = role_map[request.assignee]
        return child

    return build
