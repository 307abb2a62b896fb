"""Schedules and their fires: a trigger evaluates cadence and overlap, then submits a task; it never runs a graph.

Owns the schedules table (cadence, zone, overlap policy, catch-up window, jitter, pause
with a note, an end time or a number of actions) and the fires table, whose key is
(schedule, nominal time): a fire is inserted with its task in one transaction, and a second
scheduler's insert of the same key does nothing, so two schedulers fire it once. A scheduler
killed mid-fire committed all of a fire or none of it; the next tick takes it up.

Overlap (when a task of the schedule is still queued, leased or running):
``skip`` records the fire as skipped; ``buffer_one`` holds one fire until the active task
ends (more are skipped); ``buffer_all`` holds each, released in order; ``cancel_other`` asks
the active task to stop and holds the new one until it has; ``terminate_other`` ends the
active task's lease now and queues the new one; ``allow_all`` queues it regardless.
Missed fires within the catch-up window fire late (their lateness recorded); older ones are
recorded as skipped, with the reason. Fires while paused are not taken up on unpause.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from opgraph.actors.persistence.backends import Connection, Row

from .cadence import Cadence, jitter_offset
from .database import ControlDatabase
from .errors import (
    ACTION_KINDS,
    BackfillTooLargeError,
    ControlInputError,
    ScheduleNotFoundError,
    UnknownActionKindError,
)
from .queue import Record, TaskQueue, TaskRecord, release_buffered
from .schema import OVERLAP_POLICIES

__all__ = ["DEFAULT_MAX_BACKFILL", "FireRecord", "ScheduleRecord", "Scheduler"]

DEFAULT_MAX_BACKFILL = 1000
# Missed fires older than the catch-up window recorded one by one per tick, at most; beyond, counted.
MAX_SKIPS_RECORDED = 1000
_SCHEDULE_COLUMNS = ("schedule_id, name, cron, interval_seconds, timezone, action_kind, target, payload, queue, "
                     "priority, max_attempts, overlap, catchup_window, jitter, start_at, end_at, remaining_actions, "
                     "paused, note, cursor_at, fires, skipped, created_at, updated_at")


@dataclass(frozen=True, slots=True)
class ScheduleRecord(Record):
    schedule_id: str
    name: str
    cron: str | None
    interval_seconds: float | None
    timezone: str
    action_kind: str
    target: str
    payload: dict[str, Any]
    queue: str
    priority: int
    max_attempts: int
    overlap: str
    catchup_window: float
    jitter: float
    start_at: float | None
    end_at: float | None
    remaining_actions: int | None
    paused: int
    note: str | None
    cursor_at: float
    fires: int
    skipped: int
    created_at: float
    updated_at: float

    @classmethod
    def from_row(cls, row: Row) -> ScheduleRecord:
        values = {field.name: row[field.name] for field in fields(cls)}
        values["payload"] = json.loads(values["payload"] or "{}")
        return cls(**values)

    @property
    def cadence(self) -> Cadence:
        return Cadence(cron=self.cron, interval=self.interval_seconds, timezone=self.timezone,
                       anchor=self.start_at if self.start_at is not None else 0.0)


@dataclass(frozen=True, slots=True)
class FireRecord(Record):
    schedule_id: str
    nominal_at: float
    kind: str
    status: str
    reason: str | None
    task_id: str | None
    fired_at: float
    lateness: float
    scheduler: str | None


class Scheduler:
    """Schedules on one ``ControlDatabase``: adding and changing them, and ``tick``, which fires what is due.

    Any number of schedulers may tick the same database at once; ``name`` says which one fired
    a fire (recorded with it). ``max_backfill`` bounds the fires one backfill may make.
    """

    def __init__(self, database: ControlDatabase, *, name: str = "scheduler",
                 max_backfill: int = DEFAULT_MAX_BACKFILL) -> None:
        self.db = database
        self.queue = TaskQueue(database)
        self.name = name
        self.max_backfill = max_backfill

    @property
    def clock(self) -> Any:
        return self.db.clock

    # -- schedules ----------------------------------------------------------------------
    def add(self, name: str, *, action_kind: str, target: str, cron: str | None = None,
            interval: float | None = None, timezone: str = "UTC", payload: Mapping[str, Any] | None = None,
            queue: str = "default", priority: int = 0, max_attempts: int = 3, overlap: str = "skip",
            catchup_window: float = 60.0, jitter: float = 0.0, start_at: float | None = None,
            end_at: float | None = None, max_actions: int | None = None, paused: bool = False,
            note: str | None = None) -> ScheduleRecord:
        """A new schedule; every field is checked before anything is written. Its first fire is the
        first nominal time after now (or after ``start_at``)."""
        if not isinstance(name, str) or not 1 <= len(name.strip()) <= 120:
            raise ControlInputError(f"a schedule name is 1 to 120 characters, got {name!r}", field="name")
        if action_kind not in ACTION_KINDS:
            raise UnknownActionKindError(str(action_kind), ACTION_KINDS)
        if not isinstance(target, str) or not target.strip():
            raise ControlInputError("a schedule needs a target (a workflow name, a prompt, a file)", field="target")
        if overlap not in OVERLAP_POLICIES:
            raise ControlInputError(f"unknown overlap policy {overlap!r}; policies: {', '.join(OVERLAP_POLICIES)}",
                                    field="overlap")
        for label, value in (("catchup_window", catchup_window), ("jitter", jitter)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ControlInputError(f"{label} is a number of seconds, at least 0; got {value!r}", field=label)
        if max_actions is not None and (not isinstance(max_actions, int) or max_actions < 1):
            raise ControlInputError(f"max_actions must be at least 1, got {max_actions!r}", field="max_actions")
        if start_at is not None and end_at is not None and end_at <= start_at:
            raise ControlInputError("end_at must be after start_at", field="end_at")
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ControlInputError(f"max_attempts must be at least 1, got {max_attempts!r}", field="max_attempts")
        if payload is not None and not isinstance(payload, Mapping):
            raise ControlInputError("payload must be a JSON object", field="payload")
        Cadence(cron=cron, interval=interval, timezone=timezone, anchor=start_at or 0.0)  # CronError when bad
        now = self.clock()
        cursor = now if start_at is None else min(now, start_at - 0.001) if start_at > now else now
        schedule_id = "s" + uuid.uuid4().hex[:15]
        with self.db.transaction(write=True) as db:
            if db.execute("SELECT 1 FROM control_schedules WHERE name = ?", (name,)).fetchone() is not None:
                raise ControlInputError(f"a schedule named {name!r} exists already", field="name")
            row = db.execute(
                f"""INSERT INTO control_schedules (schedule_id, name, cron, interval_seconds, timezone, action_kind,
                    target, payload, queue, priority, max_attempts, overlap, catchup_window, jitter, start_at, end_at,
                    remaining_actions, paused, note, cursor_at, created_at, updated_at)
                    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                    RETURNING {_SCHEDULE_COLUMNS}""",
                (schedule_id, name, cron, None if interval is None else float(interval), timezone, action_kind,
                 target, json.dumps(dict(payload or {}), sort_keys=True), queue, int(priority), max_attempts,
                 overlap, float(catchup_window), float(jitter), start_at, end_at, max_actions, int(paused), note,
                 cursor, now, now)).fetchone()
        return ScheduleRecord.from_row(row)

    def get(self, schedule: str) -> ScheduleRecord:
        """A schedule by id or name."""
        with self.db.transaction() as db:
            return self._get(db, schedule)

    def _get(self, db: Connection, schedule: str, *, lock: bool = False) -> ScheduleRecord:
        suffix = " FOR UPDATE" if lock and db.dialect == "postgresql" else ""
        row = db.execute(f"SELECT {_SCHEDULE_COLUMNS} FROM control_schedules WHERE schedule_id = ? OR name = ?"
                         f"{suffix}", (schedule, schedule)).fetchone()
        if row is None:
            raise ScheduleNotFoundError(schedule)
        return ScheduleRecord.from_row(row)

    def list_schedules(self) -> list[ScheduleRecord]:
        with self.db.transaction() as db:
            rows = db.execute(f"SELECT {_SCHEDULE_COLUMNS} FROM control_schedules ORDER BY name").fetchall()
        return [ScheduleRecord.from_row(row) for row in rows]

    def pause(self, schedule: str, note: str | None = None) -> ScheduleRecord:
        return self._set_paused(schedule, True, note)

    def unpause(self, schedule: str, note: str | None = None) -> ScheduleRecord:
        """Fires again from now: what fell due while paused is not taken up."""
        return self._set_paused(schedule, False, note)

    def _set_paused(self, schedule: str, paused: bool, note: str | None) -> ScheduleRecord:
        now = self.clock()
        with self.db.transaction(write=True) as db:
            record = self._get(db, schedule, lock=True)
            cursor = record.cursor_at if paused else max(record.cursor_at, now)
            row = db.execute(f"UPDATE control_schedules SET paused = ?, note = ?, cursor_at = ?, updated_at = ? "
                             f"WHERE schedule_id = ? RETURNING {_SCHEDULE_COLUMNS}",
                             (int(paused), note, cursor, now, record.schedule_id)).fetchone()
        return ScheduleRecord.from_row(row)

    def delete(self, schedule: str) -> ScheduleRecord:
        """Remove the schedule; its fires and tasks stay as records."""
        with self.db.transaction(write=True) as db:
            record = self._get(db, schedule, lock=True)
            db.execute("DELETE FROM control_schedules WHERE schedule_id = ?", (record.schedule_id,))
        return record

    def fires(self, schedule: str, *, limit: int = 100) -> list[FireRecord]:
        record = self.get(schedule)
        with self.db.transaction() as db:
            rows = db.execute("SELECT schedule_id, nominal_at, kind, status, reason, task_id, fired_at, lateness, "
                              "scheduler FROM control_fires WHERE schedule_id = ? ORDER BY nominal_at DESC LIMIT ?",
                              (record.schedule_id, int(limit))).fetchall()
        return [FireRecord(*row) for row in rows]

    def next_times(self, schedule: ScheduleRecord, count: int = 5) -> list[float]:
        horizon = max(schedule.cursor_at, self.clock()) + 400 * 86400
        times = schedule.cadence.times(max(schedule.cursor_at, self.clock()), horizon, limit=count)
        return [when for when in times if schedule.end_at is None or when <= schedule.end_at]

    # -- firing -------------------------------------------------------------------------
    def tick(self) -> dict[str, int]:
        """Fire what is due on every unpaused schedule, each schedule in its own transaction; counts
        of fires by status. Leases that lapsed are reaped, and buffered fires whose blocker ended are
        released (a crash between the two cannot strand them)."""
        counts = {"fired": 0, "buffered": 0, "skipped": 0}
        now = self.clock()
        with self.db.transaction() as db:
            due = [row[0] for row in db.execute(
                "SELECT schedule_id FROM control_schedules WHERE paused = 0 AND cursor_at < ? "
                "AND (remaining_actions IS NULL OR remaining_actions > 0) "
                "AND (end_at IS NULL OR cursor_at < end_at)", (now,)).fetchall()]
        for schedule_id in due:
            for status, count in self._tick_one(schedule_id, now).items():
                counts[status] += count
        self.queue.reap()
        with self.db.transaction(write=True) as db:
            for (schedule_id,) in db.execute("SELECT DISTINCT schedule_id FROM control_tasks WHERE held = 1 "
                                             "AND state = 'queued'").fetchall():
                release_buffered(db, schedule_id, now)
        return counts

    def _tick_one(self, schedule_id: str, now: float) -> dict[str, int]:
        counts = {"fired": 0, "buffered": 0, "skipped": 0}
        with self.db.transaction(write=True) as db:
            # PostgreSQL: a schedule another scheduler is firing is passed over (it fires it); the fire
            # key would refuse a second fire anyway.
            suffix = " FOR UPDATE SKIP LOCKED" if db.dialect == "postgresql" else ""
            row = db.execute(f"SELECT {_SCHEDULE_COLUMNS} FROM control_schedules WHERE schedule_id = ? "
                             f"AND paused = 0{suffix}", (schedule_id,)).fetchone()
            if row is None:
                return counts
            schedule = ScheduleRecord.from_row(row)
            until = now if schedule.end_at is None else min(now, schedule.end_at)
            if until <= schedule.cursor_at:
                return counts
            oldest_in_window = now - schedule.catchup_window
            cadence = schedule.cadence
            missed = cadence.count(schedule.cursor_at, min(until, oldest_in_window - 1e-6), cap=MAX_SKIPS_RECORDED) \
                if oldest_in_window > schedule.cursor_at else 0
            recorded_skips = 0
            if missed:
                for nominal in cadence.times(schedule.cursor_at, min(until, oldest_in_window - 1e-6),
                                             limit=MAX_SKIPS_RECORDED):
                    if schedule.start_at is not None and nominal < schedule.start_at:
                        continue
                    if self._record(db, schedule, nominal, "scheduled", "skipped",
                                    f"missed by {now - nominal:.1f} s, beyond the catch-up window of "
                                    f"{schedule.catchup_window:g} s", None, now):
                        recorded_skips += 1
            remaining = schedule.remaining_actions
            start = max(schedule.cursor_at, oldest_in_window - 1e-6)
            for nominal in cadence.times(start, until, limit=10_000):
                if remaining is not None and remaining <= 0:
                    break
                if schedule.start_at is not None and nominal < schedule.start_at:
                    continue
                status = self._fire(db, schedule, nominal, "scheduled", now)
                if status is None:
                    continue
                counts[status] += 1
                if status != "skipped" and remaining is not None:
                    remaining -= 1
            counts["skipped"] += recorded_skips
            db.execute("UPDATE control_schedules SET cursor_at = CASE WHEN cursor_at > ? THEN cursor_at ELSE ? END, "
                       "remaining_actions = ?, fires = fires + ?, skipped = skipped + ?, updated_at = ? "
                       "WHERE schedule_id = ?",
                       (until, until, remaining, counts["fired"] + counts["buffered"], counts["skipped"], now,
                        schedule.schedule_id))
        return counts

    def trigger(self, schedule: str) -> FireRecord:
        """Fire now, once, under the schedule's overlap policy (a paused schedule too)."""
        now = self.clock()
        with self.db.transaction(write=True) as db:
            record = self._get(db, schedule, lock=True)
            nominal = round(now, 3)
            while db.execute("SELECT 1 FROM control_fires WHERE schedule_id = ? AND nominal_at = ?",
                             (record.schedule_id, nominal)).fetchone() is not None:
                nominal = round(nominal + 0.001, 3)  # two triggers in one millisecond are two fires
            self._fire(db, record, nominal, "manual", now)
            return self._fire_row(db, record.schedule_id, nominal)

    def backfill(self, schedule: str, start: float, end: float) -> dict[str, Any]:
        """Fire the nominal times in ``[start, end]`` in order, under the overlap policy; a time fired
        before is not fired again. More than ``max_backfill`` fires is refused before any fires."""
        if not (isinstance(start, int | float) and isinstance(end, int | float)) or end < start:
            raise ControlInputError("a backfill range needs start <= end", field="range")
        record = self.get(schedule)
        count = record.cadence.count(start - 1e-6, end, cap=self.max_backfill)
        if count > self.max_backfill:
            raise BackfillTooLargeError(
                f"the range holds more than {self.max_backfill} fires of schedule {record.name!r}; backfill a "
                f"shorter range (the maximum is configured: OPGRAPH_BACKFILL_MAX)", fires=count,
                limit=self.max_backfill)
        now = self.clock()
        counts = {"fired": 0, "buffered": 0, "skipped": 0, "already_fired": 0}
        with self.db.transaction(write=True) as db:
            record = self._get(db, schedule, lock=True)
            for nominal in record.cadence.times(start - 1e-6, end):
                status = self._fire(db, record, nominal, "backfill", now)
                counts["already_fired" if status is None else status] += 1
        return {"schedule": record.name, "range": [start, end], **counts}

    # -- inside a transaction --------------------------------------------------------------
    def _fire(self, db: Connection, schedule: ScheduleRecord, nominal: float, kind: str, now: float) -> str | None:
        """One fire under the overlap policy: its status, or None when this key fired before."""
        if db.execute("SELECT 1 FROM control_fires WHERE schedule_id = ? AND nominal_at = ?",
                      (schedule.schedule_id, nominal)).fetchone() is not None:
            return None
        active = db.execute("SELECT task_id, state FROM control_tasks WHERE schedule_id = ? AND held = 0 AND state IN "
                            "('queued', 'leased', 'running') ORDER BY created_at", (schedule.schedule_id,)).fetchall()
        held = db.execute("SELECT count(*) FROM control_tasks WHERE schedule_id = ? AND held = 1 "
                          "AND state = 'queued'", (schedule.schedule_id,)).fetchone()[0]
        policy, busy = schedule.overlap, bool(active) or bool(held)
        blocker = f"task {active[0][0]} is {active[0][1]}" if active else f"{held} fire(s) are buffered"
        if busy and policy == "skip":
            return self._skip(db, schedule, nominal, kind, f"overlap skip: {blocker}", now)
        if busy and policy == "buffer_one" and held >= 1:
            return self._skip(db, schedule, nominal, kind, f"overlap buffer_one: {blocker}, and one fire is "
                                                           f"buffered already", now)
        hold, reason = False, None
        if busy and policy in ("buffer_one", "buffer_all"):
            hold, reason = True, f"buffered ({policy}): {blocker}"
        elif active and policy == "cancel_other":
            for task_id, state in active:
                self._stop(db, task_id, state, terminate=False, reason=f"cancelled by schedule {schedule.name}'s "
                                                                       f"fire at {nominal:.3f} (cancel_other)")
            for (task_id,) in db.execute("SELECT task_id FROM control_tasks WHERE schedule_id = ? AND held = 1 "
                                         "AND state = 'queued'", (schedule.schedule_id,)).fetchall():
                self._stop(db, task_id, "queued", terminate=True, reason="superseded by a newer fire (cancel_other)")
            running = [task_id for task_id, state in active if state != "queued"]
            if running:  # a queued one was cancelled at once; a running one stops at its worker's next heartbeat
                hold, reason = True, f"waiting for the cancelled task {running[0]} to stop (cancel_other)"
        elif active and policy == "terminate_other":
            for task_id, state in active:
                self._stop(db, task_id, state, terminate=True, reason=f"terminated by schedule {schedule.name}'s "
                                                                      f"fire at {nominal:.3f} (terminate_other)")
        delay = jitter_offset(schedule.schedule_id, nominal, schedule.jitter) if kind == "scheduled" else 0.0
        task = self.queue.insert(
            db, schedule.action_kind, schedule.target, queue=schedule.queue, payload=schedule.payload,
            priority=schedule.priority, max_attempts=schedule.max_attempts,
            available_at=max(nominal + delay, now) if kind != "backfill" else now, schedule_id=schedule.schedule_id,
            nominal_at=nominal, held=hold, reason=reason,
            idempotency_key=f"fire:{schedule.schedule_id}@{nominal:.3f}")
        if task is None:  # the fire's task exists already: another scheduler fired this key
            return None
        status = "buffered" if hold else "fired"
        if not self._record(db, schedule, nominal, kind, status, reason, task.task_id, now):
            raise ControlInputError(f"fire {schedule.schedule_id}@{nominal} raced another scheduler")
        return status

    def _skip(self, db: Connection, schedule: ScheduleRecord, nominal: float, kind: str, reason: str,
              now: float) -> str | None:
        return "skipped" if self._record(db, schedule, nominal, kind, "skipped", reason, None, now) else None

    def _record(self, db: Connection, schedule: ScheduleRecord, nominal: float, kind: str, status: str,
                reason: str | None, task_id: str | None, now: float) -> bool:
        row = db.execute("INSERT INTO control_fires (schedule_id, nominal_at, kind, status, reason, task_id, "
                         "fired_at, lateness, scheduler) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                         "ON CONFLICT (schedule_id, nominal_at) DO NOTHING RETURNING schedule_id",
                         (schedule.schedule_id, nominal, kind, status, reason, task_id, now,
                          max(0.0, now - nominal) if kind == "scheduled" else 0.0, self.name)).fetchone()
        return row is not None

    def _stop(self, db: Connection, task_id: str, state: str, *, terminate: bool, reason: str) -> None:
        now = self.clock()
        if state == "queued" or terminate:
            row = db.execute("UPDATE control_tasks SET state = 'cancelled', reason = ?, updated_at = ?, "
                             "finished_at = ?, lease_expires_at = NULL WHERE task_id = ? "
                             "AND state IN ('queued', 'leased', 'running') "
                             "RETURNING task_id, queue, action_kind, attempts, run_id, schedule_id",
                             (reason, now, now, task_id)).fetchone()
            if row is not None:
                stub = _stub(row)
                self.queue._event(db, stub, state, "cancelled", "cancelled", self.name, reason)
        else:
            db.execute("UPDATE control_tasks SET cancel_requested = 1, reason = ?, updated_at = ? WHERE task_id = ?",
                       (reason, now, task_id))

    def _fire_row(self, db: Connection, schedule_id: str, nominal: float) -> FireRecord:
        row = db.execute("SELECT schedule_id, nominal_at, kind, status, reason, task_id, fired_at, lateness, "
                         "scheduler FROM control_fires WHERE schedule_id = ? AND nominal_at = ?",
                         (schedule_id, nominal)).fetchone()
        return FireRecord(*row)

    # -- statistics (metrics) -----------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        with self.db.transaction() as db:
            fires = db.execute("SELECT status, count(*) FROM control_fires GROUP BY status").fetchall()
            lateness = db.execute("SELECT lateness FROM control_fires WHERE kind = 'scheduled' AND status <> 'skipped' "
                                  "ORDER BY fired_at DESC LIMIT 1000").fetchall()
            schedules = db.execute("SELECT paused, count(*) FROM control_schedules GROUP BY paused").fetchall()
        values = sorted(float(row[0]) for row in lateness)
        return {"fires": {status: count for status, count in fires},
                "lateness_p50": _quantile(values, 0.5), "lateness_p99": _quantile(values, 0.99),
                "schedules": {("paused" if paused else "active"): count for paused, count in schedules}}


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def _stub(row: Row) -> TaskRecord:
    """Enough of a task for its event row and the transition hooks."""
    return TaskRecord(task_id=row[0], queue=row[1], action_kind=row[2], target="", payload={}, priority=0,
                      state="cancelled", idempotency_key=None, concurrency_key=None, concurrency_limit=None,
                      attempts=row[3], max_attempts=0, backoff_base=0, backoff_max=0, available_at=0, held=0,
                      reason=None, lease_owner=None, lease_token=0, lease_expires_at=None, heartbeat_at=None,
                      claimed_at=None, run_id=row[4], cancel_requested=0, schedule_id=row[5], nominal_at=None,
                      result=None, error=None, created_at=0, updated_at=0, finished_at=None)
