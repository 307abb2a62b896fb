"""The control plane (ADR-0068 D5): schedules, a leased task queue, the workers that route tasks to
lanes, and the dispatch outbox with its webhook relay.

Owns what sits around the lanes: a trigger evaluates cadence and admission, then submits a task;
a worker claims a task under a lease, then picks its action adapter by ``action_kind``. The
database is the arbiter of "at most once" (a unique fire key; leases claimed in one statement).
Producers (schedules, the CLI, the HTTP API) import the queue, never an adapter: the worker loads
adapters through the action registry.
"""

from .database import ControlDatabase, TransitionHook
from .errors import (
    ACTION_KINDS,
    BackfillTooLargeError,
    ControlError,
    ControlInputError,
    CronError,
    LeaseLostError,
    ScheduleNotFoundError,
    TaskNotFoundError,
    TaskStateError,
    UnknownActionKindError,
)
from .queue import Claim, TaskQueue, TaskRecord, WorkerRecord, backoff_delay, new_worker_id
from .schema import OVERLAP_POLICIES, TASK_STATES, TERMINAL_TASK_STATES

__all__ = [
    "ACTION_KINDS",
    "OVERLAP_POLICIES",
    "TASK_STATES",
    "TERMINAL_TASK_STATES",
    "BackfillTooLargeError",
    "Claim",
    "ControlDatabase",
    "ControlError",
    "ControlInputError",
    "CronError",
    "LeaseLostError",
    "ScheduleNotFoundError",
    "TaskNotFoundError",
    "TaskQueue",
    "TaskRecord",
    "TaskStateError",
    "TransitionHook",
    "UnknownActionKindError",
    "WorkerRecord",
    "backoff_delay",
    "new_worker_id",
]
