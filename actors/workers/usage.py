"""Token usage of one call on a worker, summed across every model request the call makes.

Owns the per-call tally that ``Session.turn`` returns (and engines price against their
budgets). The worker opens a tally around each call; a verb's model requests add to
whichever tally is open in their task, so concurrent calls never mix their counts.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

__all__ = ["CallUsage", "open_usage", "record_usage"]


class CallUsage:
    """Model calls and tokens of one operation call, in total and per ``provider/model``."""

    __slots__ = ("calls", "prompt_tokens", "completion_tokens", "by_model")

    def __init__(self) -> None:
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.by_model: dict[str, dict[str, int]] = {}

    def add(self, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.calls += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        entry = self.by_model.setdefault(model, {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0})
        entry["calls"] += 1
        entry["prompt_tokens"] += prompt_tokens
        entry["completion_tokens"] += completion_tokens

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "by_model": {model: dict(entry) for model, entry in self.by_model.items()}}


_CURRENT: ContextVar[CallUsage | None] = ContextVar("opgraph_call_usage", default=None)


def open_usage() -> CallUsage:
    """Start a tally for the current task (and the tasks it creates from here on)."""
    usage = CallUsage()
    _CURRENT.set(usage)
    return usage


def record_usage(model: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Add one model request to the open tally, if any (a verb run outside a worker has none)."""
    usage = _CURRENT.get()
    if usage is not None:
        usage.add(model, int(prompt_tokens or 0), int(completion_tokens or 0))
