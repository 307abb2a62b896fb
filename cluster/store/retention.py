"""Retention: which stored runs a policy lets go, and deleting them in short batches that never block a server.

Owns the view of every run the database keeps (a lane run's record, an engine run, a run
only the runtime's run log knows), whether each can still be resumed, the selection a
``RetentionPolicy`` makes (status, age, the N most recent kept), and the prune itself:
each batch of runs is one short write transaction (SQLite's ``BEGIN IMMEDIATE`` under the
store's busy timeout; PostgreSQL's write lock) deleting a run's record, signals, node
results, recorded branches, engine events, run log and the branches that were its alone,
then a pause for other writers. A run that can still be resumed is never deleted unless the
policy says so. Which lanes replay an ended run is told by the caller (the store knows no lane).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opgraph.actors.persistence.backends import Connection, describe, is_postgres, location
from opgraph.actors.persistence.pruning import (
    BRANCH_TABLES,
    RUN_LOG_TABLES,
    BranchHead,
    BranchSweep,
    branch_heads,
    branch_heads_in_scopes,
    chunks,
    delete_rows,
    delete_run_logs,
    logged_run_rows,
    placeholders,
    run_scope_prefixes,
    runtime_schema_version,
)

from .database import StoreDatabase
from .errors import WorkflowStoreError
from .runs import OWNER_PROCESS_LOST
from .schema import TERMINAL_RUN_STATUSES
from .space import StoreSize, checkpoint, give_back_free_pages, store_size

__all__ = [
    "ENDED_STATUSES",
    "RETENTION_STATUSES",
    "PruneReport",
    "RetentionPolicy",
    "Selection",
    "StoredRun",
    "holds_run_log",
    "prune_runs",
    "select_runs",
    "stored_runs",
]

# Every status a stored run can have, across its kinds: a lane run's, an engine run's
# (``degraded``), a logged run's (``live`` reads as running, ``error`` as failed).
RETENTION_STATUSES = ("admitted", "running", "completed", "degraded", "failed", "cancelled")
ENDED_STATUSES = frozenset({"completed", "degraded", "failed", "cancelled"})
# The store's own rows of a run, children before parents (foreign keys).
STORE_RUN_TABLES = ("run_signals", "run_nodes", "run_branches", "run_outlines", "runs")
ENGINE_RUN_TABLES = ("engine_events", "engine_runs")
# A run's outbox events (subject_id is its id) and their webhook deliveries, children first.
OUTBOX_TABLES = ("webhook_attempts", "webhook_deliveries", "outbox")
ALL_TABLES = (*STORE_RUN_TABLES, *ENGINE_RUN_TABLES, *OUTBOX_TABLES, *RUN_LOG_TABLES, *BRANCH_TABLES)
# A Session's own branches (``session-ID-NAME``): the Session drops them when it closes. A run
# may name one (and record it), but it is never a run's to delete.
SESSION_BRANCH_PREFIX = "session-"
_LOGGED_STATUS = {"live": "running", "error": "failed"}


@dataclass(frozen=True)
class RetentionPolicy:
    """What a prune deletes: runs whose status is in ``statuses`` (None: any), that ended (or,
    unended, began) at least ``older_than`` seconds ago (None: any age), beyond the ``keep_last``
    most recent runs of those statuses (None: keep none for recency). A run that can still be
    resumed (not ended, orphaned, or replayable) goes only with ``include_resumable``."""

    older_than: float | None = None
    keep_last: int | None = None
    statuses: frozenset[str] | None = None
    include_resumable: bool = False

    def __post_init__(self) -> None:
        if self.older_than is not None and not self.older_than >= 0:
            raise ValueError(f"older_than is a number of seconds, 0 or more, got {self.older_than!r}")
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 0):
            raise ValueError(f"keep_last is a whole number, 0 or more, got {self.keep_last!r}")
        if self.statuses is not None:
            unknown = set(self.statuses) - set(RETENTION_STATUSES)
            if unknown or not self.statuses:
                raise ValueError(f"statuses are some of {', '.join(RETENTION_STATUSES)}, got {sorted(self.statuses)}")
            object.__setattr__(self, "statuses", frozenset(self.statuses))

    @property
    def selective(self) -> bool:
        """Whether it says which runs go (an age, a number to keep, or statuses), not simply all."""
        return self.older_than is not None or self.keep_last is not None or self.statuses is not None

    def to_dict(self) -> dict[str, Any]:
        return {"older_than_seconds": self.older_than, "keep_last": self.keep_last,
                "statuses": sorted(self.statuses) if self.statuses is not None else None,
                "include_resumable": self.include_resumable}


@dataclass(frozen=True)
class StoredRun:
    """One run the database keeps. ``kind``: ``lane`` (a run store record, with its run log when it
    was durable), ``engine`` (an engine run and its events) or ``logged`` (a run only the runtime's
    run log knows: a Python ``Session.flow``). ``resumable`` says why it can still go on, else None."""

    run_id: str
    kind: str
    status: str
    created_at: float
    ended_at: float | None
    label: str = ""  # the lane or engine
    resumable: str | None = None

    @property
    def at(self) -> float:
        """When it ended, else when it began: what ``older_than`` measures from."""
        return self.ended_at if self.ended_at is not None else self.created_at

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "kind": self.kind, "label": self.label, "status": self.status,
                "created_at": self.created_at, "ended_at": self.ended_at, "resumable": self.resumable}


# -- what the database keeps ----------------------------------------------------------------
def _id_filter(run_ids: Collection[str] | None, column: str = "run_id") -> Iterable[tuple[str, list[str]]]:
    if run_ids is None:
        yield "", []
        return
    for part in chunks(sorted(run_ids)):
        yield f" WHERE {column} IN ({placeholders(len(part))})", list(part)


def _json(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _replayed(db: Connection) -> set[str]:
    """Runs another run was replayed from (its provenance names them: ADR-0068 D4 ``resumed_from``)."""
    column = db.json_text("provenance", "source", "resumed_from")
    return {row[0] for row in db.execute(f"SELECT {column} FROM runs WHERE {column} IS NOT NULL")}


def _load(db: Connection, *, replaying_lanes: Collection[str], run_log_here: bool, runtime: bool,
          run_ids: Collection[str] | None = None, replayed: set[str] | None = None) -> list[StoredRun]:
    logged = {row.run_id: row for row in logged_run_rows(db, run_ids)} if runtime else {}
    # Whether a missing header means "not durable": only where this database holds the run log.
    log_here = run_log_here and runtime
    replayed = _replayed(db) if replayed is None else replayed
    found: dict[str, StoredRun] = {}
    for where, parameters in _id_filter(run_ids):
        for run_id, lane, status, created, finished, error, capabilities in db.execute(
                "SELECT run_id, lane, status, created_at, finished_at, error, capabilities FROM runs" + where,
                parameters):
            log = logged.get(run_id)
            found[run_id] = StoredRun(run_id, "lane", status, created, finished, lane, _lane_resumable(
                status, lane, _json(error), _json(capabilities) or {},
                log_holds_it=(log is not None and log.has_header) or not log_here,
                replayed=run_id in replayed, replaying_lanes=replaying_lanes))
        for run_id, engine, status, created, finished in db.execute(
                "SELECT run_id, engine, status, created_at, finished_at FROM engine_runs" + where, parameters):
            if run_id not in found:
                found[run_id] = StoredRun(run_id, "engine", status, created, finished, engine,
                                          "live: the engine run has not ended" if status == "running" else None)
    for run_id, log in logged.items():
        if run_id not in found:
            status = _LOGGED_STATUS.get(log.status, log.status)
            found[run_id] = StoredRun(run_id, "logged", status, log.started, log.finished, "", (
                "live: the run log has no end for it (running, paused, or orphaned: `opgraph run resume` "
                "continues it)"
                if log.status == "live" else None))
    return list(found.values())


def _lane_resumable(status: str, lane: str, error: Any, capabilities: Mapping[str, Any], *, log_holds_it: bool,
                    replayed: bool, replaying_lanes: Collection[str]) -> str | None:
    if status not in TERMINAL_RUN_STATUSES:
        return f"live: {status}, not ended (or its owner's death not noticed yet)"
    if not log_holds_it:
        return None
    if status == "failed" and isinstance(error, Mapping) and error.get("error_type") == OWNER_PROCESS_LOST:
        return "orphaned: its owner process died; `opgraph run resume` continues it from the run log"
    if (lane in replaying_lanes and status in ("failed", "cancelled") and capabilities.get("checkpoint_resume")
            is True and not replayed):
        return f"replayable: a {status} {lane} run whose checkpoint `opgraph o flow --resume` replays"
    return None


def _runtime_tables(db: Connection, path: str) -> bool:
    """Whether the database holds the runtime's tables; older ones must be migrated by the runtime first."""
    from opgraph.actors.persistence.database import RUNTIME_SCHEMA_VERSION  # no Ray: the tables' version only

    version = runtime_schema_version(db)
    if version is not None and version != RUNTIME_SCHEMA_VERSION:
        raise WorkflowStoreError(f"the runtime tables of {describe(path)} have schema version {version}, and "
                                 f"this opgraph prunes version {RUNTIME_SCHEMA_VERSION}: open the database with "
                                 "this opgraph's runtime (any run) to migrate them, or upgrade opgraph")
    return version is not None


