"""Prometheus metrics of the control plane, read from its tables at each scrape.

Owns the families of the task queue (tasks by queue and state, the oldest due queued task's
age, lease expiries) and of schedules (fires by status, fire lateness p50 and p99). Every
state and status is exported at 0 until something happens, so rate() sees the first increase.
It only reads; without a database yet it exports zeros and creates nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..control import TASK_STATES, ControlDatabase, ControlError, TaskQueue
from ..control.schedules import Scheduler
from ..control.schema import FIRE_STATUSES
from ..store import default_store_path, store_exists

__all__ = ["ControlCollector", "control_metric_families"]


class ControlCollector(Collector):
    """The control tables of ``target`` (default ``OPGRAPH_DB``), opened on the first scrape that finds them."""

    def __init__(self, target: Any = None, *, clock: Any = None) -> None:
        self._target = target
        self._clock = clock
        self._database: ControlDatabase | None = None
        self._lock = threading.Lock()

    def _open(self) -> ControlDatabase | None:
        with self._lock:
            if self._database is None:
                target = default_store_path() if self._target is None else self._target
                if not store_exists(target):
                    return None
                self._database = ControlDatabase(target, **({} if self._clock is None else {"clock": self._clock}))
            return self._database

    def collect(self) -> Iterator[Metric]:
        try:
            database = self._open()
            queue = None if database is None else TaskQueue(database).statistics()
            fires = None if database is None else Scheduler(database).statistics()
        except ControlError:
            queue = fires = None  # the database is away: zeros, and an error count would need a row
        yield from control_metric_families(queue, fires)


def control_metric_families(queue: dict[str, Any] | None, fires: dict[str, Any] | None) -> Iterator[Metric]:
    queue = queue or {"depth": {}, "oldest_age": {}, "lease_expiries": 0}
    fires = fires or {"fires": {}, "lateness_p50": 0.0, "lateness_p99": 0.0}
    depth = GaugeMetricFamily("opgraph_control_tasks", "Tasks in the control plane's queue, by queue and state.",
                              labels=["queue", "state"])
    queues = sorted({name for name, _ in queue["depth"]} | {"default"})
    for name in queues:
        for state in TASK_STATES:
            depth.add_metric([name, state], queue["depth"].get((name, state), 0))
    yield depth
    oldest = GaugeMetricFamily("opgraph_control_oldest_queued_seconds",
                               "Age of the oldest due, unclaimed task, by queue (0 when none waits).", labels=["queue"])
    for name in queues:
        oldest.add_metric([name], queue["oldest_age"].get(name, 0.0))
    yield oldest
    yield CounterMetricFamily("opgraph_control_lease_expiries", "Leases that lapsed (a worker stopped heartbeating) "
                              "and whose task went back to the queue or died.", value=queue["lease_expiries"])
    counted = CounterMetricFamily("opgraph_control_fires", "Schedule fires by status (fired, buffered, skipped).",
                                  labels=["status"])
    for status in FIRE_STATUSES:
        counted.add_metric([status], fires["fires"].get(status, 0))
    yield counted
    lateness = GaugeMetricFamily("opgraph_control_fire_lateness_seconds",
                                 "How late scheduled fires were, over the last 1000 (p50 and p99).",
                                 labels=["quantile"])
    lateness.add_metric(["0.5"], fires["lateness_p50"])
    lateness.add_metric(["0.99"], fires["lateness_p99"])
    yield lateness
