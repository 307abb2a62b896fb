"""Context materialisation: predecessor results, the shared context, and operator steer (ADR-0023 D4).

Owns how an operation's input context is assembled and how successful responses merge
back into the flow's shared context. Pure data transformation: timestamps arrive as
values, never read from a clock.
"""

from __future__ import annotations

import bisect
import copy
import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .errors import OperationError

__all__ = [
    "OPERATOR_MESSAGES_KEY",
    "SharedContext",
    "format_steer_timestamp",
    "render_operator_messages",
    "to_mapping",
]

OPERATOR_MESSAGES_KEY = "operator_messages"
_STEER_HEADER = (
    "[OPERATOR STEER]\n"
    "A human operator sent these live corrections while this flow is running.\n"
    "Attend to them before continuing. Most recent last.\n"
)
_STEER_FOOTER = "[/OPERATOR STEER]"

Reducer = Callable[[Any, Any], Any]


_SCALARS = frozenset({str, int, float, bool, type(None)})


def to_mapping(value: Any) -> Any:
    """Recursively turn models into mappings; str, int, float and bool stay scalars."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, BaseModel):
        dumped = value.model_dump()
        for item in dumped.values():
            if type(item) not in _SCALARS:
                return to_mapping(dumped)
        # Every field a scalar (a SpawnRequest): the walk would only copy the dump. A planner's
        # 1,000 requests became their children's context 5 ms sooner without it (issue #18).
        return dumped
    if isinstance(value, Mapping):
        return {key: to_mapping(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_mapping(item) for item in value]
    return value


def format_steer_timestamp(ts: Any) -> str:
    """Numeric timestamps become UTC ``YYYY-MM-DDTHH:MM:SSZ``; anything else is ``str(ts)``."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        try:
            moment = _dt.datetime.fromtimestamp(float(ts), tz=_dt.UTC)
        except (OverflowError, OSError, ValueError):
            return str(ts)
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(ts)


def render_operator_messages(queue: list[Any], instruction: str, op_id: str) -> str:
    """Prepend unrendered steer entries to ``instruction`` and stamp their breadcrumb.

    Dict entries without a truthy ``rendered_into_op`` render in list order and are
    marked with ``op_id`` so each is consumed exactly once; other entries are ignored.
    Returns the instruction unchanged when nothing is pending.
    """
    pending = [
        entry for entry in queue if isinstance(entry, dict) and not entry.get("rendered_into_op")
    ]
    if not pending:
        return instruction
    lines = [f"- {format_steer_timestamp(entry.get('ts'))}: {entry.get('text', '')}" for entry in pending]
    for entry in pending:
        entry["rendered_into_op"] = op_id
    block = _STEER_HEADER + "\n".join(lines) + "\n" + _STEER_FOOTER
    return f"{block}\n\n{instruction}"


@dataclass(frozen=True, slots=True)
class _Write:
    """One successful node's value for one top-level key, kept so the key can be replayed."""

    rank: Any
    writer: str
    value: Any
    follows: Callable[[str], bool]


def _follows_nothing(other: str) -> bool:
    return False