def holds_run_log(store_path: str | os.PathLike[str]) -> bool:
    """Whether the runtime's run log (``OPGRAPH_DB``, else the default database) is in the store at
    ``store_path``: then a run whose log the store lacks was not durable, and cannot be resumed."""
    from opgraph.actors.persistence.database import database_path  # no Ray: a path only

    if os.fspath(store_path) == ":memory:":
        return False
    here, log = location(store_path), database_path()
    if is_postgres(str(here)) or is_postgres(str(log)):
        return str(here) == str(log)
    return Path(here).resolve() == Path(log).resolve()


def stored_runs(store: StoreDatabase, *, replaying_lanes: Collection[str] = (), run_log_here: bool = True
                ) -> list[StoredRun]:
    """Every run the database keeps, newest first, with whether each can still be resumed.

    ``replaying_lanes``: lanes whose failed or cancelled runs can be replayed from their
    checkpoint (the lane registry says which). ``run_log_here=False`` when the runtime's run
    log lives in another database: a run whose log this one lacks may be resumable there."""
    with store.transaction() as db:
        runtime = _runtime_tables(db, store.path)
        runs = _load(db, replaying_lanes=replaying_lanes, run_log_here=run_log_here, runtime=runtime)
    return sorted(runs, key=lambda run: (run.created_at, run.run_id), reverse=True)


