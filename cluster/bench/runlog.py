"""What the durable run log can write, on SQLite and on PostgreSQL, measured in one run.

Owns two measurements, each side by side on every backend given:

- ``log``: the run log's own write path (``RunLog.append``, as the executor's writer
  thread calls it): settlement records shaped like the kernel's ``finished`` records,
  encoded by the run-log codec, ``--records-per-batch`` per batch (one ``handle()`` pass)
  and ``--batches-per-commit`` batches per transaction (one group commit). Prints
  records/s and commits/s, medians of ``--repeat`` rounds, and each backend's ratio to
  the first.
- ``runtime`` (``--runtime``): a fan-out of ``--nodes`` x 0 ms through a Session whose
  runtime logs to each backend (its own namespace, so its own executor and its own
  database), against the same fan-out not logged at all. Prints nodes/s, medians.

    python -m opgraph.cluster.bench.runlog --postgres postgresql://user@127.0.0.1:5432/db --repeat 5
    python -m opgraph.cluster.bench.runlog --postgres URL --runtime --nodes 5000 --repeat 3

``--postgres`` may be given more than once (a URL can carry settings, for example
``?options=-csynchronous_commit%3Doff``); each database's run-log tables are emptied first.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from opgraph.actors.persistence import Database, RunLog
from opgraph.actors.persistence.backends import describe, is_postgres
from opgraph.actors.persistence.codec import encode

__all__ = ["main", "measure_log", "settlement_batch"]


def settlement_batch(first: int, size: int) -> list[tuple]:
    """``size`` ``finished`` records of completed nodes, each with a chat-sized response."""
    now = time.time()
    return [("finished", now, f"node-{index:08d}", 1, "completed",
             {"text": f"reply {index}: " + "lorem ipsum dolor sit amet " * 6, "model": "sim/instant"}, None, None)
            for index in range(first, first + size)]


def _clear(target: str) -> None:
    database = Database(target)
    database.transaction([("DELETE FROM runtime_run_records", ()), ("DELETE FROM runtime_runs", ())])
    database.close()


def measure_log(target: str, *, records: int, per_batch: int, per_commit: int) -> tuple[float, int]:
    """Seconds to append ``records`` records to a fresh run of the log at ``target``, and the commits made."""
    log = RunLog(target)
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    log.begin(run_id, "bench-executor", b"header", time.time())
    # Encoded up front: the codec's cost is the executor's either way, not the database's.
    batches = [encode(settlement_batch(first, per_batch)) for first in range(0, records, per_batch)]
    commits = 0
    started = time.perf_counter()
    for start in range(0, len(batches), per_commit):
        log.append([(run_id, seq, batches[seq - 1]) for seq in range(start + 1, min(start + per_commit, len(batches))
                                                                     + 1)])
        commits += 1
    elapsed = time.perf_counter() - started
    assert log.last_seq(run_id) == len(batches)
    log.database.close()
    return elapsed, commits


def _label(target: str) -> str:
    if not is_postgres(target):
        return "sqlite (WAL, synchronous=NORMAL)"
    _, _, query = describe(target).partition("?")
    return "postgresql" + (f" ({unquote(query).replace('options=-c', '')})" if query else " (server defaults)")


def run_log_figures(targets: Sequence[str], *, records: int, per_batch: int, per_commit: int,
                    repeat: int) -> list[dict[str, Any]]:
    samples: dict[str, list[float]] = {target: [] for target in targets}
    commits = 0
    for _ in range(repeat):  # rounds interleave the backends, so drift hits each alike
        for target in targets:
            elapsed, commits = measure_log(target, records=records, per_batch=per_batch, per_commit=per_commit)
            samples[target].append(elapsed)
    rows = []
    for target in targets:
        median = statistics.median(samples[target])
        rows.append({"backend": _label(target), "median_s": median, "records_per_s": records / median,
                     "commits_per_s": commits / median})
    return rows


async def _fanout(session: Any, nodes: int, durable: bool) -> float:
    from opgraph.kernel import OperationGraphBuilder

    builder = OperationGraphBuilder("runlog-bench")
    for _ in range(nodes):
        builder.add_operation("noop", depends_on=[])
    started = time.perf_counter()
    envelope = await session.flow(builder.get_graph(), max_concurrent=1000, durable=durable)
    elapsed = time.perf_counter() - started
    assert envelope["status"] == "completed", envelope["status"]
    return elapsed


def runtime_figures(targets: Sequence[str], *, nodes: int, repeat: int) -> list[dict[str, Any]]:
    import ray

    from opgraph.actors import Session

    sessions = []
    for target in targets:
        os.environ["OPGRAPH_DB"] = target  # read when the runtime of this namespace starts
        sessions.append((_label(target), Session(namespace=f"runlog-bench-{uuid.uuid4().hex[:8]}"), True))
    sessions.append(("not logged", sessions[0][1], False))
    samples: dict[str, list[float]] = {label: [] for label, _, _ in sessions}
    for round_ in range(repeat + 1):  # the first round warms every runtime up and is not counted
        for label, session, durable in sessions:
            elapsed = asyncio.run(_fanout(session, nodes, durable))
            if round_:
                samples[label].append(elapsed)
    ray.shutdown()
    return [{"backend": label, "median_s": statistics.median(samples[label]),
             "nodes_per_s": nodes / statistics.median(samples[label])} for label, _, _ in sessions]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.runlog", description=__doc__.split("\n")[0])
    parser.add_argument("--postgres", action="append", default=[], metavar="URL",
                        help="a PostgreSQL database to measure beside SQLite (repeatable)")
    parser.add_argument("--records", type=int, default=20000, help="records appended per round (20000)")
    parser.add_argument("--records-per-batch", type=int, default=1, help="records per batch (1: one settlement)")
    parser.add_argument("--batches-per-commit", type=int, nargs="+", default=[1, 16, 256],
                        help="batches per transaction, one measurement each (1 16 256)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--runtime", action="store_true", help="also measure a fan-out through a logged runtime")
    parser.add_argument("--nodes", type=int, default=5000, help="fan-out width for --runtime (5000)")
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="opgraph-runlog-bench-") as folder:
        targets = [str(Path(folder) / "runlog.db"), *arguments.postgres]
        for target in targets[1:]:
            _clear(target)
        print(f"run log writes: {arguments.records} records, {arguments.records_per_batch} per batch, "
              f"median of {arguments.repeat}")
        for per_commit in arguments.batches_per_commit:
            rows = run_log_figures(targets, records=arguments.records, per_batch=arguments.records_per_batch,
                                   per_commit=per_commit, repeat=arguments.repeat)
            base = rows[0]["records_per_s"]
            for row in rows:
                print(f"  {per_commit:>4} batches/commit  {row['backend']:<36} {row['median_s']:7.3f} s  "
                      f"{row['records_per_s']:>10,.0f} records/s  {row['commits_per_s']:>8,.0f} commits/s  "
                      f"{row['records_per_s'] / base:5.2f}x sqlite")
        if arguments.runtime:
            print(f"fan-out {arguments.nodes} x 0 ms, max_concurrent=1000, through the runtime, "
                  f"median of {arguments.repeat}")
            rows = runtime_figures(targets, nodes=arguments.nodes, repeat=arguments.repeat)
            base = rows[-1]["nodes_per_s"]
            for row in rows:
                print(f"  {row['backend']:<36} {row['median_s']:7.3f} s  {row['nodes_per_s']:>9,.0f} nodes/s  "
                      f"{row['nodes_per_s'] / base:5.2f}x not logged")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
