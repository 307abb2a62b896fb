"""The SQL backends opgraph keeps its data in: SQLite (a file) or PostgreSQL (a URL), behind one seam.

Owns telling a database location apart (``OPGRAPH_DB`` is a path or a ``postgresql://`` URL),
opening a connection to it, and the few places the two dialects differ: placeholders,
column types (``BLOB``/``bytea``, 64-bit integers, double-precision times), the schema
version of a set of tables, JSON fields, and how a write transaction excludes other
writers. Everything else is written once, in SQL both accept. No Ray, no event loop.
"""

from __future__ import annotations

import abc
import functools
import os
import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..secrets import SQLITE_COMPANIONS, private_file, redact_url

__all__ = [
    "POSTGRES_SCHEMES",
    "Connection",
    "PostgresConnection",
    "Row",
    "SharedConnection",
    "SqliteConnection",
    "describe",
    "driver_errors",
    "is_postgres",
    "location",
    "open_connection",
    "upsert",
]

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(target: Any) -> bool:
    """True for a ``postgresql://`` (or ``postgres://``) URL; a path is SQLite."""
    return isinstance(target, str) and target.startswith(POSTGRES_SCHEMES)


def location(target: str | os.PathLike[str]) -> str | Path:
    """A PostgreSQL URL as it is, else the path with ``~`` expanded (``Path`` would fold a URL's ``//``)."""
    text = os.fspath(target)
    return text if is_postgres(text) else Path(text).expanduser()


def describe(target: Any) -> str:
    """The location for messages: a URL without its password."""
    text = os.fspath(target) if not isinstance(target, str) else target
    return redact_url(text) if is_postgres(text) else text


def upsert(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """``INSERT ... ON CONFLICT (key) DO UPDATE`` of every other column: the upsert both dialects speak."""
    others = [column for column in columns if column not in key]
    action = ("DO UPDATE SET " + ", ".join(f"{column} = excluded.{column}" for column in others)) if others \
        else "DO NOTHING"
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
            f"ON CONFLICT ({', '.join(key)}) {action}")


def _split(script: str) -> list[str]:
    return [statement.strip() for statement in script.split(";") if statement.strip()]


class Row(tuple):
    """A result row read by position or by column name, as ``sqlite3.Row`` is (``dict(row)`` works)."""

    def __new__(cls, values: Iterable[Any], index: dict[str, int]) -> Row:
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


