"""The runtime's database: one SQLite file or PostgreSQL database shared by processes, and its tables.

Owns opening the database the way every runtime process must (SQLite: WAL, a busy timeout,
commits that survive a killed process; PostgreSQL: a URL in ``OPGRAPH_DB``), and the
runtime's tables and their schema version, kept apart from the run store's (cluster/) in
the same database. No Ray, no event loop; the dialects differ only in backends.py.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ..secrets import private_directory
from ..settings import opgraph_home
from .backends import Connection, describe, driver_errors, is_postgres, location, open_connection

__all__ = ["RUNTIME_SCHEMA_VERSION", "Checkpointer", "Database", "DatabaseError", "database_exists", "database_path"]

BUSY_TIMEOUT_MS = 30_000  # how long a write waits for another process's SQLite write lock
WAL_RETRY_SECONDS = 0.01  # between tries of the switch to WAL (see _enter_wal)

# SQLite's own default: its writers checkpoint once the WAL passes 1,000 pages of 4 KiB.
CHECKPOINT_BYTES = 4 << 20
# A checkpoint beside a writer that never pauses cannot let the WAL restart; past this size
# the writer checkpoints itself, between two of its commits, as SQLite's default would.
WAL_LIMIT_BYTES = 64 << 20

RUNTIME_SCHEMA_VERSION = 4

# Version 4 changes no table: its run log signs every row that holds a pickled value, and
# reads no pickle it did not sign (kernel/codec.py). Rows an older opgraph wrote are
# unsigned pickles: the runtime refuses to open them until the operator says they can be
# trusted (``opgraph store migrate --trust-existing``, which signs them: migration.py).
SIGNED_SINCE_VERSION = 4

# Version 2 keys branch rows by their owner (the runtime whose store wrote them: see
# ``BranchStore``), so runtimes sharing one file never collide on record ids. Version 1's
# rows move to the owner "" (nobody's): any runtime may adopt a branch found there.
_BRANCH_TABLES_V1_TO_V2 = """
ALTER TABLE runtime_branch_records RENAME TO runtime_branch_records_v1;
ALTER TABLE runtime_branch_heads RENAME TO runtime_branch_heads_v1;
ALTER TABLE runtime_branch_messages RENAME TO runtime_branch_messages_v1;
DROP INDEX IF EXISTS runtime_branch_heads_shard;
"""
_BRANCH_ROWS_V1_TO_V2 = """
INSERT INTO runtime_branch_records SELECT '', shard, record_id, parent_id, parent_len FROM runtime_branch_records_v1;
INSERT INTO runtime_branch_heads SELECT '', branch_id, shard, record_id FROM runtime_branch_heads_v1;
INSERT INTO runtime_branch_messages SELECT '', shard, record_id, seq, message FROM runtime_branch_messages_v1;
DROP TABLE runtime_branch_records_v1;
DROP TABLE runtime_branch_heads_v1;
DROP TABLE runtime_branch_messages_v1;
"""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS opgraph_runtime_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS runtime_runs (
    run_id TEXT PRIMARY KEY,
    executor TEXT NOT NULL,
    status TEXT NOT NULL,
    started REAL NOT NULL,
    finished REAL,
    envelope BLOB,
    error TEXT
);
CREATE INDEX IF NOT EXISTS runtime_runs_live ON runtime_runs (status, executor);
CREATE TABLE IF NOT EXISTS runtime_run_headers (
    run_id TEXT PRIMARY KEY,
    header BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS runtime_run_records (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    batch BLOB NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE IF NOT EXISTS runtime_branch_records (
    owner TEXT NOT NULL,
    shard INTEGER NOT NULL,
    record_id INTEGER NOT NULL,
    parent_id INTEGER,
    parent_len INTEGER NOT NULL,
    PRIMARY KEY (owner, shard, record_id)
);
CREATE TABLE IF NOT EXISTS runtime_branch_heads (
    owner TEXT NOT NULL,
    branch_id TEXT NOT NULL,
    shard INTEGER NOT NULL,
    record_id INTEGER NOT NULL,
    PRIMARY KEY (owner, branch_id)
);
CREATE INDEX IF NOT EXISTS runtime_branch_heads_shard ON runtime_branch_heads (owner, shard);
CREATE INDEX IF NOT EXISTS runtime_branch_heads_branch ON runtime_branch_heads (branch_id);
CREATE TABLE IF NOT EXISTS runtime_branch_messages (
    owner TEXT NOT NULL,
    shard INTEGER NOT NULL,
    record_id INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    message BLOB NOT NULL,
    PRIMARY KEY (owner, shard, record_id, seq)
);
"""
# The newest head of a branch is the one written last: SQLite numbers rows as they are
# inserted (its implicit rowid, which ``read_branch`` orders by); PostgreSQL has no such
# number, so its heads table carries one of that name.
_POSTGRES_ROWID = "ALTER TABLE runtime_branch_heads ADD COLUMN IF NOT EXISTS rowid BIGINT GENERATED ALWAYS AS IDENTITY"

