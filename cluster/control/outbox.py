"""The dispatch outbox as the control plane uses it: ``record(tx, event_type, subject_id, payload)`` in the
caller's own transaction, and the hook that gives each task's end its event (``task.<state>``).

The writer itself lives in the run store (``cluster/store/outbox.py``), whose run transitions write
their events with it; this module is the control plane's name for the same functions, so the store
never imports the control plane. ``deliver_task_transitions`` installs the hook on a
``ControlDatabase``: a task's terminal transition (succeeded, failed, cancelled, dead) then writes
its event in the transaction that commits it, and a failed delivery never changes the task.
"""

from __future__ import annotations

from typing import Any

from ..store import StoreDatabase
from ..store.outbox import RUN_EVENT_TYPES, TEST_EVENT, event_body, new_event_id, record, run_event
from .database import TASK_EVENT_STATES, task_outbox_hook

__all__ = ["RUN_EVENT_TYPES", "TASK_EVENT_STATES", "TEST_EVENT", "deliver_task_transitions", "event_body",
           "new_event_id", "record", "run_event", "task_outbox_hook"]

def deliver_task_transitions(database: Any) -> Any:
    """Install ``task_outbox_hook`` on ``database`` (a ``ControlDatabase``), once; return it.

    A control database opened where the run store already is installs the hook itself; this makes
    sure of it where the store comes second: the store at the same target is opened once so its
    schema (the outbox table) is there. An in-memory database has no store beside it.
    """
    if database.target == ":memory:" or task_outbox_hook in database.transition_hooks:
        return database
    StoreDatabase(database.target).close()  # migrated: the outbox table exists
    database.transition_hooks.append(task_outbox_hook)
    return database
