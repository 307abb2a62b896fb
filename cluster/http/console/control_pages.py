"""The control plane in the console: a page each for schedules, the task queue and webhook deliveries.

Owns reading the control tables for those pages (through the control plane's own classes,
on a connection of its own, opened on first use) and turning records into table rows. It
changes nothing: the controls stay the JSON API's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from ...control import ControlDatabase, TaskQueue
from ...control.schedules import Scheduler
from ...control.webhooks import Webhooks
from ...store import RunStore

__all__ = ["ControlPages", "table"]

ROWS = 200  # records on a page


def _cell(value: Any) -> str:
    if isinstance(value, float) and value > 1e9:  # a timestamp
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 160 else text[:159] + "…"


def table(records: Iterable[Mapping[str, Any]], columns: Iterable[str]) -> tuple[list[str], list[list[str]]]:
    """``columns`` of each record, as text (nested values as clipped JSON, timestamps as times)."""
    columns = list(columns)
    return columns, [["" if record.get(column) is None else _cell(record.get(column)) for column in columns]
                     for record in records]


class ControlPages:
    """What the control plane's console pages show, read from ``store``'s database."""

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self._db: ControlDatabase | None = None
        self._lock = threading.Lock()

    def database(self) -> ControlDatabase:
        with self._lock:
            if self._db is None:
                self._db = ControlDatabase(self.store.path)
            return self._db

    def schedules(self) -> tuple[list[str], list[list[str]]]:
        scheduler = Scheduler(self.database(), name="console")
        records = [{**record.to_dict(), "next": scheduler.next_times(record, 1)}
                   for record in scheduler.list_schedules()[:ROWS]]
        return table(records, ("name", "cron", "interval_seconds", "timezone", "action_kind", "target", "overlap",
                               "paused", "fires", "skipped", "next"))

    def tasks(self, state: str | None = None) -> tuple[list[str], list[list[str]]]:
        records = [task.to_dict() for task in TaskQueue(self.database()).list_tasks(state=state, limit=ROWS)]
        return table(records, ("task_id", "state", "queue", "action_kind", "target", "attempts", "run_id",
                               "reason", "created_at", "finished_at", "error"))

    def deliveries(self) -> tuple[list[str], list[list[str]]]:
        webhooks = Webhooks(self.database())
        records = []
        for endpoint in webhooks.list():
            for delivery in webhooks.deliveries(endpoint.name, limit=50):
                records.append({"endpoint": endpoint.name, **delivery})
        return table(records, ("endpoint", "delivery_id", "event_type", "subject_id", "status", "attempts",
                               "last_error", "created_at", "finished_at"))
