"""The runtime's database: one SQLite file shared by processes, and the runtime's own tables.

Owns opening the file the way every runtime process must (WAL, a busy timeout, commits
that survive a killed process), and the runtime's tables and their schema version,
kept apart from the run store's (cluster/) in the same file. No Ray, no event loop.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path

from opgraph.kernel import OpGraphError

__all__ = ["RUNTIME_SCHEMA_VERSION", "Database", "DatabaseError", "database_path"]

RUNTIME_SCHEMA_VERSION = 2

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
    header BLOB NOT NULL,
    envelope BLOB,
    error TEXT
);
CREATE INDEX IF NOT EXISTS runtime_runs_live ON runtime_runs (status, executor);
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


class DatabaseError(OpGraphError):
    """The runtime's database cannot be opened or written (``path`` says which)."""


def database_path() -> Path:
    """``$OPGRAPH_DB``, else ``$OPGRAPH_HOME/opgraph.db``, else ``~/.opgraph/opgraph.db``."""
    if os.environ.get("OPGRAPH_DB"):
        return Path(os.environ["OPGRAPH_DB"]).expanduser()
    if os.environ.get("OPGRAPH_HOME"):
        return Path(os.environ["OPGRAPH_HOME"]).expanduser() / "opgraph.db"
    return Path.home() / ".opgraph" / "opgraph.db"


class Database:
    """One connection to the runtime's tables in ``path``, used from one thread at a time.

    Commits survive a killed process (WAL with ``synchronous=NORMAL``: only a power cut
    could undo the last ones). Every write is one transaction (``transaction()``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(Path(path).expanduser())
        try:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.connection = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self.connection.execute("PRAGMA busy_timeout = 30000")
            self.connection.execute("PRAGMA journal_mode = WAL")
            self.connection.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise DatabaseError(f"cannot open the runtime database {self.path}: {exc}") from exc
        self.lock = threading.Lock()

    def _migrate(self) -> None:
        connection = self.connection
        connection.execute("CREATE TABLE IF NOT EXISTS opgraph_runtime_schema (version INTEGER NOT NULL)")
        connection.execute("BEGIN IMMEDIATE")  # processes opening the file at once migrate it once
        try:
            found = connection.execute("SELECT version FROM opgraph_runtime_schema").fetchone()
            if found is not None and found[0] > RUNTIME_SCHEMA_VERSION:
                raise DatabaseError(f"the runtime tables of {self.path} have schema version {found[0]}; this "
                                    f"opgraph knows up to {RUNTIME_SCHEMA_VERSION}: upgrade opgraph")
            if found is not None and found[0] == 1:
                for statement in _BRANCH_TABLES_V1_TO_V2.split(";"):
                    if statement.strip():
                        connection.execute(statement)
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    connection.execute(statement)
            if found is not None and found[0] == 1:
                for statement in _BRANCH_ROWS_V1_TO_V2.split(";"):
                    if statement.strip():
                        connection.execute(statement)
            if found is None:
                connection.execute("INSERT INTO opgraph_runtime_schema (version) VALUES (?)", (RUNTIME_SCHEMA_VERSION,))
            elif found[0] < RUNTIME_SCHEMA_VERSION:
                connection.execute("UPDATE opgraph_runtime_schema SET version = ?", (RUNTIME_SCHEMA_VERSION,))
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise

    def transaction(self, statements: list[tuple[str, tuple]]) -> None:
        """Run ``(sql, parameters)`` statements in one transaction (``executemany`` for lists of rows)."""
        with self.lock:
            cursor = self.connection.cursor()
            try:
                cursor.execute("BEGIN IMMEDIATE")
                for sql, parameters in statements:
                    if parameters and isinstance(parameters, list):
                        cursor.executemany(sql, parameters)
                    else:
                        cursor.execute(sql, parameters)
                cursor.execute("COMMIT")
            except sqlite3.Error as exc:
                if self.connection.in_transaction:
                    cursor.execute("ROLLBACK")
                raise DatabaseError(f"a write to {self.path} failed: {exc}") from exc

    def query(self, sql: str, parameters: tuple = ()) -> list[tuple]:
        with self.lock:
            try:
                return self.connection.execute(sql, parameters).fetchall()
            except sqlite3.Error as exc:
                raise DatabaseError(f"a read of {self.path} failed: {exc}") from exc

    def close(self) -> None:
        with self.lock:
            self.connection.close()
