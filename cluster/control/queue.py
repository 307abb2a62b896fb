"""The task queue: durable tasks claimed under leases, in one statement, with the database as the arbiter.

Owns every task transition (queued -> leased -> running -> succeeded | failed | cancelled | dead),
each one statement fenced by the lease's token, with its event row and the transition hooks
in the same transaction; the claim (PostgreSQL: ``FOR UPDATE SKIP LOCKED``; SQLite: one
``UPDATE ... RETURNING`` inside ``BEGIN IMMEDIATE``); leases, heartbeats and their expiry;
attempts, backoff and the dead state; priorities; idempotency keys; and concurrency limits per
queue and per key, counted over unexpired leases only, so a crashed worker's slot frees itself
when its lease lapses. It never imports or runs an action adapter: workers do.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from opgraph.actors.persistence.backends import Connection, Row

from .database import ControlDatabase
from .errors import (
    ACTION_KINDS,
    ControlInputError,
    LeaseLostError,
    TaskNotFoundError,
    TaskStateError,
    UnknownActionKindError,
)
from .schema import TASK_STATES, TERMINAL_TASK_STATES

__all__ = ["ACTIVE_STATES", "Claim", "TaskQueue", "TaskRecord", "WorkerRecord", "backoff_delay", "new_worker_id"]

ACTIVE_STATES = ("leased", "running")
_COLUMNS = ("task_id, queue, action_kind, target, payload, priority, state, idempotency_key, concurrency_key, "
            "concurrency_limit, attempts, max_attempts, backoff_base, backoff_max, available_at, held, reason, "
            "lease_owner, lease_token, lease_expires_at, heartbeat_at, claimed_at, run_id, cancel_requested, "
            "schedule_id, nominal_at, result, error, created_at, updated_at, finished_at")
_SET_LEASE = ("state = 'leased', lease_owner = ?, lease_token = lease_token + 1, lease_expires_at = ?, "
              "heartbeat_at = ?, claimed_at = ?, attempts = attempts + 1, reason = NULL, updated_at = ?")
# How long a claimer trusts what it read of a queue's limits before reading them again.
_LIMITS_TTL = 1.0
MAX_NAME = 120


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait after attempt ``attempt`` failed: doubling from ``base``, at most ``cap``."""
    return min(cap, base * (2 ** max(0, attempt - 1)))


