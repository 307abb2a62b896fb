"""Node states of the scheduler and the one declared table of legal transitions.

Owns the vocabulary every kernel module shares: internal states, their public projection,
``TRANSITIONS`` (registration included), the common path whose steps a node's story
implies rather than records, and the fast steps hot paths may write without a call per
node. Anything not in the table is a kernel bug (StateTransitionError).
"""

from __future__ import annotations

from .errors import StateTransitionError

__all__ = [
    "CANCELLED", "COMPLETED", "EVALUATING", "FAILED", "FAST_STEPS", "IMPLIED_STATES", "IMPLIED_STEPS", "READY",
    "RUNNING", "SKIPPED", "TERMINAL", "TRANSITIONS", "UNREGISTERED", "WAITING", "illegal_transition",
    "implied_story",
]

# Internal node states. "waiting", "evaluating" and "ready" all project to the public
# status "pending"; the rest are public statuses as they are. A node the run has not
# registered has no state at all (``state.get(node_id)`` is None): ``UNREGISTERED``.
UNREGISTERED = None
WAITING, EVALUATING, READY, RUNNING = "waiting", "evaluating", "ready", "running"
COMPLETED, FAILED, SKIPPED, CANCELLED = "completed", "failed", "skipped", "cancelled"
TERMINAL = frozenset({COMPLETED, FAILED, SKIPPED, CANCELLED})
_PUBLIC_STATUS = {WAITING: "pending", EVALUATING: "pending", READY: "pending", RUNNING: RUNNING,
                 COMPLETED: COMPLETED, FAILED: FAILED, SKIPPED: SKIPPED, CANCELLED: CANCELLED}

# Every legal node transition. Anything else is a kernel bug (StateTransitionError).
TRANSITIONS: frozenset[tuple[str | None, str]] = frozenset(
    {
        (UNREGISTERED, WAITING),  # registration: the node enters the run (registration.py)
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
        (RUNNING, READY),  # never started on a dead worker, or retried under its retry policy
        # Released: a settled node whose feeder recorded its outcome leaves the run (release.py).
        (COMPLETED, UNREGISTERED),
        (FAILED, UNREGISTERED),
        (SKIPPED, UNREGISTERED),
        (CANCELLED, UNREGISTERED),
    }
)
# The same table keyed by the state left, so the per-transition check is one set probe.
_ALLOWED_FROM: dict[str | None, frozenset[str]] = {
    old: frozenset(new for source, new in TRANSITIONS if source == old)
    for old in (UNREGISTERED, WAITING, EVALUATING, READY, RUNNING, COMPLETED, FAILED, SKIPPED, CANCELLED)
}

# The path almost every node takes, one step per state left: (next state, reason).
# A node's story (its transitions as (from, to, reason, attempt)) is not recorded while
# the node stays on this path, because its current state and attempt imply every step;
# that saves a tuple per transition, three per node. The first step off the path writes
# the implied steps out, and from then on that node's story is recorded in full.
IMPLIED_STEPS: dict[str, tuple[str, str]] = {
    WAITING: (READY, "dependencies settled, path valid"),
    READY: (RUNNING, "dispatched"),
    RUNNING: (COMPLETED, "operation completed"),
}
IMPLIED_STATES = frozenset({WAITING, READY, RUNNING, COMPLETED})

# The rows a hot path may write without a call per node to ``FlowState._transition``:
# registration and the common path's three steps, none of which writes a story. A single
# node takes them inline (``_register``, ``_make_ready``, ``_dispatch_ready``,
# ``_settle_completed``), each site having pinned the node's old state, so the row is a
# constant there and is checked against the table once, here, at import, not per node;
# many nodes at once take them through ``FlowState._transition_batch``, which checks the
# row once per batch. tests/kernel/test_transitions.py holds every write of a node's
# state to ``_transition``, ``_transition_batch`` and those four sites.
FAST_STEPS: frozenset[tuple[str | None, str]] = frozenset(
    {(UNREGISTERED, WAITING), *((old, new) for old, (new, _) in IMPLIED_STEPS.items())}
)


def illegal_transition(old: str | None, new: str, reason: str, node_id: str | None = None) -> StateTransitionError:
    """The error for a step that is not a row of TRANSITIONS (raised by the caller)."""
    return StateTransitionError(f"illegal transition {old} -> {new} ({reason})", node_id=node_id)


for _old, _new in FAST_STEPS:  # not ``assert``: python -O must not skip it
    if _new not in _ALLOWED_FROM[_old]:
        raise illegal_transition(_old, _new, "declared a fast step")
del _old, _new


def implied_story(current: str | None, attempt: int) -> list[tuple[str, str, str, int]]:
    """The steps that lead along the common path to ``current`` (none if it is off the path).

    Attempts count dispatches. A node on the common path was dispatched once (a second
    dispatch goes back through ``ready``, off the path, and records its story), so every
    step from ``ready`` on carries the node's one attempt number and the first carries 0.
    """
    story: list[tuple[str, str, str, int]] = []
    if current not in IMPLIED_STATES:
        return story
    old = WAITING
    while old != current:
        new, reason = IMPLIED_STEPS[old]
        story.append((old, new, reason, 0 if old == WAITING else attempt))
        old = new
    return story
