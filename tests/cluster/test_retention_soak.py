"""The retention soak: 500 real runs under a policy that keeps the last 50, and a database that stops growing.

Real runs, not rows written by hand: the bundled support-triage workflow (five nodes, a
conditional fork) on the fixed-workflow lane with the built-in ``sim/`` provider, through
a runtime of its own (executor, workers, branch store in a namespace of this test) whose
run log and branches live in the same new SQLite file as the run store, five runs at a
time (about 0.04 s a run here). Every 25 runs the policy prunes, as a server's schedule
would, beside the next five runs (the runtime and the recorder write while it deletes);
after every 100 the file's size is printed, and each must stay within 10% of the size after
the first 100.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import pytest

from opgraph.actors import Session
from opgraph.cluster.cli.flow import example_workflow_path
from opgraph.cluster.lanes import open_store
from opgraph.cluster.lanes.fixed import file_source, run_workflow
from opgraph.cluster.processes import wait_until
from opgraph.cluster.store import RetentionPolicy, StoreDatabase, prune_runs

RUNS, AT_ONCE, PRUNE_EVERY, KEEP = 500, 5, 25, 50


@pytest.fixture
def own_runtime(session, tmp_path, monkeypatch):
    """A durable runtime whose database is a new file (read when the runtime starts: its actors get it);
    ``session`` only starts Ray."""
    target = tmp_path / "opgraph.db"
    monkeypatch.setenv("OPGRAPH_DB", str(target))
    soaked = Session(namespace=f"opgraph-retention-{uuid.uuid4().hex[:8]}")
    yield soaked, target
    soaked.runtime.kill()


def _settled_size(target) -> tuple[int, int]:
    """(file bytes, WAL bytes) once the WAL is copied in and emptied; nothing runs between two groups."""
    connection = sqlite3.connect(target, timeout=30)
    try:
        wait_until(lambda: connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0, timeout=30,
                   what="a checkpoint of the whole WAL")
    finally:
        connection.close()
    wal = target.with_name(target.name + "-wal")
    return target.stat().st_size, wal.stat().st_size if wal.exists() else 0


def test_five_hundred_runs_keeping_the_last_fifty_leave_the_file_flat(own_runtime, capsys):
    soaked, target = own_runtime
    source = file_source(example_workflow_path())
    policy = RetentionPolicy(keep_last=KEEP)
    sizes: dict[int, tuple[int, int]] = {}
    with open_store(target) as store, StoreDatabase(str(target)) as pruning:
        async def one(index: int) -> str:
            result = await run_workflow(soaked, source, model="sim/fast", store=store, inputs={
                "ticket": f"ticket {index}", "priority": "high" if index % 2 else "low"})
            return result.status

        async def soak() -> None:
            pruned: asyncio.Future | None = None  # a prune going on beside the next group of runs
            for start in range(0, RUNS, AT_ONCE):
                statuses = await asyncio.gather(*(one(index) for index in range(start, start + AT_ONCE)))
                assert statuses == ["completed"] * AT_ONCE
                if pruned is not None:
                    report = await pruned
                    assert report.space_error is None and report.kept_resumable == 0
                    pruned = None
                done = start + AT_ONCE
                if done % PRUNE_EVERY == 0:
                    pruned = asyncio.ensure_future(asyncio.to_thread(prune_runs, pruning, policy))
                if done % 100 == 0:  # measured once the prune is done, with nothing running
                    report, pruned = await pruned, None
                    sizes[done] = _settled_size(target)
                    with capsys.disabled():
                        print(f"\nretention soak: after {done} runs the database file is {sizes[done][0]:,} bytes "
                              f"(WAL {sizes[done][1]:,}); {report.runs} runs, {report.rows_total} rows deleted "
                              "by the last prune", flush=True)

        asyncio.run(soak())
        remaining = store.list_runs(limit=1000)
    assert len(remaining) == KEEP
    with sqlite3.connect(target) as connection:
        assert connection.execute("SELECT COUNT(*) FROM runtime_runs").fetchone()[0] == KEEP
        assert connection.execute("SELECT COUNT(*) FROM runtime_run_headers").fetchone()[0] == KEEP
    first = sizes[100][0]
    assert all(size <= first * 1.10 for size, _ in sizes.values()), {runs: size for runs, (size, _) in sizes.items()}
