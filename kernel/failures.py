"""The failure kinds a node can settle with, declared once.

Owns the ``error_type`` strings that opgraph itself gives a failed or cancelled node
(an operation's own exception keeps its class name), the kinds a retry policy may
name, and ``RetryPolicy``. Every layer reads these names from here, never spells them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from .errors import OperationError

__all__ = [
    "BRANCH_STORE_LOST",
    "CANCELLED",
    "CANCEL_GRACE_EXPIRED",
    "CONTEXT_UPDATE_ERROR",
    "DISPATCH_ERROR",
    "EDGE_CONDITION_ERROR",
    "FAILURE_KINDS",
    "NOT_REGISTERED",
    "OPERATION_TIMEOUT",
    "OUTCOME_LOST",
    "RETRYABLE_KINDS",
    "RetryPolicy",
    "UNSERIALISABLE_OUTCOME",
    "WORKER_DIED",
    "WORKER_ERROR",
]

WORKER_DIED = "WorkerDied"  # the worker process died while the attempt was in flight on it
WORKER_ERROR = "WorkerError"  # the worker is alive but its batch loop raised (an opgraph bug)
OUTCOME_LOST = "OutcomeLost"  # the outcome could not be fetched from the worker
UNSERIALISABLE_OUTCOME = "UnserialisableOutcome"  # the result or an emission cannot be pickled
OPERATION_TIMEOUT = "OperationTimeout"  # the registered timeout elapsed
NOT_REGISTERED = "OperationNotRegistered"  # the node names an operation the run did not register
BRANCH_STORE_LOST = "BranchStoreLostError"  # the store holding the node's branch died
DISPATCH_ERROR = "DispatchError"  # the node's parameters could not be prepared
CONTEXT_UPDATE_ERROR = "ContextUpdateError"  # the response's context update is not a mapping, or a reducer raised
EDGE_CONDITION_ERROR = "EdgeConditionError"  # an incoming edge's condition raised
CANCELLED = "Cancelled"  # the attempt was cancelled and acknowledged it
CANCEL_GRACE_EXPIRED = "CancelGraceExpired"  # cancelled, but the operation ignored it past the grace period

FAILURE_KINDS: frozenset[str] = frozenset({
    WORKER_DIED, WORKER_ERROR, OUTCOME_LOST, UNSERIALISABLE_OUTCOME, OPERATION_TIMEOUT, NOT_REGISTERED,
    BRANCH_STORE_LOST, DISPATCH_ERROR, CONTEXT_UPDATE_ERROR, EDGE_CONDITION_ERROR, CANCELLED,
    CANCEL_GRACE_EXPIRED,
})
# Kinds that say nothing about the operation itself: the same attempt may well succeed
# elsewhere. A retry policy names a subset of these (or any exception class name).
RETRYABLE_KINDS: frozenset[str] = frozenset({WORKER_DIED, OUTCOME_LOST, OPERATION_TIMEOUT, BRANCH_STORE_LOST})


class RetryPolicy(NamedTuple):
    """How often one operation may be attempted, and after which failure kinds.

    ``max_attempts`` counts every attempt (1: no retry). ``on`` holds failure kinds or
    exception class names; a failure of another kind settles the node ``failed``.
    """

    max_attempts: int = 1
    on: frozenset[str] = frozenset({WORKER_DIED})

    @classmethod
    def of(cls, max_attempts: int, on: Iterable[str] | None = None) -> RetryPolicy:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise OperationError(f"max_attempts must be a whole number of at least 1, got {max_attempts!r}")
        kinds = frozenset({WORKER_DIED} if on is None else on)
        if not all(isinstance(kind, str) and kind for kind in kinds):
            raise OperationError(f"retry kinds must be non-empty strings, got {sorted(map(repr, kinds))}")
        return cls(max_attempts, kinds)

    def allows(self, attempt: int, error_type: str | None) -> bool:
        """Whether a failure of ``error_type`` on ``attempt`` earns another attempt."""
        return attempt < self.max_attempts and error_type in self.on
