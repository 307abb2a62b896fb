"""The store's size on disk, and giving the space of deleted rows back: incremental vacuum, VACUUM.

Owns measuring a store (a SQLite file and its write-ahead log, or the PostgreSQL tables of
its schema) and returning free space: SQLite's ``PRAGMA incremental_vacuum`` a step at a
time (a file created with ``auto_vacuum = INCREMENTAL``, as opgraph creates them), a WAL
checkpoint, and the full ``VACUUM`` an older file needs once to be converted (it needs the
database to itself). PostgreSQL's autovacuum reclaims on its own; a plain ``VACUUM`` may be
asked for, never ``VACUUM FULL`` (it locks every table for its whole run).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass

from opgraph.actors.persistence.backends import Connection

from .database import StoreDatabase

__all__ = ["StoreSize", "checkpoint", "give_back_free_pages", "incremental_vacuum_on", "store_size", "vacuum_store"]

# Pages one incremental-vacuum step returns (4 MiB of 4 KiB pages): each step is a short
# write transaction of its own, so a server's writers wait at most for one.
PAGES_PER_STEP = 1024
# The tables whose space a PostgreSQL VACUUM is asked to reclaim: what retention deletes from.
PRUNED_TABLES = ("run_signals", "run_nodes", "run_branches", "run_outlines", "runs", "engine_events", "engine_runs",
                 "runtime_run_records", "runtime_run_headers", "runtime_runs", "runtime_branch_heads",
                 "runtime_branch_records", "runtime_branch_messages")


@dataclass(frozen=True)
class StoreSize:
    """How big a store is. SQLite: ``bytes`` is the database file, ``wal_bytes`` its write-ahead
    log, ``free_bytes`` the free pages inside the file (reused by new rows; returned to the file
    system by incremental vacuum when ``incremental`` is on). PostgreSQL: ``bytes`` is the tables
    of the store's schema with their indexes and TOAST; the rest is None."""

    bytes: int
    wal_bytes: int | None = None
    free_bytes: int | None = None
    incremental: bool | None = None

    def to_dict(self) -> dict[str, int | bool | None]:
        return asdict(self)


def _pragma(db: Connection, name: str) -> int:
    return int(db.execute(f"PRAGMA {name}").fetchone()[0])


def store_size(store: StoreDatabase) -> StoreSize:
    with store.outside_transaction() as db:
        if db.dialect != "sqlite":
            total = db.execute(
                "SELECT COALESCE(SUM(pg_total_relation_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n "
                "ON n.oid = c.relnamespace WHERE n.nspname = current_schema() AND c.relkind = 'r'").fetchone()[0]
            return StoreSize(int(total))
        page = _pragma(db, "page_size")
        free = _pragma(db, "freelist_count") * page
        incremental = _pragma(db, "auto_vacuum") == 2
        if store.path == ":memory:":
            return StoreSize(_pragma(db, "page_count") * page, None, free, incremental)
    wal = f"{store.path}-wal"
    return StoreSize(os.path.getsize(store.path), os.path.getsize(wal) if os.path.exists(wal) else 0, free,
                     incremental)


def incremental_vacuum_on(store: StoreDatabase) -> bool:
    """Whether the store is a SQLite file whose free pages incremental vacuum can return."""
    with store.outside_transaction() as db:
        return db.dialect == "sqlite" and _pragma(db, "auto_vacuum") == 2


def give_back_free_pages(store: StoreDatabase, *, pages_per_step: int = PAGES_PER_STEP, pause: float = 0.0,
                         stop: threading.Event | None = None) -> int:
    """Return a SQLite file's free pages to the file system, ``pages_per_step`` a transaction; how many.

    Nothing on PostgreSQL, or on a file made before opgraph turned on incremental vacuum (its
    free pages are reused by new rows; ``vacuum_store`` converts it)."""
    returned = 0
    while stop is None or not stop.is_set():
        with store.outside_transaction() as db:
            if db.dialect != "sqlite" or _pragma(db, "auto_vacuum") != 2:
                return returned
            free = _pragma(db, "freelist_count")
            if not free:
                return returned
            step = min(free, pages_per_step)
            # Through executescript: the pragma frees one page per step of its statement, and
            # execute() steps a statement that returns no rows only once.
            db.connection.executescript(f"PRAGMA incremental_vacuum({step:d})")
            returned += step
        if pause:
            time.sleep(pause)  # another writer's turn between two steps
    return returned


def checkpoint(store: StoreDatabase) -> None:
    """Copy a SQLite WAL into the file, as far as readers allow (PASSIVE): the file's size is then
    what its pages are, truncated where incremental vacuum freed its end."""
    with store.outside_transaction() as db:
        if db.dialect == "sqlite" and store.path != ":memory:":
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def vacuum_store(store: StoreDatabase, *, wait: float = 5.0) -> dict[str, object]:
    """Rebuild a SQLite file with ``VACUUM`` (turning incremental vacuum on for a file made without
    it), or ``VACUUM`` PostgreSQL's store tables (plain, never FULL). The sizes before and after.

    SQLite's VACUUM holds the write lock while it rewrites the whole file, so every other
    writer (a server, a run) waits for it: it needs the database to itself. Should another
    writer hold the lock for ``wait`` seconds, it gives up (``WorkflowStoreError``)."""
    before = store_size(store)
    with store.outside_transaction() as db:
        if db.dialect == "sqlite":
            converted = _pragma(db, "auto_vacuum") != 2
            patience = _pragma(db, "busy_timeout")
            db.execute(f"PRAGMA busy_timeout = {int(wait * 1000):d}")
            try:
                db.execute("PRAGMA auto_vacuum = INCREMENTAL")
                db.execute("VACUUM")
            finally:
                db.execute(f"PRAGMA busy_timeout = {patience:d}")
            if store.path != ":memory:":
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        else:
            converted = False
            present = [table for table in PRUNED_TABLES
                       if db.execute("SELECT to_regclass(?)", (table,)).fetchone()[0] is not None]
            for table in present:
                db.execute(f"VACUUM (ANALYZE) {table}")
    after = store_size(store)
    return {"dialect": store.dialect, "converted_to_incremental": converted, "before": before.to_dict(),
            "after": after.to_dict(), "reclaimed_bytes": before.bytes - after.bytes}
