"""The control plane (ADR-0068 D5): schedules, a leased task queue, the workers that route tasks to
lanes, and the dispatch outbox with its webhook relay.

Owns what sits around the lanes: a trigger evaluates cadence and admission, then submits a task;
a worker claims a task under a lease, then picks its action adapter by ``action_kind``. The
database is the arbiter of "at most once" (a unique fire key; leases claimed in one statement).
Producers (schedules, the CLI, the HTTP API) import the queue, never an adapter: the worker loads
adapters through the action registry.
"""

from . import errors
from .database import ControlDatabase, TransitionHook
from .errors import *  # noqa: F403 - the control plane's errors, re-exported whole (its __all__)
from .queue import Claim, TaskQueue, TaskRecord, WorkerRecord, backoff_delay, new_worker_id
from .schema import OVERLAP_POLICIES, TASK_STATES, TERMINAL_TASK_STATES

__all__ = [
    "OVERLAP_POLICIES",
    "TASK_STATES",
    "TERMINAL_TASK_STATES",
    "Claim",
    "ControlDatabase",
    "TaskQueue",
    "TaskRecord",
    "TransitionHook",
    "WorkerRecord",
    "backoff_delay",
    "new_worker_id",
    *errors.__all__,
]
