"""What the actors' ``statistics()`` snapshots measure: latency histograms and resident memory.

Owns the latency bucket bounds shared by node latency (executor) and model-call latency
(providers), and the one way the runtime reads its processes' resident memory now (not
only the peak), so that a long-lived runtime can be shown to stay flat run after run.
Plain Python: the metrics library is imported only by cluster/metrics/.

The bounds are 26% apart from 50 ms to 20 s, where model calls and tool calls fall, so
a quantile interpolated inside one bucket is off by about a quarter at most (a 1 s node
read p50 1.75 s from the former (1, 2.5] bucket); coarser outside that range.
"""

from __future__ import annotations

import bisect
import math
import os
import resource
from typing import Any

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram", "current_rss_mib", "peak_rss_mib"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# Below 50 ms: coarse. From 50 ms to 20 s: the R10 preferred numbers (1, 1.25, 1.6, 2,
# 2.5, 3.2, 4, 5, 6.3, 8 per decade), each bound 1.26 times the last. Above: to 10 minutes.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025,
    0.05, 0.063, 0.08, 0.1, 0.125, 0.16, 0.2, 0.25, 0.32, 0.4, 0.5, 0.63, 0.8,
    1.0, 1.25, 1.6, 2.0, 2.5, 3.2, 4.0, 5.0, 6.3, 8.0, 10.0, 12.5, 16.0, 20.0,
    30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)


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
        for bound, count in zip((*LATENCY_BUCKETS, math.inf), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return {"buckets": buckets, "sum": self.sum, "count": self.count}


def current_rss_mib() -> float:
    """Resident memory of this process now, in MiB (from /proc; the peak where there is none)."""
    try:
        with open("/proc/self/statm") as handle:
            resident_pages = int(handle.read().split()[1])
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()
    return resident_pages * _PAGE / (1024 * 1024)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
