"""The dispatch outbox (ADR-0068 D5): a fact's notification, written in the same transaction as the fact.

Owns ``record``, the one way anything enters the outbox (a run store transition, a task
transition, a webhook test), the event types the store emits, and the body an event is
delivered with (the Standard Webhooks ``{type, timestamp, data}`` envelope). It takes the
caller's open transaction and never commits, opens a connection or sends anything: the relay
(relay.py) delivers what was committed, and a delivery never changes the fact it reports.
It imports no store module, so the store can call it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = ["RUN_EVENT_TYPES", "TEST_EVENT", "event_body", "new_event_id", "record", "run_event"]

# What a run's transitions are delivered as: ``run.<status>`` (a reopened run is ``run.resumed``).
RUN_EVENT_TYPES = ("run.admitted", "run.running", "run.completed", "run.failed", "run.cancelled", "run.resumed")
TEST_EVENT = "webhook.test"  # `opgraph webhook test`: sent to one endpoint only
MAX_EVENT_TYPE = 100


def new_event_id() -> str:
    """A message id (``webhook-id``): the same on every retry of the event, so a receiver drops duplicates."""
    return f"msg_{uuid.uuid4().hex}"


def record(tx: Any, event_type: str, subject_id: str, payload: Mapping[str, Any], *, at: float | None = None,
           endpoint_id: str | None = None) -> str:
    """Append one event to the outbox inside ``tx`` (an open write transaction of the run store's
    connection); return its event id. It commits with the caller's fact or not at all.

    ``subject_id`` names what the event is about (a run id, a task id); ``payload`` is JSON and
    becomes the body's ``data``. ``endpoint_id`` sends it to that endpoint alone (a test event);
    None sends it to every enabled endpoint subscribed to ``event_type``.
    """
    if not isinstance(event_type, str) or not 0 < len(event_type) <= MAX_EVENT_TYPE:
        raise ValueError(f"an outbox event type is a name of 1 to {MAX_EVENT_TYPE} characters, got {event_type!r}")
    event_id = new_event_id()
    tx.execute("INSERT INTO outbox (event_id, event_type, subject_id, endpoint_id, payload, created_at)"
               " VALUES (?, ?, ?, ?, ?, ?)",
               (event_id, event_type, str(subject_id), endpoint_id,
                json.dumps(dict(payload), default=str, sort_keys=True), time.time() if at is None else at))
    return event_id


def run_event(tx: Any, run_id: str, status: str, *, at: float, lane: str | None = None,
              source_ref: str | None = None, error: Any = None, event_type: str | None = None) -> str:
    """The outbox row of a run's transition to ``status`` (``run.<status>`` unless ``event_type``), in the
    transition's transaction. The body names the run, never its outputs: a receiver reads those from the
    API with its token."""
    payload: dict[str, Any] = {"run_id": run_id, "status": status, "lane": lane, "workflow": source_ref}
    if isinstance(error, Mapping) and error.get("error_type"):
        payload["error_type"] = error["error_type"]
    return record(tx, event_type or f"run.{status}", run_id, payload, at=at)


def event_body(event_type: str, created_at: float, payload_json: str) -> bytes:
    """The bytes delivered (and signed) for an outbox row: the same bytes on every attempt."""
    stamp = datetime.fromtimestamp(created_at, UTC).isoformat().replace("+00:00", "Z")
    body = {"type": event_type, "timestamp": stamp, "data": json.loads(payload_json)}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