class Connection(abc.ABC):
    """One connection in autocommit mode; transactions are explicit (``begin``, ``commit``, ``rollback``).

    SQL is written with ``?`` placeholders and SQLite's type names; each backend
    translates what it must. ``errors`` is the driver's error base class, which callers
    translate into their own typed errors, once.
    """

    dialect: str
    errors: type[BaseException]
    target: str

    @abc.abstractmethod
    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Any:
        """Run one statement; the driver's cursor, for ``fetchone``/``fetchall``/``rowcount``."""

    @abc.abstractmethod
    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run one statement once per row."""

    def executescript(self, script: str) -> None:
        """Schema statements separated by ``;``, one by one, inside the caller's transaction
        (``sqlite3``'s own ``executescript`` would commit it first)."""
        for statement in _split(script):
            self.execute(self.ddl(statement))

    def ddl(self, statement: str) -> str:
        """A schema statement written in SQLite's type names, as this dialect needs it."""
        return statement

    def run_transaction(self, statements: Sequence[tuple[str, Any]], *, write: bool = True) -> None:
        """``(sql, parameters)`` in one transaction, a list of rows as ``executemany``; rolled back on error."""
        try:
            self.begin(write=write)
            self.execute_all(statements)
            self.commit()
        except BaseException:
            self.rollback()
            raise

    def execute_all(self, statements: Sequence[tuple[str, Any]]) -> None:
        """``(sql, parameters)`` in order, a list of rows as ``executemany``, in the open transaction."""
        for sql, parameters in statements:
            if parameters and isinstance(parameters, list):
                self.executemany(sql, parameters)
            else:
                self.execute(sql, parameters)

    @abc.abstractmethod
    def begin(self, *, write: bool = False) -> None:
        """Open a transaction; ``write`` excludes other writers from its start to its end."""

    @abc.abstractmethod
    def commit(self) -> None: ...

    @abc.abstractmethod
    def rollback(self) -> None:
        """Roll back the open transaction, if there is one."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def in_transaction(self) -> bool: ...

    # -- schema versions ------------------------------------------------------------------
    @abc.abstractmethod
    def user_version(self) -> int:
        """The schema version of the store's tables (0: none yet)."""

    @abc.abstractmethod
    def set_user_version(self, version: int) -> None: ...

    # -- SQL fragments -------------------------------------------------------------------
    @abc.abstractmethod
    def json_text(self, column: str, *path: str) -> str:
        """An expression: the JSON text in ``column`` at ``path``, as text (NULL when absent)."""

    @abc.abstractmethod
    def json_number(self, column: str, *path: str) -> str:
        """An expression: the JSON text in ``column`` at ``path``, as a number (NULL when absent)."""


class SqliteConnection(Connection):
    """A SQLite file (or ``":memory:"``): ``connection`` is the ``sqlite3`` one, used as it is."""

    dialect = "sqlite"
    errors = sqlite3.Error

    def __init__(self, connection: sqlite3.Connection, target: str = "?") -> None:
        self.connection = connection
        self.target = target
        # The driver's own method, bound once: this backend adds no cost per statement.
        self.execute = connection.execute

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Any:  # replaced per instance, above
        return self.connection.execute(sql, parameters)

    @classmethod
    def open(cls, path: str, *, timeout: float, named_rows: bool) -> SqliteConnection:
        if path != ":memory:" and not path.startswith("file:"):
            # Created 0600 before SQLite opens it (its -wal and -shm take the file's mode), and
            # narrowed to 0600 if an older opgraph left it readable by others: it holds every run.
            private_file(path, companions=SQLITE_COMPANIONS)
        connection = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
        # Pages freed by pruning (opgraph runs prune) go back to the file system, a step at a
        # time, by PRAGMA incremental_vacuum. SQLite takes this only on an empty file (before the
        # first table and the switch to WAL); an older file is converted only by a full VACUUM
        # (opgraph store vacuum). Asked only of an empty file: on one that has it already, the
        # pragma rewrites the header, and so waits for any other writer.
        if connection.execute("PRAGMA page_count").fetchone()[0] == 0:
            connection.execute("PRAGMA auto_vacuum = INCREMENTAL")
        if named_rows:
            connection.row_factory = sqlite3.Row
        connection.execute(f"PRAGMA busy_timeout = {int(timeout * 1000):d}")
        return cls(connection, path)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self.connection.executemany(sql, rows)

    def begin(self, *, write: bool = False) -> None:
        # IMMEDIATE takes the write lock up front, so a read-then-write cannot race another writer.
        self.connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")

    def commit(self) -> None:
        self.connection.execute("COMMIT")

    def rollback(self) -> None:
        if self.connection.in_transaction:
            self.connection.execute("ROLLBACK")

    def close(self) -> None:
        self.connection.close()

    @property
    def in_transaction(self) -> bool:
        return self.connection.in_transaction

    def user_version(self) -> int:
        return self.connection.execute("PRAGMA user_version").fetchone()[0]

    def set_user_version(self, version: int) -> None:
        self.connection.execute(f"PRAGMA user_version = {int(version):d}")

    def json_text(self, column: str, *path: str) -> str:
        return f"json_extract({column}, '$.{'.'.join(path)}')"

    def json_number(self, column: str, *path: str) -> str:
        return f"json_extract({column}, '$.{'.'.join(path)}')"


# -- PostgreSQL -------------------------------------------------------------------------
_TYPES = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION", "BLOB": "BYTEA"}
_TYPE_WORDS = re.compile(r"\b(INTEGER|REAL|BLOB)\b")
# All writers of one database queue on this advisory lock, as SQLite's writers queue on
# its file lock: a read-then-write (the next version number, the next signal seq) is
# then as safe as under ``BEGIN IMMEDIATE``. The number is "opgraph" in ASCII.
_WRITE_LOCK = 0x6F70677261706800


@functools.lru_cache(maxsize=1024)
def postgres_sql(sql: str) -> str:
    """``?`` placeholders become ``%s`` and a literal ``%`` becomes ``%%``; quoted text is kept."""
    out, quoted = [], False
    for char in sql:
        if char == "'":
            quoted = not quoted
            out.append(char)
        elif char == "%":
            out.append("%%")
        elif char == "?" and not quoted:
            out.append("%s")
        else:
            out.append(char)
    return "".join(out)


def postgres_ddl(sql: str) -> str:
    """SQLite's type names in a schema statement, as PostgreSQL's equivalents (64-bit, double, bytea)."""
    return _TYPE_WORDS.sub(lambda match: _TYPES[match.group(1)], sql)


class PostgresConnection(Connection):
    """A PostgreSQL database (psycopg 3), in autocommit mode with explicit transactions.

    The store's tables keep the same columns as in SQLite; where SQLite has an implicit
    ``rowid`` the store orders by, the PostgreSQL table has an identity column of that name.
    """

    dialect = "postgresql"

    def __init__(self, url: str, *, timeout: float, named_rows: bool, version_table: str) -> None:
        import psycopg  # local: only a PostgreSQL store needs the driver

        self._psycopg = psycopg
        self.errors = psycopg.Error
        self.target = url
        self._version_table = version_table
        self._idle = psycopg.pq.TransactionStatus.IDLE
        self._timeout = max(1, int(timeout))
        self._named_rows = named_rows
        self._transaction_open = False
        self.connection = self._connect()

    def _connect(self) -> Any:
        connection = self._psycopg.connect(self.target, autocommit=True, connect_timeout=self._timeout)
        if self._named_rows:
            connection.row_factory = _named_rows
        return connection

    def _reconnect_if_lost(self) -> None:
        # A server restart or a dropped link breaks the connection: the statement that met it
        # failed (its caller got a typed error); the next one, outside any transaction, starts
        # on a new connection, so a long-lived executor or store does not fail forever.
        if self.connection.broken:
            self.connection = self._connect()

    def execute(self, sql: str, parameters: Sequence[Any] = ()) -> Any:
        if not self._transaction_open:
            self._reconnect_if_lost()
        if not parameters:  # psycopg reads placeholders (and ``%%``) only when there are parameters
            return self.connection.execute(sql)
        return self.connection.execute(postgres_sql(sql), tuple(parameters))

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if rows:
            with self.connection.cursor() as cursor:
                cursor.executemany(postgres_sql(sql), rows)

    def ddl(self, statement: str) -> str:
        return postgres_ddl(statement)

    def run_transaction(self, statements: Sequence[tuple[str, Any]], *, write: bool = True) -> None:
        # One pipeline: BEGIN, the statements and COMMIT leave in one round trip, not one each
        # (a run-log flush is a small transaction, so round trips are most of its cost).
        self._reconnect_if_lost()
        connection = self.connection
        try:
            with connection.pipeline(), connection.cursor() as cursor:
                cursor.execute("BEGIN")
                if write:
                    cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))
                for sql, parameters in statements:
                    if parameters and isinstance(parameters, list):
                        cursor.executemany(postgres_sql(sql), parameters)
                    elif parameters:
                        cursor.execute(postgres_sql(sql), tuple(parameters))
                    else:
                        cursor.execute(sql)
                cursor.execute("COMMIT")
        except BaseException:
            self.rollback()
            raise

    def begin(self, *, write: bool = False) -> None:
        self._reconnect_if_lost()
        self.connection.execute("BEGIN")
        self._transaction_open = True
        if write:
            self.connection.execute("SELECT pg_advisory_xact_lock(%s)", (_WRITE_LOCK,))

    def commit(self) -> None:
        self._transaction_open = False
        self.connection.execute("COMMIT")

    def rollback(self) -> None:
        self._transaction_open = False
        if not self.connection.broken and self.in_transaction:
            self.connection.execute("ROLLBACK")

    def close(self) -> None:
        self.connection.close()

    def __del__(self) -> None:
        # Readers (a CLI's run-log lookup) drop their connection without closing it, as they
        # may a sqlite3 one; closed here, psycopg has nothing to warn about.
        connection = self.__dict__.get("connection")
        if connection is not None and not connection.closed:
            connection.close()

    @property
    def in_transaction(self) -> bool:
        return self.connection.info.transaction_status != self._idle

    def user_version(self) -> int:
        if self.connection.execute("SELECT to_regclass(%s)", (self._version_table,)).fetchone()[0] is None:
            return 0
        row = self.connection.execute(f"SELECT version FROM {self._version_table}").fetchone()
        return 0 if row is None else row[0]

    def set_user_version(self, version: int) -> None:
        # Created by the first step, inside its transaction (under the write lock).
        self.connection.execute(f"CREATE TABLE IF NOT EXISTS {self._version_table} (version BIGINT NOT NULL)")
        self.connection.execute(f"DELETE FROM {self._version_table}")
        self.connection.execute(f"INSERT INTO {self._version_table} (version) VALUES (%s)", (int(version),))

    def json_text(self, column: str, *path: str) -> str:
        return f"(({column})::jsonb #>> '{{{','.join(path)}}}')"

    def json_number(self, column: str, *path: str) -> str:
        return f"(({column})::jsonb #>> '{{{','.join(path)}}}')::numeric"


