"""The actor layer's errors, and the one place where Ray's errors become opgraph's.

Owns every error type the runtime raises about its actors (a lost executor or branch
store, an unknown run, branch or watcher, a failed turn) and ``translate``, which turns
a Ray exception into one of them, naming the actor, run and node it concerns. No other
module inspects a Ray exception's type or text; callers never catch a Ray type. The call
seam (``calls``) is the one caller of ``translate`` for calls between actors.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import ray

from opgraph.kernel import ExecutionError, OpGraphError
from opgraph.kernel.failures import OUTCOME_LOST, WORKER_DIED, WORKER_ERROR

from .workers.channel import ChannelLost, WorkerRaised

__all__ = [
    "BranchStoreLostError",
    "CallFailure",
    "RuntimeLostError",
    "TurnError",
    "UnknownBranchError",
    "UnknownRunError",
    "call_failure",
    "clean_text",
    "is_actor_death",
    "name_error",
    "translate",
]

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RuntimeLostError(ExecutionError):
    """An opgraph actor died while a call to it was outstanding (``actor`` names it).

    For the executor: the run it owned is lost until the durable run log can restore it;
    the next ``flow()`` of the same Session starts a replacement executor.
    """


class BranchStoreLostError(ExecutionError):
    """The BranchStore holding this branch died; its messages cannot be read or written."""


class UnknownBranchError(ExecutionError):
    """The branch id is not held by this store (never created, dropped, or lost with its store)."""


class UnknownRunError(OpGraphError):
    """No live run with this id on the executors of this namespace (never started, or already finished)."""


class TurnError(ExecutionError):
    """A single turn (``Session.turn``) failed; ``error_type`` is its failure kind.

    The kinds are those of a failed node: an operation's exception class name, or one of
    ``opgraph.kernel.failures`` (WorkerDied, OperationTimeout, Cancelled, ...). ``usage``
    counts the model calls the turn made before it failed, so budgets see them too.
    """

    def __init__(self, message: str, *, error_type: str = "", usage: dict[str, Any] | None = None,
                 **ids: Any) -> None:
        super().__init__(message, **ids)
        self.error_type = error_type
        self.usage = dict(usage or {})  # what the failed turn's model calls cost, as TurnResult.usage


def clean_text(text: str, limit: int = 2000) -> str:
    """Text fit for an error message: terminal colour codes removed, bounded in length."""
    text = _ANSI.sub("", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_actor_death(exc: BaseException) -> bool:
    """True when ``exc`` says the actor called is gone (dead, or its process unreachable)."""
    return isinstance(exc, ray.exceptions.RayActorError)


def name_error(error: BaseException, *, actor: str | None = None, run_id: str | None = None,
               node_id: str | None = None, branch_id: str | None = None) -> BaseException:
    """``error`` with the ids the caller knows filled in where an opgraph error left them empty
    (an error an actor returned as an answer, or raised: see ``translate``)."""
    if isinstance(error, OpGraphError):
        for name, value in (("actor", actor), ("run_id", run_id), ("node_id", node_id), ("branch_id", branch_id)):
            if value is not None and getattr(error, name, None) is None:
                setattr(error, name, value)
    return error


def translate(exc: BaseException, *, actor: str | None = None, run_id: str | None = None,
              node_id: str | None = None, branch_id: str | None = None, doing: str = "") -> BaseException:
    """The opgraph error for ``exc`` raised by a call to ``actor``.

    An opgraph error raised inside the actor comes back as itself (Ray wraps it in a
    RayTaskError); the ids the caller knows are filled in where the error left them
    empty. An actor death becomes RuntimeLostError (BranchStoreLostError for a store).
    Anything else becomes an ExecutionError with Ray's text, cleaned of colour codes.
    Non-Ray exceptions are returned unchanged.
    """
    ids = {"actor": actor, "run_id": run_id, "node_id": node_id, "branch_id": branch_id}
    what = f" while {doing}" if doing else ""
    if is_actor_death(exc):
        error_type = BranchStoreLostError if actor and "branches" in actor else RuntimeLostError
        return error_type(f"opgraph actor {actor or '(unknown)'} died{what}", **ids)
    if isinstance(exc, ray.exceptions.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, OpGraphError):
            return name_error(cause, **ids)
        if isinstance(cause, BaseException):
            return ExecutionError(clean_text(f"{type(cause).__name__}{what}: {cause}"), **ids)
        return ExecutionError(clean_text(f"remote call failed{what}: {exc}"), **ids)
    if isinstance(exc, ray.exceptions.RayError):
        return ExecutionError(clean_text(f"{type(exc).__name__}{what}: {exc}"), **ids)
    return exc


class CallFailure(NamedTuple):
    """What a failed call to a worker means for the calls it carried: a failure kind and its text."""

    died: bool  # the worker is gone (its calls may not have started)
    error_type: str
    text: str


def call_failure(exc: BaseException, worker: str, what: str, *, died: bool | None = None) -> CallFailure:
    """Classify the failure of a call that carried ``what`` to ``worker``.

    A death is ``WorkerDied``; a worker that is alive but whose own loop raised is
    ``WorkerError`` (an opgraph bug, not a death); anything else means the outcome
    could not be received (``OutcomeLost``). A broken direct channel (``ChannelLost``)
    says neither: the caller asks Ray and passes ``died``.
    """
    if is_actor_death(exc) or (isinstance(exc, ChannelLost) and died):
        return CallFailure(True, WORKER_DIED, f"operation worker {worker} died while running {what}")
    if isinstance(exc, (ray.exceptions.RayTaskError, WorkerRaised)):
        return CallFailure(False, WORKER_ERROR, clean_text(f"operation worker {worker} failed: {exc}"))
    return CallFailure(False, OUTCOME_LOST, clean_text(
        f"the outcome of {what} from operation worker {worker} could not be received: {type(exc).__name__}: {exc}"))
