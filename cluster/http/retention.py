"""The server's automatic retention: the same prune as `opgraph runs prune`, on a schedule, off the request path.

Owns ``RetentionSchedule`` (a policy and how often it runs) and ``ScheduledPruning``, the
background task of `opgraph serve` that prunes on its own connection in a worker thread
(so request threads never queue behind it: they wait at most for one short batch on the
database's own lock), says what it freed, and stops between two batches when the server
does. Off unless a schedule is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Collection
from dataclasses import dataclass

from opgraph.kernel import OpGraphError

from ..store import PruneReport, RetentionPolicy, StoreDatabase, holds_run_log, prune_runs
from .runs import say

__all__ = ["DEFAULT_RETENTION_INTERVAL", "RetentionSchedule", "ScheduledPruning", "describe_prune"]

DEFAULT_RETENTION_INTERVAL = 3600.0


@dataclass(frozen=True)
class RetentionSchedule:
    """Prune by ``policy`` when the server starts, then every ``interval`` seconds."""

    policy: RetentionPolicy
    interval: float = DEFAULT_RETENTION_INTERVAL

    def __post_init__(self) -> None:
        if not self.policy.selective or self.policy.include_resumable:
            raise ValueError("a server's retention policy needs keep_last or older_than, and never includes "
                             "resumable runs")
        if not self.interval > 0:
            raise ValueError(f"the retention interval is a number of seconds above 0, got {self.interval!r}")


def describe_prune(report: PruneReport) -> str:
    """One line: what a prune freed."""
    kept = f"kept {report.kept_recent} recent, {report.kept_young} younger, {report.kept_resumable} resumable"
    size = ""
    if report.before is not None and report.after is not None:
        size = f"; store {report.before.bytes / 1e6:.1f} MB -> {report.after.bytes / 1e6:.1f} MB"
    verb = "would delete" if report.dry_run else "deleted"
    return (f"{verb} {report.runs} of {report.matched} matching runs ({report.rows_total} rows), {kept}{size}"
            + (" (stopped early)" if report.stopped else ""))


class ScheduledPruning:
    """The server's retention task: ``start()`` on the server's loop, ``await stop()`` before it ends.

    It prunes through a connection of its own to ``store``'s database (the same connection
    only for an in-memory store, which no other connection can see)."""

    def __init__(self, store: StoreDatabase, schedule: RetentionSchedule, replaying_lanes: Collection[str]) -> None:
        self.store = store
        self.schedule = schedule
        self.replaying_lanes = frozenset(replaying_lanes)
        self.runs = 0  # prunes done
        self.last: PruneReport | None = None
        self._stopping = threading.Event()  # read by the prune between two batches
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_pruning(), name="opgraph-retention")

    async def stop(self) -> None:
        """End the task: a prune under way stops after its current batch."""
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _keep_pruning(self) -> None:
        own = self.store.path != ":memory:"
        try:
            pruning = await asyncio.to_thread(StoreDatabase, self.store.path) if own else self.store
        except OpGraphError as exc:
            say(f"retention: cannot open the store to prune it: {exc}; retention is off")
            return
        try:
            while not self._stopping.is_set():
                await self._prune_once(pruning)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.schedule.interval)
        finally:
            if own:
                await asyncio.to_thread(pruning.close)

    async def _prune_once(self, pruning: StoreDatabase) -> None:
        try:
            report = await asyncio.to_thread(prune_runs, pruning, self.schedule.policy,
                                             replaying_lanes=self.replaying_lanes,
                                             run_log_here=holds_run_log(pruning.path), stop=self._stopping)
        except (OpGraphError, OSError) as exc:  # the store failed (or its file went): said, tried again later
            say(f"retention: the prune failed: {exc}; trying again in {self.schedule.interval:g} s")
            return
        self.runs += 1
        self.last = report
        if report.runs or report.space_error:
            say("retention: " + describe_prune(report)
                + (f"; giving space back failed: {report.space_error}" if report.space_error else ""))