# Version 3 keeps a run's header (its pickled graph: a megabyte for 10,000 nodes) in a table
# of its own. In the run's row, every status change (a run finished, resumed, failed)
# rewrote it, a megabyte written for a few bytes changed.
_RUN_HEADERS_V2_TO_V3 = """
INSERT INTO runtime_run_headers SELECT run_id, header FROM runtime_runs;
ALTER TABLE runtime_runs DROP COLUMN header;
"""


def _has_column(connection: Connection, table: str, column: str) -> bool:
    cursor = connection.execute(f"SELECT * FROM {table} LIMIT 0")
    return column in [described[0] for described in cursor.description]


def _holds_logged_rows(connection: Connection) -> bool:
    """Whether any table holds a row an older opgraph may have pickled into (headers, batches,
    envelopes, branch messages)."""
    return any(connection.execute(f"SELECT 1 FROM {table} WHERE {column} IS NOT NULL LIMIT 1").fetchone()
               for table, column in (("runtime_run_headers", "header"), ("runtime_run_records", "batch"),
                                     ("runtime_runs", "envelope"), ("runtime_branch_messages", "message")))


def _unsigned_rows_refused(path: str, version: int) -> str:
    where = describe(path)
    return (f"the runtime tables of {where} were written by an older opgraph (runtime schema {version}), whose run "
            "log kept pickles unsigned; this opgraph reads no pickle it did not sign, so it does not open them. "
            f"Either move them aside (rename the file, or set OPGRAPH_DB to a new database: runs recorded in the "
            f"old one stay there), or, if nobody but you could ever have written it (it never came from a backup, "
            f"a shared server or another machine you do not trust), sign its rows: "
            f"opgraph store migrate --trust-existing --store {where}")


class DatabaseError(OpGraphError):
    """The runtime's database cannot be opened or written (``path`` says which)."""


def database_path() -> Path | str:
    """``$OPGRAPH_DB`` (a path, or a ``postgresql://`` URL kept as it is), else
    ``$OPGRAPH_HOME/opgraph.db``, else ``~/.opgraph/opgraph.db``."""
    if os.environ.get("OPGRAPH_DB"):
        return location(os.environ["OPGRAPH_DB"])
    return opgraph_home() / "opgraph.db"


def database_exists(target: Path | str) -> bool:
    """Whether there may be something to read at ``target``: a SQLite file exists; a URL always may."""
    return is_postgres(target) or Path(target).is_file()


def _enter_wal(connection: Connection) -> None:
    """Switch a SQLite file to write-ahead logging, waiting for another process that holds it.

    Two processes opening one new file at once (an executor and a branch store starting
    together) race to switch it: the loser is told "database is locked" at once, as SQLite
    does not call the busy handler for this switch, and failed to open 1 time in 10. It
    tries again until the busy timeout, as any write would wait."""
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            connection.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(WAL_RETRY_SECONDS)


