"""Scheduler events (facts that go in) and instructions (effects that come out).

Owns the vocabulary of ``FlowState.handle(*events) -> instructions``. Every
node-scoped event and instruction carries the node id and attempt number, so the shell
can drop stale results. The shell performs the effects, the kernel never does.

Each type is a small frozen record: a ``NamedTuple`` that compares equal only to a
record of the same type. Five are made per node (an outcome, a dispatch, three
signals), and a frozen dataclass costs four to five times as much to construct (one
``object.__setattr__`` per field; measured 1.2-2.4 us against 0.26-0.6 us): about a
quarter of the scheduler's time per node before issue #2.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .graph import Operation

# Builds a NamedTuple record from a complete field tuple, skipping the generated
# ``__new__`` and its argument handling: half the cost, for the records made per node.
new_record = tuple.__new__

__all__ = [
    "AdmissionDecided",
    "AppendRecords",
    "CancelGraceExpired",
    "CancelOperation",
    "CancelRequested",
    "CloneBranch",
    "CloseRequested",
    "ConditionsEvaluated",
    "DispatchHeld",
    "DispatchOperation",
    "DispatchUndelivered",
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
    "ReleaseRequested",
    "ReplaceHistory",
    "Restored",
    "ResumeRequested",
    "SpawnRequested",
]


# -- events -------------------------------------------------------------------
# Every event starts with ``now``: time arrives as a field, the kernel reads no clock.
class FlowStarted(NamedTuple):
    """The graph was submitted: validate, preallocate branches, dispatch roots."""

    now: float = 0.0


class OperationFinished(NamedTuple):
    """An operation attempt settled. ``status`` is completed, failed or cancelled."""

    now: float = 0.0
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


class DispatchUndelivered(NamedTuple):
    """The attempt was sent to a worker that was already dead: it never started.

    The node goes back to the ready queue and is dispatched again as a new attempt; it
    is not failed, because nothing of it ran (DESIGN.md, "Supervision").
    """

    now: float = 0.0
    node_id: str = ""
    attempt: int = 0
    reason: str = ""


class ConditionsEvaluated(NamedTuple):
    """Results of async edge conditions, edge id -> bool (or an error text)."""

    now: float = 0.0
    node_id: str = ""
    results: tuple[tuple[str, bool], ...] = ()
    error: str | None = None


class SpawnRequested(NamedTuple):
    """A SpawnRequest arrived (sent during an operation, or found in its response).

    ``dedupe_key`` identifies one request object across both routes; without it the
    scheduler uses the emitter id plus the request's content. ``redelivery`` marks the
    shell's own second copy of a request it already sent live (carried in the outcome
    so a late message cannot lose it): a redelivered duplicate is silently ignored,
    whereas a request genuinely seen twice is recorded as ``duplicate``.
    """

    now: float = 0.0
    emitter_id: str | None = None
    request: Any = None
    dedupe_key: Any = None
    redelivery: bool = False


class EscalationRequested(SpawnRequested):
    """An EscalationRequest arrived: the fields of SpawnRequested (``redelivery`` likewise), its own
    type, so the scheduler's table sends it to the escalation handler."""

    __slots__ = ()


class InjectRequested(NamedTuple):
    """A prebuilt Operation to admit, answered by ``AdmissionDecided(token=...)``."""

    now: float = 0.0
    operation: Operation | None = None
    after: str | None = None
    independent: bool = False
    token: Any = None


class Restored(NamedTuple):
    """A decision replayed from the durable run log (``FlowState.rebuild``): never sent by a shell.

    ``record`` is one admission-ledger record (``seen``, ``admitted``, ``dropped``,
    ``escalated``): what a node builder or an escalation decided the first time is
    applied again as it was, never decided anew.
    """

    now: float = 0.0
    record: tuple = ()


class ReleaseRequested(NamedTuple):
    """The caller recorded these settled nodes elsewhere: the run lets them go (``node_ids``).

    A run fed for a long time (a dataset job admitting a million rows) would otherwise
    hold every node it ever admitted. A node that is not settled, or whose result an
    open dependent still needs, is kept; an id the run does not hold is ignored.
    """

    now: float = 0.0
    node_ids: tuple[str, ...] = ()


