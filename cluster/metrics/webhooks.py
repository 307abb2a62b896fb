"""Webhook delivery metrics, read from the run store at each scrape (the relay may run in any process).

Owns ``StoreCollector``: attempts by outcome, deliveries given up, deliveries pending and
disabled endpoints, from the store's few counter rows (``control.webhooks.delivery_statistics``).
Every family is exported with zeros when there is no store yet, so a dashboard's panels always
have series. It only reads; it never opens a store that does not exist.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opgraph.kernel import OpGraphError

from ..control.webhooks import OUTCOMES, delivery_statistics
from ..store import StoreDatabase, store_exists, store_location

__all__ = ["StoreCollector", "webhook_metric_families"]

_EMPTY = {"attempts": dict.fromkeys(OUTCOMES, 0), "dead": 0, "pending": 0, "disabled_endpoints": 0}


def webhook_metric_families(statistics: dict[str, Any]) -> Iterator[Metric]:
    attempts = CounterMetricFamily("opgraph_webhook_attempts", "Webhook delivery attempts by outcome: delivered "
                                   "(2xx), failed (another status), timeout, error (no answer), refused (not sent)",
                                   labels=["outcome"])
    for outcome in OUTCOMES:
        attempts.add_metric([outcome], statistics["attempts"].get(outcome, 0))
    yield attempts
    yield CounterMetricFamily("opgraph_webhook_deliveries_dead", "Webhook deliveries given up after every attempt",
                              value=statistics["dead"])
    yield GaugeMetricFamily("opgraph_webhook_deliveries_pending", "Webhook deliveries waiting for an attempt",
                            value=statistics["pending"])
    yield GaugeMetricFamily("opgraph_webhook_endpoints_disabled", "Webhook endpoints disabled for failing",
                            value=statistics["disabled_endpoints"])


class StoreCollector(Collector):
    """The webhook families of the store at ``path`` (default ``OPGRAPH_DB``), opened on the first scrape
    that finds it. A store that fails is exported as zeros for that scrape and opened again on the next."""

    def __init__(self, path: str | None = None) -> None:
        self._path = store_location(path)
        self._store: StoreDatabase | None = None
        self._lock = threading.Lock()

    def _statistics(self) -> dict[str, Any]:
        with self._lock:
            try:
                if self._store is None:
                    if not store_exists(self._path):
                        return _EMPTY
                    self._store = StoreDatabase(self._path)
                return delivery_statistics(self._store)
            except OpGraphError:
                if self._store is not None:
                    self._store.close()
                self._store = None
                return _EMPTY

    def collect(self) -> Iterator[Metric]:
        yield from webhook_metric_families(self._statistics())

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