class SharedContext:
    """The flow-wide context with deterministic merging of parallel writes.

    Ideal over retrospective (ADR-0023 D4): the record let completion timing decide
    colliding writes. Here the value of every top-level key is defined as the initial
    value deep-merged with each write to it *in rank order* (graph insertion order,
    descendants after ancestors), whatever order the writers finish in. A write that
    arrives in rank order is applied directly; one that arrives early for its rank
    makes that key replay its writes in order. Replaying, rather than keeping per-leaf
    owners, is what makes mixed shapes deterministic: a scalar and a nested write to
    the same key resolve the same way in every completion order.

    A key with a declared reducer combines values with it, also in rank order. A
    write that replaces another writer's value, when it does not causally follow that
    writer (``follows(previous)``), is recorded as a collision for the envelope.
    """

    #: The initial context, a deep copy, never changed: every replay starts from it.
    _initial: dict[str, Any]
    #: The current context. Written by ``_apply`` and ``_replay`` (so by ``merge`` and
    #: ``_withdraw``); FlowState appends operator messages to its steer queue, and
    #: dispatch marks those entries rendered.
    data: dict[str, Any]
    #: Key -> its declared reducer, set at construction.
    reducers: dict[str, Reducer]
    #: Key -> every successful write to it, in rank order: what ``_replay`` applies.
    #: Added to by ``merge``, taken from by ``_withdraw``.
    _writes: dict[str, list[_Write]]
    #: Key -> path -> (rank, writer) of the write that set that leaf (or, for a key with
    #: a reducer, the key as a whole). Kept by ``_apply``, ``_merge_into`` and ``_replay``.
    _owners: dict[str, dict[tuple[str, ...], tuple[Any, str]]]
    #: Key -> the collisions recorded on it (``_record``), cleared when it replays.
    _collisions: dict[str, list[dict[str, Any]]]

    def __init__(self, initial: Mapping[str, Any] | None = None, reducers: Mapping[str, Reducer] | None = None):
        self._initial: dict[str, Any] = copy.deepcopy(dict(initial or {}))
        self.data: dict[str, Any] = copy.deepcopy(self._initial)
        self.reducers: dict[str, Reducer] = dict(reducers or {})
        self._writes: dict[str, list[_Write]] = {}
        # Per top-level key: path -> (rank, writer) of the write that set that leaf.
        self._owners: dict[str, dict[tuple[str, ...], tuple[Any, str]]] = {}
        self._collisions: dict[str, list[dict[str, Any]]] = {}

    @property
    def collisions(self) -> list[dict[str, Any]]:
        """Recorded collisions, keys in the rank order of their first write."""
        keys = sorted(self._collisions, key=lambda key: self._writes[key][0].rank)
        return [entry for key in keys for entry in self._collisions[key]]

    def merge(
        self,
        update: Mapping[str, Any],
        *,
        writer: str,
        rank: Any,
        follows: Callable[[str], bool] | None = None,
    ) -> None:
        """Deep-merge ``update`` from ``writer``; ``follows(other)`` says writer runs after other.

        All or nothing: should a reducer raise, or a value refuse to be copied, every
        key of ``update`` is restored to what it was and OperationError names the key.
        """
        follows = follows or _follows_nothing
        touched: list[str] = []
        try:
            for key, value in update.items():
                touched.append(key)
                write = _Write(rank, writer, copy.deepcopy(value), follows)
                writes = self._writes.setdefault(key, [])
                if not writes or writes[-1].rank < rank:
                    writes.append(write)
                    self._apply(key, write)
                else:
                    bisect.insort(writes, write, key=_rank_of)
                    self._replay(key)
        except Exception as exc:
            self._withdraw(writer, touched)
            raise OperationError(
                f"context key {touched[-1]!r} could not be merged: {type(exc).__name__}: {exc}", node_id=writer
            ) from exc

    def _withdraw(self, writer: str, keys: list[str]) -> None:
        """Take ``writer``'s writes back from ``keys``: each is replayed from the rest."""
        for key in keys:
            remaining = [write for write in self._writes.get(key, ()) if write.writer != writer]
            if remaining:
                self._writes[key] = remaining
            else:
                self._writes.pop(key, None)
            self._replay(key)

    def _replay(self, key: str) -> None:
        self._owners.pop(key, None)
        self._collisions.pop(key, None)
        if key in self._initial:
            self.data[key] = copy.deepcopy(self._initial[key])
        else:
            self.data.pop(key, None)
        for write in self._writes.get(key, ()):
            self._apply(key, write)

    def _apply(self, key: str, write: _Write) -> None:
        if key in self.reducers:
            owners = self._owners.setdefault(key, {})
            previous = owners.get((key,))
            if key in self.data and previous is not None and previous[1] != write.writer:
                self._record((key,), previous[1], write.writer, winner="reducer")
            self.data[key] = self.reducers[key](self.data.get(key), copy.deepcopy(write.value))
            owners[(key,)] = (write.rank, write.writer)
        else:
            self._merge_into(self.data, (key,), write.value, write)

    def _merge_into(self, target: dict, path: tuple[str, ...], value: Any, write: _Write) -> None:
        key = path[-1]
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            for sub_key, sub_value in value.items():
                self._merge_into(target[key], (*path, sub_key), sub_value, write)
            return
        owners = self._owners.setdefault(path[0], {})
        # Replacing ``path`` replaces everything under it: each displaced writer collides once.
        displaced = [owned for owned in owners if owned[: len(path)] == path]
        previous_writers = dict.fromkeys(owners.pop(owned)[1] for owned in displaced)
        for previous in previous_writers:
            if previous != write.writer and not write.follows(previous):
                self._record(path, previous, write.writer, winner=write.writer)
        target[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else copy.deepcopy(value)
        self._claim(owners, path, value, (write.rank, write.writer))

    def _claim(self, owners: dict, path: tuple[str, ...], value: Any, owner: tuple[Any, str]) -> None:
        owners[path] = owner
        if isinstance(value, Mapping):
            for sub_key, sub_value in value.items():
                self._claim(owners, (*path, sub_key), sub_value, owner)

    def _record(self, path: tuple[str, ...], first: str, second: str, *, winner: str) -> None:
        self._collisions.setdefault(path[0], []).append(
            {"key": ".".join(map(str, path)), "writers": [first, second], "winner": winner}
        )

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)


def _rank_of(write: _Write) -> Any:
    return write.rank
