"""RunLogger without Ray: when a run's header, batches and end reach the log, and what waits for them.

The executor's logger is driven here the way ExecutorShell drives it, over a real SQLite
log and a real writer thread, with a bare ``_Run``: a new run's header costs no write of
its own, and nothing a run posts gets out before what decided it is durable.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from opgraph.actors.executor.durability import RunLogger
from opgraph.actors.executor.shell import _Run
from opgraph.actors.persistence import RunLog, Writer
from opgraph.actors.persistence.database import DatabaseError
from opgraph.actors.protocol import RunOptions
from opgraph.kernel import FlowState, Graph, create_operation


def _run(run_id: str) -> _Run:
    graph = Graph()
    graph.add_node(create_operation("chat"))
    return _Run(run_id, FlowState(graph), RunOptions())


class _CountingLog(RunLog):
    """A run log that counts its transactions, and can be told to refuse them."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.transactions = 0
        self.refuse = False
        self.threads: set[str] = set()

    def append(self, rows, headers=()):
        self._check()
        super().append(rows, headers)
        self.transactions += 1
        self.threads.add(threading.current_thread().name)

    def try_append(self, rows, headers=()):
        self._check()
        done = super().try_append(rows, headers)
        if done:
            self.transactions += 1
            self.threads.add(threading.current_thread().name)
        return done

    def _check(self):
        if self.refuse:
            raise DatabaseError("a write to the test log failed: disk full")


def test_a_new_runs_header_goes_in_one_transaction_with_its_first_batch_and_posts_wait_for_it(tmp_path):
    log = _CountingLog(tmp_path / "runs.db")

    async def go():
        logger = RunLogger(log, Writer(), "executor-0")
        run = _run("r1")
        logger.open(run, b"the graph")
        run.post("signal", "started")  # decided before anything was durable: held back
        held = list(run.outbox)
        run.gate_seq = logger.append(run, (("admitted", 1.0),))
        await logger.durable(run, run.gate_seq)
        return run, held

    run, held = asyncio.run(go())
    assert held == []
    assert log.transactions == 1  # header and first batch together
    assert log.threads == {"MainThread"}  # a small flush with nobody else writing: committed on the loop
    assert list(run.outbox) == [("signal", "started")]  # released once durable
    loaded = log.load("r1")
    assert loaded.header == b"the graph" and loaded.entry.status == "live"
    assert loaded.batches == [[["admitted", 1.0]]]


def test_a_header_that_cannot_be_written_fails_the_wait_and_nothing_is_released(tmp_path):
    log = _CountingLog(tmp_path / "runs.db")
    log.refuse = True

    async def go():
        logger = RunLogger(log, Writer(), "executor-0")
        run = _run("r2")
        logger.open(run, b"the graph")
        run.post("signal", "started")
        with pytest.raises(DatabaseError, match="disk full"):
            await logger.durable(run, 0)
        return run

    run = asyncio.run(go())
    assert list(run.outbox) == [] and run.flushed_seq == -1
    assert log.entry("r2") is None


def test_the_wal_is_checkpointed_off_the_writers_connection_and_by_the_writer_past_its_limit(tmp_path, monkeypatch):
    from opgraph.actors.persistence import database as module

    log = RunLog(tmp_path / "runs.db")
    checkpointer = log.database.checkpoint_elsewhere()
    assert log.database.query("PRAGMA wal_autocheckpoint") == [(0,)]  # commits no longer checkpoint
    monkeypatch.setattr(module, "CHECKPOINT_BYTES", 1000)
    path = tmp_path / "runs.db"
    log.begin("r1", "executor-0", bytes(500_000), 1.0)
    assert path.stat().st_size < 500_000  # committed into the WAL only
    assert checkpointer.written(500_000) is False  # handed to the checkpointer's own thread
    checkpointer.close()
    assert (checkpointer.checkpoints, checkpointer.failures) == (1, 0)
    assert path.stat().st_size > 500_000  # copied into the database file

    monkeypatch.setattr(module, "WAL_LIMIT_BYTES", 1000)
    log.begin("r2", "executor-0", bytes(50_000), 2.0)
    assert checkpointer.written(50_000) is True  # too long: the writer checkpoints, between its commits


def test_a_flush_goes_to_the_writer_thread_while_another_process_writes_or_when_it_is_large(tmp_path):
    """The loop never waits for SQLite's write lock nor writes a large flush itself."""
    path = tmp_path / "runs.db"
    log = _CountingLog(path)

    async def go():
        logger = RunLogger(log, Writer("test-writer"), "executor-0")
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        run = _run("r3")
        logger.open(run, b"the graph")
        run.gate_seq = logger.append(run, (("admitted", 1.0),))
        waiting = asyncio.ensure_future(logger.durable(run, run.gate_seq))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # waiting on the writer thread, which waits for the lock
        other.execute("COMMIT")
        await asyncio.wait_for(waiting, 30)
        log.threads.clear()
        large = logger.append(run, (("blob", "x" * (300 << 10)),))  # above INLINE_BYTES
        await logger.durable(run, large)
        return run

    run = asyncio.run(go())
    assert log.threads == {"test-writer_0"}
    assert log.load("r3").batches[-1][0][0] == "blob" and run.flushed_seq == 2
