"""The lanes (ADR-0068): where a graph comes from, whether a planner may touch it, whether it may grow.

Owns the lane seam every surface uses: ``LaneInvocation``, ``PreparedLaneRun``, the
``LaneAdapter`` protocol and the registry keyed by lane kind (``lane_adapter``), the
capability matrix of an invocation (D3), run provenance (D4), and the shared way a
prepared run executes, recorded, and the ways it is submitted detached, settled from the
run log and resumed. Each lane's own parts live in its sub-package (the
fixed workflow lane in ``fixed/``, the planned reactive flow in ``planned/``, play in
``play/``), loaded by the registry: surfaces never import them.
"""

from . import registry
from .base import (
    FIXED_WORKFLOW,
    PLANNED_REACTIVE_FLOW,
    PUBLIC_LANES,
    REACTIVE_PLAY,
    LaneAdapter,
    LaneInvocation,
    LaneKind,
    LaneRunResult,
    PreparedLaneRun,
    RunHooks,
    parse_inputs,
)
from .capabilities import (
    CAPABILITY_NAMES,
    CONTROL_CAPABILITIES,
    LaneCapabilities,
    LaneCapabilityError,
    check_capabilities,
    describe_capabilities,
)
from .execution import LaneRunControl, Presentation, logged_capabilities, recorded_recovery, run_prepared
from .provenance import (
    SOURCE_KINDS,
    Admission,
    PinnedSourceChangedError,
    PlannerUse,
    ProvenanceError,
    ReactiveSettings,
    RunProvenance,
    SourceKind,
    SourceRef,
)
from .recovery import (
    follow_submitted,
    logged_end,
    resume_recorded,
    settle_from_log,
    settle_recorded,
    submit_prepared,
)
from .registry import *  # noqa: F403 - the lane registry, re-exported whole (its __all__)

__all__ = [
    "CAPABILITY_NAMES",
    "CONTROL_CAPABILITIES",
    "FIXED_WORKFLOW",
    "PLANNED_REACTIVE_FLOW",
    "PUBLIC_LANES",
    "REACTIVE_PLAY",
    "SOURCE_KINDS",
    "Admission",
    "LaneAdapter",
    "LaneCapabilities",
    "LaneCapabilityError",
    "LaneInvocation",
    "LaneKind",
    "LaneRunControl",
    "LaneRunResult",
    "PinnedSourceChangedError",
    "PlannerUse",
    "Presentation",
    "PreparedLaneRun",
    "ProvenanceError",
    "ReactiveSettings",
    "RunHooks",
    "RunProvenance",
    "SourceKind",
    "SourceRef",
    "check_capabilities",
    "describe_capabilities",
    "follow_submitted",
    "logged_capabilities",
    "logged_end",
    "parse_inputs",
    "recorded_recovery",
    "resume_recorded",
    "run_prepared",
    "settle_from_log",
    "settle_recorded",
    "submit_prepared",
    *registry.__all__,
]
