"""The fixed-workflow lane's SQLite store: versioned definitions and run records (ADR-0073, ADR-0068 D4).

Owns immutable content-hashed definition versions with stable ``name@version``
resolution, and the run rows (provenance, lifecycle, signals, branches). The schema and
its migrations are schema.py's (re-exported here), definition rules spec.py's and
provenance rules lanes.py's; it must not compile or run anything::

    OpGraphError
    ├── WorkflowValidationError (spec.py)  a bad name or spec; ``.errors`` lists every problem (422)
    └── WorkflowStoreError (schema.py)     the database failed, or the store is closed
        ├── StoreSchemaError (schema.py)   the file's schema is newer than this code knows
        ├── WorkflowNameConflictError      a live workflow already has the name (409)
        ├── WorkflowNotFoundError          no live workflow by that name or id (404)
        │   └── WorkflowVersionNotFoundError   the workflow exists, the version does not
        ├── RunNotFoundError               no run with that id
        └── RunConflictError               a run with that id already exists
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..lanes.capabilities import FIXED_WORKFLOW, ProvenanceError, RunProvenance
from ..lanes.fixed.spec import (
    WorkflowValidationError,
    canonical_json,
    content_hash,
    problem,
    validate_definition,
    validate_name,
)
from .owners import ProcessIdentity, current_process, owner_is_alive
from .schema import (
    MAX_VERSION,
    MIGRATIONS,
    RUN_STATUSES,
    RUN_TRANSITIONS,
    SCHEMA_VERSION,
    TERMINAL_RUN_STATUSES,
    Migration,
    StoreSchemaError,
    WorkflowStoreError,
    default_store_path,
    migrate,
    sources_of,
)
from .writer import StoreWriter

__all__ = [
    "MAX_VERSION",
    "MIGRATIONS",
    "RUN_STATUSES",
    "RUN_TRANSITIONS",
    "SCHEMA_VERSION",
    "TERMINAL_RUN_STATUSES",
    "Migration",
    "RunConflictError",
    "RunNotFoundError",
    "RunRecord",
    "StoreSchemaError",
    "WorkflowNameConflictError",
    "WorkflowNotFoundError",
    "RunStore",
    "WorkflowStoreError",
    "WorkflowSummary",
    "WorkflowVersion",
    "WorkflowVersionNotFoundError",
    "default_store_path",
    "migrate",
]


# -- errors ----------------------------------------------------------------------------
class WorkflowNameConflictError(WorkflowStoreError):
    """A live workflow already has ``name`` (HTTP 409)."""

    _fields = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__(f"a workflow named {name!r} already exists; add a version to it, delete it, "
                         "or choose another name")
        self.name = name


class WorkflowNotFoundError(WorkflowStoreError):
    """No live workflow has ``name`` as its name or id (HTTP 404)."""

    _fields = ("name",)

    def __init__(self, name: str) -> None:
        super().__init__(f"no workflow named {name!r} (nor with that id); `opgraph workflows list` shows them")
        self.name = name


class WorkflowVersionNotFoundError(WorkflowNotFoundError):
    """The workflow exists but has no ``version``; a pinned version never falls back to latest."""

    _fields = ("name", "version")

    def __init__(self, name: str, version: int | None) -> None:
        which = "versions" if version is None else f"version {version}"
        WorkflowStoreError.__init__(self, f"workflow {name!r} has no {which}; "
                                          f"`opgraph workflows versions {name}` lists them")
        self.name, self.version = name, version


class RunNotFoundError(WorkflowStoreError):
    """No run has ``run_id``."""

    _fields = ("run_id",)

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run with id {run_id!r}")
        self.run_id = run_id


class RunConflictError(WorkflowStoreError):
    """A run with ``run_id`` already exists; run ids are never reused."""

    _fields = ("run_id",)

    def __init__(self, run_id: str) -> None:
        super().__init__(f"a run with id {run_id!r} already exists; use a fresh run id")
        self.run_id = run_id


# -- records ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkflowVersion:
    """One immutable definition version; ``spec`` is decoded afresh, so mutating it changes nothing stored."""

    workflow_id: str
    name: str
    version: int
    content_hash: str
    spec: dict[str, Any] | None
    description: str | None
    created_at: float

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class WorkflowSummary:
    """A live workflow and its latest version: ``description`` and ``content_hash`` are that
    version's, and ``updated_at`` is when it was added."""

    id: str
    name: str
    description: str | None
    latest_version: int
    content_hash: str
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One run row with its JSON columns decoded (ADR-0068 D4 provenance included)."""

    run_id: str
    session_id: str
    lane: str
    workflow_id: str | None
    workflow_name: str | None
    version: int | None
    content_hash: str
    source_kind: str
    source_ref: str
    provenance: dict[str, Any]
    inputs: dict[str, Any]
    status: str
    outputs: Any
    error: Any
    created_at: float
    started_at: float | None
    finished_at: float | None
    # The process running it (see owners.py); None for runs recorded before schema v3.
    owner_host: str | None = None
    owner_pid: int | None = None
    owner_start: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATUSES


def _encode(value: Any) -> str:
    # Outputs, errors and messages may hold non-JSON values; they are stored as their str().
    return json.dumps(value, default=str, sort_keys=True)


_VERSIONS_OF = ("SELECT w.id, w.name, v.version, v.content_hash, v.spec_json, v.description, v.created_at"
                " FROM workflows w JOIN workflow_versions v ON v.workflow_id = w.id WHERE w.id = ?")


def _version(row: sqlite3.Row) -> WorkflowVersion:
    return WorkflowVersion(workflow_id=row[0], name=row[1], version=row[2], content_hash=row[3],
                           spec=json.loads(row[4]), description=row[5], created_at=row[6])


def _run(row: sqlite3.Row) -> RunRecord:
    values = dict(row)
    for column in ("provenance", "inputs", "outputs", "error"):
        values[column] = None if values[column] is None else json.loads(values[column])
    return RunRecord(**values)


def _encode_spec(spec: Any, description: Any, problems: Iterable[dict[str, Any]] = ()) -> tuple[str, str]:
    """Canonical JSON and hash of ``spec``, or one ``WorkflowValidationError`` with every problem.

    The stored text is exactly the hashed bytes, so ``content_hash == sha256(spec_json)``.
    """
    problems = list(problems)
    if description is not None and not isinstance(description, str):
        problems.append(problem(f"the description must be a string, got {type(description).__name__}"))
    problems += validate_definition(spec)
    if problems:
        raise WorkflowValidationError(problems)
    return canonical_json(spec).decode("utf-8"), content_hash(spec)


def _signal_rows(signals: Iterable[Mapping[str, Any]], now: float) -> list[tuple[Any, ...]]:
    rows = []
    for index, signal in enumerate(signals):
        if not isinstance(signal.get("node_id"), str) or not isinstance(signal.get("kind"), str):
            raise ValueError(f"signal {index} needs string node_id and kind, got {dict(signal)!r}")
        rows.append((signal["node_id"], signal.get("spec_node_id"), signal["kind"],
                     signal.get("elapsed"), signal.get("at", now)))
    return rows


def _check_status(status: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if status not in allowed:
        raise ValueError(f"run status {status!r} is not allowed here; allowed: {', '.join(allowed)}")


# -- the store -------------------------------------------------------------------------
class RunStore:
    """One SQLite connection, shared by threads under a lock (the HTTP API calls from threads).

    Code on an event loop writes through ``writer``, the store's one writer thread, so
    the loop never waits for SQLite; reads from a loop go through a thread pool.

    ``path`` is a file (parent folders are created), ``":memory:"``, or None for
    ``default_store_path()``. ``clock`` stamps every row (tests pass a fake one).
    """

    def __init__(self, path: str | Path | None = None, *, clock: Callable[[], float] = time.time) -> None:
        path = default_store_path() if path is None else path
        self.path = str(path)
        self._clock = clock
        self._lock = threading.Lock()
        self._owner = current_process()
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self.path = str(Path(self.path).expanduser())
        self._db: sqlite3.Connection | None = None
        self._writer: StoreWriter | None = None
        self._writer_lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.execute("PRAGMA busy_timeout = 10000")
            if self.path != ":memory:":
                # WAL lets the CLI read while a long run writes signals.
                self._db.execute("PRAGMA journal_mode = WAL")
                # A commit reaches the operating system before it returns, so a killed
                # process loses nothing committed; only a power loss may undo the last
                # commits (never corrupting the file). FULL added an fsync per commit:
                # 1.46x against 1.10x the bare run time (python -m opgraph.cluster.bench.store).
                self._db.execute("PRAGMA synchronous = NORMAL")
            migrate(self._db, path=self.path)
        except BaseException as exc:
            if self._db is not None:
                self._db.close()
                self._db = None
            if isinstance(exc, sqlite3.Error):
                raise WorkflowStoreError(f"cannot open the workflow store {self.path}: {exc}") from exc
            raise

    @property
    def writer(self) -> StoreWriter:
        """This store's writer thread, started on first use: how code on an event loop writes."""
        # Not the connection's lock: the writer thread holds that for whole transactions,
        # and an event loop asking for the writer must not wait on one.
        with self._writer_lock:
            if self._db is None:
                raise WorkflowStoreError(f"the workflow store {self.path} is closed")
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
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @contextmanager
    def _transaction(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        """One locked transaction; sqlite3 errors are translated here, once."""
        with self._lock:
            if self._db is None:
                raise WorkflowStoreError(f"the workflow store {self.path} is closed")
            db = self._db
            try:
                # IMMEDIATE takes the write lock up front, so read-then-write (the next
                # version number, the next signal seq) cannot race another process.
                db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise WorkflowStoreError(f"the workflow store {self.path} failed: {exc}") from exc

    def schema_version(self) -> int:
        with self._transaction() as db:
            return db.execute("PRAGMA user_version").fetchone()[0]

    # -- definitions -------------------------------------------------------------------
    def create_workflow(self, name: str, spec: Mapping[str, Any] | None,
                        description: str | None = None) -> WorkflowVersion:
        """Create workflow ``name`` with version 1; nothing is written unless name and spec are valid.

        A ``None`` spec is stored (ADR-0073 D1) but cannot run. A live workflow with the
        same trimmed name raises ``WorkflowNameConflictError``.
        """
        spec_json, digest = _encode_spec(spec, description, validate_name(name))
        name = name.strip()
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM workflows WHERE name = ? AND deleted_at IS NULL", (name,)).fetchone():
                raise WorkflowNameConflictError(name)
            workflow_id = secrets.token_hex(6)
            while db.execute("SELECT 1 FROM workflows WHERE id = ?", (workflow_id,)).fetchone():
                workflow_id = secrets.token_hex(6)
            now = self._clock()
            db.execute("INSERT INTO workflows (id, name, description, created_at) VALUES (?, ?, ?, ?)",
                       (workflow_id, name, description, now))
            return self._insert_version(db, workflow_id, 1, digest, spec_json, description, now)

    def add_version(self, name_or_id: str, spec: Mapping[str, Any] | None,
                    description: str | None = None) -> WorkflowVersion:
        """Append version N+1 of a live workflow and return it.

        Idempotent: when ``spec`` hashes to the latest version's hash, the latest version
        is returned unchanged and nothing is written (a new description alone does not
        make a version). ``description=None`` carries the latest description forward.
        A ``None`` spec is refused: it would become the latest version, which every run
        by name resolves to, and it cannot run (only a new workflow may start without one).
        """
        missing = [problem("a new version needs a spec: a version without one would become the latest "
                           "and could not run; send the definition as \"spec\"")] if spec is None else []
        spec_json, digest = _encode_spec(spec, description, missing)
        with self._transaction(write=True) as db:
            latest = self._resolve(db, name_or_id, None, include_deleted=False)
            if latest.content_hash == digest:
                return latest
            return self._insert_version(db, latest.workflow_id, latest.version + 1, digest, spec_json,
                                        latest.description if description is None else description, self._clock())

    def _insert_version(self, db: sqlite3.Connection, workflow_id: str, version: int, digest: str,
                        spec_json: str, description: str | None, now: float) -> WorkflowVersion:
        db.execute("INSERT INTO workflow_versions (workflow_id, version, content_hash, spec_json, description,"
                   " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                   (workflow_id, version, digest, spec_json, description, now))
        return self._resolve(db, workflow_id, version, include_deleted=False)

    def _workflow_row(self, db: sqlite3.Connection, name_or_id: str, include_deleted: bool) -> sqlite3.Row:
        key = name_or_id.strip() if isinstance(name_or_id, str) else name_or_id
        # A live name wins over an id; deleted workflows are reachable by id only, since
        # several deleted workflows may have had the same name.
        row = db.execute("SELECT id, name FROM workflows WHERE name = ? AND deleted_at IS NULL", (key,)).fetchone()
        row = row or db.execute("SELECT id, name FROM workflows WHERE id = ? AND (deleted_at IS NULL OR ?)",
                                (key, include_deleted)).fetchone()
        if row is None:
            raise WorkflowNotFoundError(str(name_or_id))
        return row

    def _resolve(self, db: sqlite3.Connection, name_or_id: str, version: int | None,
                 include_deleted: bool) -> WorkflowVersion:
        workflow = self._workflow_row(db, name_or_id, include_deleted)
        if version is None:
            row = db.execute(_VERSIONS_OF + " ORDER BY v.version DESC LIMIT 1", (workflow["id"],)).fetchone()
        else:
            row = db.execute(_VERSIONS_OF + " AND v.version = ?", (workflow["id"], version)).fetchone()
        if row is None:
            raise WorkflowVersionNotFoundError(workflow["name"], version)
        return _version(row)

    def resolve(self, name_or_id: str, version: int | None = None, *,
                include_deleted: bool = False) -> WorkflowVersion:
        """Pin one version of a live workflow (the latest when ``version`` is None).

        ``include_deleted=True`` also finds a deleted workflow by its id (never by name):
        that is how a run's exact definition is read back after its workflow was deleted.
        """
        if version is not None and (type(version) is not int or version < 1):
            raise ValueError(f"a workflow version is an integer from 1, got {version!r}")
        with self._transaction() as db:
            if version is not None and version > MAX_VERSION:
                # SQLite integers stop at 2**63 - 1: no such version exists, and binding the
                # number would overflow. An unknown workflow is still the plainer 404.
                workflow = self._workflow_row(db, name_or_id, include_deleted)
                raise WorkflowVersionNotFoundError(workflow["name"], version)
            return self._resolve(db, name_or_id, version, include_deleted)

    def versions(self, name_or_id: str, *, include_deleted: bool = False) -> list[WorkflowVersion]:
        """Every version of one workflow, oldest first (deleted ones by id, as for ``resolve``)."""
        with self._transaction() as db:
            workflow = self._workflow_row(db, name_or_id, include_deleted)
            rows = db.execute(_VERSIONS_OF + " ORDER BY v.version", (workflow["id"],))
            return [_version(row) for row in rows]

    def list_workflows(self) -> list[WorkflowSummary]:
        """Every live workflow with its latest version, ordered by name."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT w.id, w.name, v.description, v.version, v.content_hash, w.created_at, v.created_at "
                "FROM workflows w JOIN workflow_versions v ON v.workflow_id = w.id WHERE w.deleted_at IS NULL "
                "AND v.version = (SELECT MAX(version) FROM workflow_versions WHERE workflow_id = w.id) "
                "ORDER BY w.name").fetchall()
        return [WorkflowSummary(*row) for row in rows]

    def delete_workflow(self, name_or_id: str) -> None:
        """Soft-delete a live workflow: its name is free again; its versions stay for old runs."""
        with self._transaction(write=True) as db:
            workflow = self._workflow_row(db, name_or_id, include_deleted=False)
            db.execute("UPDATE workflows SET deleted_at = ? WHERE id = ?", (self._clock(), workflow["id"]))

    # -- runs --------------------------------------------------------------------------
    def create_run(self, run_id: str, *, session_id: str, provenance: Mapping[str, Any],
                   inputs: Mapping[str, Any] | None, workflow: WorkflowVersion | None = None,
                   status: str = "admitted") -> RunRecord:
        """Record a fixed-lane run; lane and source come from the validated ``provenance``.

        A ``workflow_def`` source needs its pinned ``workflow``, and the two must agree on
        name, version and hash (else ``ProvenanceError``); a ``workflow_file`` takes none.
        ``status`` is ``admitted`` or ``running``; ``inputs=None`` is stored as ``{}``.
        """
        _check_status(status, ("admitted", "running"))
        parsed = RunProvenance.from_payload(provenance)
        source = parsed.source
        if parsed.lane != FIXED_WORKFLOW:
            raise ProvenanceError(f"this store records {FIXED_WORKFLOW} runs, not {parsed.lane!r} runs")
        if (source.kind == "workflow_def") != (workflow is not None):
            raise ProvenanceError(f"a {source.kind} run {'needs' if workflow is None else 'takes no'} "
                                  "pinned WorkflowVersion")
        if workflow is not None and (workflow.name, workflow.version, workflow.content_hash) != (
                source.ref, source.version, source.content_hash):
            raise ProvenanceError(f"the provenance pins {source.ref}@{source.version} ({source.content_hash}) "
                                  f"but the workflow is {workflow.ref} ({workflow.content_hash})")
        now = self._clock()
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone():
                raise RunConflictError(run_id)
            if workflow is not None and not db.execute(
                    "SELECT 1 FROM workflow_versions WHERE workflow_id = ? AND version = ? AND content_hash = ?",
                    (workflow.workflow_id, workflow.version, workflow.content_hash)).fetchone():
                raise WorkflowVersionNotFoundError(workflow.name, workflow.version)
            db.execute(
                "INSERT INTO runs (run_id, session_id, lane, workflow_id, workflow_name, version, content_hash,"
                " source_kind, source_ref, provenance, inputs, status, created_at, started_at,"
                " owner_host, owner_pid, owner_start)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, str(session_id), parsed.lane, workflow and workflow.workflow_id,
                 workflow and workflow.name, source.version, source.content_hash, source.kind, source.ref,
                 _encode(parsed.to_payload()), _encode(dict(inputs or {})), status, now,
                 now if status == "running" else None, self._owner.host, self._owner.pid, self._owner.start))
            return self._get_run(db, run_id)

    def _get_run(self, db: sqlite3.Connection, run_id: str) -> RunRecord:
        row = db.execute("SELECT * FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        if row is None:
            raise RunNotFoundError(run_id)
        return _run(row)

    def _transition(self, db: sqlite3.Connection, run_id: str, target: str, sets: str,
                    values: tuple[Any, ...]) -> bool:
        sources = sources_of(target)
        marks = ", ".join("?" * len(sources))
        changed = db.execute(f"UPDATE runs SET status = ?, {sets} WHERE run_id = ? AND status IN ({marks})",
                             (target, *values, run_id, *sources)).rowcount
        if not changed:
            self._get_run(db, run_id)  # raises RunNotFoundError for an unknown run
        return bool(changed)

    def mark_running(self, run_id: str) -> bool:
        """``admitted -> running``; False (and no change) when the run already left ``admitted``."""
        with self._transaction(write=True) as db:
            return self._transition(db, run_id, "running", "started_at = ?", (self._clock(),))

    def finish_run(self, run_id: str, status: str, *, outputs: Any = None, error: Any = None) -> bool:
        """Settle a run as completed, failed or cancelled.

        Terminal statuses are final: finishing a run that already finished returns False
        and changes nothing, so a cancelled run stays cancelled whatever arrives later.
        """
        _check_status(status, sorted(TERMINAL_RUN_STATUSES))
        with self._transaction(write=True) as db:
            return self._transition(db, run_id, status, "outputs = ?, error = ?, finished_at = ?",
                                    (_encode(outputs), _encode(error), self._clock()))

    def get_run(self, run_id: str) -> RunRecord:
        return self._read_runs(lambda db: [self._get_run(db, run_id)])[0]

    def _read_runs(self, read: Callable[[sqlite3.Connection], list[RunRecord]]) -> list[RunRecord]:
        """``read`` the runs; if any is an orphan, settle it as failed and read them again."""
        with self._transaction() as db:
            records = read(db)
        orphans = [record for record in records if self._orphaned(record)]
        if not orphans:
            return records
        for record in orphans:
            self._settle_orphan(record)
        with self._transaction() as db:
            return read(db)

    def reap_orphaned_runs(self) -> list[str]:
        """Settle as failed every unfinished run whose owner process on this host is gone.

        A run executes in the process that admitted it; once that process has died (a
        crash, a kill, a closed terminal) nothing else will settle it. Reads do this for
        the runs they return; this does it for all of them. Returns the run ids settled.
        """
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM runs WHERE status IN ('admitted', 'running') AND owner_host = ?",
                              (self._owner.host,)).fetchall()
        return [record.run_id for record in map(_run, rows) if self._orphaned(record) and self._settle_orphan(record)]

    def _orphaned(self, record: RunRecord) -> bool:
        if record.terminal or record.owner_pid is None or record.owner_host is None:
            return False
        owner = ProcessIdentity(record.owner_host, record.owner_pid, record.owner_start)
        return owner_is_alive(owner, self._owner) is False

    def _settle_orphan(self, record: RunRecord) -> bool:
        error = {"error": f"the process that ran it (pid {record.owner_pid} on {record.owner_host}) "
                          "exited before the run settled", "error_type": "OwnerProcessLost"}
        return self.finish_run(record.run_id, "failed", error=error)

    def list_runs(self, *, workflow: str | None = None, status: str | None = None,
                  limit: int = 50) -> list[RunRecord]:
        """Newest first. ``workflow`` matches a workflow id, the name a run was recorded
        under (deleted workflows included), or a file run's path."""
        if status is not None:
            _check_status(status, RUN_STATUSES)
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        query, values = "SELECT * FROM runs WHERE 1", []
        if workflow is not None:
            query += " AND ? IN (workflow_id, workflow_name, source_ref)"
            values.append(workflow.strip())
        if status is not None:
            query += " AND status = ?"
            values.append(status)
        query += " ORDER BY created_at DESC, rowid DESC LIMIT ?"
        return self._read_runs(lambda db: [_run(row) for row in db.execute(query, (*values, limit))])

    def record_signals(self, run_id: str, signals: Iterable[Mapping[str, Any]]) -> int:
        """Append lifecycle signals in one transaction; return the last ``seq`` of the run.

        Each signal needs ``node_id`` and ``kind``; ``spec_node_id`` and ``elapsed`` may be
        absent, and ``at`` defaults to now. ``seq`` is assigned here, increasing per run.
        """
        rows = _signal_rows(signals, self._clock())
        with self._transaction(write=True) as db:
            self._get_run(db, run_id)
            return self._append_signals(db, run_id, rows)

    @staticmethod
    def _append_signals(db: sqlite3.Connection, run_id: str, rows: list[tuple[Any, ...]]) -> int:
        last = db.execute("SELECT COALESCE(MAX(seq), 0) FROM run_signals WHERE run_id = ?", (run_id,)).fetchone()[0]
        db.executemany("INSERT INTO run_signals (run_id, seq, node_id, spec_node_id, kind, elapsed, at)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?)",
                       [(run_id, last + offset, *row) for offset, row in enumerate(rows, start=1)])
        return last + len(rows)

    def record_progress(self, run_id: str, *, signals: Iterable[Mapping[str, Any]] = (),
                        nodes: Iterable[Mapping[str, Any]] = ()) -> int:
        """Append lifecycle signals and record settled nodes in one transaction; return the last ``seq``.

        Signals are as for ``record_signals``. Each node needs ``node_id`` and ``status``;
        ``spec_node_id``, ``result`` (any JSON value) and ``settled_at`` (default now) may
        be given. A node recorded again (a retried attempt) replaces its earlier record.
        """
        now = self._clock()
        signal_rows = _signal_rows(signals, now)
        node_rows = []
        for index, node in enumerate(nodes):
            if not isinstance(node.get("node_id"), str) or not isinstance(node.get("status"), str):
                raise ValueError(f"node {index} needs string node_id and status, got {dict(node)!r}")
            node_rows.append((run_id, node["node_id"], node.get("spec_node_id"), node["status"],
                              _encode(node.get("result")), node.get("settled_at", now)))
        with self._transaction(write=True) as db:
            self._get_run(db, run_id)
            last = self._append_signals(db, run_id, signal_rows)
            db.executemany("INSERT INTO run_nodes (run_id, node_id, spec_node_id, status, result, settled_at)"
                           " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, node_id) DO UPDATE SET"
                           " status = excluded.status, result = excluded.result, settled_at = excluded.settled_at,"
                           " spec_node_id = excluded.spec_node_id", node_rows)
            return last

    def run_nodes(self, run_id: str) -> list[dict[str, Any]]:
        """``[{node_id, spec_node_id, status, result, settled_at}]`` of the settled nodes, in settle order."""
        with self._transaction() as db:
            self._get_run(db, run_id)
            rows = db.execute("SELECT node_id, spec_node_id, status, result, settled_at FROM run_nodes"
                              " WHERE run_id = ? ORDER BY settled_at, rowid", (run_id,))
            return [{**dict(row), "result": json.loads(row["result"])} for row in rows]

    def run_signals(self, run_id: str, after_seq: int = 0) -> list[dict[str, Any]]:
        """The run's signals with ``seq > after_seq``, in ``seq`` order (poll with the last seq seen)."""
        with self._transaction() as db:
            self._get_run(db, run_id)
            rows = db.execute("SELECT seq, node_id, spec_node_id, kind, elapsed, at FROM run_signals"
                              " WHERE run_id = ? AND seq > ? ORDER BY seq", (run_id, after_seq))
            return [dict(row) for row in rows]

    def record_branch(self, run_id: str, branch_id: str, *, node_id: str | None = None,
                      messages: Iterable[Any]) -> None:
        """Insert or replace one branch's messages; a None ``node_id`` keeps the recorded one."""
        encoded = _encode(list(messages))
        with self._transaction(write=True) as db:
            self._get_run(db, run_id)
            db.execute("INSERT INTO run_branches (run_id, branch_id, node_id, messages) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT (run_id, branch_id) DO UPDATE SET messages = excluded.messages,"
                       " node_id = COALESCE(excluded.node_id, run_branches.node_id)",
                       (run_id, branch_id, node_id, encoded))

    def run_branches(self, run_id: str) -> list[dict[str, Any]]:
        """``[{branch_id, node_id, messages}]`` in the order branches were first recorded."""
        with self._transaction() as db:
            self._get_run(db, run_id)
            rows = db.execute("SELECT branch_id, node_id, messages FROM run_branches WHERE run_id = ?"
                              " ORDER BY rowid", (run_id,))
            return [{"branch_id": r["branch_id"], "node_id": r["node_id"], "messages": json.loads(r["messages"])}
                    for r in rows]
