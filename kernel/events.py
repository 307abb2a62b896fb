"""Scheduler events (facts that go in) and instructions (effects that come out).

Owns the vocabulary of ``FlowState.handle(*events) -> instructions``. Every
node-scoped event and instruction carries the node id and attempt number, so the shell
can drop stale results. These are small frozen dataclasses; the shell performs the
effects, the kernel never does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .graph import Operation

__all__ = [
    "AdmissionDecided",
    "CancelOperation",
    "CancelRequested",
    "CloneBranch",
    "ConditionsEvaluated",
    "DispatchHeld",
    "DispatchOperation",
    "EmitSignal",
    "EscalationRequested",
    "EvaluateConditions",
    "Event",
    "FinishRun",
    "FlowStarted",
    "InjectRequested",
    "Instruction",
    "OperationFinished",
    "OperatorMessageReceived",
    "PauseRequested",
    "ReplaceHistory",
    "ResumeRequested",
    "SpawnRequested",
]


# -- events -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Event:
    now: float = 0.0


@dataclass(frozen=True, slots=True)
class FlowStarted(Event):
    """The graph was submitted: validate, preallocate branches, dispatch roots."""


@dataclass(frozen=True, slots=True)
class OperationFinished(Event):
    """An operation attempt settled. ``status`` is completed, failed or cancelled."""

    node_id: str = ""
    attempt: int = 0
    status: str = "completed"
    response: Any = None
    error: str | None = None
    error_type: str | None = None
    requests: tuple[Any, ...] = ()
    # True when the shell already extracted requests from the response (the worker
    # does, where object identity still means something); skips a second walk.
    extracted: bool = False


@dataclass(frozen=True, slots=True)
class ConditionsEvaluated(Event):
    """Results of async edge conditions, edge id -> bool (or an error text)."""

    node_id: str = ""
    results: tuple[tuple[str, bool], ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SpawnRequested(Event):
    """A SpawnRequest arrived (sent during an operation, or found in its response).

    ``dedupe_key`` identifies one request object across both routes; without it the
    scheduler uses the emitter id plus the request's content. ``redelivery`` marks the
    shell's own second copy of a request it already sent live (carried in the outcome
    so a late message cannot lose it): a redelivered duplicate is silently ignored,
    whereas a request genuinely seen twice is recorded as ``duplicate``.
    """

    emitter_id: str | None = None
    request: Any = None
    dedupe_key: Any = None
    redelivery: bool = False


@dataclass(frozen=True, slots=True)
class EscalationRequested(Event):
    """An EscalationRequest arrived; ``redelivery`` as for SpawnRequested."""

    emitter_id: str | None = None
    request: Any = None
    dedupe_key: Any = None
    redelivery: bool = False


@dataclass(frozen=True, slots=True)
class InjectRequested(Event):
    """A prebuilt Operation to admit, answered by ``AdmissionDecided(token=...)``."""

    operation: Operation | None = None
    after: str | None = None
    independent: bool = False
    token: Any = None


@dataclass(frozen=True, slots=True)
class PauseRequested(Event):
    pass


@dataclass(frozen=True, slots=True)
class ResumeRequested(Event):
    pass


@dataclass(frozen=True, slots=True)
class DispatchHeld(Event):
    """Backpressure from the shell: while ``held``, nothing new is dispatched (no signal)."""

    held: bool = True


@dataclass(frozen=True, slots=True)
class OperatorMessageReceived(Event):
    text: str = ""
    ts: Any = None


@dataclass(frozen=True, slots=True)
class CancelRequested(Event):
    reason: str = "cancelled"


# -- instructions -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Instruction:
    pass


@dataclass(frozen=True, slots=True)
class CloneBranch(Instruction):
    """Create ``branch_id`` as a copy-on-write clone of ``source`` (None: the default branch).

    ``reactive`` clones also run ``spawn_branch_setup``; every clone fires
    ``on_branch_created`` (branch-hook parity, DESIGN.md).
    """

    node_id: str
    branch_id: str
    source: str | None
    reactive: bool = False


@dataclass(frozen=True, slots=True)
class ReplaceHistory(Instruction):
    """Primary-dependency inheritance: ``branch_id`` takes ``source``'s messages."""

    node_id: str
    attempt: int
    branch_id: str
    source: str


@dataclass(frozen=True, slots=True)
class DispatchOperation(Instruction):
    node_id: str
    attempt: int
    operation: str
    parameters: dict[str, Any]
    branch_id: str | None


@dataclass(frozen=True, slots=True)
class CancelOperation(Instruction):
    node_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class EvaluateConditions(Instruction):
    """Evaluate async conditions: ``edges`` is ((edge_id, predecessor_result), ...)."""

    node_id: str
    edges: tuple[tuple[str, Any], ...]
    context: dict[str, Any]


@dataclass(frozen=True, slots=True)
class EmitSignal(Instruction):
    """Deliver a lifecycle signal of class ``kind``.

    Node signals carry the node and the few values that change; the pydantic model is
    built on access (``.signal``), in the shell, so the scheduler's hot path allocates
    one small object per signal rather than a validated model. ``fields`` holds the
    complete payload for signals that are not about one existing node's progress.
    """

    kind: Any
    run_id: str = ""
    node: Operation | None = None
    elapsed: float = 0.0
    depends_on: Any = ()
    fields: dict[str, Any] | None = None

    @property
    def op_id(self) -> str:
        if self.node is not None:
            return self.node.id
        return (self.fields or {}).get("op_id", "")

    @property
    def signal(self) -> Any:
        if self.node is None:
            return self.kind(**(self.fields or {}))
        metadata = self.node.metadata
        payload = {
            "run_id": self.run_id,
            "op_id": self.node.id,
            "name": metadata.get("reference_id") or self.node.operation,
            "elapsed": self.elapsed,
            "parent_id": metadata.get("parent_id"),
            "depends_on": list(self.depends_on),
        }
        if self.fields:
            payload.update(self.fields)
        return self.kind(**payload)


@dataclass(frozen=True, slots=True)
class AdmissionDecided(Instruction):
    token: Any
    accepted: bool
    node_id: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class FinishRun(Instruction):
    envelope: dict[str, Any] = field(default_factory=dict)
