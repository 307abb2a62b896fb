"""Conversation branches: a copy-on-write table and the BranchStore actor that hosts it.

Owns branch state. ``BranchTable`` is plain Python (testable without Ray); the
``BranchStore`` actor holds one table and serves many branches, so 10,000 branches are
10,000 small records, never 10,000 processes. A clone shares its parent's frozen prefix
and stores only its own new messages.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import ray

from opgraph.kernel import ExecutionError

from .errors import UnknownBranchError
from .memory import current_rss_mib

__all__ = ["BranchStore", "BranchTable", "UnknownBranchError", "shard_for"]


def shard_for(branch_id: str, shards: int) -> int:
    """The home shard of a root branch (clones live beside their source)."""
    return zlib.crc32(branch_id.encode()) % shards


def _size_of(message: Any) -> int:
    try:
        return len(json.dumps(message, default=str))
    except (TypeError, ValueError):
        return len(repr(message))


class _Record:
    """One branch: a frozen view of a parent record's first ``parent_len`` messages + own."""

    __slots__ = ("parent", "parent_len", "own", "own_bytes")

    def __init__(self, parent: _Record | None, parent_len: int, own: list[Any] | None = None) -> None:
        self.parent = parent
        self.parent_len = parent_len
        self.own: list[Any] = own if own is not None else []
        self.own_bytes = sum(_size_of(m) for m in self.own)

    def __len__(self) -> int:
        return self.parent_len + len(self.own)

    def materialise(self, limit: int | None = None) -> list[Any]:
        """The first ``limit`` messages (all by default), walking the parent chain once."""
        limit = len(self) if limit is None else limit
        chain: list[tuple[_Record, int]] = []
        record, take = self, limit
        while record is not None and take > 0:
            own_take = max(0, take - record.parent_len)
            chain.append((record, own_take))
            take = min(take, record.parent_len)
            record = record.parent
        messages: list[Any] = []
        for record, own_take in reversed(chain):
            messages.extend(record.own[:own_take])
        return messages


class BranchTable:
    """Branch id -> copy-on-write record. Every operation is O(1) except reading messages."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}
        self.clones = 0

    def _get(self, branch_id: str) -> _Record:
        record = self._records.get(branch_id)
        if record is None:
            raise UnknownBranchError("branch does not exist", branch_id=branch_id)
        return record

    def create(self, branch_id: str, messages: Sequence[Any] = (), *, exist_ok: bool = False) -> bool:
        if branch_id in self._records:
            if exist_ok:
                return False
            raise ExecutionError("branch already exists", branch_id=branch_id)
        self._records[branch_id] = _Record(None, 0, list(messages))
        return True

    def ensure(self, branch_id: str) -> bool:
        """Create ``branch_id`` empty unless it exists; True when it had to be created."""
        if branch_id in self._records:
            return False
        self._records[branch_id] = _Record(None, 0, [])
        return True

    def clone(self, source: str, destination: str) -> None:
        """O(1): the destination sees the source's current messages, then diverges."""
        parent = self._get(source)
        if destination in self._records:
            raise ExecutionError("clone destination already exists", branch_id=destination)
        self._records[destination] = _Record(parent, len(parent))
        self.clones += 1

    def replace_history(self, destination: str, source: str) -> bool:
        """Primary inheritance: the destination's history becomes the source's (O(1)).

        Returns False, and leaves the destination as it is, when the source is not held:
        it was lost with a store that died, and the caller reports the loss."""
        self._get(destination)
        parent = self._records.get(source)
        if parent is None:
            return False
        # A fresh record: clones taken from the old destination keep their frozen view.
        self._records[destination] = _Record(parent, len(parent))
        return True

    def append(self, branch_id: str, messages: Iterable[Any]) -> int:
        record = self._get(branch_id)
        for message in messages:
            record.own.append(message)
            record.own_bytes += _size_of(message)
        return len(record)

    def messages(self, branch_id: str) -> list[Any]:
        return self._get(branch_id).materialise()

    def length(self, branch_id: str) -> int:
        return len(self._get(branch_id))

    def drop(self, branch_id: str) -> bool:
        """Forget a branch. Clones taken from it keep their view (they hold its record)."""
        return self._records.pop(branch_id, None) is not None

    def __contains__(self, branch_id: object) -> bool:
        return branch_id in self._records

    def statistics(self) -> dict[str, Any]:
        return {
            "branches": len(self._records),
            "own_messages": sum(len(r.own) for r in self._records.values()),
            "bytes": sum(r.own_bytes for r in self._records.values()),
            "clones": self.clones,
        }


@ray.remote
class BranchStore:
    """A Ray actor serving one shard of branches; every method is a short, atomic call."""

    def __init__(self, shard: int = 0) -> None:
        self.shard = shard
        self.table = BranchTable()

    def create(self, branch_id: str, messages: list[Any] | None = None, exist_ok: bool = False) -> bool:
        return self.table.create(branch_id, messages or (), exist_ok=exist_ok)

    def clone(self, source: str, destination: str) -> None:
        self.table.clone(source, destination)

    def clone_many(self, pairs: list[tuple[str, str]]) -> list[str]:
        """Clone each (source, destination); returns the sources this store does not hold.

        A source can be missing only when it was lost (its store died and this one
        replaced it): the destination is then created empty, and the caller reports
        the loss, instead of every later node of the run failing on a missing branch.
        """
        missing = []
        table = self.table
        for source, destination in pairs:
            if source in table:
                table.clone(source, destination)
            else:
                missing.append(source)
                table.ensure(destination)
        return missing

    def ensure_many(self, branch_ids: list[str]) -> list[str]:
        """Create each branch that does not exist yet, empty; returns those created."""
        return [branch_id for branch_id in branch_ids if self.table.ensure(branch_id)]

    def drop_many(self, branch_ids: list[str]) -> int:
        return sum(1 for branch_id in branch_ids if self.table.drop(branch_id))

    def ping(self) -> int:
        return self.shard

    def replace_history(self, destination: str, source: str) -> bool:
        return self.table.replace_history(destination, source)

    def append(self, branch_id: str, messages: list[Any]) -> int:
        return self.table.append(branch_id, messages)

    def messages(self, branch_id: str) -> list[Any]:
        return self.table.messages(branch_id)

    def has(self, branch_id: str) -> bool:
        return branch_id in self.table

    def drop(self, branch_id: str) -> bool:
        return self.table.drop(branch_id)

    def statistics(self) -> dict[str, Any]:
        import resource  # local: only statistics reads process memory

        stats = self.table.statistics()
        stats["shard"] = self.shard
        stats["pid"] = os.getpid()
        stats["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        stats["rss_mib"] = current_rss_mib()
        return stats