# -- what a policy selects -------------------------------------------------------------------
@dataclass
class Selection:
    """What a policy does with the runs it sees: ``delete`` (oldest first), and what it keeps."""

    matched: int = 0
    delete: list[StoredRun] = field(default_factory=list)
    kept_recent: int = 0
    kept_young: int = 0
    kept_resumable: list[StoredRun] = field(default_factory=list)


def _matches(run: StoredRun, policy: RetentionPolicy) -> bool:
    return policy.statuses is None or run.status in policy.statuses


def select_runs(runs: Iterable[StoredRun], policy: RetentionPolicy, now: float) -> Selection:
    """Runs matching the statuses, newest first; the ``keep_last`` first kept; of the rest, those
    at least ``older_than`` old go, unless they can be resumed (and the policy does not include them)."""
    matched = sorted((run for run in runs if _matches(run, policy)), key=lambda run: (run.created_at, run.run_id),
                     reverse=True)
    selection = Selection(matched=len(matched))
    keep = policy.keep_last if policy.keep_last is not None else 0
    selection.kept_recent = min(keep, len(matched))
    for run in matched[keep:]:
        if policy.older_than is not None and now - run.at < policy.older_than:
            selection.kept_young += 1
        elif run.resumable is not None and not policy.include_resumable:
            selection.kept_resumable.append(run)
        else:
            selection.delete.append(run)
    selection.delete.reverse()  # oldest first: a prune stopped half-way has removed the oldest
    return selection


# -- the prune -------------------------------------------------------------------------------
@dataclass
class PruneReport:
    """What a prune deleted (or, ``dry_run``, would delete): runs, rows per table, and the store's size."""

    dry_run: bool
    database: str
    dialect: str
    policy: dict[str, Any]
    matched: int = 0
    runs: int = 0
    kept_recent: int = 0
    kept_young: int = 0
    kept_resumable: int = 0
    changed: int = 0  # selected, then left: it changed meanwhile (resumed, say)
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ALL_TABLES, 0))
    before: StoreSize | None = None
    after: StoreSize | None = None
    space_error: str | None = None  # giving space back failed (the rows are deleted all the same)
    batches: int = 0
    seconds: float = 0.0
    stopped: bool = False
    resumable: list[dict[str, Any]] = field(default_factory=list)  # a few of the runs kept as resumable

    @property
    def rows_total(self) -> int:
        return sum(self.rows.values())

    @property
    def reclaimed_bytes(self) -> int | None:
        """What the store shrank by (None for a dry run); PostgreSQL's tables shrink only as
        autovacuum and new rows reuse the space, so this is often 0 there."""
        if self.dry_run or self.before is None or self.after is None:
            return None
        return self.before.bytes - self.after.bytes

    def add(self, counts: Mapping[str, int]) -> None:
        for table, count in counts.items():
            self.rows[table] = self.rows.get(table, 0) + count

    def to_dict(self) -> dict[str, Any]:
        return {"dry_run": self.dry_run, "database": self.database, "dialect": self.dialect, "policy": self.policy,
                "matched": self.matched, "runs": self.runs,
                "kept": {"recent": self.kept_recent, "younger": self.kept_young, "resumable": self.kept_resumable,
                         "changed_meanwhile": self.changed},
                "rows": dict(self.rows), "rows_total": self.rows_total,
                "bytes": {"before": self.before.to_dict() if self.before else None,
                          "after": self.after.to_dict() if self.after else None,
                          "reclaimed": self.reclaimed_bytes},
                "space_error": self.space_error, "batches": self.batches, "seconds": round(self.seconds, 3),
                "stopped": self.stopped, "resumable_examples": self.resumable}


