"""The durable run log: each run's header and its batches of records, and how the run ended.

Owns the rows of the runtime's run tables. A header (headers.py: the submitted graph and
the run's options, no secret in it, signed) is written when the run is admitted; record
batches (kernel/runlog.py, through the kernel's run-log codec) as they are decided; the
envelope when the run ends. Nothing here interprets a record. A row that fails the
codec's integrity check is reported with its run's id, and nothing of it is read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opgraph.kernel import RunLogIntegrityError, compact_envelope, expand_envelope

from .backends import upsert
from .codec import decode, encode
from .database import Database, database_path

__all__ = ["LIVE", "LoggedRun", "RunLog", "RunLogEntry"]

LIVE = "live"
_BEGIN = ("INSERT INTO runtime_runs (run_id, executor, status, started) VALUES (?, ?, ?, ?) "
          "ON CONFLICT(run_id) DO UPDATE SET executor = excluded.executor, status = excluded.status, "
          "finished = NULL, envelope = NULL, error = NULL")
_HEADER = upsert("runtime_run_headers", ("run_id", "header"), ("run_id",))
_APPEND = upsert("runtime_run_records", ("run_id", "seq", "batch"), ("run_id", "seq"))


@dataclass(frozen=True)
class RunLogEntry:
    """One logged run: ``status`` is live, completed, failed, cancelled or error."""

    run_id: str
    executor: str
    status: str
    started: float
    finished: float | None
    error: str | None


@dataclass
class LoggedRun:
    """Everything the log holds of one run: what a rebuild needs."""

    entry: RunLogEntry
    header: bytes
    batches: list[list[Any]]
    envelope: dict[str, Any] | None


def encode_envelope(envelope: dict[str, Any]) -> bytes:
    """The envelope compacted (kernel ``compact_envelope``): one record of two values, (rest, columns).

    A million-node run's envelope stored whole was the executor's peak memory (issue #18)."""
    return encode([compact_envelope(envelope)])


def decode_envelope(data: bytes) -> dict[str, Any]:
    """The envelope ``encode_envelope`` stored; a record of one value is a whole envelope (written before)."""
    record = decode(data)[0]
    return record[0] if len(record) == 1 else expand_envelope(*record)


class RunLog:
    """The run log in the runtime database at ``path`` (default ``OPGRAPH_DB``)."""

    def __init__(self, path: Any = None, *, database: Database | None = None) -> None:
        self.database = database or Database(path or database_path())

    # -- writing -------------------------------------------------------------------------
    def begin(self, run_id: str, executor: str, header: bytes, started: float) -> None:
        """Admit ``run_id``: its header, live on ``executor``. A run resumed from its log keeps
        its records and is live again (on whichever executor now owns it)."""
        self.database.transaction([(_BEGIN, (run_id, executor, LIVE, started)), (_HEADER, (run_id, header))])

    def append(self, rows: list[tuple[str, int, bytes]],
               headers: list[tuple[str, str, float, bytes]] = ()) -> None:
        """Record batches ``(run_id, seq, encoded batch)`` of any runs, in one transaction, after
        the headers ``(run_id, executor, started, header)`` of runs admitted since the last one."""
        statements = self._statements(rows, headers)
        if statements:
            self.database.transaction(statements)

    @staticmethod
    def _statements(rows: list[tuple[str, int, bytes]],
                    headers: list[tuple[str, str, float, bytes]]) -> list[tuple[str, Any]]:
        statements = [(_BEGIN, [(run_id, executor, LIVE, started) for run_id, executor, started, _ in headers]),
                      (_HEADER, [(run_id, header) for run_id, _, _, header in headers])] if headers else []
        if rows:
            statements.append((_APPEND, rows))
        return statements

    def try_append(self, rows: list[tuple[str, int, bytes]],
                   headers: list[tuple[str, str, float, bytes]] = ()) -> bool:
        """``append`` now if it need not wait for anyone (SQLite); False, with nothing written, if it would."""
        return self.database.try_transaction(self._statements(rows, headers))

    def finish(self, run_id: str, status: str, envelope: dict[str, Any] | None = None,
               error: str | None = None) -> int:
        """Record how ``run_id`` ended; returns the bytes of envelope written."""
        blob = encode_envelope(envelope) if envelope is not None else None
        self.database.transaction([("UPDATE runtime_runs SET status = ?, finished = ?, envelope = ?, error = ? "
                                    "WHERE run_id = ?", (status, time.time(), blob, error, run_id))])
        return len(blob) if blob is not None else 0

    def forget(self, run_id: str) -> None:
        """Remove a run's records, keeping how it ended (a finished run needs no replay)."""
        self.database.transaction([("DELETE FROM runtime_run_records WHERE run_id = ?", (run_id,))])

    # -- reading -------------------------------------------------------------------------
    def entry(self, run_id: str) -> RunLogEntry | None:
        rows = self.database.query("SELECT run_id, executor, status, started, finished, error FROM runtime_runs "
                                   "WHERE run_id = ?", (run_id,))
        return RunLogEntry(*rows[0]) if rows else None

    def runs(self, *, status: str | None = None, executor: str | None = None) -> list[RunLogEntry]:
        sql = "SELECT run_id, executor, status, started, finished, error FROM runtime_runs"
        clauses, parameters = [], []
        if status is not None:
            clauses.append("status = ?")
            parameters.append(status)
        if executor is not None:
            clauses.append("executor = ?")
            parameters.append(executor)
        if clauses:
            sql += " WHERE " + " AND ".join(clauses)
        return [RunLogEntry(*row) for row in self.database.query(sql + " ORDER BY started", tuple(parameters))]

    def load(self, run_id: str) -> LoggedRun | None:
        rows = self.database.query("SELECT r.run_id, r.executor, r.status, r.started, r.finished, r.error, "
                                   "h.header, r.envelope FROM runtime_runs r "
                                   "JOIN runtime_run_headers h ON h.run_id = r.run_id WHERE r.run_id = ?", (run_id,))
        if not rows:
            return None
        *fields, header, envelope = rows[0]
        blobs = self.database.query("SELECT batch FROM runtime_run_records WHERE run_id = ? ORDER BY seq", (run_id,))
        with _integrity_of(run_id):
            batches = [decode(blob) for (blob,) in blobs]
            return LoggedRun(RunLogEntry(*fields), header, batches,
                             decode_envelope(envelope) if envelope is not None else None)

    def envelope(self, run_id: str) -> dict[str, Any] | None:
        rows = self.database.query("SELECT envelope FROM runtime_runs WHERE run_id = ?", (run_id,))
        with _integrity_of(run_id):
            return decode_envelope(rows[0][0]) if rows and rows[0][0] is not None else None

    def last_seq(self, run_id: str) -> int:
        rows = self.database.query("SELECT MAX(seq) FROM runtime_run_records WHERE run_id = ?", (run_id,))
        return rows[0][0] or 0


@contextlib.contextmanager
def _integrity_of(run_id: str) -> Iterator[None]:
    """A row of ``run_id`` that fails its integrity check is reported as that run's."""
    try:
        yield
    except RunLogIntegrityError as exc:
        if exc.run_id is not None:
            raise
        raise RunLogIntegrityError(f"the run log of run {run_id} cannot be trusted: {exc.message}",
                                   run_id=run_id) from None
