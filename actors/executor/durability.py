"""The executor's side of the durable run log: append, flush, and hold back what must wait for it.

Owns when a run's record batches reach the database and what waits for them. Batches
of every run are flushed together, in one transaction on the writer thread, as soon as
the loop is free (a flush under way gathers the next one: group commit, no fixed
window). Until its batch is durable, nothing a batch decided is acknowledged to anyone
(driver signals, watcher events, the envelope) or dispatched, so a crash can lose only
decisions nobody acted on. A run's header is written in that first flush; its format, and
what it keeps of the run's options, is ``persistence/headers.py``'s.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ..persistence import RunLog, Writer
from ..persistence.codec import encode
from ..persistence.headers import decode_header, encode_header

if TYPE_CHECKING:
    from .shell import _Run

__all__ = ["RunLogger", "decode_header", "encode_header"]

# The largest flush committed on the executor's loop (SQLite); a larger one goes to the writer thread.
INLINE_BYTES = 256 << 10
YIELD_BEFORE_RECORDS = 256  # a flush of this many records lets the loop's ready tasks go first


class RunLogger:
    """Appends run-log batches and releases what waited for them; one per executor."""

    def __init__(self, log: RunLog, writer: Writer, executor: str) -> None:
        self.log = log
        self.writer = writer
        self.executor = executor
        self.checkpointer = log.database.checkpoint_elsewhere()
        self._pending: list[tuple[_Run, int, tuple]] = []
        self._headers: list[tuple[str, str, float, bytes]] = []  # runs admitted since the last flush
        self._flushing: asyncio.Task | None = None
        self.batches = 0
        self.flushes = 0
        self.bytes = 0
        self.end_failures = 0  # envelopes not written after their driver was answered
        self.inline = 0  # flushes committed on the loop (_commit_here)

    async def begin(self, run: _Run, header: bytes) -> None:
        """Admit a run the log may already hold (one resumed): its header, then where its records end."""
        await self.writer.run(self.log.begin, run.run_id, self.executor, header, run.started)
        run.flushed_seq = run.log_seq = await self.writer.run(self.log.last_seq, run.run_id)

    def open(self, run: _Run, header: bytes) -> None:
        """Admit a new run: its header goes in the next flush, in one transaction with its first
        batch, instead of a write of its own ahead of it. Until that flush the run is not
        durable (``flushed_seq`` -1), so everything it posts is held back and nothing is
        dispatched; ``durable(run, 0)`` waits for the header alone."""
        run.log_seq, run.flushed_seq, run.gate_seq = 0, -1, 0
        self._headers.append((run.run_id, self.executor, run.started, header))
        self._pending.append((run, 0, ()))
        self._schedule()

    def append(self, run: _Run, records: tuple) -> int:
        run.log_seq += 1
        self._pending.append((run, run.log_seq, records))
        self._schedule()
        return run.log_seq

    def _schedule(self) -> None:
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def durable(self, run: _Run, seq: int) -> None:
        """Return once every batch of ``run`` up to ``seq`` is in the database."""
        while run.flushed_seq < seq:
            if run.log_error is not None:
                raise run.log_error
            waiter = asyncio.get_running_loop().create_future()
            run.durable_waiters.append(waiter)
            await waiter

    async def _flush(self) -> None:
        try:
            if sum(len(records) for _, _, records in self._pending) >= YIELD_BEFORE_RECORDS:
                # A large batch is tens of milliseconds to encode: what handling it started
                # (the clones of 1,000 spawned children) goes out first, and the stores work
                # while this loop encodes, instead of after.
                await asyncio.sleep(0)
            while self._pending:
                pending, self._pending = self._pending, []
                headers, self._headers = self._headers, []
                rows = [(run.run_id, seq, encode(records)) for run, seq, records in pending if seq]
                count = sum(len(row[2]) for row in rows) + sum(len(header[3]) for header in headers)
                try:
                    if not self._commit_here(rows, headers, count):
                        await self.writer.run(self._commit, rows, headers, count)
                except Exception as exc:  # noqa: BLE001 - the runs lose durability: they end, typed
                    for run, _, _ in pending:
                        run.log_error = exc
                        _wake(run)
                    continue
                self.flushes += 1
                for run, seq, _ in pending:
                    if seq > run.flushed_seq:
                        run.flushed_seq = seq
                released = {id(run): run for run, _, _ in pending}
                for run in released.values():
                    run.release_gated()
                    _wake(run)
        finally:
            self._flushing = None

    def _commit_here(self, rows: list[tuple[str, int, bytes]], headers: list[tuple[str, str, float, bytes]],
                     count: int) -> bool:
        """A SQLite flush of at most ``INLINE_BYTES``, committed on the loop if nobody holds the
        database; False (nothing written) sends it to the writer thread.

        Ideal over the writer's own rule (a slow disk never stalls the loop): a WAL commit
        without a sync is a copy into the page cache, tens of microseconds for a flush's
        few kilobytes, while the round trip to the writer thread and back costs two thread
        wake-ups under the GIL on every flush, and every dispatch waits for its flush.
        A commit that would wait (another process writing, a large header) goes to the
        thread as before, so the loop never waits on a lock or a large write."""
        if self.checkpointer is None or count > INLINE_BYTES or not self.log.try_append(rows, headers):
            return False
        self.inline += 1
        self._count(rows, count)
        if self.checkpointer.written(count):
            self.writer.submit(self.checkpointer.checkpoint_writer)
        return True

    def _commit(self, rows: list[tuple[str, int, bytes]], headers: list[tuple[str, str, float, bytes]],
                count: int) -> None:
        """On the writer thread: one transaction for every batch of the flush, after the headers
        of runs admitted since the last one."""
        self.log.append(rows, headers)
        self._count(rows, count)
        self._written(count)

    def _count(self, rows: list, count: int) -> None:
        self.batches += len(rows)
        self.bytes += count

    def _written(self, count: int) -> None:
        """On the writer thread: tell the checkpointer (SQLite) what went in; checkpoint here if it
        says the WAL is too long."""
        if self.checkpointer is not None and self.checkpointer.written(count):
            self.checkpointer.checkpoint_writer()

    async def finish(self, run: _Run, status: str, envelope: dict[str, Any] | None, error: str | None = None) -> None:
        await self.durable(run, run.log_seq)
        await self.writer.run(self._finish, run.run_id, status, envelope, error)

    def _finish(self, run_id: str, status: str, envelope: dict[str, Any] | None, error: str | None) -> None:
        """On the writer thread: a large write, never made on the loop."""
        self._written(self.log.finish(run_id, status, envelope, error))

    def statistics(self) -> dict[str, Any]:
        checkpointer = self.checkpointer
        return {"batches": self.batches, "flushes": self.flushes, "bytes": self.bytes, "pending": len(self._pending),
                "end_failures": self.end_failures, "inline": self.inline, "at": time.time(),
                "checkpoints": checkpointer.checkpoints if checkpointer else None,
                "checkpoint_failures": checkpointer.failures if checkpointer else None}


def _wake(run: _Run) -> None:
    waiters, run.durable_waiters = run.durable_waiters, []
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
