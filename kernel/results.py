"""The result envelope and FlowEvent: what a settled run and a settled node look like.

Owns the public result shapes of ADR-0023 D4/D6 and ADR-0033 D5, plus the truthful
additions of DESIGN.md (failed_operations, per-op status, context collisions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvariantViolation

__all__ = ["FlowEvent", "DROPPED_SPAWN_REASONS", "validate_envelope"]

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
