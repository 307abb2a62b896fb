"""The typed errors of the engines layer; each names the engine run it concerns.

Owns only the error classes (ADR-0034). Budget exhaustion is a control signal inside a
run; the public result marks it as degradation instead of raising (D5)::

    OpGraphError (kernel/errors.py)
    └── EngineError             an engine run could not do what was asked; ``run_id`` names the run
        ├── EngineInputError    bad input, refused before any agent is made
        ├── EngineBudgetError   a hard bound (agents, deadline, tokens, cost) refused more work;
        │                       also a RuntimeError, as in the record
        ├── PlanError           the planner gave no usable plan, even after one retry
        ├── EventSinkError      the run's events could not be recorded durably
        └── WorkspaceConflictError  a coding result cannot be applied: the workspace changed since
"""

from __future__ import annotations

from typing import Any

from opgraph.kernel import OpGraphError

__all__ = [
    "EngineBudgetError",
    "EngineError",
    "EngineInputError",
    "EventSinkError",
    "PlanError",
    "WorkspaceConflictError",
    "require_text",
]


class EngineError(OpGraphError):
    """Root of the engine errors; ``run_id`` (the root's field) is the engine run's id when one exists.

    Ids, printing and pickling (every attribute travels) are the root's own.
    """


class EngineInputError(EngineError, ValueError):
    """The engine was given bad input (an empty prompt, an unknown kind, a missing path,
    a non-positive budget); nothing ran and no agent was made."""


def require_text(value: Any, missing: str, *, what: str = "", limit: int | None = None, setting: str = "") -> None:
    """Refuse ``value`` unless it is text, not blank, and at most ``limit`` characters long.

    ``missing`` is the message for no text; a text too long is named ``what`` in the message,
    with the ``setting`` that bounds it when given."""
    if not isinstance(value, str) or not value.strip():
        raise EngineInputError(missing)
    if limit is not None and len(value) > limit:
        bound = f" ({setting})" if setting else ""
        raise EngineInputError(f"{what} has {len(value)} characters; the limit is {limit}{bound}")


class EngineBudgetError(EngineError, RuntimeError):
    """A hard bound refused more work; ``reason`` is ``agents``, ``deadline``, ``tokens`` or ``cost``."""

    def __init__(self, message: str, *, reason: str, **ids: str | None) -> None:
        super().__init__(message, **ids)
        self.reason = reason


class PlanError(EngineError):
    """The planner returned no usable plan (empty after one retry, over the cap, or cyclic)."""


class EventSinkError(EngineError):
    """The run's events could not be written to its event sink; the cause is chained."""


class WorkspaceConflictError(EngineError):
    """A coding result's patch cannot be applied: a file changed in the workspace since the copy
    was made (or the change is not text); nothing was written."""
