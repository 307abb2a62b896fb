"""The run store's schema: its migrations, run statuses and where the store file lives.

Owns the ordered migration steps (applied by ``PRAGMA user_version`` in SQLite, the
``opgraph_store_schema`` table in PostgreSQL; one transaction each), the run status
vocabulary and its legal transitions, and the default location. It must not read or
write definitions or runs: definitions.py and runs.py do.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opgraph.actors.persistence.backends import Connection, SqliteConnection, is_postgres, location
from opgraph.actors.persistence.database import database_path

from .errors import StoreSchemaError, WorkflowStoreError

__all__ = [
    "MAX_VERSION",
    "MIGRATIONS",
    "RUN_STATUSES",
    "RUN_TRANSITIONS",
    "SCHEMA_VERSION",
    "TERMINAL_RUN_STATUSES",
    "Migration",
    "default_store_path",
    "migrate",
    "store_exists",
    "store_location",
    "sources_of",
]


# -- schema ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Migration:
    """One schema step; applied once, in its own transaction, then ``user_version = version``.

    ``rebuilds`` names the tables of a step that rebuilds a table others refer to (SQLite
    cannot drop a column constraint in place): foreign keys are switched off around it, as
    SQLite's own procedure for such changes says, and those tables' references are
    checked before it commits (only theirs: the file holds other components' tables).

    ``postgres`` is the same step for a PostgreSQL store where its SQL differs (checks
    without GLOB, a trigger function, the ``rowid`` SQLite has implicitly, a constraint
    altered in place instead of a rebuild); None runs ``statements`` with PostgreSQL's
    type names. Either way the step leaves the same tables, columns and rules.
    """

    version: int
    description: str
    statements: tuple[str, ...]
    rebuilds: tuple[str, ...] = ()
    postgres: tuple[str, ...] | None = None


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "workflow definitions with immutable, content-hashed versions", (
        """CREATE TABLE workflows (
            id TEXT PRIMARY KEY CHECK (length(id) = 12 AND id NOT GLOB '*[^0-9a-f]*'),
            name TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 120),
            description TEXT, created_at REAL NOT NULL, deleted_at REAL)""",
        # Names are unique among live workflows only, so a deleted name can be reused.
        "CREATE UNIQUE INDEX workflows_live_name ON workflows(name) WHERE deleted_at IS NULL",
        # spec_json holds exactly the canonical bytes that content_hash hashes.
        """CREATE TABLE workflow_versions (
            workflow_id TEXT NOT NULL REFERENCES workflows(id),
            version INTEGER NOT NULL CHECK (version >= 1),
            content_hash TEXT NOT NULL CHECK (content_hash GLOB 'sha256:*' AND length(content_hash) = 71),
            spec_json TEXT NOT NULL, description TEXT, created_at REAL NOT NULL,
            PRIMARY KEY (workflow_id, version))""",
        "CREATE INDEX workflow_versions_hash ON workflow_versions(content_hash)",
        # Immutability lives in the database, so no code path (nor a sqlite3 shell) can
        # rewrite the definition an old run pinned.
        """CREATE TRIGGER workflow_versions_no_update BEFORE UPDATE ON workflow_versions
           BEGIN SELECT RAISE(ABORT, 'workflow versions are immutable; add a new version'); END""",
        """CREATE TRIGGER workflow_versions_no_delete BEFORE DELETE ON workflow_versions
           BEGIN SELECT RAISE(ABORT, 'workflow versions are immutable; they are never deleted'); END""",
    ), postgres=(
        """CREATE TABLE workflows (
            id TEXT PRIMARY KEY CHECK (id ~ '^[0-9a-f]{12}$'),
            name TEXT NOT NULL CHECK (length(name) BETWEEN 1 AND 120),
            description TEXT, created_at DOUBLE PRECISION NOT NULL, deleted_at DOUBLE PRECISION)""",
        "CREATE UNIQUE INDEX workflows_live_name ON workflows(name) WHERE deleted_at IS NULL",
        """CREATE TABLE workflow_versions (
            workflow_id TEXT NOT NULL REFERENCES workflows(id),
            version BIGINT NOT NULL CHECK (version >= 1),
            content_hash TEXT NOT NULL CHECK (content_hash ~ '^sha256:' AND length(content_hash) = 71),
            spec_json TEXT NOT NULL, description TEXT, created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (workflow_id, version))""",
        "CREATE INDEX workflow_versions_hash ON workflow_versions(content_hash)",
        # The same rule as SQLite's triggers, with the same words; TRUNCATE is refused too.
        """CREATE FUNCTION opgraph_workflow_versions_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
           BEGIN
             IF TG_OP = 'UPDATE' THEN
               RAISE EXCEPTION 'workflow versions are immutable; add a new version'
                 USING ERRCODE = 'integrity_constraint_violation';
             END IF;
             RAISE EXCEPTION 'workflow versions are immutable; they are never deleted'
               USING ERRCODE = 'integrity_constraint_violation';
           END $$""",
        """CREATE TRIGGER workflow_versions_no_update BEFORE UPDATE ON workflow_versions
           FOR EACH ROW EXECUTE FUNCTION opgraph_workflow_versions_immutable()""",
        """CREATE TRIGGER workflow_versions_no_delete BEFORE DELETE ON workflow_versions
           FOR EACH ROW EXECUTE FUNCTION opgraph_workflow_versions_immutable()""",
        """CREATE TRIGGER workflow_versions_no_truncate BEFORE TRUNCATE ON workflow_versions
           FOR EACH STATEMENT EXECUTE FUNCTION opgraph_workflow_versions_immutable()""",
    )),
    Migration(2, "fixed-lane runs with provenance, lifecycle signals and branch messages", (
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, lane TEXT NOT NULL,
            workflow_id TEXT, workflow_name TEXT, version INTEGER, content_hash TEXT NOT NULL,
            source_kind TEXT NOT NULL CHECK (source_kind IN ('workflow_def', 'workflow_file')),
            source_ref TEXT NOT NULL, provenance TEXT NOT NULL, inputs TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('admitted', 'running', 'completed', 'failed', 'cancelled')),
            outputs TEXT, error TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
            FOREIGN KEY (workflow_id, version) REFERENCES workflow_versions(workflow_id, version))""",
        "CREATE INDEX runs_created ON runs(created_at)",
        "CREATE INDEX runs_workflow ON runs(workflow_id)",
        """CREATE TABLE run_signals (
            run_id TEXT NOT NULL REFERENCES runs(run_id), seq INTEGER NOT NULL,
            node_id TEXT NOT NULL, spec_node_id TEXT, kind TEXT NOT NULL, elapsed REAL, at REAL NOT NULL,
            PRIMARY KEY (run_id, seq))""",
        """CREATE TABLE run_branches (
            run_id TEXT NOT NULL REFERENCES runs(run_id), branch_id TEXT NOT NULL,
            node_id TEXT, messages TEXT NOT NULL, PRIMARY KEY (run_id, branch_id))""",
    ), postgres=(
        # rowid: the insertion order SQLite keeps implicitly, which listings order by.
        """CREATE TABLE runs (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, lane TEXT NOT NULL,
            workflow_id TEXT, workflow_name TEXT, version BIGINT, content_hash TEXT NOT NULL,
            source_kind TEXT NOT NULL CONSTRAINT runs_source_kind_check
                CHECK (source_kind IN ('workflow_def', 'workflow_file')),
            source_ref TEXT NOT NULL, provenance TEXT NOT NULL, inputs TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('admitted', 'running', 'completed', 'failed', 'cancelled')),
            outputs TEXT, error TEXT, created_at DOUBLE PRECISION NOT NULL, started_at DOUBLE PRECISION,
            finished_at DOUBLE PRECISION, rowid BIGINT GENERATED ALWAYS AS IDENTITY,
            FOREIGN KEY (workflow_id, version) REFERENCES workflow_versions(workflow_id, version))""",
        "CREATE INDEX runs_created ON runs(created_at)",
        "CREATE INDEX runs_workflow ON runs(workflow_id)",
        """CREATE TABLE run_signals (
            run_id TEXT NOT NULL REFERENCES runs(run_id), seq BIGINT NOT NULL,
            node_id TEXT NOT NULL, spec_node_id TEXT, kind TEXT NOT NULL, elapsed DOUBLE PRECISION,
            at DOUBLE PRECISION NOT NULL, PRIMARY KEY (run_id, seq))""",
        """CREATE TABLE run_branches (
            run_id TEXT NOT NULL REFERENCES runs(run_id), branch_id TEXT NOT NULL,
            node_id TEXT, messages TEXT NOT NULL, rowid BIGINT GENERATED ALWAYS AS IDENTITY,
            PRIMARY KEY (run_id, branch_id))""",
    )),
    Migration(3, "run owners, so a run whose process died can be settled as failed", (
        "ALTER TABLE runs ADD COLUMN owner_host TEXT",
        "ALTER TABLE runs ADD COLUMN owner_pid INTEGER",
        "ALTER TABLE runs ADD COLUMN owner_start TEXT",
    )),
    Migration(4, "each node's status and result, recorded as the node settles", (
        """CREATE TABLE run_nodes (
            run_id TEXT NOT NULL REFERENCES runs(run_id), node_id TEXT NOT NULL, spec_node_id TEXT,
            status TEXT NOT NULL, result TEXT, settled_at REAL NOT NULL,
            PRIMARY KEY (run_id, node_id))""",
    ), postgres=(
        """CREATE TABLE run_nodes (
            run_id TEXT NOT NULL REFERENCES runs(run_id), node_id TEXT NOT NULL, spec_node_id TEXT,
            status TEXT NOT NULL, result TEXT, settled_at DOUBLE PRECISION NOT NULL,
            rowid BIGINT GENERATED ALWAYS AS IDENTITY, PRIMARY KEY (run_id, node_id))""",
    )),
    # Engine runs (ADR-0034): every typed event and notification under the engine run's id.
    Migration(5, "engine runs and their events", (
        """CREATE TABLE engine_runs (
            run_id TEXT PRIMARY KEY, engine TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'degraded', 'failed', 'cancelled')),
            inputs TEXT NOT NULL, config TEXT NOT NULL, result TEXT, degrade_reason TEXT NOT NULL DEFAULT '',
            error TEXT, statistics TEXT, created_at REAL NOT NULL, finished_at REAL,
            owner_host TEXT, owner_pid INTEGER, owner_start TEXT)""",
        "CREATE INDEX engine_runs_created ON engine_runs(created_at)",
        """CREATE TABLE engine_events (
            run_id TEXT NOT NULL REFERENCES engine_runs(run_id), seq INTEGER NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('event', 'notification')), type TEXT NOT NULL,
            agent TEXT, data TEXT NOT NULL, at REAL NOT NULL, PRIMARY KEY (run_id, seq))""",
    ), postgres=(
        """CREATE TABLE engine_runs (
            run_id TEXT PRIMARY KEY, engine TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'degraded', 'failed', 'cancelled')),
            inputs TEXT NOT NULL, config TEXT NOT NULL, result TEXT, degrade_reason TEXT NOT NULL DEFAULT '',
            error TEXT, statistics TEXT, created_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION,
            owner_host TEXT, owner_pid BIGINT, owner_start TEXT, rowid BIGINT GENERATED ALWAYS AS IDENTITY)""",
        "CREATE INDEX engine_runs_created ON engine_runs(created_at)",
        """CREATE TABLE engine_events (
            run_id TEXT NOT NULL REFERENCES engine_runs(run_id), seq BIGINT NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('event', 'notification')), type TEXT NOT NULL,
            agent TEXT, data TEXT NOT NULL, at DOUBLE PRECISION NOT NULL, PRIMARY KEY (run_id, seq))""",
    )),
    # Runs of every lane (ADR-0068): any source kind, a hash only where the lane pinned one
    # (a prompt has none; new rows' hashes are checked in code, old rows are kept as they
    # are), the invocation's capability matrix (D3) and recovery data (what its lane needs
    # to present or resume it elsewhere). Every run before this step was a fixed-workflow
    # run, whose matrix then was the one written below.
    Migration(6, "runs of any lane, with their capability matrix and recovery data", (
        """CREATE TABLE runs_v6 (
            run_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, lane TEXT NOT NULL CHECK (length(lane) > 0),
            workflow_id TEXT, workflow_name TEXT, version INTEGER, content_hash TEXT,
            source_kind TEXT NOT NULL CHECK (length(source_kind) > 0),
            source_ref TEXT NOT NULL, provenance TEXT NOT NULL, inputs TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('admitted', 'running', 'completed', 'failed', 'cancelled')),
            outputs TEXT, error TEXT, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
            owner_host TEXT, owner_pid INTEGER, owner_start TEXT, capabilities TEXT, recovery TEXT,
            FOREIGN KEY (workflow_id, version) REFERENCES workflow_versions(workflow_id, version))""",
        """INSERT INTO runs_v6 (run_id, session_id, lane, workflow_id, workflow_name, version, content_hash,
            source_kind, source_ref, provenance, inputs, status, outputs, error, created_at, started_at,
            finished_at, owner_host, owner_pid, owner_start)
           SELECT run_id, session_id, lane, workflow_id, workflow_name, version, content_hash, source_kind,
            source_ref, provenance, inputs, status, outputs, error, created_at, started_at, finished_at,
            owner_host, owner_pid, owner_start FROM runs""",
        "DROP TABLE runs",
        "ALTER TABLE runs_v6 RENAME TO runs",
        "CREATE INDEX runs_created ON runs(created_at)",
        "CREATE INDEX runs_workflow ON runs(workflow_id)",
        "CREATE INDEX runs_lane ON runs(lane)",
        """UPDATE runs SET capabilities = '{"cancel": true, "checkpoint_resume": false, "leased_admission": false,'
           || ' "live_message": false, "live_pause": false, "planner": false, "reactive_growth": false}'
           WHERE lane = 'fixed_workflow'""",
    ), rebuilds=("runs", "run_signals", "run_branches", "run_nodes"), postgres=(
        # PostgreSQL alters the constraints in place: no rebuild, the references stay as they are.
        "ALTER TABLE runs ALTER COLUMN content_hash DROP NOT NULL",
        "ALTER TABLE runs DROP CONSTRAINT runs_source_kind_check",
        "ALTER TABLE runs ADD CONSTRAINT runs_source_kind_check CHECK (length(source_kind) > 0)",
        "ALTER TABLE runs ADD CONSTRAINT runs_lane_check CHECK (length(lane) > 0)",
        "ALTER TABLE runs ADD COLUMN capabilities TEXT",
        "ALTER TABLE runs ADD COLUMN recovery TEXT",
        "CREATE INDEX runs_lane ON runs(lane)",
        """UPDATE runs SET capabilities = '{"cancel": true, "checkpoint_resume": false, "leased_admission": false,'
           || ' "live_message": false, "live_pause": false, "planner": false, "reactive_growth": false}'
           WHERE lane = 'fixed_workflow'""",
    )),
    # Dataset jobs (`opgraph map`, cluster/jobs/): one row per job, found again by the command
    # that made it (``command_key``: the input's location and the options that shape an answer),
    # pinned to the input's content (``input_hash``), and one row per answered input row, keyed by
    # the row's id column: recorded once, with its usage and cost, before it counts as done.
    Migration(7, "dataset jobs and each row's recorded answer", (
        """CREATE TABLE map_jobs (
            job_id TEXT PRIMARY KEY, command_key TEXT NOT NULL, input_ref TEXT NOT NULL,
            input_hash TEXT NOT NULL CHECK (input_hash GLOB 'sha256:*'), spec TEXT NOT NULL,
            rows_total INTEGER, run_id TEXT, runs INTEGER NOT NULL DEFAULT 0,
            status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'stopped', 'failed', 'cancelled')),
            summary TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL,
            owner_host TEXT, owner_pid INTEGER, owner_start TEXT)""",
        "CREATE INDEX map_jobs_command ON map_jobs(command_key, created_at)",
        """CREATE TABLE map_rows (
            job_id TEXT NOT NULL REFERENCES map_jobs(job_id), row_key TEXT NOT NULL, ordinal INTEGER NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('done', 'failed')), answer TEXT, error TEXT,
            calls INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
            completion_tokens INTEGER NOT NULL DEFAULT 0, cost_usd REAL NOT NULL DEFAULT 0,
            model TEXT, run_id TEXT, recorded_at REAL NOT NULL, PRIMARY KEY (job_id, row_key))""",
        "CREATE INDEX map_rows_ordinal ON map_rows(job_id, ordinal)",
    ), postgres=(
        """CREATE TABLE map_jobs (
            job_id TEXT PRIMARY KEY, command_key TEXT NOT NULL, input_ref TEXT NOT NULL,
            input_hash TEXT NOT NULL CHECK (input_hash ~ '^sha256:'), spec TEXT NOT NULL,
            rows_total BIGINT, run_id TEXT, runs BIGINT NOT NULL DEFAULT 0,
            status TEXT NOT NULL CHECK (status IN ('running', 'completed', 'stopped', 'failed', 'cancelled')),
            summary TEXT, created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
            owner_host TEXT, owner_pid BIGINT, owner_start TEXT)""",
        "CREATE INDEX map_jobs_command ON map_jobs(command_key, created_at)",
        """CREATE TABLE map_rows (
            job_id TEXT NOT NULL REFERENCES map_jobs(job_id), row_key TEXT NOT NULL, ordinal BIGINT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('done', 'failed')), answer TEXT, error TEXT,
            calls BIGINT NOT NULL DEFAULT 0, prompt_tokens BIGINT NOT NULL DEFAULT 0,
            completion_tokens BIGINT NOT NULL DEFAULT 0, cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
            model TEXT, run_id TEXT, recorded_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, row_key))""",
        "CREATE INDEX map_rows_ordinal ON map_rows(job_id, ordinal)",
    )),
    # The dispatch outbox (ADR-0068 D5) and the webhooks it is delivered to (cluster/control/): an
    # event is written in the same transaction as the fact it reports; the relay fans it out to
    # one delivery per subscribed endpoint and records every attempt. No secret is stored: an
    # endpoint names where its signing secret lives (``secret_ref``), resolved when it sends.
    Migration(8, "the dispatch outbox, webhook endpoints, their deliveries and every attempt", (
        """CREATE TABLE outbox (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL UNIQUE,
            event_type TEXT NOT NULL, subject_id TEXT NOT NULL, endpoint_id TEXT, payload TEXT NOT NULL,
            created_at REAL NOT NULL, dispatched_at REAL)""",
        "CREATE INDEX outbox_undispatched ON outbox(seq) WHERE dispatched_at IS NULL",
        """CREATE TABLE webhook_endpoints (
            endpoint_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, url TEXT NOT NULL,
            secret_ref TEXT NOT NULL, event_types TEXT NOT NULL, description TEXT,
            enabled INTEGER NOT NULL DEFAULT 1, disabled_reason TEXT, disabled_at REAL,
            consecutive_failures INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL)""",
        """CREATE TABLE webhook_deliveries (
            delivery_id INTEGER PRIMARY KEY AUTOINCREMENT, event_id TEXT NOT NULL REFERENCES outbox(event_id),
            endpoint_id TEXT NOT NULL REFERENCES webhook_endpoints(endpoint_id),
            status TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'dead')),
            attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at REAL NOT NULL, lease_until REAL,
            last_error TEXT, created_at REAL NOT NULL, finished_at REAL, UNIQUE (event_id, endpoint_id))""",
        "CREATE INDEX webhook_deliveries_due ON webhook_deliveries(next_attempt_at) WHERE status = 'pending'",
        "CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries(endpoint_id, delivery_id)",
        """CREATE TABLE webhook_attempts (
            delivery_id INTEGER NOT NULL REFERENCES webhook_deliveries(delivery_id), attempt INTEGER NOT NULL,
            at REAL NOT NULL, outcome TEXT NOT NULL, status_code INTEGER, latency REAL NOT NULL, error TEXT,
            PRIMARY KEY (delivery_id, attempt))""",
        # Attempts by outcome, counted in each attempt's transaction: what /metrics reads, in a few rows.
        "CREATE TABLE webhook_outcomes (outcome TEXT PRIMARY KEY, attempts INTEGER NOT NULL)",
    ), postgres=(
        """CREATE TABLE outbox (
            seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id TEXT NOT NULL UNIQUE,
            event_type TEXT NOT NULL, subject_id TEXT NOT NULL, endpoint_id TEXT, payload TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL, dispatched_at DOUBLE PRECISION)""",
        "CREATE INDEX outbox_undispatched ON outbox(seq) WHERE dispatched_at IS NULL",
        """CREATE TABLE webhook_endpoints (
            endpoint_id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, url TEXT NOT NULL,
            secret_ref TEXT NOT NULL, event_types TEXT NOT NULL, description TEXT,
            enabled BIGINT NOT NULL DEFAULT 1, disabled_reason TEXT, disabled_at DOUBLE PRECISION,
            consecutive_failures BIGINT NOT NULL DEFAULT 0, created_at DOUBLE PRECISION NOT NULL)""",
        """CREATE TABLE webhook_deliveries (
            delivery_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            event_id TEXT NOT NULL REFERENCES outbox(event_id),
            endpoint_id TEXT NOT NULL REFERENCES webhook_endpoints(endpoint_id),
            status TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'dead')),
            attempts BIGINT NOT NULL DEFAULT 0, next_attempt_at DOUBLE PRECISION NOT NULL,
            lease_until DOUBLE PRECISION, last_error TEXT, created_at DOUBLE PRECISION NOT NULL,
            finished_at DOUBLE PRECISION, UNIQUE (event_id, endpoint_id))""",
        "CREATE INDEX webhook_deliveries_due ON webhook_deliveries(next_attempt_at) WHERE status = 'pending'",
        "CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries(endpoint_id, delivery_id)",
        """CREATE TABLE webhook_attempts (
            delivery_id BIGINT NOT NULL REFERENCES webhook_deliveries(delivery_id), attempt BIGINT NOT NULL,
            at DOUBLE PRECISION NOT NULL, outcome TEXT NOT NULL, status_code BIGINT,
            latency DOUBLE PRECISION NOT NULL, error TEXT, PRIMARY KEY (delivery_id, attempt))""",
        "CREATE TABLE webhook_outcomes (outcome TEXT PRIMARY KEY, attempts BIGINT NOT NULL)",
    )),
    # The console (cluster/http/console): a run's graph outline, recorded once when the run
    # starts (node ids, names, operations and edges), so a finished run's page draws its
    # graph, unreached nodes and edges included, without the executor.
    Migration(9, "each run's graph outline", (
        """CREATE TABLE run_outlines (
            run_id TEXT PRIMARY KEY REFERENCES runs(run_id), outline TEXT NOT NULL)""",
    ), postgres=(
        """CREATE TABLE run_outlines (
            run_id TEXT PRIMARY KEY REFERENCES runs(run_id), outline TEXT NOT NULL)""",
    )),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
