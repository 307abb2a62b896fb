"""The control plane's tables and their numbered migration steps, on SQLite and PostgreSQL.

Owns the ordered steps that create the queues, tasks, task events, schedules and fires
tables, and the version they reach (kept in ``opgraph_control_schema``, apart from the run
store's and the runtime's versions, so the three evolve on their own). Each step runs once,
in one write transaction with its version. It reads and writes no row of its tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from opgraph.actors.persistence.backends import Connection

__all__ = ["CONTROL_MIGRATIONS", "CONTROL_SCHEMA_VERSION", "FIRE_STATUSES", "OVERLAP_POLICIES", "TASK_STATES",
           "TERMINAL_TASK_STATES", "migrate_control"]

TASK_STATES = ("queued", "leased", "running", "succeeded", "failed", "cancelled", "dead")
TERMINAL_TASK_STATES = frozenset({"succeeded", "failed", "cancelled", "dead"})
OVERLAP_POLICIES = ("skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all")
FIRE_STATUSES = ("fired", "buffered", "skipped")
VERSION_TABLE = "opgraph_control_schema"


@dataclass(frozen=True, slots=True)
class ControlMigration:
    """One step: ``sqlite`` statements, and ``postgres`` where the SQL differs (None: the same)."""

    version: int
    description: str
    sqlite: tuple[str, ...]
    postgres: tuple[str, ...] | None = None


def _states(column: str, states: tuple[str, ...]) -> str:
    return f"CHECK ({column} IN ({', '.join(repr(state) for state in states)}))"


_TASKS = f"""CREATE TABLE control_tasks (
    task_id TEXT PRIMARY KEY, queue TEXT NOT NULL CHECK (length(queue) BETWEEN 1 AND 120),
    action_kind TEXT NOT NULL, target TEXT NOT NULL, payload TEXT NOT NULL DEFAULT '{{}}',
    priority INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL {_states('state', TASK_STATES)},
    idempotency_key TEXT UNIQUE, concurrency_key TEXT, concurrency_limit INTEGER CHECK (concurrency_limit >= 1),
    attempts INTEGER NOT NULL DEFAULT 0, max_attempts INTEGER NOT NULL DEFAULT 3 CHECK (max_attempts >= 1),
    backoff_base REAL NOT NULL DEFAULT 1.0, backoff_max REAL NOT NULL DEFAULT 300.0,
    available_at REAL NOT NULL, held INTEGER NOT NULL DEFAULT 0, reason TEXT,
    lease_owner TEXT, lease_token INTEGER NOT NULL DEFAULT 0, lease_expires_at REAL, heartbeat_at REAL,
    claimed_at REAL, run_id TEXT, cancel_requested INTEGER NOT NULL DEFAULT 0,
    schedule_id TEXT, nominal_at REAL, result TEXT, error TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, finished_at REAL)"""

_SCHEDULES = f"""CREATE TABLE control_schedules (
    schedule_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 120),
    cron TEXT, interval_seconds REAL CHECK (interval_seconds > 0), timezone TEXT NOT NULL DEFAULT 'UTC',
    action_kind TEXT NOT NULL, target TEXT NOT NULL, payload TEXT NOT NULL DEFAULT '{{}}',
    queue TEXT NOT NULL, priority INTEGER NOT NULL DEFAULT 0, max_attempts INTEGER NOT NULL DEFAULT 3,
    overlap TEXT NOT NULL {_states('overlap', OVERLAP_POLICIES)},
    catchup_window REAL NOT NULL DEFAULT 60 CHECK (catchup_window >= 0), jitter REAL NOT NULL DEFAULT 0,
    start_at REAL, end_at REAL, remaining_actions INTEGER, paused INTEGER NOT NULL DEFAULT 0, note TEXT,
    cursor_at REAL NOT NULL, fires INTEGER NOT NULL DEFAULT 0, skipped INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL, updated_at REAL NOT NULL,
    CHECK ((cron IS NULL) <> (interval_seconds IS NULL)))"""

_FIRES = f"""CREATE TABLE control_fires (
    schedule_id TEXT NOT NULL, nominal_at REAL NOT NULL, kind TEXT NOT NULL
        CHECK (kind IN ('scheduled', 'manual', 'backfill')),
    status TEXT NOT NULL {_states('status', FIRE_STATUSES)}, reason TEXT, task_id TEXT,
    fired_at REAL NOT NULL, lateness REAL NOT NULL DEFAULT 0, scheduler TEXT,
    PRIMARY KEY (schedule_id, nominal_at))"""

_WORKERS = """CREATE TABLE control_workers (
            worker_id TEXT PRIMARY KEY, queue TEXT NOT NULL, action_kinds TEXT NOT NULL, concurrency INTEGER NOT NULL,
            host TEXT, pid INTEGER, started_at REAL NOT NULL, seen_at REAL NOT NULL, state TEXT NOT NULL)"""


def _first_tables(queues: str, task_events: str) -> tuple[str, ...]:
    """Migration 1's statements, in order: only the queue and task-event tables differ by dialect."""
    return (
        queues,
        _TASKS,
        # The claim's index: the best task of a queue first (its priority, then when it became due).
        "CREATE INDEX control_tasks_claim ON control_tasks(queue, state, priority DESC, available_at, task_id)",
        "CREATE INDEX control_tasks_key ON control_tasks(concurrency_key, state) WHERE concurrency_key IS NOT NULL",
        "CREATE INDEX control_tasks_lease ON control_tasks(state, lease_expires_at)",
        "CREATE INDEX control_tasks_schedule ON control_tasks(schedule_id, state)",
        task_events,
        "CREATE INDEX control_task_events_task ON control_task_events(task_id, event_id)",
        "CREATE INDEX control_task_events_kind ON control_task_events(kind, at)",
        _SCHEDULES,
        _FIRES,
        "CREATE INDEX control_fires_status ON control_fires(status, fired_at)",
        _WORKERS,
        "CREATE INDEX control_workers_queue ON control_workers(queue, seen_at)",
    )


