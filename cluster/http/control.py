"""The control plane under ``/api/``: schedules, tasks and workers, behind the server's access guard.

Owns the routes and JSON shapes of `opgraph schedule`, `opgraph task` and the worker list, on
the run store's database (the control tables beside the runs). Producers only: a request
submits or changes tasks and schedules; it never runs one and never imports an action adapter
(workers do). A client names no file on the server's disk: a ``workflow`` task names a stored
workflow, and ``flow_yaml`` (a spec file) is refused here.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Literal

from fastapi import FastAPI, Query
from pydantic import BaseModel, ConfigDict, Field

from ..control import ACTION_KINDS, OVERLAP_POLICIES, TASK_STATES, ControlDatabase, ControlInputError, TaskQueue
from ..control.admission import check_target
from ..control.outbox import deliver_task_transitions
from ..control.schedules import DEFAULT_MAX_BACKFILL, Scheduler
from ..store import RunStore
from .problems import errors

__all__ = ["add_control_routes"]

ActionKind = Literal["agent", "flow", "fanout", "play", "flow_yaml", "workflow"]
Overlap = Literal["skip", "buffer_one", "buffer_all", "cancel_other", "terminate_other", "allow_all"]
TaskState = Literal["queued", "leased", "running", "succeeded", "failed", "cancelled", "dead"]
if (ActionKind.__args__, Overlap.__args__, TaskState.__args__) != (ACTION_KINDS, OVERLAP_POLICIES, TASK_STATES):
    raise ImportError("the API's vocabularies differ from the control plane's")

NAME = Field(min_length=1, max_length=120)
SECONDS = {"ge": 0, "le": 10**9, "allow_inf_nan": False}
EPOCH = {"ge": 0, "le": 10**11, "allow_inf_nan": False}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ScheduleRequest(_Strict):
    """A schedule: ``cron`` (in ``timezone``) or ``interval`` seconds; what it submits; how it fires."""

    name: str = NAME
    action_kind: ActionKind
    target: str = Field(min_length=1, max_length=4000)
    cron: str | None = Field(default=None, max_length=200)
    interval: float | None = Field(default=None, ge=0.001, le=10**9, allow_inf_nan=False)
    timezone: str = Field(default="UTC", min_length=1, max_length=64)
    payload: dict[str, Any] = Field(default_factory=dict)
    queue: str = Field(default="default", min_length=1, max_length=120)
    priority: int = Field(default=0, ge=-1000, le=1000)
    max_attempts: int = Field(default=3, ge=1, le=100)
    overlap: Overlap = "skip"
    catchup_window: float = Field(default=60.0, **SECONDS)
    jitter: float = Field(default=0.0, **SECONDS)
    start_at: float | None = Field(default=None, **EPOCH)
    end_at: float | None = Field(default=None, **EPOCH)
    max_actions: int | None = Field(default=None, ge=1, le=10**9)
    paused: bool = False
    note: str | None = Field(default=None, max_length=1000)


class NoteRequest(_Strict):
    note: str | None = Field(default=None, max_length=1000)


class BackfillRequest(_Strict):
    """Nominal times in ``[start, end]`` (seconds since the epoch), each fired under the overlap policy."""

    start: float = Field(**EPOCH)
    end: float = Field(**EPOCH)


class TaskRequest(_Strict):
    action_kind: ActionKind
    target: str = Field(min_length=1, max_length=4000)
    queue: str = Field(default="default", min_length=1, max_length=120)
    payload: dict[str, Any] = Field(default_factory=dict)
    priority: int = Field(default=0, ge=-1000, le=1000)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=200)
    concurrency_key: str | None = Field(default=None, min_length=1, max_length=200)
    concurrency_limit: int | None = Field(default=None, ge=1, le=10**6)
    max_attempts: int = Field(default=3, ge=1, le=100)


class CancelRequest(_Strict):
    reason: str | None = Field(default=None, max_length=1000)
    terminate: bool = True


def _remote_target(action_kind: str, target: str, store: RunStore) -> None:
    if action_kind == "flow_yaml":
        raise ControlInputError("flow_yaml names a spec file on the server's disk; submit it with `opgraph task "
                                "submit` on that machine, or send a flow prompt", field="action_kind")
    if action_kind == "workflow" and (target.endswith(".json") or "/" in target or "\\" in target):
        raise ControlInputError("over HTTP a workflow task names a stored workflow (NAME or NAME@VERSION), "
                                "not a file", field="target")
    check_target(action_kind, target, store)


def add_control_routes(app: FastAPI, store: RunStore, *, max_backfill: int = DEFAULT_MAX_BACKFILL) -> None:
    """The schedule, task and worker routes over ``store``'s database (its own connection, opened once)."""
    opened: dict[str, ControlDatabase] = {}
    lock = threading.Lock()

    def database() -> ControlDatabase:
        with lock:
            if "db" not in opened:
                opened["db"] = deliver_task_transitions(ControlDatabase(store.path))
            return opened["db"]

    def queue() -> TaskQueue:
        return TaskQueue(database())

    def scheduler() -> Scheduler:
        return Scheduler(database(), name="api", max_backfill=max_backfill)

    @app.post("/api/schedules", status_code=201, operation_id="create_schedule", responses=errors(404, 409, 422))
    def create_schedule(body: ScheduleRequest) -> dict[str, Any]:
        """Add a schedule; a bad cron, time zone or target is 422 and nothing is written."""
        _remote_target(body.action_kind, body.target, store)
        fields = body.model_dump()
        return scheduler().add(fields.pop("name"), **fields).to_dict()

    @app.get("/api/schedules", operation_id="list_schedules", responses=errors())
    def list_schedules() -> dict[str, Any]:
        found = scheduler()
        return {"schedules": [{**record.to_dict(), "next": found.next_times(record, 1)}
                              for record in found.list_schedules()]}

    @app.get("/api/schedules/{name}", operation_id="get_schedule", responses=errors(404))
    def get_schedule(name: str, fires: int = Query(default=20, ge=0, le=1000)) -> dict[str, Any]:
        found = scheduler()
        record = found.get(name)
        return {**record.to_dict(), "next": found.next_times(record, 5),
                "fires": [fire.to_dict() for fire in found.fires(name, limit=fires)]}

    @app.delete("/api/schedules/{name}", operation_id="delete_schedule", responses=errors(404))
    def delete_schedule(name: str) -> dict[str, Any]:
        return scheduler().delete(name).to_dict()

    @app.post("/api/schedules/{name}/pause", operation_id="pause_schedule", responses=errors(404, 422))
    def pause_schedule(name: str, body: NoteRequest) -> dict[str, Any]:
        return scheduler().pause(name, body.note).to_dict()

    @app.post("/api/schedules/{name}/unpause", operation_id="unpause_schedule", responses=errors(404, 422))
    def unpause_schedule(name: str, body: NoteRequest) -> dict[str, Any]:
        return scheduler().unpause(name, body.note).to_dict()

    @app.post("/api/schedules/{name}/trigger", status_code=201, operation_id="trigger_schedule",
              responses=errors(404))
    def trigger_schedule(name: str) -> dict[str, Any]:
        """Fire now, under the schedule's overlap policy (the fire may be skipped or buffered, as it says)."""
        return scheduler().trigger(name).to_dict()

    @app.post("/api/schedules/{name}/backfill", operation_id="backfill_schedule", responses=errors(404, 422))
    def backfill_schedule(name: str, body: BackfillRequest) -> dict[str, Any]:
        """Fire the range's nominal times; more than the server's maximum is 422 and nothing fires."""
        return scheduler().backfill(name, body.start, body.end)

    @app.post("/api/tasks", status_code=201, operation_id="submit_task", responses=errors(404, 422))
    def submit_task(body: TaskRequest) -> dict[str, Any]:
        """Queue a task (201); the same ``idempotency_key`` again returns the first task, ``created`` false."""
        _remote_target(body.action_kind, body.target, store)
        task, created = queue().submit(**body.model_dump())
        return {**task.to_dict(), "created": created}

    @app.get("/api/tasks", operation_id="list_tasks", responses=errors(422))
    def list_tasks(queue_name: str | None = Query(default=None, alias="queue", max_length=120),
                   state: TaskState | None = None, schedule: str | None = Query(default=None, max_length=120),
                   limit: int = Query(default=50, ge=1, le=1000)) -> dict[str, Any]:
        return {"tasks": [task.to_dict() for task in queue().list_tasks(queue=queue_name, state=state,
                                                                         schedule_id=schedule, limit=limit)]}

    @app.get("/api/tasks/{task_id}", operation_id="get_task", responses=errors(404))
    def get_task(task_id: str) -> dict[str, Any]:
        tasks = queue()
        task = tasks.get(task_id)
        return {**task.to_dict(), "waiting_because": tasks.why_waiting(task), "events": tasks.events(task_id)}

    @app.post("/api/tasks/{task_id}/cancel", operation_id="cancel_task", responses=errors(404, 409, 422))
    def cancel_task(task_id: str, body: CancelRequest) -> dict[str, Any]:
        return queue().cancel(task_id, reason=body.reason or "cancelled over the API",
                              terminate=body.terminate).to_dict()

    @app.post("/api/tasks/{task_id}/retry", operation_id="retry_task", responses=errors(404, 409))
    def retry_task(task_id: str) -> dict[str, Any]:
        return queue().retry(task_id, reason="retried over the API").to_dict()

    @app.get("/api/workers", operation_id="list_workers", responses=errors(422))
    def list_workers(within: float = Query(default=90.0, gt=0, le=86400)) -> dict[str, Any]:
        return {"workers": [dataclasses.asdict(worker) for worker in queue().workers(within=within)]}