MAX_VERSION = 2**63 - 1  # the largest SQLite INTEGER and PostgreSQL BIGINT: no definition version can be higher

RUN_STATUSES: tuple[str, ...] = ("admitted", "running", "completed", "failed", "cancelled")
TERMINAL_RUN_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
# The legal run transitions; a terminal status is final (a cancelled run stays cancelled).
RUN_TRANSITIONS: Mapping[str, frozenset[str]] = {
    "admitted": frozenset({"running"}) | TERMINAL_RUN_STATUSES,
    "running": TERMINAL_RUN_STATUSES,
    **{status: frozenset() for status in TERMINAL_RUN_STATUSES},
}


def sources_of(target: str) -> tuple[str, ...]:
    return tuple(status for status in RUN_STATUSES if target in RUN_TRANSITIONS[status])


def migrate(connection: sqlite3.Connection | Connection, *, target: int = SCHEMA_VERSION, path: str = "?") -> int:
    """Apply the missing ``MIGRATIONS`` up to ``target``; return the schema version reached.

    ``connection`` is a ``sqlite3`` connection in autocommit mode (``isolation_level=None``)
    or a backend ``Connection`` (SQLite or PostgreSQL). Each step runs in its own write
    transaction with its version, so a failed step leaves the previous version intact, and
    the version is read again under the write lock, so two processes opening a new store at
    once apply each step once. A newer database raises ``StoreSchemaError``.
    """
    if isinstance(connection, sqlite3.Connection):
        connection = SqliteConnection(connection, path)
    current = connection.user_version()
    if current > SCHEMA_VERSION:
        raise StoreSchemaError(path, current, SCHEMA_VERSION)
    for step in MIGRATIONS:
        if current < step.version <= target:
            current = _apply(connection, step, path)
    return current


