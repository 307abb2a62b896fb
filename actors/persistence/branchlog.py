"""Durable branches: the journal of a branch table's changes, and loading a shard back.

Owns the rows of the runtime's branch tables. A branch table (actors/branches.py) with a
journal notes every record it makes (a copy-on-write node: its parent and the length of
the parent it sees), every branch head pointed at a record, every message appended to a
record, and every record nothing references any more; the store flushes the journal in
one transaction per group commit. ``load_shard`` reads a shard back, parents first.
"""

from __future__ import annotations

from typing import Any

from .backends import upsert
from .codec import decode, encode
from .database import Database

__all__ = ["BranchJournal", "ShardRows", "load_shard"]

# Upserts both SQLite and PostgreSQL speak (backends.py).
_RECORD = upsert("runtime_branch_records", ("shard", "record_id", "parent_id", "parent_len"), ("shard", "record_id"))
_MESSAGE = upsert("runtime_branch_messages", ("shard", "record_id", "seq", "message"), ("shard", "record_id", "seq"))
_HEAD = upsert("runtime_branch_heads", ("branch_id", "shard", "record_id"), ("branch_id",))


class BranchJournal:
    """Changes of one shard not yet written, in order; record ids are the shard's own."""

    def __init__(self, shard: int, next_id: int = 1) -> None:
        self.shard = shard
        self.next_id = next_id
        self.ops: list[tuple] = []

    def new_record(self, parent_id: int | None, parent_len: int, messages: list[Any]) -> int:
        record_id = self.next_id
        self.next_id += 1
        self.ops.append(("record", record_id, parent_id, parent_len))
        for seq, message in enumerate(messages):
            self.ops.append(("message", record_id, seq, message))
        return record_id

    def head(self, branch_id: str, record_id: int) -> None:
        self.ops.append(("head", branch_id, record_id))

    def unhead(self, branch_id: str) -> None:
        self.ops.append(("unhead", branch_id))

    def message(self, record_id: int, seq: int, message: Any) -> None:
        self.ops.append(("message", record_id, seq, message))

    def forget(self, record_id: int) -> None:
        """The record is unreachable (no branch, no clone sees it): its rows go."""
        self.ops.append(("forget", record_id))

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def write(self, database: Database, ops: list[tuple]) -> None:
        """On the writer thread: ``ops`` in one transaction, in order."""
        shard, statements = self.shard, []
        for op in ops:
            kind = op[0]
            if kind == "record":
                statements.append((_RECORD, (shard, op[1], op[2], op[3])))
            elif kind == "message":
                statements.append((_MESSAGE, (shard, op[1], op[2], encode([[op[3]]]))))
            elif kind == "head":
                statements.append((_HEAD, (op[1], shard, op[2])))
            elif kind == "unhead":
                statements.append(("DELETE FROM runtime_branch_heads WHERE branch_id = ? AND shard = ?",
                                   (op[1], shard)))
            elif kind == "forget":
                statements.append(("DELETE FROM runtime_branch_messages WHERE shard = ? AND record_id = ?",
                                   (shard, op[1])))
                statements.append(("DELETE FROM runtime_branch_records WHERE shard = ? AND record_id = ?",
                                   (shard, op[1])))
        if statements:
            database.transaction(statements)


class ShardRows:
    """What a shard holds on disk: records (parents first), their messages, and the heads."""

    def __init__(self, records: list[tuple[int, int | None, int]], messages: dict[int, list[Any]],
                 heads: dict[str, int]) -> None:
        self.records = records
        self.messages = messages
        self.heads = heads

    @property
    def next_id(self) -> int:
        return max((record[0] for record in self.records), default=0) + 1


def load_shard(database: Database, shard: int) -> ShardRows:
    records = [(record_id, parent_id, parent_len) for record_id, parent_id, parent_len in database.query(
        "SELECT record_id, parent_id, parent_len FROM runtime_branch_records WHERE shard = ? ORDER BY record_id",
        (shard,))]
    messages: dict[int, list[Any]] = {}
    for record_id, _, blob in database.query(
            "SELECT record_id, seq, message FROM runtime_branch_messages WHERE shard = ? ORDER BY record_id, seq",
            (shard,)):
        messages.setdefault(record_id, []).append(decode(blob)[0][0])
    heads = dict(database.query("SELECT branch_id, record_id FROM runtime_branch_heads WHERE shard = ?", (shard,)))
    return ShardRows(records, messages, heads)
