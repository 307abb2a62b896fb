"""The fixed workflow lane's contract (ADR-0068 D1, D3, D4): its name, capability matrix and provenance rules.

Owns what every fixed run publishes and persists: no planner, authored topology only, no
live controls, direct admission, cancel, and checkpoint resume by source/hash replay when
the run is logged; and a provenance payload whose source is a pinned workflow definition
or file, with its hash. It must not run, store or queue anything.
"""

from __future__ import annotations

from typing import Literal

from ...store import ProvenanceError
from ..base import FIXED_WORKFLOW
from ..capabilities import LaneCapabilities
from ..provenance import RunProvenance

__all__ = [
    "FIXED_SOURCE_KINDS",
    "FIXED_WORKFLOW",
    "FIXED_WORKFLOW_CAPABILITIES",
    "check_fixed_provenance",
    "fixed_workflow_provenance",
]

FIXED_SOURCE_KINDS: tuple[str, ...] = ("workflow_def", "workflow_file")

# Fixed runs: no planner, authored topology only, no live controls, direct (not leased)
# admission; cancellation has a consumer, and a run kept in the run log can be resumed
# by replaying its pinned source and hash (ADR-0068 D3's "fixed source/hash replay").
FIXED_WORKFLOW_CAPABILITIES = LaneCapabilities(
    planner=False,
    reactive_growth=False,
    live_pause=False,
    live_message=False,
    checkpoint_resume=True,
    leased_admission=False,
    cancel=True,
)


def check_fixed_provenance(provenance: RunProvenance) -> None:
    """Raise ``ProvenanceError`` unless ``provenance`` is a fixed run's: a pinned hash (this
    registry is the record's migration), a registry source's version, no planner, no growth."""
    source = provenance.source
    problems = []
    if provenance.lane != FIXED_WORKFLOW:
        problems.append(f"the lane is {provenance.lane!r}, not {FIXED_WORKFLOW}")
    if source.kind not in FIXED_SOURCE_KINDS:
        problems.append(f"a fixed_workflow run's source is a workflow_def or workflow_file, not {source.kind!r}")
    if source.content_hash is None:
        problems.append("a fixed_workflow run must record the pinned content_hash")
    if source.kind == "workflow_def" and source.version is None:
        problems.append("a fixed_workflow run from the registry must record the pinned version")
    if provenance.planner.used or provenance.reactive.enabled or provenance.reactive.max_ops:
        problems.append("a fixed_workflow run never uses a planner or reactive growth")
    if problems:
        raise ProvenanceError("invalid run provenance: " + "; ".join(problems))


def fixed_workflow_provenance(
    *,
    ref: str,
    content_hash: str,
    version: int | None = None,
    source_kind: Literal["workflow_def", "workflow_file"] = "workflow_def",
    task_id: str | None = None,
    lease_attempt: int | None = None,
) -> RunProvenance:
    """The fixed lane's payload: a pinned source, no planner, no reactive growth."""
    provenance = RunProvenance.from_payload(
        {
            "lane": FIXED_WORKFLOW,
            "source": {"kind": source_kind, "ref": ref, "version": version, "content_hash": content_hash},
            "admission": {"task_id": task_id, "lease_attempt": lease_attempt},
        }
    )
    check_fixed_provenance(provenance)
    return provenance
