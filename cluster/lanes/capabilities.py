"""Lane capabilities (ADR-0068 D3) and run provenance (ADR-0068 D4) for the fixed-workflow lane.

Owns the fixed lane's capability matrix as data, the check that rejects a control request
the lane cannot honour (so it is never queued), and the provenance payload a run persists.
It must not run, store or queue anything; runners and the store read these values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from opgraph.kernel import OpGraphError

__all__ = [
    "CAPABILITY_NAMES",
    "CONTROL_CAPABILITIES",
    "FIXED_WORKFLOW",
    "FIXED_WORKFLOW_CAPABILITIES",
    "LANE_CAPABILITIES",
    "Admission",
    "LaneCapabilities",
    "LaneCapabilityError",
    "LaneKind",
    "PlannerUse",
    "ProvenanceError",
    "ReactiveSettings",
    "RunProvenance",
    "SourceRef",
    "check_control",
    "describe_capabilities",
]

LaneKind = Literal["reactive_play", "planned_reactive_flow", "fixed_workflow"]
FIXED_WORKFLOW: LaneKind = "fixed_workflow"


# -- capabilities ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LaneCapabilities:
    """What one lane invocation supports (ADR-0068 D3); false means "reject, never enqueue".

    The six record keys plus ``cancel``: issue #5 gives the fixed lane a cancel
    consumer, and D3 says cancellation does not bring messages or replay with it.
    """

    planner: bool
    reactive_growth: bool
    live_pause: bool
    live_message: bool
    checkpoint_resume: bool
    leased_admission: bool
    cancel: bool

    def as_metadata(self) -> dict[str, bool]:
        """The ``lane_capabilities`` projection published in run metadata and API schemas."""
        return asdict(self)


CAPABILITY_NAMES: tuple[str, ...] = (
    "planner",
    "reactive_growth",
    "live_pause",
    "live_message",
    "checkpoint_resume",
    "leased_admission",
    "cancel",
)

# Fixed runs: no planner, authored topology only, no live controls or checkpoints, direct
# (not leased) admission; cancellation is the one control with a consumer.
FIXED_WORKFLOW_CAPABILITIES = LaneCapabilities(
    planner=False,
    reactive_growth=False,
    live_pause=False,
    live_message=False,
    checkpoint_resume=False,
    leased_admission=False,
    cancel=True,
)

# Only the fixed lane is declared here: the other lanes' flags depend on the invocation
# (``--reactive off`` is truthful as reactive_growth=False) and belong to their adapters.
LANE_CAPABILITIES: Mapping[str, LaneCapabilities] = {FIXED_WORKFLOW: FIXED_WORKFLOW_CAPABILITIES}

# Control request kinds, and the capability that must be true to honour each.
CONTROL_CAPABILITIES: Mapping[str, str] = {
    "cancel": "cancel",
    "pause": "live_pause",
    "resume": "live_pause",
    "message": "live_message",
    "checkpoint_resume": "checkpoint_resume",
    "spawn": "reactive_growth",
    "replan": "planner",
}

_CAPABILITY_WORDS = {
    "planner": "planner",
    "reactive_growth": "reactive growth (spawns)",
    "live_pause": "live pause/resume",
    "live_message": "live operator message",
    "checkpoint_resume": "checkpoint resume",
    "leased_admission": "leased (queued) admission",
    "cancel": "cancel",
}


class LaneCapabilityError(OpGraphError):
    """A control request the lane cannot honour; it was rejected and not queued.

    Carries ``lane`` and ``request_kind``. Use a lane that supports the control
    (for example a planned reactive flow for live messages), or cancel and rerun.
    """

    def __init__(self, message: str, *, lane: str, request_kind: str) -> None:
        super().__init__(message)
        self.lane = lane
        self.request_kind = request_kind


def check_control(lane: str | LaneCapabilities, request_kind: str) -> None:
    """Return when ``lane`` honours ``request_kind``; otherwise raise ``LaneCapabilityError``.

    ``lane`` is a lane name with a declared matrix or an invocation's own
    ``LaneCapabilities``. Unknown request kinds and undeclared lanes are rejected too:
    a control nobody consumes must never be accepted.
    """
    if isinstance(lane, LaneCapabilities):
        lane_name, capabilities = "invocation", lane
    else:
        lane_name, capabilities = str(lane), LANE_CAPABILITIES.get(lane)
        if capabilities is None:
            raise LaneCapabilityError(
                f"lane {lane_name!r} has no declared capability matrix here; "
                f"declared lanes: {', '.join(LANE_CAPABILITIES)}",
                lane=lane_name,
                request_kind=str(request_kind),
            )
    capability = CONTROL_CAPABILITIES.get(request_kind)
    if capability is None:
        raise LaneCapabilityError(
            f"unknown control request {request_kind!r}; known: {', '.join(CONTROL_CAPABILITIES)}",
            lane=lane_name,
            request_kind=str(request_kind),
        )
    if not getattr(capabilities, capability):
        raise LaneCapabilityError(
            f"the {lane_name} lane does not support {_CAPABILITY_WORDS[capability]}; the "
            f"{request_kind!r} request was rejected and not queued",
            lane=lane_name,
            request_kind=request_kind,
        )


def describe_capabilities(capabilities: LaneCapabilities = FIXED_WORKFLOW_CAPABILITIES) -> str:
    """One line for ``--help`` and logs: ``cancel: yes, live operator message: no, ...``."""
    return ", ".join(
        f"{_CAPABILITY_WORDS[name]}: {'yes' if getattr(capabilities, name) else 'no'}"
        for name in CAPABILITY_NAMES
    )


# -- provenance ------------------------------------------------------------------------
_HASH = re.compile(r"sha256:[0-9a-f]{64}")


class ProvenanceError(OpGraphError):
    """A provenance payload breaks the ADR-0068 D4 shape; the message lists what is wrong."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class SourceRef(_Frozen):
    """What exact definition produced the graph.

    ``workflow_def`` is a registry name pinned to a version; ``workflow_file`` is file
    mode (no version; the hash is of the validated bytes that were compiled). The other
    kinds are the reactive lanes' sources of ADR-0068 D2.
    """

    kind: Literal["workflow_def", "workflow_file", "playbook", "prompt", "flow_spec", "checkpoint"]
    ref: str
    version: int | None = None
    content_hash: str | None = None


