"""Role-task graph builders: fan-out and ordinal DAGs from TaskAssignments (ADR-0033 D2).

Owns initial-topology policy for planned work. Roles are referenced by name and map to
branch ids, since branches live in actors; the builders add only declared dependency
or aggregation edges and never chain nodes implicitly.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from .contracts import TaskAssignment
from .errors import OperationError
from .graph import Graph, create_operation

__all__ = [
    "DependencyReferenceWarning",
    "build_dag_graph",
    "build_fanout_graph",
    "normalise_dependency_ordinals",
]


class DependencyReferenceWarning(UserWarning):
    """A TaskAssignment dependency reference was dropped (non-integer, self or out of range)."""


def normalise_dependency_ordinals(refs: Sequence[str], index: int, count: int) -> list[int]:
    """Turn 1-based ordinal strings into 0-based indices of other assignments.

    Each reference is stripped, parsed as an int and decremented. Self, out-of-range
    and non-integer references are dropped with a DependencyReferenceWarning. Forward
    references are kept (validity is against ``count``); duplicates are not removed.
    """
    indices: list[int] = []
    for ref in refs:
        text = str(ref).strip()
        try:
            target = int(text) - 1
        except ValueError:
            warnings.warn(
                f"assignment {index + 1}: dependency {ref!r} is not an integer ordinal",
                DependencyReferenceWarning,
                stacklevel=2,
            )
            continue
        if target == index:
            warnings.warn(
                f"assignment {index + 1}: dependency {ref!r} refers to itself",
                DependencyReferenceWarning,
                stacklevel=2,
            )
            continue
        if not 0 <= target < count:
            warnings.warn(
                f"assignment {index + 1}: dependency {ref!r} is out of range 1..{count}",
                DependencyReferenceWarning,
                stacklevel=2,
            )
            continue
        indices.append(target)
    return indices


def _task_instruction(assignment: TaskAssignment) -> str:
    text = assignment.task
    if assignment.exit_criteria:
        text += f"\n\nExit criteria: {assignment.exit_criteria}"
    return text


def _role_node(graph: Graph, assignment: TaskAssignment, roles: Mapping[str, str | None], operation: str):
    node = create_operation(
        operation,
        {"instruction": _task_instruction(assignment), "inputs": list(assignment.inputs)},
        branch_id=roles[assignment.assignee],
    )
    node.metadata["assignee"] = assignment.assignee
    node.metadata["modes"] = list(assignment.modes)
    return graph.add_node(node)


def _require_some_role(assignments: Sequence[TaskAssignment], roles: Mapping[str, str | None]) -> None:
    if not isinstance(roles, Mapping):
        raise OperationError(f"roles must map role names to branch ids, got {type(roles).__name__}")
    if isinstance(assignments, (str, bytes)):
        raise OperationError(f"assignments must be a list of TaskAssignment objects, got {type(assignments).__name__}")
    stray = next((a for a in assignments if not isinstance(a, TaskAssignment)), None)
    if stray is not None:
        raise OperationError(f"assignments must be TaskAssignment objects, got {type(stray).__name__}")
    if not any(a.assignee in roles for a in assignments):
        raise ValueError(
            "no assignment maps to a known role; known roles: " + (", ".join(sorted(roles)) or "none")
        )


def build_fanout_graph(
    assignments: Sequence[TaskAssignment],
    roles: Mapping[str, str | None],
    *,
    synthesis_role: str | None = None,
    operation: str = "operate",
) -> tuple[Graph, list[str]]:
    """Independent nodes, one per routable assignment, plus an optional synthesis node.

    Unroutable assignments are skipped. The synthesis node aggregates every task node.
    Differs from the record only in taking role names instead of a live Session.
    """
    _require_some_role(assignments, roles)
    graph = Graph("fanout")
    ids = [_role_node(graph, a, roles, operation).id for a in assignments if a.assignee in roles]
    if synthesis_role is not None:
        if synthesis_role not in roles:
            raise ValueError(f"synthesis role {synthesis_role!r} is not a known role")
        synthesis = create_operation(
            operation,
            {
                "instruction": "Synthesise the results of the preceding tasks.",
                "aggregation_sources": list(ids),
                "aggregation_count": len(ids),
            },
            branch_id=roles[synthesis_role],
        )
        synthesis.metadata["aggregation_sources"] = list(ids)
        synthesis.metadata["assignee"] = synthesis_role
        synthesis.metadata["reference_id"] = "synthesis"
        graph.add_node(synthesis)
        for node_id in ids:
            graph.add_edge(node_id, synthesis.id, label=["aggregate"])
        ids.append(synthesis.id)
    return graph, ids


def build_dag_graph(
    assignments: Sequence[TaskAssignment],
    roles: Mapping[str, str | None],
    *,
    operation: str = "operate",
) -> tuple[Graph, list[str | None]]:
    """One node per assignment with edges from its ordinal ``depends_on`` references.

    An assignment whose role is unknown yields a None placeholder so ordinals stay
    aligned; edges to or from a placeholder are dropped.
    """
    _require_some_role(assignments, roles)
    graph = Graph("dag")
    ids: list[str | None] = [
        _role_node(graph, a, roles, operation).id if a.assignee in roles else None
        for a in assignments
    ]
    for index, assignment in enumerate(assignments):
        node_id = ids[index]
        for target in normalise_dependency_ordinals(assignment.depends_on, index, len(assignments)):
            dep = ids[target]
            if node_id is not None and dep is not None:
                graph.add_edge(dep, node_id, label=["depends_on"])
    return graph, ids