@dataclass
class _Pruner:
    """One prune's state across its batches."""

    store: StoreDatabase
    policy: RetentionPolicy
    dry_run: bool
    replaying_lanes: Collection[str]
    run_log_here: bool
    runtime: bool
    replayed: set[str]
    sweep: BranchSweep
    gone: set[str] = field(default_factory=set)  # runs deleted (or counted) so far

    def batch(self, run_ids: Sequence[str], report: PruneReport) -> None:
        with self.store.transaction(write=not self.dry_run) as db:
            if not self.dry_run:
                run_ids = self._still_prunable(db, run_ids, report)
            leaving = self.gone | set(run_ids)
            if self.runtime:
                report.add({"runtime_branch_heads": self.sweep.drop(db, self._branch_heads(db, run_ids, leaving))})
                report.add(delete_run_logs(db, run_ids, count_only=self.dry_run))
            for part in chunks(run_ids):
                where, marks = f"run_id IN ({placeholders(len(part))})", list(part)
                for table in (*STORE_RUN_TABLES, *ENGINE_RUN_TABLES):
                    report.add({table: delete_rows(db, table, where, marks, count_only=self.dry_run)})
                events = f"SELECT event_id FROM outbox WHERE subject_id IN ({placeholders(len(part))})"
                deliveries = f"SELECT delivery_id FROM webhook_deliveries WHERE event_id IN ({events})"
                for table, outbox_where in (("webhook_attempts", f"delivery_id IN ({deliveries})"),
                                            ("webhook_deliveries", f"event_id IN ({events})"),
                                            ("outbox", f"subject_id IN ({placeholders(len(part))})")):
                    report.add({table: delete_rows(db, table, outbox_where, marks, count_only=self.dry_run)})
        self.gone.update(run_ids)
        report.runs += len(run_ids)
        report.batches += 1

    def _still_prunable(self, db: Connection, run_ids: Sequence[str], report: PruneReport) -> list[str]:
        """Within the batch's transaction: a run that changed since it was selected (resumed, reopened)
        and now may not go is left alone. A run already gone is simply gone."""
        now = {run.run_id: run for run in _load(db, replaying_lanes=self.replaying_lanes,
                                                 run_log_here=self.run_log_here, runtime=self.runtime,
                                                 run_ids=run_ids, replayed=self.replayed)}
        kept = [run_id for run_id in run_ids if run_id in now and not (
            _matches(now[run_id], self.policy)
            and (now[run_id].resumable is None or self.policy.include_resumable))]
        report.changed += len(kept)
        return [run_id for run_id in run_ids if run_id not in kept]

    def _branch_heads(self, db: Connection, run_ids: Sequence[str], leaving: set[str]) -> list[BranchHead]:
        """The heads of the batch's branches: those named in its runs' own scopes, and those its runs
        recorded, except a Session's and any another run (one not leaving) still records or owns.
        Only branches that still have a head are looked up further (a lane's run drops its own at its
        end), so a batch of such runs reads no more than the branch-id index."""
        recorded: set[str] = set()
        for part in chunks(run_ids):
            recorded.update(row[0] for row in db.execute(
                f"SELECT branch_id FROM run_branches WHERE run_id IN ({placeholders(len(part))})", list(part)))
        named = branch_heads_in_scopes(db, [prefix for run_id in run_ids for prefix in run_scope_prefixes(run_id)])
        found = {head.branch_id for head in named}
        heads = [*named, *branch_heads(db, {branch for branch in recorded - found
                                             if not branch.startswith(SESSION_BRANCH_PREFIX)})]
        if not heads:
            return []
        needed = self._still_referenced(db, {head.branch_id for head in heads}, leaving)
        return [head for head in heads if head.branch_id not in needed]

    def _still_referenced(self, db: Connection, branch_ids: set[str], leaving: set[str]) -> set[str]:
        referenced: set[str] = set()
        ordered = sorted(branch_ids)
        for part in chunks(ordered):
            for run_id, branch_id in db.execute("SELECT run_id, branch_id FROM run_branches WHERE branch_id IN "
                                                f"({placeholders(len(part))})", list(part)):
                if run_id not in leaving:
                    referenced.add(branch_id)
        # A branch named in another run's own scope is that run's while it stays.
        owners: dict[str, set[str]] = {}
        for branch_id in ordered:
            for prefix in ("run-", "branch-"):
                if branch_id.startswith(prefix):
                    rest = branch_id[len(prefix):]
                    for end in (index for index, char in enumerate(rest) if char == "-"):
                        owners.setdefault(rest[:end], set()).add(branch_id)
        candidates = [run_id for run_id in owners if run_id not in leaving]
        for part in chunks(candidates):
            marks = placeholders(len(part))
            for table in ("runs", "engine_runs", *(("runtime_runs",) if self.runtime else ())):
                for (run_id,) in db.execute(f"SELECT run_id FROM {table} WHERE run_id IN ({marks})", list(part)):
                    referenced.update(owners[run_id])
        return referenced

    def collect_branches(self, report: PruneReport) -> None:
        """The records only the deleted heads reached, one owner's shard a transaction."""
        for owner, shard in self.sweep.shards():
            with self.store.transaction(write=not self.dry_run) as db:
                report.add(self.sweep.collect(db, owner, shard))


