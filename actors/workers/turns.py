"""Single turns: one call on a branch, on a supervised worker, outside any graph.

Owns the executor side of ``Session.turn``: pick a live worker, run the call, and treat
its failures as a graph node's are treated (a dead worker is a ``WorkerDied`` attempt,
retried under the operation's RetryPolicy with a new attempt number). Engines run every
agent turn through here, so no model call runs in the driver.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..errors import call_failure
from ..protocol import CallRow, OutcomeRow

if TYPE_CHECKING:
    from ..executor.shell import ExecutorShell

__all__ = ["run_turn"]


async def run_turn(shell: ExecutorShell, key: str, call: CallRow) -> tuple[OutcomeRow, dict[str, Any], int]:
    """Run ``call`` (its store index is filled in here) until it settles; (row, usage, attempt)."""
    node_id, attempt, operation, parameters, branch_id, _ = call
    shard = shell.branches.shard_of(branch_id)
    resources = shell.resources.get(key)
    registered = resources.operations.get(operation) if resources is not None else None
    policy = getattr(registered, "retry", None)
    spent: dict[str, Any] = {}
    while True:
        row, usage = await _attempt(shell, key, (node_id, attempt, operation, parameters, branch_id, shard))
        shell.totals["turns"] += 1
        spent = _summed(spent, usage)  # a retried attempt's model calls were paid for too
        if row[2] == "failed" and policy is not None and policy.allows(attempt, row[5]):
            attempt += 1
            continue
        return row, spent, attempt


def _summed(total: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any]:
    """Two ``CallUsage.as_dict()`` tallies added up (either may be empty)."""
    if not total:
        return usage
    if not usage:
        return total
    summed = {name: total.get(name, 0) + usage.get(name, 0)
              for name in ("calls", "prompt_tokens", "completion_tokens", "total_tokens")}
    by_model = {model: dict(counts) for model, counts in total.get("by_model", {}).items()}
    for model, counts in usage.get("by_model", {}).items():
        mine = by_model.setdefault(model, {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0})
        for name, value in counts.items():
            mine[name] = mine.get(name, 0) + value
    return {**summed, "by_model": by_model}


async def _attempt(shell: ExecutorShell, key: str, call: CallRow) -> tuple[OutcomeRow, dict[str, Any]]:
    index, _ = await shell.workers.live()
    worker = shell.worker(index)
    try:
        return await worker.run_turn(key, call, shell.slot)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the turn's typed outcome
        failure = call_failure(exc, worker.name, "the turn")
        if failure.died and shell.workers.mark_dead(index, worker.handle, "while running a turn"):
            shell.worker_deaths += 1
        now = time.time()
        return (call[0], call[1], "failed", None, failure.text, failure.error_type, [], now, now), {}