def _apply(connection: Connection, step: Migration, path: str) -> int:
    sqlite = connection.dialect == "sqlite"
    # The pragma is a no-op inside a transaction, so it is set before BEGIN and restored after.
    enforced = sqlite and connection.execute("PRAGMA foreign_keys").fetchone()[0]
    if step.rebuilds and enforced:
        connection.execute("PRAGMA foreign_keys = OFF")
    try:
        connection.begin(write=True)
        try:
            current = connection.user_version()
            if current >= step.version:  # another process applied it meanwhile
                connection.commit()
                return current
            statements = step.statements if sqlite or step.postgres is None else step.postgres
            for statement in statements:
                connection.execute(statement if sqlite or step.postgres is not None else connection.ddl(statement))
            if sqlite and step.rebuilds and any(connection.execute(f"PRAGMA foreign_key_check({table})").fetchone()
                                                for table in step.rebuilds):
                raise WorkflowStoreError(f"migration {step.version} of the store {path} left rows whose "
                                         "references do not resolve; nothing was changed")
            connection.set_user_version(step.version)
            connection.commit()
        except BaseException:
            connection.rollback()
            raise
    finally:
        if step.rebuilds and enforced:
            connection.execute("PRAGMA foreign_keys = ON")
    return step.version


def default_store_path() -> Path | str:
    """``$OPGRAPH_DB`` (a path, or a ``postgresql://`` URL kept as it is), else
    ``$OPGRAPH_HOME/opgraph.db``, else ``~/.opgraph/opgraph.db``: the run store and the
    runtime's run log share one database, so one function (the runtime's) decides where."""
    return database_path()


def store_location(store: str | os.PathLike[str] | None = None) -> Path | str:
    """A ``--store`` option as given (a path with ``~`` expanded, or a PostgreSQL URL), else the default."""
    return default_store_path() if not store else location(store)


def store_exists(target: Path | str) -> bool:
    """Whether a store may hold something at ``target``: a SQLite file that exists, or any PostgreSQL URL."""
    return is_postgres(target) or Path(target).is_file()