class PlannerUse(_Frozen):
    used: bool = False


class ReactiveSettings(_Frozen):
    enabled: bool = False
    max_ops: int = 0


class Admission(_Frozen):
    task_id: str | None = None
    lease_attempt: int | None = None


class RunProvenance(_Frozen):
    """The provenance payload every run persists (ADR-0068 D4); ``to_payload`` is its JSON.

    For the fixed lane the pinned hash is required (this registry is the record's
    migration), a registry source also needs its version, and planner and reactive
    growth must be off.
    """

    lane: LaneKind
    source: SourceRef
    planner: PlannerUse = PlannerUse()
    reactive: ReactiveSettings = ReactiveSettings()
    admission: Admission = Admission()

    @model_validator(mode="after")
    def _fixed_lane_rules(self) -> RunProvenance:
        source = self.source
        if source.content_hash is not None and not _HASH.fullmatch(source.content_hash):
            raise ValueError(f"content_hash must be 'sha256:' and 64 hex digits, got {source.content_hash!r}")
        if source.version is not None and source.version < 1:
            raise ValueError(f"source version must be at least 1, got {source.version}")
        if self.lane != FIXED_WORKFLOW:
            return self
        if source.kind not in ("workflow_def", "workflow_file"):
            raise ValueError(f"a fixed_workflow run's source is a workflow_def or workflow_file, not {source.kind!r}")
        if source.content_hash is None:
            raise ValueError("a fixed_workflow run must record the pinned content_hash")
        if source.kind == "workflow_def" and source.version is None:
            raise ValueError("a fixed_workflow run from the registry must record the pinned version")
        if self.planner.used or self.reactive.enabled or self.reactive.max_ops:
            raise ValueError("a fixed_workflow run never uses a planner or reactive growth")
        return self

    @classmethod
    def fixed_workflow(
        cls,
        *,
        ref: str,
        content_hash: str,
        version: int | None = None,
        source_kind: Literal["workflow_def", "workflow_file"] = "workflow_def",
        task_id: str | None = None,
        lease_attempt: int | None = None,
    ) -> RunProvenance:
        """The fixed lane's payload: a pinned source, no planner, no reactive growth."""
        return cls.from_payload(
            {
                "lane": FIXED_WORKFLOW,
                "source": {"kind": source_kind, "ref": ref, "version": version, "content_hash": content_hash},
                "admission": {"task_id": task_id, "lease_attempt": lease_attempt},
            }
        )

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> RunProvenance:
        """Parse a stored payload; a malformed one is a ``ProvenanceError``."""
        try:
            return cls.model_validate(payload)
        except ValidationError as exc:
            details = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'payload'}: {err['msg']}" for err in exc.errors()
            )
            raise ProvenanceError(f"invalid run provenance: {details}") from exc

    def to_payload(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
