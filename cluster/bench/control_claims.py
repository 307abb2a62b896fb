"""The task queue's claim benchmark: claims per second with 1, 2 and 4 workers, on SQLite and PostgreSQL.

Owns the figures of issue 34's speed goal (at least 500 claims/s on PostgreSQL with 4 workers,
claim p99 under 50 ms). Each worker is a process with its own connection, as `opgraph worker`s
are; each claims a task, records it succeeded, and claims again until the queue is empty. A
claim is timed from the call to its answer; a run's rate is its claims over its wall time::

    python -m opgraph.cluster.bench.control_claims --tasks 4000 --postgres postgresql://user@127.0.0.1:5432/db

Each run gets a fresh SQLite file, or a fresh schema of the PostgreSQL database.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

from opgraph.actors.persistence.backends import describe, is_postgres

from ..control import ControlDatabase, TaskQueue

__all__ = ["fresh_target", "main", "run_claims"]


def fresh_target(base: str, folder: str) -> str:
    """A new SQLite file in ``folder``, or a new schema of the PostgreSQL database at ``base``."""
    if not is_postgres(base):
        return str(Path(folder) / f"claims-{uuid.uuid4().hex[:8]}.db")
    import psycopg

    schema = f"claims_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True) as connection:
        connection.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in base else "?"
    return f"{base}{separator}options={quote(f'-csearch_path={schema}')}"


def _worker(target: str, name: str, start: Any, results: Any, complete: bool) -> None:
    database = ControlDatabase(target)
    queue = TaskQueue(database)
    latencies: list[float] = []
    settles: list[float] = []
    cpu = time.process_time()
    start.wait()
    began = time.perf_counter()
    while True:
        asked = time.perf_counter()
        claim = queue.claim("bench", name, lease_seconds=60)
        latencies.append(time.perf_counter() - asked)
        if claim is None:
            break
        if complete:
            asked = time.perf_counter()
            queue.succeed(claim)
            settles.append(time.perf_counter() - asked)
    ended = time.perf_counter()
    cpu = time.process_time() - cpu
    database.close()
    results.put({"claims": len(latencies) - 1, "latencies": latencies[:-1], "settles": settles, "began": began,
                 "ended": ended, "cpu": cpu})


def run_claims(base: str, workers: int, tasks: int, folder: str, *, complete: bool = True) -> dict[str, Any]:
    """``tasks`` queued, then claimed (and with ``complete`` each recorded succeeded before the next
    claim, as a worker does) by ``workers`` processes: claims/s and claim latency."""
    target = fresh_target(base, folder)
    database = ControlDatabase(target)
    queue = TaskQueue(database)
    with database.transaction(write=True) as db:
        for index in range(tasks):
            queue.insert(db, "agent", f"task {index}", queue="bench", priority=index % 3)
    database.close()
    context = multiprocessing.get_context("spawn")
    start, results = context.Event(), context.Queue()
    processes = [context.Process(target=_worker, args=(target, f"w{index}", start, results, complete))
                 for index in range(workers)]
    for process in processes:
        process.start()
    time.sleep(0.5)
    start.set()
    reports = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(60)
    claims = sum(report["claims"] for report in reports)
    wall = max(report["ended"] for report in reports) - min(report["began"] for report in reports)
    latencies = sorted(value for report in reports for value in report["latencies"])
    settles = sorted(value for report in reports for value in report["settles"])
    check = TaskQueue(ControlDatabase(target))
    settled = len(check.list_tasks(state="succeeded" if complete else "leased", limit=tasks + 1))
    check.db.close()
    return {"database": "postgresql" if is_postgres(base) else "sqlite", "workers": workers,
            "mode": "claim+succeed" if complete else "claim", "claims": claims,
            "settled_once": settled == claims == tasks, "claims_per_second": round(claims / wall, 1),
            "p50_ms": round(1000 * latencies[len(latencies) // 2], 2),
            "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
            "mean_ms": round(1000 * statistics.fmean(latencies), 2), "wall_seconds": round(wall, 2),
            # Where a worker's time goes: its succeed calls, and the CPU its own Python spent.
            "succeed_p50_ms": round(1000 * settles[len(settles) // 2], 2) if settles else None,
            "succeed_p99_ms": round(1000 * settles[min(len(settles) - 1, int(0.99 * len(settles)))], 2)
            if settles else None,
            "worker_cpu_share": round(sum(report["cpu"] for report in reports) / (wall * workers), 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.control_claims", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=4000, help="tasks queued per run (4000)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts to run (1,2,4)")
    parser.add_argument("--postgres", default=None, metavar="URL", help="a PostgreSQL database to run on too")
    parser.add_argument("--modes", default="claim,claim+succeed",
                        help="claim (lease every task), claim+succeed (a worker's cycle), or both (the default)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON here too")
    arguments = parser.parse_args(argv)
    counts = [int(value) for value in arguments.workers.split(",")]
    modes = arguments.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for base in [str(Path(folder) / "sqlite"), *([arguments.postgres] if arguments.postgres else [])]:
            for mode in modes:
                for workers in counts:
                    row = run_claims(base, workers, arguments.tasks, folder, complete=mode != "claim")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    names = sorted({row["database"] for row in rows})
    for mode in modes:
        print(f"\n{mode:<14} | " + " | ".join(f"{name:>26}" for name in names))
        for workers in counts:
            cells = []
            for name in names:
                row = next(row for row in rows if (row["workers"], row["database"], row["mode"]) ==
                           (workers, name, "claim" if mode == "claim" else "claim+succeed"))
                cells.append(f"{row['claims_per_second']:>9.0f}/s p99 {row['p99_ms']:>6.1f} ms")
            print(f"{workers:>6} worker(s) | " + " | ".join(f"{cell:>26}" for cell in cells))
    if arguments.postgres:
        print(f"(PostgreSQL: {describe(arguments.postgres)})")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(row["settled_once"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
