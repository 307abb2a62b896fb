"""The messages between the executor, its workers and the driver, declared once (no Ray import).

Owns the wire layout of a call and its outcome, what a run ships to workers, a registered
operation and the result of a single turn. The per-node rows are plain tuples, pickled
by Ray: a batch of builtin tuples pickles in C, where a dataclass per item cost ~6 us
each way in Python reduce and setstate, the largest per-node cost of a 10,000-node
fan-out. (DESIGN.md names the kernel's msgpack codec for durable data; on this per-node
path it would cost more still, so these rows are a deliberate exception.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opgraph.kernel import RetryPolicy, expand_envelope

__all__ = [
    "ACKNOWLEDGED",
    "AdmittedRow",
    "CallRow",
    "CompactEnvelope",
    "Outcome",
    "OutcomeRow",
    "RegisteredOperation",
    "RunOptions",
    "RunResources",
    "SharedResult",
    "TurnResult",
]

#   CallRow:    (node_id, attempt, operation, parameters, branch_id, store_index)
#   OutcomeRow: (node_id, attempt, status, response, error, error_type, requests, started, finished)
# ``requests`` is a list of (kind, request, dedupe key, redelivery); a dedupe key is
# (node_id, attempt, ordinal): the same object keeps its ordinal on both routes.
CallRow = tuple[str, int, str, dict[str, Any], "str | None", int]
OutcomeRow = tuple[str, int, str, Any, "str | None", "str | None", list, float, float]
#   AdmittedRow: (node_id, operation, parameters, metadata), one operation a fed run's feeder
# admits (``FedRun.admit``): built into an Operation on the executor, with no branch of its own
# given (a dataset job admits a million; an Operation pickled by its reduce cost twice as much).
AdmittedRow = tuple[str, str, dict[str, Any], dict[str, Any]]

class SharedResult:
    """In a call's context, in place of a large result its run's dependents share: the worker
    fetches it from the run's executor once and keeps it for the run (OperationWorker.shared).

    Ideal over retrospective: a planner's result of N spawn requests went to each of its
    N children in full, N times over the wire and N unpicklings on the workers.
    """

    __slots__ = ("node_id",)

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return SharedResult, (self.node_id,)

    def __repr__(self) -> str:
        return f"SharedResult({self.node_id!r})"


# The first item a worker's batch stream yields: "every call of this batch has started".
# A batch whose stream fails before it never reached a live worker, so its calls are
# re-dispatched instead of failed (DESIGN.md, "Supervision").
ACKNOWLEDGED: list = []


@dataclass(slots=True)
class CompactEnvelope:
    """A finished run's envelope as its driver receives it: kernel ``compact_envelope``'s
    (rest, columns), without the node ids when they are the submitted graph's, in its
    order (``columns["ids"]`` None, ``columns["count"]`` how many), for the driver to
    put back from its own graph.

    Why: the envelope names every node three times. For 10,000 nodes it was a 560 KB
    answer, which Ray sends through its object store: 14-17 ms from the executor's
    answer to the driver's, against 1.6 ms for this one (issue #18)."""

    rest: dict[str, Any]
    columns: dict[str, Any]

    def expand(self, node_ids: list[str] | None) -> dict[str, Any]:
        """The envelope, equal to the executor's; ``node_ids``: the submitted graph's, in order."""
        columns = self.columns
        if columns and columns["ids"] is None:
            if node_ids is None or len(node_ids) != columns["count"]:
                raise ValueError(f"the envelope left out its {columns['count']} node ids, and "
                                 f"{'none' if node_ids is None else len(node_ids)} were known here")
            columns = dict(columns, ids=node_ids)
        return expand_envelope(self.rest, columns)


@dataclass(slots=True)
class Outcome:
    """What a worker returns for one call, never an exception; ``row()`` is its wire form."""

    node_id: str
    attempt: int
    status: str  # completed | failed | cancelled
    response: Any = None
    error: str | None = None
    error_type: str | None = None
    requests: list[tuple[str, Any, Any, bool]] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0

    def row(self) -> OutcomeRow:
        return (self.node_id, self.attempt, self.status, self.response, self.error, self.error_type,
                self.requests, self.started, self.finished)


@dataclass(slots=True)
class RegisteredOperation:
    """A user operation: ``async fn(branch, **parameters)``.

    ``record_turn`` appends the instruction and response to the branch; ``timeout``
    (seconds) turns a hung call into a failed outcome of type ``OperationTimeout``;
    ``retry`` says how often a failed attempt is tried again, and after which kinds.
    """

    fn: Callable[..., Any]
    record_turn: bool = True
    timeout: float | None = None
    retry: RetryPolicy | None = None


@dataclass(slots=True)
class RunResources:
    """What a run (or a Session's turns) ships to each worker once: operations, providers, settings.

    Workers fetch it from the executor the first time a call of the run reaches them,
    so a worker started to replace a dead one is set up before it runs anything.
    ``spawn_type`` is the request type a worker looks for in results.
    """

    operations: dict[str, Any] = field(default_factory=dict)
    providers: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    spawn_type: type | None = None


@dataclass(frozen=True)
class TurnResult:
    """One agent turn run on a worker (``Session.turn``): its response and what it cost.

    ``usage`` sums every model call of the turn: calls, prompt_tokens, completion_tokens,
    total_tokens, and ``by_model`` ("provider/model" -> the same counts), from which a
    cost budget is priced.
    """

    response: Any
    usage: dict[str, Any]
    branch_id: str
    attempt: int
    elapsed: float


@dataclass
class RunOptions:
    """Everything ``Session.flow`` decides for one run, shipped to the executor once.

    ``default_branch_id`` is where roots run; ``clone_source_branch_id`` the session's
    default branch, which dependent nodes are cloned from. ``known_branches`` (id ->
    shard) are branches the run may name; the executor recreates any it finds lost.
    ``branch_scope`` owns the branches the run creates (``scope_parent`` owns that
    scope in turn); with ``isolated`` the run also gets a default branch of its own,
    in its scope, so nothing of another run reaches it. A ``durable`` run is logged as
    it goes and outlives its executor; a ``detached`` run has no driver draining it
    (``Session.submit``): its executor forgets it once its end is durable. A run kept
    open (``keep_open``, a ``FedRun``) waits for its feeder's admissions until it is closed.
    """

    context: dict[str, Any] | None = None
    max_concurrent: int | None = 5
    parallel: bool = True
    reactive: bool = False
    max_spawn: int = 50
    spawn_type: type | None = None
    node_builder: Any = None
    reducers: dict[str, Any] | None = None
    default_branch_id: str | None = None
    clone_source_branch_id: str | None = None
    known_branches: dict[str, int] = field(default_factory=dict)
    resources: RunResources = field(default_factory=RunResources)
    retry_policies: dict[str, RetryPolicy] = field(default_factory=dict)
    spawn_branch_setup: Any = None
    want_signals: bool = True
    want_events: bool = False
    stream_buffer: int = 1024
    branch_scope: str | None = None
    scope_parent: str | None = None
    isolated: bool = False
    cancel_grace: float = 5.0
    durable: bool = False
    detached: bool = False
    keep_open: bool = False
