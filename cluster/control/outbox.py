"""The dispatch outbox as the control plane uses it: ``record(tx, event_type, subject_id, payload)`` in the
caller's own transaction (a task transition's), and the body an event is delivered with.

The writer itself lives in the run store (``cluster/store/outbox.py``), whose run transitions write
their events with it; this module is the control plane's name for the same functions, so the store
never imports the control plane.
"""

from __future__ import annotations

from ..store.outbox import RUN_EVENT_TYPES, TEST_EVENT, event_body, new_event_id, record, run_event

__all__ = ["RUN_EVENT_TYPES", "TEST_EVENT", "event_body", "new_event_id", "record", "run_event"]