class CloseRequested(NamedTuple):
    """A run kept open for admissions (``keep_open``) will take no more: it finishes once
    nothing is open or in flight."""

    now: float = 0.0


class PauseRequested(NamedTuple):
    now: float = 0.0


class ResumeRequested(NamedTuple):
    now: float = 0.0


class DispatchHeld(NamedTuple):
    """Backpressure from the shell: while ``held``, nothing new is dispatched (no signal)."""

    now: float = 0.0
    held: bool = True


class OperatorMessageReceived(NamedTuple):
    now: float = 0.0
    text: str = ""
    ts: Any = None


class CancelRequested(NamedTuple):
    now: float = 0.0
    reason: str = "cancelled"


class CancelGraceExpired(NamedTuple):
    """The cancel grace period elapsed: operations still in flight are settled ``cancelled``.

    They ignored the cancellation; whatever they return later is a stale result.
    """

    now: float = 0.0


# -- instructions -------------------------------------------------------------
class CloneBranch(NamedTuple):
    """Create ``branch_id`` as a copy-on-write clone of ``source`` (None: the default branch).

    ``reactive`` clones also run ``spawn_branch_setup``; every clone fires
    ``on_branch_created`` (branch-hook parity, DESIGN.md).
    """

    node_id: str
    branch_id: str
    source: str | None
    reactive: bool = False


class ReplaceHistory(NamedTuple):
    """Primary-dependency inheritance: ``branch_id`` takes ``source``'s messages."""

    node_id: str
    attempt: int
    branch_id: str
    source: str


class DispatchOperation(NamedTuple):
    node_id: str
    attempt: int
    operation: str
    parameters: dict[str, Any]
    branch_id: str | None


class CancelOperation(NamedTuple):
    node_id: str
    attempt: int


class EvaluateConditions(NamedTuple):
    """Evaluate async conditions: ``edges`` is ((edge_id, predecessor_result), ...)."""

    node_id: str
    edges: tuple[tuple[str, Any], ...]
    context: dict[str, Any]


class EmitSignal(NamedTuple):
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


class AdmissionDecided(NamedTuple):
    token: Any
    accepted: bool
    node_id: str | None = None
    reason: str | None = None


class AppendRecords(NamedTuple):
    """Durable runs only: the records of one ``handle()`` call, to append to the run log.

    Always the first instruction of its batch. The shell makes them durable before it
    acknowledges any outcome of the batch to anyone, and before it dispatches anything
    the batch decided, so that after a crash nothing is run twice under one attempt.
    """

    records: tuple


class FinishRun(NamedTuple):
    """The run settled; ``envelope`` is its result envelope."""

    envelope: dict[str, Any]


Event = (
    FlowStarted
    | OperationFinished
    | ConditionsEvaluated
    | SpawnRequested
    | EscalationRequested
    | InjectRequested
    | PauseRequested
    | ResumeRequested
    | DispatchHeld
    | OperatorMessageReceived
    | CancelRequested
    | CancelGraceExpired
    | DispatchUndelivered
    | Restored
    | ReleaseRequested
    | CloseRequested
)
Instruction = (
    CloneBranch | ReplaceHistory | DispatchOperation | CancelOperation | EvaluateConditions | EmitSignal
    | AdmissionDecided | FinishRun | AppendRecords
)


def _same_record(self: tuple, other: object) -> bool:
    return type(self) is type(other) and tuple.__eq__(self, other)


def _different_record(self: tuple, other: object) -> bool:
    return not _same_record(self, other)


# A plain tuple compares by content alone, so PauseRequested(0.0) would equal
# ResumeRequested(0.0) and CancelOperation("a", 1) would equal ("a", 1). Records keep
# the dataclass rule instead: equal only to the same type with the same fields.
for _record in (*Event.__args__, *Instruction.__args__):
    _record.__eq__ = _same_record
    _record.__ne__ = _different_record
    _record.__hash__ = tuple.__hash__
del _record
