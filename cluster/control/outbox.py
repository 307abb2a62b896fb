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

__all__ = ["RUN_EVENT_TYPES", "TASK_EVENT_STATES", "TEST_EVENT", "deliver_task_transitions", "event_body",
           "new_event_id", "record", "run_event", "task_transition_event"]

# A task's ends are announced; its claims and heartbeats are not (they are many, and no receiver acts on them).
TASK_EVENT_STATES = frozenset({"succeeded", "failed", "cancelled", "dead"})


def task_transition_event(tx: Any, transition: dict[str, Any]) -> None:
    """A ``ControlDatabase`` transition hook: a task that reached an end gets its outbox event."""
    state = transition["to_state"]
    if state not in TASK_EVENT_STATES or transition["from_state"] == state:
        return
    payload = {key: transition.get(key) for key in ("task_id", "queue", "action_kind", "from_state", "attempt",
                                                    "run_id", "schedule_id", "detail")}
    record(tx, f"task.{state}", transition["task_id"], {**payload, "state": state}, at=transition.get("at"))


# The states this hook acts on (``ControlDatabase.hooked``): the queue may claim on PostgreSQL in one
# statement when no hook needs to see a claim ("leased"), and this one does not.
task_transition_event.states = TASK_EVENT_STATES  # type: ignore[attr-defined]


def deliver_task_transitions(database: Any) -> Any:
    """Install ``task_transition_event`` on ``database`` (a ``ControlDatabase``), once; return it.

    The outbox table is the run store's: the store at the same target is opened once so its schema
    is there. An in-memory database has no store beside it, so nothing is installed there.
    """
    if database.target == ":memory:" or task_transition_event in database.transition_hooks:
        return database
    StoreDatabase(database.target).close()  # migrated: the outbox table exists
    database.transition_hooks.append(task_transition_event)
    return database
