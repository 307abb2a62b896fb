"""The control plane's errors (schedules, the task queue, workers): each names what it concerns.

Owns the typed errors of ``cluster/control``; the tree is drawn in ``kernel/errors.py``.
Every error says what to do next, and pickles with its fields (``OpGraphError`` carries them)::

    ControlError
    ├── ControlInputError        bad input to a schedule or a task, refused before anything is written
    │   ├── CronError            a cron expression, interval or time zone that cannot be used
    │   ├── BackfillTooLargeError  a backfill range holds more fires than the configured maximum
    │   └── UnknownActionKindError  no action adapter for that action_kind
    ├── ScheduleNotFoundError    no schedule by that id or name
    ├── TaskNotFoundError        no task with that id
    ├── TaskStateError           the task's state forbids what was asked (cancel a finished task...)
    └── LeaseLostError           the worker's lease on a task lapsed or was taken over; its write was refused
"""

from __future__ import annotations

from opgraph.kernel import OpGraphError

__all__ = [
    "ACTION_KINDS",
    "BackfillTooLargeError",
    "ControlError",
    "ControlInputError",
    "CronError",
    "LeaseLostError",
    "ScheduleNotFoundError",
    "TaskNotFoundError",
    "TaskStateError",
    "UnknownActionKindError",
]

# ADR-0068 D5: the typed routing key of a task.
ACTION_KINDS: tuple[str, ...] = ("agent", "flow", "fanout", "play", "flow_yaml", "workflow")


class ControlError(OpGraphError):
    """The control plane (schedules, task queue, workers) could not do what was asked."""


class ControlInputError(ControlError, ValueError):
    """Bad input to a schedule or task; nothing was written. ``field`` names the bad field."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CronError(ControlInputError):
    """A cron expression, interval or IANA time zone that cannot be used; nothing was written."""


class BackfillTooLargeError(ControlInputError):
    """A backfill range holds more fires than the configured maximum (``limit``); nothing was fired."""

    def __init__(self, message: str, *, fires: int, limit: int) -> None:
        super().__init__(message, field="range")
        self.fires, self.limit = fires, limit


class UnknownActionKindError(ControlInputError):
    """No action adapter is registered for that ``action_kind``; ``known`` lists those that are."""

    def __init__(self, action_kind: str, known: tuple[str, ...]) -> None:
        super().__init__(f"unknown action_kind {action_kind!r}; known: {', '.join(known)}", field="action_kind")
        self.action_kind, self.known = action_kind, known


class ScheduleNotFoundError(ControlError):
    """No schedule by that id or name; ``opgraph schedule list`` shows those that exist."""

    def __init__(self, schedule: str) -> None:
        super().__init__(f"no schedule {schedule!r}; `opgraph schedule list` shows the schedules")
        self.schedule = schedule


class TaskNotFoundError(ControlError):
    """No task with that id; ``opgraph task list`` shows the tasks."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"no task {task_id!r}; `opgraph task list` shows the tasks")
        self.task_id = task_id


class TaskStateError(ControlError):
    """The task's state forbids what was asked (``state`` says which it is in)."""

    def __init__(self, message: str, *, task_id: str, state: str) -> None:
        super().__init__(message)
        self.task_id, self.state = task_id, state


class LeaseLostError(ControlError):
    """The worker's lease on a task lapsed or another worker took it over; the write was refused,
    and the task is the other worker's now."""

    def __init__(self, task_id: str, worker: str) -> None:
        super().__init__(f"worker {worker} no longer holds the lease on task {task_id}; another worker continues it",
                         actor=worker)
        self.task_id, self.worker = task_id, worker
