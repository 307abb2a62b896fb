"""The typed errors of the engines layer; each names the engine run it concerns.

Owns only the error classes (ADR-0034). Budget exhaustion is a control signal inside a
run; the public result marks it as degradation instead of raising (D5)::

    OpGraphError (kernel/errors.py)
    └── EngineError             an engine run could not do what was asked; ``run_id`` names the run
        ├── EngineInputError    bad input, refused before any agent is made
        ├── EngineBudgetError   a hard bound (agents, deadline, tokens, cost) refused more work;
        │                       also a RuntimeError, as in the record
        ├── PlanError           the planner gave no usable plan, even after one retry
        └── EventSinkError      the run's events could not be recorded durably
"""

from __future__ import annotations

from typing import Any

from opgraph.kernel import OpGraphError

__all__ = ["EngineBudgetError", "EngineError", "EngineInputError", "EventSinkError", "PlanError"]


class EngineError(OpGraphError):
    """Root of the engine errors; ``run_id`` is the engine run's id when one exists."""

    def __init__(self, message: str, *, run_id: str | None = None, node_id: str | None = None,
                 branch_id: str | None = None, edge_id: str | None = None) -> None:
        super().__init__(message, node_id=node_id, branch_id=branch_id, edge_id=edge_id)
        self.run_id = run_id

    def __reduce__(self):
        # Every attribute travels, so subclasses with fields of their own pickle too.
        return (_rebuild_engine_error, (type(self), self.message, dict(self.__dict__)))

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} [run={self.run_id}]" if self.run_id else text


def _rebuild_engine_error(cls: type[EngineError], message: str, state: dict[str, Any]) -> EngineError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class EngineInputError(EngineError, ValueError):
    """The engine was given bad input (an empty prompt, an unknown kind, a missing path,
    a non-positive budget); nothing ran and no agent was made."""


class EngineBudgetError(EngineError, RuntimeError):
    """A hard bound refused more work; ``reason`` is ``agents``, ``deadline``, ``tokens`` or ``cost``."""

    def __init__(self, message: str, *, reason: str, run_id: str | None = None, node_id: str | None = None,
                 branch_id: str | None = None) -> None:
        super().__init__(message, run_id=run_id, node_id=node_id, branch_id=branch_id)
        self.reason = reason


class PlanError(EngineError):
    """The planner returned no usable plan (empty after one retry, over the cap, or cyclic)."""


class EventSinkError(EngineError):
    """The run's events could not be written to its event sink; the cause is chained."""
