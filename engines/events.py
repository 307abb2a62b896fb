"""Typed engine events, the run's bounded event log, and the durable event-sink protocol.

Owns ``EngineEvent``/``JudgeVerdict`` (ADR-0034 D3), the ``EventRecord`` every typed
event and notification becomes, and ``EventLog``: the in-memory history ``by_type()``
queries, bounded by a retention policy, with every record also written to an injected
``EventSink``. It performs no I/O itself; the sink does (cluster/ supplies SQLite).

Retention (ADR-0034 delta 1, ideal over retrospective): the record kept every observer
item in memory for the life of the run. Here the log keeps the newest
``max_retained_events`` typed events (default 10,000) and the newest
``max_retained_notifications`` notifications (default 1,000) in memory; older ones are
evicted, counted in ``statistics()``, and stay in the sink, which holds every record of
the run. ``by_type()`` answers from what is retained.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from .errors import EventSinkError

__all__ = [
    "DEFAULT_MAX_RETAINED_EVENTS",
    "DEFAULT_MAX_RETAINED_NOTIFICATIONS",
    "EngineEvent",
    "EventLog",
    "EventRecord",
    "EventSink",
    "JudgeVerdict",
    "MemorySink",
    "event_data",
]

DEFAULT_MAX_RETAINED_EVENTS = 10_000
DEFAULT_MAX_RETAINED_NOTIFICATIONS = 1_000


class EngineEvent(BaseModel):
    """Base of every typed domain emission; unknown fields are refused (``extra="forbid"``)."""

    model_config = ConfigDict(extra="forbid")


class JudgeVerdict(EngineEvent):
    """A judge's typed decision about ``subject`` (an event id or topic)."""

    subject: str = ""
    allow: bool = True
    reason: str = ""


def event_data(value: Any) -> dict[str, Any]:
    """A payload as plain JSON-able data (a model's dump, or a mapping copied)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {str(key): item for key, item in value.items()}
    return {"value": value}


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One entry of a run's log: a typed event (``kind="event"``) or a notification.

    ``type`` is the event class name or the notification kind; ``data`` is plain data
    (what the sink stores); ``payload`` is the live ``EngineEvent`` (events only, never stored).
    """

    run_id: str
    seq: int
    kind: Literal["event", "notification"]
    type: str
    data: dict[str, Any]
    agent: str | None = None
    at: float = 0.0
    payload: Any = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """What ``on_event`` receives: ``{"type": kind, **data}``, plus the agent when known."""
        message = {"type": self.type, **self.data}
        if self.agent is not None:
            message.setdefault("agent", self.agent)
        return message


@runtime_checkable
class EventSink(Protocol):
    """Where a run's records go to outlive the process (called from a worker thread).

    ``open_run`` once before any record, ``record_events`` with batches in ``seq``
    order, ``close_run`` once at the end with the run's status
    (``completed``, ``degraded``, ``failed`` or ``cancelled``).
    """

    def open_run(self, run_id: str, *, engine: str, inputs: Mapping[str, Any],
                 config: Mapping[str, Any]) -> None: ...

    def record_events(self, run_id: str, records: Sequence[EventRecord]) -> None: ...

    def close_run(self, run_id: str, status: str, *, result: str | None, degrade_reason: str,
                  error: Mapping[str, Any] | None, statistics: Mapping[str, Any]) -> None: ...


