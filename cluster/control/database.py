"""One connection to the control plane's tables (SQLite or PostgreSQL), with its clock and transition hooks.

Owns opening the database (the run store's: ``OPGRAPH_DB``, a path or a ``postgresql://``
URL), migrating the control tables, one locked transaction at a time with the driver's
errors translated once, and the hooks that see every task transition inside the transaction
that commits it (the dispatch outbox writes its row there). It must not know a table's rows:
the queue and the schedules do.

A write transaction on SQLite is ``BEGIN IMMEDIATE`` (the file's one writer); on PostgreSQL it is a
plain transaction, never the run store's global advisory lock: a claim locks only the rows it
takes (``FOR UPDATE SKIP LOCKED``), and the code that needs more takes a lock of its own.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from opgraph.actors.persistence.backends import Connection, SharedConnection, describe, is_postgres

from ..store.schema import default_store_path
from .errors import ControlError
from .schema import migrate_control

__all__ = ["ControlDatabase", "TransitionHook"]

# hook(connection, transition): called inside the transaction of every task transition, with a dict
# {task_id, queue, action_kind, from_state, to_state, kind, worker, attempt, at, detail, run_id, schedule_id}.
TransitionHook = Callable[[Connection, dict[str, Any]], None]


class ControlDatabase(SharedConnection):
    """The control tables on one connection, shared by threads under a lock.

    ``target`` is a SQLite path, ``":memory:"`` or a ``postgresql://`` URL (None: ``OPGRAPH_DB``).
    ``clock`` (seconds since the epoch) stamps every row and decides every due time: tests pass
    a fake one. ``transition_hooks`` see each task transition inside its transaction.
    """

    _error_type = ControlError
    _closed_text = "the control tables in {where} are closed"
    _failed_text = "the control tables in {where} failed: {error}"
    _open_text = "cannot open the control tables in {where}: {error}"

    def __init__(self, target: str | Path | None = None, *, clock: Callable[[], float] = time.time,
                 timeout: float = 30.0) -> None:
        target = default_store_path() if target is None else target
        self.target = str(target) if is_postgres(str(target)) else str(Path(str(target)).expanduser())
        self.clock = clock
        self.transition_hooks: list[TransitionHook] = []
        self._lock = threading.RLock()
        self._db: Connection | None = None
        if not is_postgres(self.target) and self.target != ":memory:":
            Path(self.target).parent.mkdir(parents=True, exist_ok=True)
        file = self.dialect == "sqlite" and self.target != ":memory:"
        self._connect(self.target, timeout=timeout,
                      sqlite_pragmas=("PRAGMA journal_mode = WAL", "PRAGMA synchronous = NORMAL") if file else (),
                      migrate=self._migrate)

    def _migrate(self, db: Connection) -> None:
        migrate_control(db, location=describe(self.target))
        if _has_table(db, "outbox"):
            # The run store's dispatch outbox is here: a task's end is a fact to deliver, written
            # in the transaction that commits it (ADR-0068 D5).
            self.transition_hooks.append(task_outbox_hook)

    @property
    def dialect(self) -> str:
        return "postgresql" if is_postgres(self.target) else "sqlite"

    def describe(self) -> str:
        return describe(self.target)

    def _where(self) -> str:
        return describe(self.target)

    def transaction(self, *, write: bool = False) -> AbstractContextManager[Connection]:
        """One locked transaction; ``write`` on SQLite takes the file's write lock from its start."""
        return self._locked(transaction=True, write=write and self.dialect == "sqlite")

    def autocommit(self) -> AbstractContextManager[Connection]:
        """The connection with no transaction open: a single statement commits on its own (PostgreSQL's
        one-statement claim)."""
        return self._locked(transaction=False)

    def hooked(self, to_state: str) -> bool:
        """Whether a transition to ``to_state`` has a hook to call (else it may take a one-statement path)."""
        return any(to_state in getattr(hook, "states", (to_state,)) for hook in self.transition_hooks)

    def lock_key(self, connection: Connection, name: str) -> None:
        """Inside a PostgreSQL transaction: wait for the advisory lock named ``name`` (released at commit).
        SQLite's write transaction holds the file's lock already."""
        if connection.dialect == "postgresql":
            connection.execute("SELECT pg_advisory_xact_lock(?)", (_lock_number(name),))


def _lock_number(name: str) -> int:
    # 0x6F63 ("oc", opgraph control) in the high bits keeps these apart from the run store's write lock.
    return (0x6F63 << 40) | zlib.crc32(name.encode())


TASK_EVENT_STATES = frozenset({"succeeded", "failed", "cancelled", "dead"})


def task_outbox_hook(connection: Connection, transition: dict[str, Any]) -> None:
    """``task.<state>`` in the outbox for a task that ended, in the transition's transaction."""
    from .outbox import record

    record(connection, f"task.{transition['to_state']}", transition["task_id"], {
        key: transition[key] for key in ("task_id", "queue", "action_kind", "from_state", "to_state", "attempt",
                                         "run_id", "schedule_id", "worker", "detail")}, at=transition["at"])


task_outbox_hook.states = TASK_EVENT_STATES  # type: ignore[attr-defined]


def _has_table(connection: Connection, name: str) -> bool:
    if connection.dialect == "sqlite":
        return connection.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                                  (name,)).fetchone() is not None
    return connection.execute("SELECT to_regclass(?)", (name,)).fetchone()[0] is not None
