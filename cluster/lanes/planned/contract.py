"""The planned reactive flow lane's contract (ADR-0068 D1, D3, D4): its modes, capability matrix, spawn cap, provenance.

Owns what every planned (and play) run publishes: a planner for a new run and none on a
checkpoint replay, reactive growth only when ``--reactive`` allows it, the live controls
(pause, resume, operator message, cancel) and checkpoint resume when the run is logged;
the spawn cap a ``--max-ops`` gives; and the rules of its provenance payload. It must
not run, store or queue anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from ...store import ProvenanceError
from ..base import PLANNED_REACTIVE_FLOW, REACTIVE_PLAY
from ..capabilities import LaneCapabilities
from ..provenance import RunProvenance

__all__ = [
    "DEFAULT_SPAWN_CAP",
    "PLANNED_REACTIVE_FLOW",
    "PLANNED_SOURCE_KINDS",
    "PlannedModeError",
    "check_planned_provenance",
    "planned_capabilities",
    "planned_provenance",
    "reactive_roles",
    "sha256_of",
    "spawn_cap",
]

# --max-ops 0: no shared ceiling, and spawned follow-ups are capped at this many.
DEFAULT_SPAWN_CAP = 20
PLANNED_SOURCE_KINDS: tuple[str, ...] = ("prompt", "flow_spec", "checkpoint", "playbook")


class PlannedModeError(ValueError):
    """A ``--reactive`` or ``--max-ops`` value the lane cannot take (a usage error: nothing ran)."""


def sha256_of(data: bytes | str) -> str:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def reactive_roles(mode: str, roles: Iterable[str]) -> tuple[str, ...] | None:
    """The roles allowed to spawn under ``--reactive MODE``: None for ``all``, () for ``off``,
    else the listed roles (``-`` and ``_`` equivalent), each of which must be on the roster."""
    text = (mode or "all").strip()
    if text.lower() == "all":
        return None
    if text.lower() == "off":
        return ()
    by_normal = {str(role).strip().lower().replace("_", "-"): role for role in roles}
    chosen, unknown = [], []
    for part in (item.strip() for item in text.split(",")):
        if not part:
            continue
        role = by_normal.get(part.lower().replace("_", "-"))
        (chosen if role is not None else unknown).append(role if role is not None else part)
    if unknown:
        raise PlannedModeError(f"--reactive names roles not on the roster: {', '.join(unknown)}; roster: "
                               f"{', '.join(by_normal.values())} (or use all / off)")
    if not chosen:
        raise PlannedModeError("--reactive takes all, off, or a comma-separated list of roles")
    return tuple(dict.fromkeys(chosen))


def spawn_cap(max_ops: int, planned: int, restored_spawned: int = 0) -> int:
    """Spawns still allowed: ``max_ops`` 0 means no shared ceiling (``DEFAULT_SPAWN_CAP`` spawns in
    all); otherwise ``max_ops`` less the planned and the already spawned (restored) operations."""
    if isinstance(max_ops, bool) or not isinstance(max_ops, int) or max_ops < 0:
        raise PlannedModeError(f"--max-ops must be a whole number >= 0, got {max_ops!r}")
    if max_ops == 0:
        return max(0, DEFAULT_SPAWN_CAP - restored_spawned)
    return max(0, max_ops - planned - restored_spawned)


def planned_capabilities(reactive_mode: str = "all", *, durable: bool = True) -> LaneCapabilities:
    """A planned invocation's matrix (D3): growth only when reactive, resume only when logged."""
    return LaneCapabilities(planner=True, reactive_growth=(reactive_mode or "all").strip().lower() != "off",
                            live_pause=True, live_message=True, checkpoint_resume=durable,
                            leased_admission=False, cancel=True)


def planned_provenance(*, lane: str, source_kind: str, ref: str, content_hash: str | None,
                       planner_used: bool, reactive: bool, max_ops: int, path: str | None = None,
                       resumed_from: str | None = None) -> RunProvenance:
    """The payload of a planned or play run (D4)."""
    source: dict[str, Any] = {"kind": source_kind, "ref": ref, "content_hash": content_hash}
    if path is not None:
        source["path"] = path
    if resumed_from is not None:
        source["resumed_from"] = resumed_from
    provenance = RunProvenance.from_payload({"lane": lane, "source": source, "planner": {"used": planner_used},
                                             "reactive": {"enabled": reactive, "max_ops": max_ops}})
    check_planned_provenance(provenance)
    return provenance


def check_planned_provenance(provenance: RunProvenance) -> None:
    """Raise ``ProvenanceError`` unless the payload is a planned or play run's."""
    problems = []
    if provenance.lane not in (PLANNED_REACTIVE_FLOW, REACTIVE_PLAY):
        problems.append(f"the lane is {provenance.lane!r}, not {PLANNED_REACTIVE_FLOW} or {REACTIVE_PLAY}")
    kind = provenance.source.kind
    if kind not in PLANNED_SOURCE_KINDS:
        problems.append(f"a planned run's source is one of {', '.join(PLANNED_SOURCE_KINDS)}, not {kind!r}")
    if kind == "checkpoint" and provenance.planner.used:
        problems.append("a checkpoint replay never calls the planner")
    if kind != "checkpoint" and not provenance.planner.used:
        problems.append("a new planned run is planned by the planner")
    if provenance.lane == REACTIVE_PLAY and kind not in ("playbook", "checkpoint"):
        problems.append("a play run's source is a playbook")
    if problems:
        raise ProvenanceError("invalid run provenance: " + "; ".join(problems))
