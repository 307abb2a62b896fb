"""The result envelope and FlowEvent: what a settled run and a settled node look like.

Owns the public result shapes of ADR-0023 D4/D6 and ADR-0033 D5, plus the truthful
additions of DESIGN.md (failed_operations, per-op status, context collisions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvariantViolation

__all__ = ["FlowEvent", "DROPPED_SPAWN_REASONS", "compact_envelope", "expand_envelope", "validate_envelope"]

# The record's five reasons (ADR-0023 D6), plus ``invalid_request``: beyond the record, a
# request that fails validation again at admission (one built with ``model_construct``,
# or not of the run's spawn type) is dropped before routing, never admitted.
DROPPED_SPAWN_REASONS = frozenset(
    {"builder_error", "null_child", "cycle", "max_spawn_exceeded", "duplicate", "invalid_request"}
)


@dataclass(slots=True)
class FlowEvent:
    """One settled operation, in completion order.

    Ideal over retrospective: ``status`` is ``failed`` for every failure, including
    defensive executor errors the record mislabelled ``completed``.
    """

    operation_id: str
    name: str
    status: str  # "completed" | "failed" | "skipped" | "cancelled"
    result: Any
    spawned: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def validate_envelope(envelope: dict[str, Any]) -> None:
    """Completed and skipped ids are disjoint (ADR-0023 D4); dropped reasons are known."""
    skipped = envelope["skipped_operations"]
    overlap = set(envelope["completed_operations"]).intersection(skipped) if skipped else ()
    if overlap:
        raise InvariantViolation(
            "completed_operations and skipped_operations overlap", node_id=sorted(overlap)[0]
        )
    for entry in envelope.get("dropped_spawns", ()):
        if entry["reason"] not in DROPPED_SPAWN_REASONS:
            raise InvariantViolation(f"unknown dropped-spawn reason {entry['reason']!r}")


# The per-node fields of an envelope, each a function of the node ids (every node, in
# registration order: ``operation_statuses``' keys), their statuses and which have a result.
_NODE_LISTS = (("skipped_operations", "skipped"), ("failed_operations", "failed"),
               ("cancelled_operations", "cancelled"))


def compact_envelope(envelope: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``envelope`` as (rest, columns): every node id once, and what ``expand_envelope`` derives left out.

    Why: a run's envelope names each node up to three times (completed list, results,
    statuses). Stored as it is, a million-node run's was a 123 MiB blob, packed through a
    buffer twice that size and copied again by the database, the executor's peak memory
    at the end of the run (issue #18). Here the ids are one list, the statuses one string
    when every node shares it, the results a list of values aligned with the ids when
    every node has one, and each list of ids is left out when the statuses and results
    give it back exactly. A field that does not match its derivation is kept as it is, so
    any envelope, however it was built, comes back equal. ``rest`` keeps the envelope's
    keys in order (a derived field's value is None there)."""
    statuses = envelope.get("operation_statuses")
    results = envelope.get("operation_results")
    if not isinstance(statuses, dict) or not isinstance(results, dict):
        return dict(envelope), {}
    rest = dict(envelope)
    ids = list(statuses)
    values = list(statuses.values())
    first = values[0] if values else None
    uniform = values.count(first) == len(values)
    columns: dict[str, Any] = {"ids": ids, "statuses": first if uniform else values, "uniform": uniform}
    rest["operation_statuses"] = None
    if list(results) == ids:
        columns["results"] = list(results.values())
        rest["operation_results"] = None
    derived = []
    for key, status in _NODE_LISTS:
        if key in envelope and envelope[key] == _with_status(ids, values, uniform, first, status):
            derived.append(key)
            rest[key] = None
    if "completed_operations" in envelope and envelope["completed_operations"] == _completed(
            results, statuses, uniform, first):
        derived.append("completed_operations")
        rest["completed_operations"] = None
    columns["derived"] = derived
    return rest, columns


def expand_envelope(rest: dict[str, Any], columns: dict[str, Any]) -> dict[str, Any]:
    """The envelope ``compact_envelope`` took apart, equal to the one it was given."""
    envelope = dict(rest)
    if not columns:
        return envelope
    ids, uniform, first = columns["ids"], columns["uniform"], columns["statuses"]
    if uniform:  # one status for every node: ``_with_status`` then reads no per-node list
        values: list[Any] = []
        statuses = dict.fromkeys(ids, first)
    else:
        values = first
        statuses = dict(zip(ids, values, strict=True))
    envelope["operation_statuses"] = statuses
    if "results" in columns:
        envelope["operation_results"] = dict(zip(ids, columns["results"], strict=True))
    results = envelope["operation_results"]
    for key in columns["derived"]:
        if key == "completed_operations":
            envelope[key] = _completed(results, statuses, uniform, first)
        else:
            envelope[key] = _with_status(ids, values, uniform, first, dict(_NODE_LISTS)[key])
    return envelope


def _with_status(ids: list[str], values: list[str], uniform: bool, first: Any, status: str) -> list[str]:
    if uniform:
        return list(ids) if first == status else []
    return [node_id for node_id, value in zip(ids, values, strict=True) if value == status]


def _completed(results: dict[str, Any], statuses: dict[str, Any], uniform: bool, first: Any) -> list[str]:
    """Settled with a result and not skipped: ``completed_operations`` as the kernel builds it."""
    if uniform and first != "skipped":
        return list(results)
    return [node_id for node_id in results if statuses.get(node_id) != "skipped"]