class Database:
    """One connection to the runtime's tables at ``path`` (a file or a URL), used from one thread at a time.

    SQLite commits survive a killed process (WAL with ``synchronous=NORMAL``: only a power
    cut could undo the last ones); PostgreSQL commits are the server's. Every write is one
    transaction (``transaction()``).
    """

    def __init__(self, path: str | os.PathLike[str], *, trust_existing: bool = False) -> None:
        target = location(path)
        self.path = str(target)
        self.postgres = is_postgres(self.path)
        self.connection: Connection | None = None
        try:
            if not self.postgres:
                private_directory(Path(self.path).parent)
            self.connection = open_connection(self.path, timeout=BUSY_TIMEOUT_MS / 1000)
            if not self.postgres:
                _enter_wal(self.connection)
                self.connection.execute("PRAGMA synchronous = NORMAL")
            self.signed = self._migrate(trust_existing)
        except BaseException as exc:
            if self.connection is not None:
                self.connection.close()
            if isinstance(exc, (*driver_errors(), OSError)):
                raise DatabaseError(f"cannot open the runtime database {describe(self.path)}: {exc}") from exc
            raise
        self.lock = threading.Lock()

    def _migrate(self, trust_existing: bool) -> dict[str, int]:
        """Bring the runtime's tables to this version, in one transaction; what was signed on the
        operator's word (``trust_existing``), by kind of row."""
        connection = self.connection
        signed: dict[str, int] = {}
        # One transaction under the write lock: processes opening the database at once
        # migrate it once (PostgreSQL would also refuse a second CREATE of the same table).
        connection.begin(write=True)
        try:
            connection.execute(connection.ddl("CREATE TABLE IF NOT EXISTS opgraph_runtime_schema "
                                              "(version INTEGER NOT NULL)"))
            found = connection.execute("SELECT version FROM opgraph_runtime_schema").fetchone()
            if found is not None and found[0] > RUNTIME_SCHEMA_VERSION:
                raise DatabaseError(f"the runtime tables of {describe(self.path)} have schema version {found[0]}; "
                                    f"this opgraph knows up to {RUNTIME_SCHEMA_VERSION}: upgrade opgraph")
            if found is not None and found[0] == 1:
                connection.executescript(_BRANCH_TABLES_V1_TO_V2)
            connection.executescript(_SCHEMA)
            if self.postgres:
                connection.execute(_POSTGRES_ROWID)
            if found is not None and found[0] == 1:
                connection.executescript(_BRANCH_ROWS_V1_TO_V2)
            if found is not None and found[0] <= 2 and _has_column(connection, "runtime_runs", "header"):
                connection.executescript(_RUN_HEADERS_V2_TO_V3)
            if found is not None and found[0] < SIGNED_SINCE_VERSION and _holds_logged_rows(connection):
                if not trust_existing:
                    raise DatabaseError(_unsigned_rows_refused(self.path, found[0]))
                from .migration import sign_existing_rows  # local: it loads the runtime's pickler (Ray)

                signed = sign_existing_rows(connection)
            if found is None:
                connection.execute("INSERT INTO opgraph_runtime_schema (version) VALUES (?)",
                                   (RUNTIME_SCHEMA_VERSION,))
            elif found[0] < RUNTIME_SCHEMA_VERSION:
                connection.execute("UPDATE opgraph_runtime_schema SET version = ?", (RUNTIME_SCHEMA_VERSION,))
            connection.commit()
        except BaseException:
            connection.rollback()
            raise
        return signed

    def transaction(self, statements: list[tuple[str, tuple]]) -> None:
        """Run ``(sql, parameters)`` statements in one transaction (``executemany`` for lists of rows).

        SQLite takes its write lock up front; PostgreSQL needs none here (the runtime's
        writes never read first), and sends the whole transaction in one round trip."""
        with self.lock:
            connection = self.connection
            try:
                connection.run_transaction(statements, write=not self.postgres)
            except connection.errors as exc:
                raise DatabaseError(f"a write to {describe(self.path)} failed: {exc}") from exc

    def try_transaction(self, statements: list[tuple[str, Any]]) -> bool:
        """``transaction(statements)`` if it can start without waiting: this connection free and
        SQLite's write lock not held by another process. False (nothing written) if either is
        busy, and always on PostgreSQL, whose every commit is a round trip to the server."""
        if self.postgres or not self.lock.acquire(blocking=False):
            return False
        connection = self.connection
        try:
            connection.execute("PRAGMA busy_timeout = 0")
            try:
                connection.begin(write=True)
            except connection.errors:  # the write lock is another process's: the caller waits elsewhere
                return False
            finally:
                connection.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS:d}")
            try:
                connection.execute_all(statements)
                connection.commit()
            except BaseException as exc:
                connection.rollback()
                if isinstance(exc, connection.errors):
                    raise DatabaseError(f"a write to {describe(self.path)} failed: {exc}") from exc
                raise
            return True
        finally:
            self.lock.release()

    def query(self, sql: str, parameters: tuple = ()) -> list[tuple]:
        with self.lock:
            try:
                return [tuple(row) for row in self.connection.execute(sql, parameters).fetchall()]
            except self.connection.errors as exc:
                if self.postgres:
                    self.connection.rollback()
                raise DatabaseError(f"a read of {describe(self.path)} failed: {exc}") from exc

    def close(self) -> None:
        with self.lock:
            self.connection.close()

    def rewrite(self) -> None:
        """Rewrite a SQLite file whole (``VACUUM``) and empty its WAL: no free page, no old frame
        keeps bytes a row held before (after ``trust_existing`` signed an older run log)."""
        with self.lock:
            try:
                self.connection.execute("VACUUM")
                self.connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            except self.connection.errors as exc:
                raise DatabaseError(f"rewriting {describe(self.path)} failed: {exc}") from exc

    def checkpoint_elsewhere(self) -> Checkpointer | None:
        """Stop this connection's commits from checkpointing; the Checkpointer returned does it instead.

        A SQLite commit that takes the WAL past 1,000 pages copies the WAL into the database
        file and syncs it, before the commit returns: for the run log, a dispatch waiting
        on that commit waits 10-20 ms more every few runs. None for PostgreSQL."""
        if self.postgres:
            return None
        with self.lock:
            self.connection.execute("PRAGMA wal_autocheckpoint = 0")
            # A WAL restarted after a checkpoint shrinks back to this (SQLite keeps it at its
            # largest otherwise), so its size keeps saying how far checkpoints lag.
            self.connection.execute(f"PRAGMA journal_size_limit = {2 * CHECKPOINT_BYTES:d}")
        return Checkpointer(self)

    def checkpoint(self) -> None:
        """Checkpoint the SQLite WAL on this connection, between two of its transactions."""
        with self.lock:
            try:
                self.connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except self.connection.errors as exc:
                raise DatabaseError(f"a checkpoint of {describe(self.path)} failed: {exc}") from exc