class Record:
    """A control record's fields as a dict, one level deep (what ``--json`` and the HTTP API show)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


@dataclass(frozen=True, slots=True)
class TaskRecord(Record):
    """One task row; ``payload``, ``result`` and ``error`` decoded from JSON."""

    task_id: str
    queue: str
    action_kind: str
    target: str
    payload: dict[str, Any]
    priority: int
    state: str
    idempotency_key: str | None
    concurrency_key: str | None
    concurrency_limit: int | None
    attempts: int
    max_attempts: int
    backoff_base: float
    backoff_max: float
    available_at: float
    held: int
    reason: str | None
    lease_owner: str | None
    lease_token: int
    lease_expires_at: float | None
    heartbeat_at: float | None
    claimed_at: float | None
    run_id: str | None
    cancel_requested: int
    schedule_id: str | None
    nominal_at: float | None
    result: Any
    error: Any
    created_at: float
    updated_at: float
    finished_at: float | None

    @classmethod
    def from_row(cls, row: Row | Mapping[str, Any]) -> TaskRecord:
        values = {field.name: row[field.name] for field in fields(cls)}
        for name in ("payload", "result", "error"):
            if values[name] is not None:
                values[name] = json.loads(values[name])
        values["payload"] = values["payload"] or {}
        return cls(**values)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_TASK_STATES


@dataclass(frozen=True, slots=True)
class Claim:
    """A won lease: the task as claimed and the token every later write of this worker must show."""

    task: TaskRecord
    token: int
    worker: str


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    worker_id: str
    queue: str
    action_kinds: tuple[str, ...]
    concurrency: int
    host: str | None
    pid: int | None
    started_at: float
    seen_at: float
    state: str


def _check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME:
        raise ControlInputError(f"{what} must be 1 to {MAX_NAME} characters, got {value!r}", field=what)
    return value


class TaskQueue:
    """The queue's operations on one ``ControlDatabase``; every time comes from its clock."""

    def __init__(self, database: ControlDatabase) -> None:
        self.db = database
        self._limits: dict[str, tuple[float, bool]] = {}

    @property
    def clock(self) -> Any:
        return self.db.clock

    # -- producing ----------------------------------------------------------------------
    def submit(self, action_kind: str, target: str, *, queue: str = "default", payload: Mapping[str, Any] | None = None,
               priority: int = 0, idempotency_key: str | None = None, concurrency_key: str | None = None,
               concurrency_limit: int | None = None, max_attempts: int = 3, backoff_base: float = 1.0,
               backoff_max: float = 300.0, available_at: float | None = None) -> tuple[TaskRecord, bool]:
        """Queue a task; ``(task, created)``. A second submit with the same ``idempotency_key``
        returns the first task and ``created=False``: nothing new is queued."""
        self._check(action_kind, target, queue, max_attempts, concurrency_key, concurrency_limit, payload)
        with self.db.transaction(write=True) as db:
            if idempotency_key is not None:
                found = self._by_key(db, idempotency_key)
                if found is not None:
                    return found, False
            task = self.insert(db, action_kind, target, queue=queue, payload=payload, priority=priority,
                               idempotency_key=idempotency_key, concurrency_key=concurrency_key,
                               concurrency_limit=concurrency_limit, max_attempts=max_attempts,
                               backoff_base=backoff_base, backoff_max=backoff_max, available_at=available_at)
            if task is None:  # another submitter won the key between our read and our write (PostgreSQL)
                return self._by_key(db, idempotency_key), False
            return task, True

    @staticmethod
    def _check(action_kind: str, target: str, queue: str, max_attempts: int, concurrency_key: str | None,
               concurrency_limit: int | None, payload: Any) -> None:
        if action_kind not in ACTION_KINDS:
            raise UnknownActionKindError(str(action_kind), ACTION_KINDS)
        _check_name(queue, "queue")
        if not isinstance(target, str) or not target.strip():
            raise ControlInputError("a task needs a target (a workflow name, a prompt, a file)", field="target")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ControlInputError(f"max_attempts must be at least 1, got {max_attempts!r}", field="max_attempts")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ControlInputError(f"concurrency_limit must be at least 1, got {concurrency_limit!r}",
                                    field="concurrency_limit")
        if concurrency_limit is not None and concurrency_key is None:
            raise ControlInputError("concurrency_limit needs a concurrency_key", field="concurrency_key")
        if payload is not None and not isinstance(payload, Mapping):
            raise ControlInputError("payload must be a JSON object", field="payload")

    def insert(self, db: Connection, action_kind: str, target: str, *, queue: str = "default",
               payload: Mapping[str, Any] | None = None, priority: int = 0, idempotency_key: str | None = None,
               concurrency_key: str | None = None, concurrency_limit: int | None = None, max_attempts: int = 3,
               backoff_base: float = 1.0, backoff_max: float = 300.0, available_at: float | None = None,
               schedule_id: str | None = None, nominal_at: float | None = None, held: bool = False,
               reason: str | None = None) -> TaskRecord | None:
        """Insert a task in the caller's transaction (the scheduler's fire commits with it); None when
        ``idempotency_key`` is taken already."""
        now = self.clock()
        task_id = "t" + uuid.uuid4().hex[:15]
        if concurrency_key is not None and concurrency_limit is None:
            concurrency_limit = 1
        row = db.execute(
            f"""INSERT INTO control_tasks (task_id, queue, action_kind, target, payload, priority, state,
                idempotency_key, concurrency_key, concurrency_limit, max_attempts, backoff_base, backoff_max,
                available_at, held, reason, schedule_id, nominal_at, created_at, updated_at)
                VALUES (?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                ON CONFLICT (idempotency_key) DO NOTHING RETURNING {_COLUMNS}""",
            (task_id, queue, action_kind, target, json.dumps(dict(payload or {}), sort_keys=True), int(priority),
             idempotency_key, concurrency_key, concurrency_limit, max_attempts, float(backoff_base),
             float(backoff_max), now if available_at is None else float(available_at), int(held), reason,
             schedule_id, nominal_at, now, now)).fetchone()
        if row is None:
            return None
        task = TaskRecord.from_row(row)
        self._event(db, task, None, "queued", "submitted", None, reason)
        return task

    def set_queue_limit(self, queue: str, limit: int | None) -> None:
        """At most ``limit`` tasks of ``queue`` hold a live lease at once (None: no limit)."""
        _check_name(queue, "queue")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ControlInputError(f"a queue's concurrency limit must be at least 1, got {limit!r}", field="limit")
        with self.db.transaction(write=True) as db:
            db.execute("INSERT INTO control_queues (queue, concurrency_limit, updated_at) VALUES (?, ?, ?) "
                       "ON CONFLICT (queue) DO UPDATE SET concurrency_limit = excluded.concurrency_limit, "
                       "updated_at = excluded.updated_at", (queue, limit, self.clock()))
        self._limits.pop(queue, None)

    # -- claiming -----------------------------------------------------------------------
    def claim(self, queue: str, worker: str, *, lease_seconds: float = 30.0,
              action_kinds: Sequence[str] | None = None) -> Claim | None:
        """Win the lease on the best due task of ``queue`` (highest priority, then longest due), or None.

        Only tasks whose ``action_kind`` is in ``action_kinds`` (None: any) are taken, so a task no
        worker here can route stays queued for one that can. A concurrency key or a queue limit is
        counted over unexpired leases only.
        """
        now = self.clock()
        lease = (worker, now + lease_seconds, now, now, now)
        kinds = tuple(action_kinds) if action_kinds is not None else None
        kind_filter = "" if kinds is None else f" AND t.action_kind IN ({', '.join('?' * len(kinds))})"
        kind_values = () if kinds is None else kinds
        if self.db.dialect == "postgresql" and not self.db.hooked("leased") and not self._limited(queue):
            # One statement, committed on its own: rows another claimer holds are skipped, not waited for.
            sql = (f"UPDATE control_tasks SET {_SET_LEASE}{_LAZY_COMMIT} WHERE task_id = (SELECT t.task_id "
                   f"FROM control_tasks t WHERE t.queue = ? AND t.state = 'queued' AND t.held = 0 "
                   f"AND t.available_at <= ? AND t.concurrency_key IS NULL{kind_filter} "
                   f"ORDER BY t.priority DESC, t.available_at, t.task_id "
                   f"LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING {_COLUMNS}")
            with self.db.autocommit() as db:
                row = _commit_lazily(db, sql, (*lease, queue, now, *kind_values))
            return None if row is None else self._claimed(row, worker)
        skip_locked = " FOR UPDATE OF t SKIP LOCKED" if self.db.dialect == "postgresql" else ""
        sql = (f"UPDATE control_tasks SET {_SET_LEASE} WHERE task_id = (SELECT t.task_id FROM control_tasks t "
               f"WHERE t.queue = ? AND t.state = 'queued' AND t.held = 0 AND t.available_at <= ?{kind_filter} "
               f"AND (t.concurrency_key IS NULL OR (SELECT count(*) FROM control_tasks r "
               f"WHERE r.concurrency_key = t.concurrency_key AND r.state IN ('leased', 'running') "
               f"AND r.lease_expires_at > ?) < t.concurrency_limit) "
               f"{{queue_limit}}ORDER BY t.priority DESC, t.available_at, t.task_id LIMIT 1{skip_locked}) "
               f"RETURNING {_COLUMNS}")
        with self.db.transaction(write=True) as db:
            # PostgreSQL: claims that count leases queue behind one lock per queue, so two claimers
            # never both see the last free slot (SQLite's BEGIN IMMEDIATE already serializes them).
            self.db.lock_key(db, f"queue:{queue}")
            found = db.execute("SELECT concurrency_limit FROM control_queues WHERE queue = ?", (queue,)).fetchone()
            limit = None if found is None else found[0]
            # The queue's leases are counted only when it has a limit: the count grows with the queue.
            queue_limit = "" if limit is None else ("AND (SELECT count(*) FROM control_tasks r WHERE r.queue = t.queue "
                                                    "AND r.state IN ('leased', 'running') AND r.lease_expires_at > ?) "
                                                    "< ? ")
            extra = () if limit is None else (now, limit)
            row = db.execute(sql.replace("{queue_limit}", queue_limit),
                             (*lease, queue, now, *kind_values, now, *extra)).fetchone()
            if row is None:
                return None
            claim = self._claimed(row, worker)
            self._hooks(db, claim.task, "queued", "leased", "claimed", worker, None)
            return claim

    def _claimed(self, row: Row, worker: str) -> Claim:
        task = TaskRecord.from_row(row)
        return Claim(task=task, token=task.lease_token, worker=worker)

    def _limited(self, queue: str) -> bool:
        """Whether claims on ``queue`` must count leases: it has a limit, or keyed tasks wait in it."""
        now = time.monotonic()
        cached = self._limits.get(queue)
        if cached is not None and now - cached[0] < _LIMITS_TTL:
            return cached[1]
        with self.db.autocommit() as db:
            row = db.execute(
                "SELECT EXISTS (SELECT 1 FROM control_queues WHERE queue = ? AND concurrency_limit IS NOT NULL) "
                "OR EXISTS (SELECT 1 FROM control_tasks WHERE queue = ? AND state = 'queued' "
                "AND concurrency_key IS NOT NULL)", (queue, queue)).fetchone()
        limited = bool(row[0])
        self._limits[queue] = (now, limited)
        return limited

    # -- a lease holder's writes (fenced by its token) ------------------------------------
    def heartbeat(self, claim: Claim, *, lease_seconds: float = 30.0) -> bool:
        """Extend the lease; True when someone asked to cancel the task (the worker should stop it).
        ``LeaseLostError`` when the lease lapsed and was taken over, or the task was terminated."""
        now = self.clock()
        with self.db.transaction() as db:
            row = db.execute(
                "UPDATE control_tasks SET lease_expires_at = ?, heartbeat_at = ?, updated_at = ? "
                "WHERE task_id = ? AND lease_token = ? AND state IN ('leased', 'running') AND lease_expires_at > ? "
                "RETURNING cancel_requested",
                (now + lease_seconds, now, now, claim.task.task_id, claim.token, now)).fetchone()
        if row is None:
            raise LeaseLostError(claim.task.task_id, claim.worker)
        return bool(row[0])

    def mark_running(self, claim: Claim, run_id: str) -> TaskRecord:
        """The task's run has its id: recorded before it starts, so a successor finds it in the run log."""
        return self._transition(claim, ("leased", "running"), "running", "started", run_id=run_id)

    def succeed(self, claim: Claim, result: Any = None) -> TaskRecord:
        return self._transition(claim, ACTIVE_STATES, "succeeded", "succeeded", result=result, finished=True)

    def fail(self, claim: Claim, error: Any, *, retryable: bool = True) -> TaskRecord:
        """The attempt failed: queued again after its backoff while attempts remain and ``retryable``,
        else ``failed`` (not retryable) or ``dead`` (attempts spent), with the reason."""
        task = claim.task
        if not retryable:
            return self._transition(claim, ACTIVE_STATES, "failed", "failed", error=error, finished=True,
                                    reason=f"failed and not retryable: {_summary(error)}")
        if task.attempts >= task.max_attempts:
            return self._transition(claim, ACTIVE_STATES, "dead", "dead", error=error, finished=True,
                                    reason=f"attempt {task.attempts} of {task.max_attempts} failed: {_summary(error)}")
        delay = backoff_delay(task.attempts, task.backoff_base, task.backoff_max)
        return self._transition(claim, ACTIVE_STATES, "queued", "retry", error=error, clear_run=True,
                                available_at=self.clock() + delay,
                                reason=f"attempt {task.attempts} of {task.max_attempts} failed; retrying in "
                                       f"{delay:g} s: {_summary(error)}")

    def release(self, claim: Claim, reason: str, *, keep_run: bool = True) -> TaskRecord:
        """Give the task back unfinished (a worker stopping): queued at once, this attempt not counted.
        ``keep_run``: the next worker continues the run from the log; else (the run was cancelled) it
        starts a new one."""
        return self._transition(claim, ACTIVE_STATES, "queued", "released", reason=reason, uncount=True,
                                available_at=self.clock(), clear_run=not keep_run)

    def _transition(self, claim: Claim, sources: Iterable[str], to_state: str, kind: str, *,
                    run_id: str | None = None, result: Any = None, error: Any = None, finished: bool = False,
                    reason: str | None = None, clear_run: bool = False, uncount: bool = False,
                    available_at: float | None = None) -> TaskRecord:
        now = self.clock()
        sources = tuple(sources)
        # The columns this transition sets: always its state, time and reason; the others when given.
        given = {"run_id": run_id, "result": _encoded(result), "error": _encoded(error),
                 "finished_at": now if finished else None, "available_at": available_at}
        columns = {"state": to_state, "updated_at": now, "reason": reason,
                   **{column: value for column, value in given.items() if value is not None}}
        sets = [f"{column} = ?" for column in columns]
        values = list(columns.values())
        if clear_run:
            sets.append("run_id = NULL")
        if uncount:
            sets.append("attempts = attempts - 1")
        if to_state not in ACTIVE_STATES:
            sets.append("lease_expires_at = NULL")
        update = (f"UPDATE control_tasks SET {', '.join(sets)} WHERE task_id = ? AND lease_token = ? "
                  f"AND state IN ({', '.join('?' * len(sources))}) AND lease_expires_at > ? RETURNING {_COLUMNS}")
        parameters = (*values, claim.task.task_id, claim.token, *sources, now)
        if self.db.dialect == "postgresql" and not self.db.hooked(to_state) and claim.task.schedule_id is None:
            # One statement, one round trip: the transition and its event row commit together.
            with self.db.autocommit() as db:
                row = db.execute(
                    f"WITH changed AS ({update}), logged AS (INSERT INTO control_task_events (task_id, at, "
                    f"from_state, to_state, kind, worker, attempt, detail) SELECT task_id, ?, ?, ?, ?, ?, attempts, ? "
                    f"FROM changed) SELECT {_COLUMNS} FROM changed",
                    (*parameters, now, claim.task.state, to_state, kind, claim.worker, reason)).fetchone()
            if row is None:
                raise LeaseLostError(claim.task.task_id, claim.worker)
            return TaskRecord.from_row(row)
        with self.db.transaction(write=True) as db:
            row = db.execute(update, parameters).fetchone()
            if row is None:
                raise LeaseLostError(claim.task.task_id, claim.worker)
            task = TaskRecord.from_row(row)
            self._event(db, task, claim.task.state, to_state, kind, claim.worker, reason)
            if task.terminal:
                self._release_buffered(db, task)
            return task

    # -- anyone's writes ------------------------------------------------------------------
    def cancel(self, task_id: str, *, reason: str = "cancelled by an operator", terminate: bool = True) -> TaskRecord:
        """Cancel a task. Queued: cancelled at once. Leased or running: ``terminate`` ends its lease
        now (the worker's next heartbeat finds it gone and stops the run); else the worker is asked
        to stop (``cancel_requested``) and records the cancellation itself."""
        now = self.clock()
        with self.db.transaction(write=True) as db:
            task = self._get(db, task_id)
            if task.terminal:
                raise TaskStateError(f"task {task_id} is {task.state} already; only an unfinished task can be "
                                     f"cancelled", task_id=task_id, state=task.state)
            if task.state in ACTIVE_STATES and not terminate:
                row = db.execute(f"UPDATE control_tasks SET cancel_requested = 1, reason = ?, updated_at = ? "
                                 f"WHERE task_id = ? RETURNING {_COLUMNS}", (reason, now, task_id)).fetchone()
                return TaskRecord.from_row(row)
            row = db.execute(f"UPDATE control_tasks SET state = 'cancelled', reason = ?, updated_at = ?, "
                             f"finished_at = ?, lease_expires_at = NULL, held = 0 WHERE task_id = ? "
                             f"RETURNING {_COLUMNS}", (reason, now, now, task_id)).fetchone()
            cancelled = TaskRecord.from_row(row)
            self._event(db, cancelled, task.state, "cancelled", "cancelled", None, reason)
            self._release_buffered(db, cancelled)
            return cancelled

    def cancelled_by_worker(self, claim: Claim, reason: str) -> TaskRecord:
        """The worker stopped the run it was asked to cancel."""
        return self._transition(claim, ACTIVE_STATES, "cancelled", "cancelled", reason=reason, finished=True)

    def retry(self, task_id: str, *, reason: str = "retried by an operator") -> TaskRecord:
        """Queue a failed, dead or cancelled task again with its attempts reset (a new run)."""
        now = self.clock()
        with self.db.transaction(write=True) as db:
            task = self._get(db, task_id)
            if task.state not in ("failed", "dead", "cancelled"):
                raise TaskStateError(f"task {task_id} is {task.state}; only a failed, dead or cancelled task can "
                                     f"be retried", task_id=task_id, state=task.state)
            row = db.execute(f"UPDATE control_tasks SET state = 'queued', attempts = 0, run_id = NULL, held = 0, "
                             f"cancel_requested = 0, available_at = ?, reason = ?, finished_at = NULL, "
                             f"updated_at = ? WHERE task_id = ? RETURNING {_COLUMNS}",
                             (now, reason, now, task_id)).fetchone()
            again = TaskRecord.from_row(row)
            self._event(db, again, task.state, "queued", "retried", None, reason)
            return again

    def reap(self, *, limit: int = 500) -> list[TaskRecord]:
        """Tasks whose lease lapsed go back to the queue (their run id kept: the next worker continues
        the run), or to ``dead`` when their attempts are spent. Returns them."""
        now = self.clock()
        with self.db.transaction(write=True) as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM control_tasks WHERE state IN ('leased', 'running') "
                              f"AND lease_expires_at <= ? ORDER BY lease_expires_at LIMIT ?"
                              + (" FOR UPDATE SKIP LOCKED" if db.dialect == "postgresql" else ""),
                              (now, limit)).fetchall()
            reaped = []
            for row in rows:
                task = TaskRecord.from_row(row)
                spent = task.attempts >= task.max_attempts
                reason = (f"the lease of worker {task.lease_owner} lapsed at {task.lease_expires_at:.3f} "
                          f"(attempt {task.attempts} of {task.max_attempts})")
                to_state = "dead" if spent else "queued"
                new = db.execute(
                    f"UPDATE control_tasks SET state = ?, reason = ?, updated_at = ?, lease_expires_at = NULL, "
                    f"available_at = ?, finished_at = ? WHERE task_id = ? AND lease_token = ? RETURNING {_COLUMNS}",
                    (to_state, reason + ("; attempts spent" if spent else "; queued for another worker"), now, now,
                     now if spent else None, task.task_id, task.lease_token)).fetchone()
                if new is None:
                    continue
                new_task = TaskRecord.from_row(new)
                self._event(db, new_task, task.state, to_state, "lease_expired", task.lease_owner, reason)
                if new_task.terminal:
                    self._release_buffered(db, new_task)
                reaped.append(new_task)
            return reaped

    # -- reading ------------------------------------------------------------------------
    def get(self, task_id: str) -> TaskRecord:
        with self.db.transaction() as db:
            return self._get(db, task_id)

    def _get(self, db: Connection, task_id: str) -> TaskRecord:
        row = db.execute(f"SELECT {_COLUMNS} FROM control_tasks WHERE task_id = ?", (task_id,)).fetchone()
        if row is None:
            raise TaskNotFoundError(task_id)
        return TaskRecord.from_row(row)

    def _by_key(self, db: Connection, key: str | None) -> TaskRecord | None:
        row = db.execute(f"SELECT {_COLUMNS} FROM control_tasks WHERE idempotency_key = ?", (key,)).fetchone()
        return None if row is None else TaskRecord.from_row(row)

    def list_tasks(self, *, queue: str | None = None, state: str | None = None, schedule_id: str | None = None,
             limit: int = 100) -> list[TaskRecord]:
        if state is not None and state not in TASK_STATES:
            raise ControlInputError(f"unknown task state {state!r}; states: {', '.join(TASK_STATES)}", field="state")
        where, values = [], []
        for column, value in (("queue", queue), ("state", state), ("schedule_id", schedule_id)):
            if value is not None:
                where.append(f"{column} = ?")
                values.append(value)
        sql = (f"SELECT {_COLUMNS} FROM control_tasks" + (f" WHERE {' AND '.join(where)}" if where else "")
               + " ORDER BY created_at DESC, task_id LIMIT ?")
        with self.db.transaction() as db:
            return [TaskRecord.from_row(row) for row in db.execute(sql, (*values, int(limit))).fetchall()]

    def events(self, task_id: str) -> list[dict[str, Any]]:
        with self.db.transaction() as db:
            rows = db.execute("SELECT at, from_state, to_state, kind, worker, attempt, detail FROM "
                              "control_task_events WHERE task_id = ? ORDER BY event_id", (task_id,)).fetchall()
        return [dict(zip(("at", "from_state", "to_state", "kind", "worker", "attempt", "detail"), row, strict=True))
                for row in rows]

    def why_waiting(self, task: TaskRecord) -> str | None:
        """Why a queued task has not been claimed, in words a user can act on (None for other states)."""
        if task.state != "queued":
            return None
        now = self.clock()
        if task.held:
            return task.reason or "buffered behind its schedule's running task"
        if task.available_at > now:
            return (task.reason + "; " if task.reason else "") + f"due in {task.available_at - now:.1f} s"
        workers = [worker for worker in self.workers(queue=task.queue) if worker.state == "running"]
        if not workers:
            return f"no live worker on queue {task.queue!r}; start one: opgraph worker --queue {task.queue}"
        if not any(task.action_kind in worker.action_kinds for worker in workers):
            kinds = sorted({kind for worker in workers for kind in worker.action_kinds})
            return (f"no live worker on queue {task.queue!r} takes action_kind {task.action_kind!r} "
                    f"(its workers take {', '.join(kinds)})")
        if task.concurrency_key is not None:
            with self.db.transaction() as db:
                held = db.execute("SELECT count(*) FROM control_tasks WHERE concurrency_key = ? AND state IN "
                                  "('leased', 'running') AND lease_expires_at > ?",
                                  (task.concurrency_key, now)).fetchone()[0]
            if held >= (task.concurrency_limit or 1):
                return (f"waiting for a slot of concurrency key {task.concurrency_key!r} "
                        f"({held} of {task.concurrency_limit} held)")
        return task.reason or "waiting for a free worker"

    # -- workers ------------------------------------------------------------------------
    def worker_seen(self, worker: str, *, queue: str, action_kinds: Sequence[str], concurrency: int,
                    state: str = "running") -> None:
        now = self.clock()
        host, _, rest = worker.partition(":")
        pid = rest.partition(":")[0]
        with self.db.transaction(write=True) as db:
            db.execute("INSERT INTO control_workers (worker_id, queue, action_kinds, concurrency, host, pid, "
                       "started_at, seen_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (worker_id) "
                       "DO UPDATE SET seen_at = excluded.seen_at, state = excluded.state",
                       (worker, queue, ",".join(action_kinds), concurrency, host, int(pid) if pid.isdigit() else None,
                        now, now, state))

    def workers(self, *, queue: str | None = None, within: float = 90.0) -> list[WorkerRecord]:
        """Workers seen within ``within`` seconds (a stopped or silent one is not live)."""
        with self.db.transaction() as db:
            rows = db.execute("SELECT worker_id, queue, action_kinds, concurrency, host, pid, started_at, seen_at, "
                              "state FROM control_workers WHERE seen_at >= ?" + (" AND queue = ?" if queue else ""),
                              (self.clock() - within, *((queue,) if queue else ()))).fetchall()
        return [WorkerRecord(row[0], row[1], tuple(filter(None, row[2].split(","))), *row[3:]) for row in rows]

    # -- statistics (metrics) -----------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Queue depth by (queue, state), the oldest due queued task's age by queue, and lease expiries."""
        now = self.clock()
        with self.db.transaction() as db:
            depth = db.execute("SELECT queue, state, count(*) FROM control_tasks GROUP BY queue, state").fetchall()
            oldest = db.execute("SELECT queue, min(available_at) FROM control_tasks WHERE state = 'queued' "
                                "AND held = 0 GROUP BY queue").fetchall()
            expiries = db.execute("SELECT count(*) FROM control_task_events WHERE kind = 'lease_expired'").fetchone()
        return {"depth": {(queue, state): count for queue, state, count in depth},
                "oldest_age": {queue: max(0.0, now - float(first)) for queue, first in oldest if first is not None},
                "lease_expiries": int(expiries[0])}

    # -- inside a transaction --------------------------------------------------------------
    def _event(self, db: Connection, task: TaskRecord, from_state: str | None, to_state: str, kind: str,
               worker: str | None, detail: str | None) -> None:
        db.execute("INSERT INTO control_task_events (task_id, at, from_state, to_state, kind, worker, attempt, detail) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                   (task.task_id, self.clock(), from_state, to_state, kind, worker, task.attempts, detail))
        self._hooks(db, task, from_state, to_state, kind, worker, detail)

    def _hooks(self, db: Connection, task: TaskRecord, from_state: str | None, to_state: str, kind: str,
               worker: str | None, detail: str | None) -> None:
        if not self.db.hooked(to_state):
            return
        transition = {"task_id": task.task_id, "queue": task.queue, "action_kind": task.action_kind,
                      "from_state": from_state, "to_state": to_state, "kind": kind, "worker": worker,
                      "attempt": task.attempts, "at": self.clock(), "detail": detail, "run_id": task.run_id,
                      "schedule_id": task.schedule_id}
        for hook in self.db.transition_hooks:
            if to_state in getattr(hook, "states", (to_state,)):
                hook(db, transition)

    def _release_buffered(self, db: Connection, task: TaskRecord) -> None:
        """A schedule's task ended: the oldest fire buffered behind it (overlap buffer_one/buffer_all) is due now."""
        if task.schedule_id is None:
            return
        release_buffered(db, task.schedule_id, self.clock())


# Joined into the one-statement claim: its transaction commits without waiting for its WAL flush.
_LAZY_COMMIT = " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS lazy_commit"


def _commit_lazily(db: Connection, sql: str, parameters: Sequence[Any]) -> Row | None:
    """One statement, committed on its own without waiting for its WAL flush, in one round trip.

    A claim may: if the database crashes before the flush, the claim is lost and the task is
    queued again; the worker that believed it held the lease is refused at its first write (the
    token moved on, or the row says queued) and cancels its run, and the next claimer continues
    that run from the run log. What must survive a crash (a task's end) commits durably.

    The statement itself turns ``synchronous_commit`` off for its own transaction (``set_config``
    with ``is_local``, joined in as a one-row ``FROM``): one prepared statement in autocommit, where
    a pipelined BEGIN / SET LOCAL / statement / COMMIT cost twice the time and client CPU.
    """
    return db.execute(sql, tuple(parameters)).fetchone()


def release_buffered(db: Connection, schedule_id: str, now: float) -> str | None:
    """Un-hold the oldest buffered task of ``schedule_id`` when none of its tasks is active; its id."""
    active = db.execute("SELECT 1 FROM control_tasks WHERE schedule_id = ? AND held = 0 AND state IN "
                        "('queued', 'leased', 'running') LIMIT 1", (schedule_id,)).fetchone()
    if active is not None:
        return None
    row = db.execute("SELECT task_id FROM control_tasks WHERE schedule_id = ? AND held = 1 AND state = 'queued' "
                     "ORDER BY nominal_at, created_at LIMIT 1", (schedule_id,)).fetchone()
    if row is None:
        return None
    db.execute("UPDATE control_tasks SET held = 0, reason = NULL, updated_at = ?, "
               "available_at = CASE WHEN available_at > ? THEN available_at ELSE ? END WHERE task_id = ?",
               (now, now, now, row[0]))
    return row[0]


def _encoded(value: Any) -> str | None:
    """A result or an error as its JSON column holds it; None stays None (the column is not set)."""
    return None if value is None else json.dumps(value, default=str)


def _summary(error: Any) -> str:
    if isinstance(error, Mapping):
        text = error.get("error") or error.get("message") or json.dumps(error, default=str)
    else:
        text = str(error)
    return text if len(text) <= 300 else text[:297] + "..."
