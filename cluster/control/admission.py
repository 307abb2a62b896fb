"""Admission checks a producer runs before it submits: what can be known without an adapter.

Owns refusing, before anything is queued, a task whose target cannot exist: a ``workflow`` task
naming a workflow the run store does not hold (a file target is read by the worker). It reads
the run store only; it imports no adapter and no lane.
"""

from __future__ import annotations

from pathlib import Path

from ..store import RunStore, WorkflowNotFoundError
from .errors import ACTION_KINDS, ControlInputError, UnknownActionKindError

__all__ = ["check_target"]


def check_target(action_kind: str, target: str, store: RunStore | None) -> None:
    """``UnknownActionKindError`` for an unknown kind; ``WorkflowNotFoundError`` (typed, from the store) for a
    workflow name the store does not hold; ``ControlInputError`` for a missing file target."""
    if action_kind not in ACTION_KINDS:
        raise UnknownActionKindError(str(action_kind), ACTION_KINDS)
    if not isinstance(target, str) or not target.strip():
        raise ControlInputError("a task needs a target (a workflow name, a prompt, a file)", field="target")
    if "\x00" in target:
        raise ControlInputError("a target holds no NUL character", field="target")
    if action_kind == "flow_yaml" and not Path(target).expanduser().is_file():
        raise ControlInputError(f"no flow spec file {target!r}", field="target")
    if action_kind != "workflow" or store is None:
        return
    if target.endswith(".json") or Path(target).expanduser().is_file():
        if not Path(target).expanduser().is_file():
            raise ControlInputError(f"no workflow file {target!r}", field="target")
        return
    name, _, version = target.partition("@")
    try:
        store.resolve(name, int(version) if version.isdigit() else None)
    except WorkflowNotFoundError:
        raise
    except ValueError as exc:
        raise ControlInputError(f"bad workflow reference {target!r}: {exc}", field="target") from exc