def _named_rows(cursor: Any) -> Any:
    description = cursor.description
    if description is None:
        return tuple
    index = {column.name: position for position, column in enumerate(description)}
    return lambda values: Row(values, index)


def open_connection(target: str | os.PathLike[str], *, timeout: float = 30.0, named_rows: bool = False,
                    version_table: str = "opgraph_store_schema") -> Connection:
    """A connection to ``target``: a ``postgresql://`` URL, or a SQLite path (``":memory:"`` too).

    ``named_rows`` makes rows readable by column name. ``version_table`` is where a
    PostgreSQL database keeps ``user_version`` (SQLite keeps it in the file's header).
    Errors are the driver's (``connection.errors``), for the caller to translate.
    """
    text = os.fspath(target)
    if is_postgres(text):
        return PostgresConnection(text, timeout=timeout, named_rows=named_rows, version_table=version_table)
    return SqliteConnection.open(text, timeout=timeout, named_rows=named_rows)


def driver_errors() -> tuple[type[BaseException], ...]:
    """Every driver error a connection may raise, for code that opens one (the driver may be absent)."""
    try:
        import psycopg
    except ImportError:
        return (sqlite3.Error,)
    return (sqlite3.Error, psycopg.Error)


class SharedConnection:
    """Base of a store whose one connection (``_db``) threads share under ``_lock``: one locked
    transaction at a time, or the bare connection, with the driver's errors translated once.

    A subclass names its error type and the two messages, formatted with ``_where()`` (and the
    driver's error).
    """

    _lock: Any
    _db: Connection | None
    _error_type: type[Exception]
    _closed_text: str  # "{where} ... closed"
    _failed_text: str  # "{where} ... failed: {error}"
    _open_text: str  # "cannot open {where}: {error}"

    def _where(self) -> str:
        raise NotImplementedError

    def _connect(self, target: str, *, timeout: float, sqlite_pragmas: Sequence[str],
                 migrate: Callable[[Connection], None]) -> None:
        """Open ``target`` as ``_db`` (rows readable by name), run ``sqlite_pragmas`` on SQLite, then
        ``migrate`` it; on any error close it again, a driver's raised as the subclass's error."""
        try:
            self._db = open_connection(target, timeout=timeout, named_rows=True)
            if self._db.dialect == "sqlite":
                for pragma in sqlite_pragmas:
                    self._db.execute(pragma)
            migrate(self._db)
        except BaseException as exc:
            if self._db is not None:
                self._db.close()
                self._db = None
            if isinstance(exc, driver_errors()):
                raise self._error_type(self._open_text.format(where=self._where(), error=exc)) from exc
            raise

    def close(self) -> None:
        """Close the connection; later calls raise the subclass's error. Idempotent."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @contextmanager
    def _locked(self, *, transaction: bool, write: bool = False) -> Iterator[Connection]:
        """Under the lock: the connection in one transaction (rolled back on any error), or with
        none open (``transaction=False``: each statement commits on its own)."""
        with self._lock:
            if self._db is None:
                raise self._error_type(self._closed_text.format(where=self._where()))
            db = self._db
            try:
                if not transaction:
                    yield db
                    return
                db.begin(write=write)
                try:
                    yield db
                except BaseException:
                    db.rollback()
                    raise
                db.commit()
            except db.errors as exc:
                if transaction:
                    db.rollback()
                raise self._error_type(self._failed_text.format(where=self._where(), error=exc)) from exc
