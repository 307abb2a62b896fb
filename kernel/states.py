"""Node states of the scheduler and the one declared table of legal transitions.

Owns the vocabulary every kernel module shares: internal states, their public projection
and ``TRANSITIONS``. Anything not in the table is a kernel bug (StateTransitionError).
"""

from __future__ import annotations

__all__ = [
    "CANCELLED", "COMPLETED", "EVALUATING", "FAILED", "READY", "RUNNING", "SKIPPED",
    "TERMINAL", "TRANSITIONS", "WAITING",
]

# Internal node states. "waiting", "evaluating" and "ready" all project to the public
# status "pending"; the rest are public statuses as they are.
WAITING, EVALUATING, READY, RUNNING = "waiting", "evaluating", "ready", "running"
COMPLETED, FAILED, SKIPPED, CANCELLED = "completed", "failed", "skipped", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, SKIPPED, CANCELLED})
_PUBLIC_STATUS = {WAITING: "pending", EVALUATING: "pending", READY: "pending", RUNNING: RUNNING,
                 COMPLETED: COMPLETED, FAILED: FAILED, SKIPPED: SKIPPED, CANCELLED: CANCELLED}

# Every legal node transition. Anything else is a kernel bug (StateTransitionError).
TRANSITIONS: frozenset[tuple[str, str]] = frozenset(
    {
        (WAITING, EVALUATING),
        (WAITING, READY),
        (WAITING, SKIPPED),
        (WAITING, FAILED),
        (WAITING, CANCELLED),
        (WAITING, COMPLETED),  # restored terminal node (ADR-0023 D5)
        (EVALUATING, READY),
        (EVALUATING, SKIPPED),
        (EVALUATING, FAILED),
        (EVALUATING, CANCELLED),
        (READY, RUNNING),
        (READY, CANCELLED),
        (RUNNING, COMPLETED),
        (RUNNING, FAILED),
        (RUNNING, CANCELLED),
    }
)
# The same table keyed by the state left, so the per-transition check is one set probe.
_ALLOWED_FROM: dict[str, frozenset[str]] = {
    old: frozenset(new for source, new in TRANSITIONS if source == old)
    for old in (WAITING, EVALUATING, READY, RUNNING, COMPLETED, FAILED, SKIPPED, CANCELLED)
}
