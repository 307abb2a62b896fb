"""Watchers: a second client's view of a run it did not start, found by run id.

Owns the per-watcher bounded event queue and the run summary a watcher ends with. The
GraphExecutor holds the watchers and feeds them on its main loop; a watcher never
holds up the run, and nothing here talks to Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from opgraph.kernel import FlowEvent, OpGraphError

__all__ = ["WATCHER_IDLE_SECONDS", "RunWatcher", "UnknownWatcherError", "envelope_summary"]

WATCHER_IDLE_SECONDS = 60.0  # a watcher that has not polled for this long is dropped


class UnknownWatcherError(OpGraphError):
    """No watcher with this id: it finished, was closed, or idled past WATCHER_IDLE_SECONDS.

    Attach again (``RunControl.watch()``) if the run is still live.
    """


def envelope_summary(envelope: dict[str, Any]) -> dict[str, Any]:
    """What an operator reads at the end of a run: status and counts, not every result."""
    statuses = envelope.get("operation_statuses", {})
    by_status: dict[str, int] = {}
    for status in statuses.values():
        by_status[status] = by_status.get(status, 0) + 1
    operator_messages = (envelope.get("final_context") or {}).get("operator_messages") or []
    summary = {
        "run_id": envelope.get("run_id"),
        "status": envelope.get("status"),
        "nodes": len(statuses),
        "by_status": by_status,
        "failed_operations": list(envelope.get("failed_operations", []))[:20],
        "operator_messages": [m.get("text") for m in operator_messages if isinstance(m, dict)],
        "scheduler_messages": envelope.get("scheduler_messages"),
    }
    if "spawned_operations" in envelope:
        summary["spawned_operations"] = envelope["spawned_operations"]
        summary["dropped_spawns"] = len(envelope.get("dropped_spawns", []))
    return summary


class RunWatcher:
    """One watcher of one run: settled-node events in a bounded queue, then a summary.

    The owning driver's outbox is consumed by that driver alone, so each watcher gets
    its own queue. A watcher never applies backpressure: when its queue is full the
    oldest event is dropped and counted, and the next poll says how many were missed.
    """

    def __init__(self, watcher_id: str, run_id: str, buffer: int) -> None:
        self.id = watcher_id
        self.run_id = run_id
        self.buffer = max(1, buffer)
        self.queue: deque[FlowEvent] = deque()
        self.dropped = 0
        self.wakeup = asyncio.Event()
        self.finished: dict[str, Any] | None = None
        self.last_poll = time.monotonic()

    def push(self, event: FlowEvent) -> None:
        if self.finished is not None:
            return
        if len(self.queue) >= self.buffer:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(event)
        self.wakeup.set()

    def finish(self, summary: dict[str, Any]) -> None:
        """The run ended (or was forgotten): the summary is the watcher's last item."""
        if self.finished is None:
            self.finished = summary
            self.wakeup.set()

    async def next_items(self, max_items: int, timeout: float) -> tuple[list[FlowEvent], int, dict[str, Any] | None]:
        """Wait up to ``timeout`` for something to report; (events, dropped, summary-or-None)."""
        self.last_poll = time.monotonic()
        if not self.queue and self.finished is None:
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), timeout)
            except TimeoutError:
                pass
        items = []
        while self.queue and len(items) < max_items:
            items.append(self.queue.popleft())
        dropped, self.dropped = self.dropped, 0
        self.last_poll = time.monotonic()
        return items, dropped, (self.finished if not self.queue else None)

    def idle_since(self, cutoff: float) -> bool:
        return self.last_poll < cutoff
