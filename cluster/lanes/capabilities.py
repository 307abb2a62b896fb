"""The capability matrix of a lane invocation (ADR-0068 D3), and the check that rejects a control outside it.

Owns the matrix as data, the control request kinds with the capability each needs, the
one-line description for ``--help``, and ``LaneCapabilityError``. Which matrix an
invocation has is its lane adapter's decision; nothing here runs, stores or queues.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from opgraph.kernel import OpGraphError

__all__ = [
    "CAPABILITY_NAMES",
    "CONTROL_CAPABILITIES",
    "LaneCapabilities",
    "LaneCapabilityError",
    "check_capabilities",
    "describe_capabilities",
]


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

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> LaneCapabilities:
        """The matrix a run recorded; a capability it does not name is false (rejected, never queued)."""
        return cls(**{field.name: metadata.get(field.name) is True for field in fields(cls)})


CAPABILITY_NAMES: tuple[str, ...] = tuple(field.name for field in fields(LaneCapabilities))

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
    """A control request the lane invocation cannot honour; it was rejected and not queued.

    Carries ``lane``, ``request_kind`` and, when known, the invocation's ``capabilities``
    (its matrix as metadata). Use a lane that supports the control (for example a
    planned reactive flow for live messages), or cancel and rerun.
    """

    def __init__(self, message: str, *, lane: str, request_kind: str,
                 capabilities: Mapping[str, bool] | None = None, run_id: str | None = None) -> None:
        super().__init__(message, run_id=run_id)
        self.lane = lane
        self.request_kind = request_kind
        self.capabilities = None if capabilities is None else dict(capabilities)


def check_capabilities(capabilities: LaneCapabilities, request_kind: str, *, lane: str = "invocation",
                       run_id: str | None = None) -> None:
    """Return when ``capabilities`` honour ``request_kind``; otherwise raise ``LaneCapabilityError``.

    Unknown request kinds are rejected too: a control nobody consumes must never be accepted.
    """
    metadata = capabilities.as_metadata()
    capability = CONTROL_CAPABILITIES.get(request_kind)
    if capability is None:
        raise LaneCapabilityError(
            f"unknown control request {request_kind!r}; known: {', '.join(CONTROL_CAPABILITIES)}",
            lane=lane, request_kind=str(request_kind), capabilities=metadata, run_id=run_id)
    if not getattr(capabilities, capability):
        which = f"the {lane} lane" if run_id is None else f"run {run_id} (lane {lane})"
        raise LaneCapabilityError(
            f"{which} does not support {_CAPABILITY_WORDS[capability]}; the {request_kind!r} request was "
            "rejected and not queued", lane=lane, request_kind=request_kind, capabilities=metadata, run_id=run_id)


def describe_capabilities(capabilities: LaneCapabilities) -> str:
    """One line for ``--help`` and logs: ``cancel: yes, live operator message: no, ...``."""
    return ", ".join(
        f"{_CAPABILITY_WORDS[name]}: {'yes' if getattr(capabilities, name) else 'no'}"
        for name in CAPABILITY_NAMES
    )
