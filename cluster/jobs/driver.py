"""What every job driver shares: where it runs, its exit statuses, and its progress lines.

Owns the address a driver joins (``--address``, else the cluster ``ray job submit`` names,
else ``ray.init()``'s choice), whether its actors outlive it, the exit statuses, and
``ProgressLog``: a line whenever another 5% of the nodes settled or the interval passed.
It starts nothing itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..command_line import ExitCode
from ..connection import EXIT_RUNTIME

__all__ = ["EXIT_RUNTIME", "EXIT_RUN_NOT_COMPLETED", "EXIT_USAGE", "ProgressLog", "detach_problem", "job_address",
           "job_detached"]

EXIT_RUN_NOT_COMPLETED = ExitCode.FAILED  # the run failed or was cancelled: the job is marked FAILED
EXIT_USAGE = ExitCode.USAGE  # bad arguments or store, or a workflow definition that does not validate or compile


class ProgressLog:
    """A job's progress lines: counts node lifecycle signals (as an ``on_progress``
    callback) or takes the run's counters (``observe``, from a polled status), and prints a
    line whenever another ``step`` of the nodes has settled or ``interval`` seconds have passed.

    Settled counts completed, failed and skipped nodes (cancelled nodes send no signal);
    in flight is started minus finished. A line looks like
    ``progress: settled 120/200 (60%), in flight 20, failed 0, 1.4 s``; the last one,
    from the run's result, adds ``cancelled N`` when nodes were cancelled.
    """

    def __init__(self, total: int, *, out: TextIO | None = None, interval: float = 1.0,
                 step: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.out = out if out is not None else sys.stdout
        self.interval = interval
        self.step_nodes = max(1, int(total * step))
        self.clock = clock
        self.started_at = clock()
        self.counts = {"started": 0, "completed": 0, "failed": 0, "skipped": 0, "cancelled": 0}
        self.finished = False
        self.lines = 0
        self._last_line_at = self.started_at
        self._last_line_settled = 0

    @property
    def settled(self) -> int:
        return self.counts["completed"] + self.counts["failed"] + self.counts["skipped"]

    @property
    def in_flight(self) -> int:
        if self.finished:
            return 0
        return max(0, self.counts["started"] - self.counts["completed"] - self.counts["failed"])

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        if status in self.counts:
            self.counts[status] += 1
        now = self.clock()
        if (self.settled - self._last_line_settled >= self.step_nodes
                or now - self._last_line_at >= self.interval):
            self.report(now)

    def observe(self, status: dict[str, Any]) -> None:
        """Take the run's counters from a ``RunControl.status()`` snapshot (polled, instead of a
        signal per node): settled by status as the run counts them, in flight as running."""
        by_status = status.get("settled_by_status", {})
        for kind in ("completed", "failed", "skipped", "cancelled"):
            self.counts[kind] = by_status.get(kind, 0)
        self.counts["started"] = self.settled + status.get("running", 0)
        now = self.clock()
        if (self.settled - self._last_line_settled >= self.step_nodes
                or now - self._last_line_at >= self.interval):
            self.report(now)

    def close(self, envelope: dict[str, Any] | None = None) -> None:
        """The last line, from the run's result when it is given: a cancelled node sends no
        signal, so counting signals alone left "in flight 96" after a cancel. Once the run
        has ended nothing is in flight, and the line says how many were cancelled."""
        if envelope is not None:
            statuses = list(envelope.get("operation_statuses", {}).values())
            for status in ("completed", "failed", "skipped", "cancelled"):
                self.counts[status] = statuses.count(status)
            self.counts["started"] = self.counts["completed"] + self.counts["failed"]
            self.finished = True
            self.report()
        elif self.lines == 0 or self._last_line_settled != self.settled:
            self.report()

    def report(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        percent = 100.0 * self.settled / self.total if self.total else 100.0
        cancelled = f", cancelled {self.counts['cancelled']}" if self.counts["cancelled"] else ""
        print(f"progress: settled {self.settled}/{self.total} ({percent:.0f}%), in flight {self.in_flight}, "
              f"failed {self.counts['failed']}{cancelled}, {now - self.started_at:.1f} s", file=self.out, flush=True)
        self.lines += 1
        self._last_line_at = now
        self._last_line_settled = self.settled


def job_address(arguments: argparse.Namespace) -> str | None:
    """Where to run: --address, else the cluster Ray names for job drivers, else ray.init()'s default."""
    if arguments.address:
        return arguments.address
    if os.environ.get("RAY_ADDRESS"):
        return "auto"  # `ray job submit` sets RAY_ADDRESS for the driver
    return None


def job_detached(arguments: argparse.Namespace, address: str | None) -> bool:
    """The driver's actors outlive it when asked, or by default whenever it joined an address."""
    return arguments.detached if arguments.detached is not None else address is not None


def detach_problem(arguments: argparse.Namespace, address: str | None) -> str | None:
    """Why ``--detach`` cannot hold here (a run that outlives the job needs a runtime that does), or None."""
    if not arguments.detach:
        return None
    if address is None:
        return ("--detach needs a runtime that outlives this job: run it under `ray job submit`, or give "
                "--address (an embedded Ray ends with the job, and its run with it)")
    if arguments.detached is False:
        return "--detach needs the detached actors that --no-detached turns off"
    return None
