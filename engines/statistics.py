"""Per-engine counters: agents made, budget exhaustions, missing emissions, judge outcomes, runs.

Owns the process-wide ``statistics()`` snapshots of engines, keyed by engine kind
(``planning``, ``review``...), for the metrics exporter (cluster/) to translate. Counters
only grow; they are plain ints under a lock, since observers read from other threads.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["EngineCounters", "counters_for", "engine_statistics", "reset_engine_statistics"]

_lock = threading.Lock()
_registry: dict[str, EngineCounters] = {}


class EngineCounters:
    """Monotonic counters of one engine kind in this process."""

    SCALARS = ("runs_started", "agents_made", "emissions_missing")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.values: dict[str, int] = dict.fromkeys(self.SCALARS, 0)
        self.budget_exhaustions: dict[str, int] = {}
        self.judge_outcomes: dict[str, int] = {}
        self.runs_finished: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        with _lock:
            self.values[name] = self.values.get(name, 0) + amount

    def budget_exhausted(self, reason: str) -> None:
        with _lock:
            self.budget_exhaustions[reason] = self.budget_exhaustions.get(reason, 0) + 1

    def judged(self, outcome: str) -> None:
        """``allow``, ``reject``, ``error`` (failed open), ``budget`` (failed closed) or ``skipped``."""
        with _lock:
            self.judge_outcomes[outcome] = self.judge_outcomes.get(outcome, 0) + 1

    def finished(self, status: str) -> None:
        with _lock:
            self.runs_finished[status] = self.runs_finished.get(status, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        with _lock:
            return {**self.values, "budget_exhaustions": dict(self.budget_exhaustions),
                    "judge_outcomes": dict(self.judge_outcomes), "runs_finished": dict(self.runs_finished)}


def counters_for(kind: str) -> EngineCounters:
    with _lock:
        counters = _registry.get(kind)
        if counters is None:
            counters = _registry[kind] = EngineCounters(kind)
        return counters


def engine_statistics() -> dict[str, dict[str, Any]]:
    """``{kind: snapshot}`` for every engine kind that ran in this process."""
    with _lock:
        kinds = list(_registry.values())
    return {counters.kind: counters.snapshot() for counters in kinds}


def reset_engine_statistics() -> None:
    """Forget every counter (tests)."""
    with _lock:
        _registry.clear()