# A batch whose transaction took longer than this is halved next time (and one far quicker
# doubled, up to the batch size asked for): a server's writers wait at most about this long.
BATCH_TARGET_SECONDS = 0.25


def prune_runs(store: StoreDatabase, policy: RetentionPolicy, *, dry_run: bool = False,
               replaying_lanes: Collection[str] = (), run_log_here: bool = True, now: float | None = None,
               batch_size: int = 100, pause: float = 0.02, stop: threading.Event | None = None) -> PruneReport:
    """Delete what ``policy`` selects, ``batch_size`` runs a transaction (fewer while batches are slow),
    pausing ``pause`` seconds between them; ``dry_run`` counts the same rows and deletes nothing.

    Each run's record, signals, node results and recorded branches, engine events, run log
    (header, record batches, end) and the branches that were its alone go in its batch's
    transaction; the records only those branches reached follow, an owner's shard at a time.
    Then a SQLite file made with incremental vacuum gives its free pages back (a step a
    transaction) and its WAL is checkpointed. ``stop`` (set from another thread) ends the prune
    between two batches. ``now`` is the clock ``older_than`` is measured against."""
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"batch_size is a whole number from 1, got {batch_size!r}")
    started = time.monotonic()
    report = PruneReport(dry_run, describe(store.path), store.dialect, policy.to_dict())
    report.before = store_size(store)
    with store.transaction() as db:
        runtime = _runtime_tables(db, store.path)
        replayed = _replayed(db)
        runs = _load(db, replaying_lanes=replaying_lanes, run_log_here=run_log_here, runtime=runtime,
                     replayed=replayed)
    selection = select_runs(runs, policy, time.time() if now is None else now)
    report.matched, report.kept_recent, report.kept_young = selection.matched, selection.kept_recent, \
        selection.kept_young
    report.kept_resumable = len(selection.kept_resumable)
    report.resumable = [run.to_dict() for run in selection.kept_resumable[:20]]
    pruner = _Pruner(store, policy, dry_run, replaying_lanes, run_log_here, runtime, replayed,
                     BranchSweep(count_only=dry_run))
    ids = [run.run_id for run in selection.delete]
    size, position = batch_size, 0
    while position < len(ids):
        if stop is not None and stop.is_set():
            report.stopped = True
            break
        began = time.monotonic()
        pruner.batch(ids[position:position + size], report)
        position += size
        took = time.monotonic() - began
        size = max(1, size // 2) if took > BATCH_TARGET_SECONDS else \
            min(batch_size, size * 2) if took < BATCH_TARGET_SECONDS / 4 else size
        if pause and position < len(ids):
            time.sleep(pause)  # another writer's turn (SQLite's lock is not handed over fairly)
    pruner.collect_branches(report)
    if not dry_run:
        try:
            give_back_free_pages(store, pause=pause, stop=stop)
            checkpoint(store)
        except WorkflowStoreError as exc:  # the rows are gone either way; the space comes back next time
            report.space_error = str(exc)
    report.after = store_size(store) if not dry_run else report.before
    report.seconds = time.monotonic() - started
    return report
