"""A bounded latency histogram whose snapshot is already in Prometheus's shape.

Owns the bucket bounds shared by node latency (executor) and model-call latency
(providers). Plain Python: the metrics library is imported only by cluster/metrics.py.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class LatencyHistogram:
    """Counts per latency bucket plus a sum and a count; never the samples themselves.

    Bounded however many nodes settle, and its snapshot is already in Prometheus's
    shape (cumulative, monotonic buckets), so a scrape copies numbers instead of
    replaying observations.
    """

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last slot is above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        # bisect_left puts a value equal to a bound in that bound's bucket (le is <=).
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def snapshot(self) -> dict[str, Any]:
        """{"buckets": [(upper bound, cumulative count), ..., (inf, count)], "sum", "count"}."""
        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, math.inf), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return {"buckets": buckets, "sum": self.sum, "count": self.count}