CONTROL_MIGRATIONS: tuple[ControlMigration, ...] = (
    ControlMigration(1, "queues, leased tasks and their events, schedules and their fires", _first_tables(
        """CREATE TABLE control_queues (queue TEXT PRIMARY KEY, concurrency_limit INTEGER
            CHECK (concurrency_limit >= 1), updated_at REAL NOT NULL)""",
        """CREATE TABLE control_task_events (
            event_id INTEGER PRIMARY KEY, task_id TEXT NOT NULL, at REAL NOT NULL, from_state TEXT,
            to_state TEXT NOT NULL, kind TEXT NOT NULL, worker TEXT, attempt INTEGER NOT NULL, detail TEXT)""",
    ), postgres=_first_tables(
        """CREATE TABLE control_queues (queue TEXT PRIMARY KEY, concurrency_limit BIGINT
            CHECK (concurrency_limit >= 1), updated_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE control_task_events (
            event_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, task_id TEXT NOT NULL,
            at DOUBLE PRECISION NOT NULL, from_state TEXT, to_state TEXT NOT NULL, kind TEXT NOT NULL,
            worker TEXT, attempt BIGINT NOT NULL, detail TEXT)""",
    )),
)
CONTROL_SCHEMA_VERSION = CONTROL_MIGRATIONS[-1].version


def _version(connection: Connection) -> int:
    if connection.dialect == "sqlite":
        found = connection.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?",
                                   (VERSION_TABLE,)).fetchone()
    else:
        found = connection.execute("SELECT to_regclass(?)", (VERSION_TABLE,)).fetchone()
        found = None if found is None or found[0] is None else found
    if found is None:
        return 0
    row = connection.execute(f"SELECT version FROM {VERSION_TABLE}").fetchone()
    return 0 if row is None else int(row[0])


def migrate_control(connection: Connection, *, location: str = "?") -> int:
    """Apply the missing steps; each in its own write transaction (SQLite's ``BEGIN IMMEDIATE``,
    PostgreSQL's advisory write lock), the version read again under it, so two processes opening
    a new database at once apply each step once. A newer database raises ``ControlError``."""
    from .errors import ControlError

    current = _version(connection)
    if current > CONTROL_SCHEMA_VERSION:
        raise ControlError(f"the control-plane tables of {location} are at version {current}; this opgraph "
                           f"knows up to {CONTROL_SCHEMA_VERSION}: upgrade opgraph")
    for step in CONTROL_MIGRATIONS:
        if current >= step.version:
            continue
        connection.begin(write=True)
        try:
            current = _version(connection)
            if current < step.version:
                sqlite = connection.dialect == "sqlite"
                statements = step.sqlite if sqlite or step.postgres is None else step.postgres
                for statement in statements:
                    connection.execute(statement if sqlite else connection.ddl(statement))
                connection.execute(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version INTEGER NOT NULL)")
                connection.execute(f"DELETE FROM {VERSION_TABLE}")
                connection.execute(f"INSERT INTO {VERSION_TABLE} (version) VALUES (?)", (step.version,))
                current = step.version
            connection.commit()
        except BaseException:
            connection.rollback()
            raise
    return current
