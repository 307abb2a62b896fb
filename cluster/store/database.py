"""One connection of the run store (SQLite or PostgreSQL): opened and migrated once, shared by threads.

Owns the connection's settings (SQLite: WAL, foreign keys, durability), its migration on
open, one locked transaction at a time with the driver's errors translated once, and the
store's writer thread. It must not know a table: the definitions, runs and engine runs
built on it do. What differs between the two databases is in the backend seam
(``opgraph.actors.persistence.backends``), not here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from opgraph.actors.persistence.backends import Connection, SharedConnection, describe, is_postgres
from opgraph.actors.secrets import private_directory

from .errors import WorkflowStoreError
from .owners import current_process
from .schema import default_store_path, migrate
from .writer import StoreWriter

__all__ = ["StoreDatabase"]


class StoreDatabase(SharedConnection):
    """One connection, shared by threads under a lock (the HTTP API calls from threads).

    Code on an event loop writes through ``writer``, the store's one writer thread, so
    the loop never waits for the database; reads from a loop go through a thread pool.

    ``path`` is a file (parent folders are created), ``":memory:"``, a ``postgresql://``
    URL (a database shared by machines), or None for ``default_store_path()``. ``clock``
    stamps every row (tests pass a fake one).
    ``fsync_every_commit=True`` keeps SQLite's default (``synchronous = FULL``): the
    engine runs' store, which commits far less often, always had it.
    """

    _error_type = WorkflowStoreError
    _closed_text = "the run store {where} is closed"
    _failed_text = "the run store {where} failed: {error}"
    _open_text = "cannot open the run store {where}: {error}"

    def __init__(self, path: str | Path | None = None, *, clock: Callable[[], float] = time.time,
                 fsync_every_commit: bool = False) -> None:
        path = default_store_path() if path is None else path
        self.path = str(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._owner = current_process()
        postgres = is_postgres(self.path)
        if self.path != ":memory:" and not postgres:
            private_directory(Path(self.path).expanduser().parent)
            self.path = str(Path(self.path).expanduser())
        self._db: Connection | None = None
        self._writer: StoreWriter | None = None
        self._writer_lock = threading.Lock()
        pragmas = ["PRAGMA foreign_keys = ON"]
        if self.path != ":memory:":
            # WAL lets the CLI read while a long run writes signals.
            pragmas.append("PRAGMA journal_mode = WAL")
            if not fsync_every_commit:
                # A commit reaches the operating system before it returns, so a killed
                # process loses nothing committed; only a power loss may undo the last
                # commits (never corrupting the file). FULL added an fsync per commit:
                # 1.46x against 1.10x the bare run time (python -m opgraph.cluster.bench.store).
                pragmas.append("PRAGMA synchronous = NORMAL")
        self._connect(self.path, timeout=10.0, sqlite_pragmas=pragmas,
                      migrate=lambda db: migrate(db, path=describe(self.path)))

    @property
    def dialect(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return "postgresql" if is_postgres(self.path) else "sqlite"

    @property
    def writer(self) -> StoreWriter:
        """This store's writer thread, started on first use: how code on an event loop writes."""
        # Not the connection's lock: the writer thread holds that for whole transactions,
        # and an event loop asking for the writer must not wait on one.
        with self._writer_lock:
            if self._db is None:
                raise WorkflowStoreError(f"the run store {describe(self.path)} is closed")
            if self._writer is None:
                self._writer = StoreWriter(self)
            return self._writer

    def close(self) -> None:
        """Write what the writer holds, then close the connection; later calls raise
        ``WorkflowStoreError``. Idempotent."""
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        super().close()

    def _where(self) -> str:
        return describe(self.path)

    def _transaction(self, *, write: bool = False) -> AbstractContextManager[Connection]:
        """One locked transaction; the driver's errors are translated here, once."""
        # A write transaction excludes other writers from its start (SQLite's BEGIN
        # IMMEDIATE, PostgreSQL's advisory lock), so read-then-write (the next
        # version number, the next signal seq) cannot race another process.
        return self._locked(transaction=True, write=write)

    def transaction(self, *, write: bool = False) -> Any:
        """One locked transaction on this store's connection (a context manager yielding it), for
        code beyond the store's own methods: retention deletes a run's runtime rows in the same
        transaction as its record. ``write`` excludes other writers from its start."""
        return self._transaction(write=write)

    def outside_transaction(self) -> AbstractContextManager[Connection]:
        """The connection under this store's lock with no transaction open, for the statements that
        must run outside one (SQLite's VACUUM and incremental vacuum, PostgreSQL's VACUUM)."""
        return self._locked(transaction=False)

    def schema_version(self) -> int:
        with self._transaction() as db:
            return db.user_version()
