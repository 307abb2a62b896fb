"""EngineResult: a ``str`` that also carries the run, its skipped emissions and degradation (ADR-0034 D5).

Owns only the result type. ``degrade_reason`` is ``""`` for a clean run, else
``budget``, ``deadline`` or ``emission_failure`` (the last as the record's library added
later: the run finished, but some agent never produced its typed emission).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DEGRADE_REASONS", "EngineResult"]

DEGRADE_REASONS = ("budget", "deadline", "emission_failure")


class EngineResult(str):
    """``str(result) == result.text``; ``run`` is the live run.

    The run holds a supplied Session (and so its branches) as long as ``run`` is kept:
    release results you no longer need. A Session the run made for itself was closed
    when the run ended; the run's events (``events_by_type``) stay readable either way.
    """

    text: str
    skipped: list[str]
    degraded: bool
    degrade_reason: str
    run: Any

    def __new__(cls, text: str, *, events_by_type: Callable[[type], list[Any]], skipped: list[str],
                degraded: bool, run: Any, degrade_reason: str = "") -> EngineResult:
        if degrade_reason and degrade_reason not in DEGRADE_REASONS:
            raise ValueError(f"degrade_reason must be one of {DEGRADE_REASONS} or '', got {degrade_reason!r}")
        result = super().__new__(cls, text)
        result.text = str(text)
        result.skipped = list(skipped)
        result.degraded = bool(degraded)
        result.degrade_reason = degrade_reason
        result.run = run
        result._events_by_type = events_by_type
        return result

    def events_by_type(self, event_type: type) -> list[Any]:
        """The live run's typed payloads of ``event_type`` (``run.by_type``)."""
        return self._events_by_type(event_type)

    def __repr__(self) -> str:
        state = f"degraded={self.degrade_reason!r}" if self.degraded else "clean"
        return f"EngineResult({self.text[:60]!r}{'…' if len(self.text) > 60 else ''}, {state})"
