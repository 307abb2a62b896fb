"""Context materialisation: predecessor results, the shared context, and operator steer (ADR-0023 D4).

Owns how an operation's input context is assembled and how successful responses merge
back into the flow's shared context. Pure data transformation: timestamps arrive as
values, never read from a clock.
"""

from __future__ import annotations

import copy
import datetime as _dt
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

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


def to_mapping(value: Any) -> Any:
    """Recursively turn models into mappings; str, int, float and bool stay scalars."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, BaseModel):
        return to_mapping(value.model_dump())
    if isinstance(value, Mapping):
        return {key: to_mapping(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_mapping(item) for item in value]
    return value


def format_steer_timestamp(ts: Any) -> str:
    """Numeric timestamps become UTC ``YYYY-MM-DDTHH:MM:SSZ``; anything else is ``str(ts)``."""
    if isinstance(ts, (int, float)) and not isinstance(ts, bool):
        try:
            moment = _dt.datetime.fromtimestamp(float(ts), tz=_dt.timezone.utc)
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


class SharedContext:
    """The flow-wide context with deterministic merging of parallel writes.

    Ideal over retrospective (ADR-0023 D4): the record let completion timing decide
    colliding writes. Here a key with a declared reducer combines values with it;
    otherwise each leaf remembers the rank of its writer. A writer that causally
    follows the previous one (``follows(previous)``) simply overwrites. Between
    parallel writers the higher rank (later in graph insertion order) wins, whatever
    order they finish in, and the collision is recorded for the envelope.
    """

    def __init__(self, initial: Mapping[str, Any] | None = None, reducers: Mapping[str, Reducer] | None = None):
        self.data: dict[str, Any] = copy.deepcopy(dict(initial or {}))
        self.reducers: dict[str, Reducer] = dict(reducers or {})
        self._owner: dict[tuple[str, ...], tuple[Any, str]] = {}
        self.collisions: list[dict[str, Any]] = []

    def merge(
        self,
        update: Mapping[str, Any],
        *,
        writer: str,
        rank: Any,
        follows: Callable[[str], bool] | None = None,
    ) -> None:
        """Deep-merge ``update`` from ``writer``; ``follows(other)`` says writer runs after other."""
        self._follows = follows or (lambda other: False)
        for key, value in update.items():
            if key in self.reducers:
                path = (key,)
                previous = self._owner.get(path)
                if key in self.data and previous is not None and previous[1] != writer:
                    self._record(path, previous[1], writer, winner="reducer")
                self.data[key] = self.reducers[key](self.data.get(key), copy.deepcopy(value))
                self._owner[path] = (rank, writer)
            else:
                self._merge_into(self.data, (key,), value, writer, rank)

    def _merge_into(self, target: dict, path: tuple[str, ...], value: Any, writer: str, rank: Any) -> None:
        key = path[-1]
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            for sub_key, sub_value in value.items():
                self._merge_into(target[key], (*path, sub_key), sub_value, writer, rank)
            return
        previous = self._owner.get(path)
        if previous is not None and previous[1] != writer and not self._follows(previous[1]):
            if previous[0] > rank:
                self._record(path, previous[1], writer, winner=previous[1])
                return
            self._record(path, previous[1], writer, winner=writer)
        target[key] = copy.deepcopy(dict(value)) if isinstance(value, Mapping) else copy.deepcopy(value)
        self._owner[path] = (rank, writer)
        if isinstance(value, Mapping):
            self._claim_children(path, value, writer, rank)

    def _claim_children(self, path: tuple[str, ...], value: Mapping, writer: str, rank: Any) -> None:
        for sub_key, sub_value in value.items():
            self._owner[(*path, sub_key)] = (rank, writer)
            if isinstance(sub_value, Mapping):
                self._claim_children((*path, sub_key), sub_value, writer, rank)

    def _record(self, path: tuple[str, ...], first: str, second: str, *, winner: str) -> None:
        self.collisions.append(
            {"key": ".".join(map(str, path)), "writers": [first, second], "winner": winner}
        )

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)