class MemorySink:
    """An ``EventSink`` that keeps everything in this process (tests, scripts without a store)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, Any]] = {}
        self.records: dict[str, list[EventRecord]] = {}

    def open_run(self, run_id: str, *, engine: str, inputs: Mapping[str, Any],
                 config: Mapping[str, Any]) -> None:
        self.runs[run_id] = {"engine": engine, "inputs": dict(inputs), "config": dict(config), "status": "running"}
        self.records.setdefault(run_id, [])

    def record_events(self, run_id: str, records: Sequence[EventRecord]) -> None:
        self.records.setdefault(run_id, []).extend(records)

    def close_run(self, run_id: str, status: str, *, result: str | None, degrade_reason: str,
                  error: Mapping[str, Any] | None, statistics: Mapping[str, Any]) -> None:
        self.runs[run_id].update(status=status, result=result, degrade_reason=degrade_reason,
                                 error=None if error is None else dict(error), statistics=dict(statistics))

    def types(self, run_id: str) -> list[str]:
        return [record.type for record in self.records.get(run_id, [])]


class EventLog:
    """A run's typed events and notifications: bounded in memory, complete in the sink.

    Appends are synchronous (any code of the run may notify); writes to the sink happen
    in batches on a worker thread, one batch at a time, in ``seq`` order. ``drain()``
    waits until everything appended so far is written and raises ``EventSinkError`` if
    the sink failed (a failed write is never retried or dropped silently).
    """

    def __init__(self, run_id: str, sink: EventSink | None = None, *,
                 max_retained_events: int = DEFAULT_MAX_RETAINED_EVENTS,
                 max_retained_notifications: int = DEFAULT_MAX_RETAINED_NOTIFICATIONS,
                 clock: Callable[[], float] = time.time) -> None:
        self.run_id = run_id
        self.sink = sink
        self._clock = clock
        self._events: deque[EventRecord] = deque(maxlen=max_retained_events)
        self._notifications: deque[EventRecord] = deque(maxlen=max_retained_notifications)
        self._unwritten: list[EventRecord] = []
        self._writer: asyncio.Task | None = None
        self._sink_error: BaseException | None = None
        self.seq = 0
        self.evicted_events = 0
        self.evicted_notifications = 0
        self.written = 0

    # -- appending ----------------------------------------------------------------------
    def add_event(self, payload: BaseModel, *, agent: str | None = None) -> EventRecord:
        """Record a typed emission; the payload itself is kept for ``by_type()``."""
        record = self._record("event", type(payload).__name__, event_data(payload), agent, payload)
        if len(self._events) == self._events.maxlen:
            self.evicted_events += 1
        self._events.append(record)
        return record

    def add_notification(self, kind: str, data: Mapping[str, Any] | None = None, *,
                         agent: str | None = None) -> EventRecord:
        record = self._record("notification", kind, dict(data or {}), agent, None)
        if len(self._notifications) == self._notifications.maxlen:
            self.evicted_notifications += 1
        self._notifications.append(record)
        return record

    def _record(self, kind: Literal["event", "notification"], type_name: str, data: dict[str, Any],
                agent: str | None, payload: Any) -> EventRecord:
        self.seq += 1
        record = EventRecord(self.run_id, self.seq, kind, type_name, data, agent, self._clock(), payload)
        if self.sink is not None:
            self._unwritten.append(record)
            self._schedule_write()
        return record

    # -- queries ------------------------------------------------------------------------
    def by_type(self, match: type | Callable[[Any], bool], *, agent: str | None = None) -> list[Any]:
        """Retained payloads that are instances of ``match`` (or satisfy it, when a callable)."""
        if isinstance(match, type):
            def test(payload: Any) -> bool:
                return isinstance(payload, match)
        else:
            test = match
        return [record.payload for record in self._events
                if (agent is None or record.agent == agent) and test(record.payload)]

    def events(self) -> list[EventRecord]:
        return list(self._events)

    def notifications(self, kind: str | None = None) -> list[EventRecord]:
        return [record for record in self._notifications if kind is None or record.type == kind]

    def statistics(self) -> dict[str, int]:
        return {
            "recorded": self.seq,
            "retained_events": len(self._events),
            "retained_notifications": len(self._notifications),
            "evicted_events": self.evicted_events,
            "evicted_notifications": self.evicted_notifications,
            "written": self.written,
            "unwritten": len(self._unwritten),
        }

    # -- durability ---------------------------------------------------------------------
    def _schedule_write(self) -> None:
        if self._writer is not None and not self._writer.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): drain() writes it later
        self._writer = loop.create_task(self._write_all())

    async def _write_all(self) -> None:
        while self._unwritten and self._sink_error is None:
            batch, self._unwritten = self._unwritten, []
            try:
                await asyncio.to_thread(self.sink.record_events, self.run_id, batch)
            except Exception as exc:  # noqa: BLE001 - kept and raised by drain() as EventSinkError
                self._sink_error = exc
                self._unwritten = batch + self._unwritten
                return
            self.written += len(batch)

    async def drain(self) -> None:
        """Wait until every record appended so far is in the sink; raise if the sink failed."""
        while True:
            writer = self._writer
            if writer is not None and not writer.done():
                # Shielded: a caller cancelled while draining still leaves the write whole.
                await asyncio.shield(writer)
            if self._sink_error is None and self._unwritten and self.sink is not None:
                self._writer = asyncio.get_running_loop().create_task(self._write_all())
                continue
            break
        if self._sink_error is not None:
            raise EventSinkError(f"the run's events could not be recorded: {type(self._sink_error).__name__}: "
                                 f"{self._sink_error}", run_id=self.run_id) from self._sink_error
