"""Reading this process's memory for ``statistics()`` snapshots.

Owns the one way the runtime measures its actors' resident memory now (not only the
peak), so that a long-lived runtime can be shown to stay flat run after run.
"""

from __future__ import annotations

import os
import resource

__all__ = ["current_rss_mib", "peak_rss_mib"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
