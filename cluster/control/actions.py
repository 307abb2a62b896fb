"""The action registry (ADR-0068 D5): ``action_kind`` -> the adapter a worker runs a task with.

Owns the typed routing key's adapters, loaded by module name only when a worker first asks
(``"module:attribute"``), so a producer (a schedule, the CLI, the API) that submits a task never
imports an adapter; and the shape an adapter is called with and returns. It runs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..lazy_registry import LazyRegistry
from .errors import ACTION_KINDS, UnknownActionKindError
from .queue import TaskRecord

__all__ = ["ACTIONS", "BUILTIN_ACTIONS", "ActionAdapter", "ActionContext", "ActionOutcome", "ActionRegistry"]

# The built-in adapters, by where they live: imported by a worker, on first use.
BUILTIN_ACTIONS: Mapping[str, str] = {
    "agent": "opgraph.cluster.control.adapters:AGENT",
    "fanout": "opgraph.cluster.control.adapters:FANOUT",
    "flow": "opgraph.cluster.control.adapters:FLOW",
    "flow_yaml": "opgraph.cluster.control.adapters:FLOW_YAML",
    "play": "opgraph.cluster.control.adapters:PLAY",
    "workflow": "opgraph.cluster.control.adapters:WORKFLOW",
}


@dataclass
class ActionContext:
    """What a worker hands an adapter for one task.

    ``session()`` opens (once) the Session runs go to; ``store`` is the run store lane runs are
    recorded in; ``started(run_id)`` must be awaited with the run's id before the run starts, so
    a worker that takes the task over finds the run in the log; ``on_progress(label, name, status,
    elapsed)`` sees each node's lifecycle signal.
    """

    session: Callable[[], Any]
    store: Any
    started: Callable[[str], Any]
    on_progress: Callable[[str, str, str, float], Any] | None = None
    worker: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ActionOutcome:
    """How a task's run ended: ``completed``, ``failed`` (``retryable`` says whether another attempt may
    help: a workflow that does not exist will not) or ``cancelled``; ``result`` is what the task keeps."""

    status: str
    result: dict[str, Any] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    retryable: bool = True


@runtime_checkable
class ActionAdapter(Protocol):
    """Runs one task of its ``action_kind``: a new run, or (``task.run_id`` set by an earlier attempt
    whose lease lapsed) that run continued from the run log, so no settled node runs again."""

    action_kind: str

    async def run(self, task: TaskRecord, context: ActionContext) -> ActionOutcome: ...


class ActionRegistry(LazyRegistry[ActionAdapter]):
    """``action_kind`` -> adapter; the built-in ones load on first use."""

    def __init__(self, builtin: Mapping[str, str] = BUILTIN_ACTIONS) -> None:
        super().__init__(builtin)

    def register(self, adapter: ActionAdapter, *, replace: bool = False) -> None:
        if adapter.action_kind not in ACTION_KINDS:
            raise UnknownActionKindError(adapter.action_kind, ACTION_KINDS)
        self._put(adapter.action_kind, adapter, replace=replace,
                  refusal=f"action {adapter.action_kind!r} is registered already; pass replace=True")

    def adapter(self, action_kind: str) -> ActionAdapter:
        return self._get(action_kind, _load_adapter, lambda: UnknownActionKindError(str(action_kind), self.kinds()))


def _load_adapter(where: str) -> ActionAdapter:
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


ACTIONS = ActionRegistry()
