"""Canonical lifecycle signals keyed by ``op_id`` (ADR-0033 D5).

Owns the signal models every run emits, whoever called it: queued, started,
completed, failed, skipped, spawned, paused, escalated, and (beyond the record)
cancelled. Each carries the schema version. Signals are data; delivery belongs to
the executor shell.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

__all__ = [
    "NODE_PROGRESS_KINDS",
    "NODE_PROGRESS_SIGNALS",
    "NodeCancelled",
    "SIGNAL_SCHEMA_VERSION",
    "NodeCompleted",
    "NodeEscalated",
    "NodeFailed",
    "NodeLifecycleState",
    "NodePaused",
    "NodeQueued",
    "NodeSkipped",
    "NodeSpawned",
    "NodeStarted",
    "Signal",
]

SIGNAL_SCHEMA_VERSION: int = 1

NodeLifecycleState = Literal[
    "queued", "running", "awaiting_approval", "paused", "succeeded", "failed", "escalated"
]


class Signal(BaseModel):
    schema_version: int = SIGNAL_SCHEMA_VERSION
    run_id: str = ""
    kind: str = ""


class NodeQueued(Signal):
    kind: str = "queued"
    op_id: str = ""
    name: str = ""
    elapsed: float = 0.0
    parent_id: str | None = None
    depends_on: list[str] = Field(default_factory=list)


class NodeStarted(NodeQueued):
    kind: str = "started"


class NodeCompleted(NodeQueued):
    kind: str = "completed"


class NodeFailed(NodeQueued):
    kind: str = "failed"
    error: str | None = None


class NodeSkipped(NodeQueued):
    """Ideal over retrospective: a condition skip is its own signal, never ``failed``.

    ``reason`` says why no incoming path passed."""

    kind: str = "skipped"
    reason: str | None = None


class NodeCancelled(NodeQueued):
    """Beyond the record: a node settled ``cancelled`` (waiting, or cancelled while running).

    ADR-0033 D5's list has no cancelled signal, so a node cancelled mid-run was seen as
    queued, started, then nothing; every cancelled node that was queued now says so."""

    kind: str = "cancelled"
    reason: str | None = None


class NodePaused(NodeQueued):
    kind: str = "paused"


class NodeSpawned(Signal):
    kind: str = "spawned"
    op_id: str = ""
    parent_id: str | None = None
    independent: bool = False
    assignee: str | None = None
    instruction: str | None = None


class NodeEscalated(Signal):
    kind: str = "escalated"
    op_id: str = ""
    route: str = ""
    reason: str = ""
    child_id: str | None = None


# Signals that map onto the ``on_progress(op_id, name, status, elapsed)`` callback.
NODE_PROGRESS_SIGNALS: dict[type, str] = {
    NodeQueued: "queued",
    NodeStarted: "started",
    NodeCompleted: "completed",
    NodeFailed: "failed",
    NodeSkipped: "skipped",
    NodeCancelled: "cancelled",
}
NODE_PROGRESS_KINDS: dict[str, str] = {
    cls.model_fields["kind"].default: status for cls, status in NODE_PROGRESS_SIGNALS.items()
}