class Checkpointer:
    """Checkpoints a SQLite WAL from a thread and connection of its own, off the writer's path.

    ``written(n)`` after each commit; once ``CHECKPOINT_BYTES`` have gone in since the last
    checkpoint, one runs (PASSIVE: it copies what it can without waiting for, or blocking,
    the writer). A failed checkpoint is counted and tried again later: the WAL keeps every
    commit either way. Should the WAL still pass ``WAL_LIMIT_BYTES``, ``written`` returns
    True: the writer's turn to checkpoint, on its own connection (``checkpoint_writer``,
    run where the writer's writes run).
    """

    def __init__(self, writer: Database) -> None:
        self.writer = writer
        self.path = writer.path
        self.wal = f"{writer.path}-wal"
        self._lock = threading.Lock()  # written() is told by the writer thread and by a loop's commits
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opgraph-checkpoint")
        self._connection: Connection | None = None
        self._running: Future | None = None
        self._since = 0
        self.checkpoints = 0
        self.failures = 0

    def written(self, count: int) -> bool:
        """Count ``count`` bytes committed; True if the writer must checkpoint (``checkpoint_writer``)."""
        with self._lock:
            self._since += count
            if self._since < CHECKPOINT_BYTES:
                return False
            self._since = 0
        try:
            if os.path.getsize(self.wal) > WAL_LIMIT_BYTES:
                return True
        except OSError:
            pass
        if self._running is None or self._running.done():
            self._running = self._pool.submit(self._checkpoint)
        return False

    def checkpoint_writer(self) -> None:
        """Checkpoint on the writer's own connection, between two of its commits; a failure is counted."""
        try:
            self.writer.checkpoint()
        except DatabaseError:  # the commits are in the WAL: only the copy failed, and is tried again
            self.failures += 1

    def _checkpoint(self) -> None:
        try:
            if self._connection is None:
                self._connection = open_connection(self.path, timeout=30.0)
            self._connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self.checkpoints += 1
        except (*driver_errors(), OSError):
            self.failures += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._connection is not None:
            self._connection.close()
