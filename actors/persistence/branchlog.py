"""Durable branches: the journal of a branch table's changes, and loading a shard back.

Owns the rows of the runtime's branch tables. A branch table (actors/branches/store.py) with a
journal notes every record it makes (a copy-on-write node: its parent and the length of
the parent it sees), every branch head pointed at a record, every message appended to a
record, and every record nothing references any more; the store flushes the journal in
one transaction per group commit. ``load_shard`` reads a shard back, parents first.

Rows belong to an owner: the runtime whose store wrote them (its namespace and process
token, ``BranchStore``'s ``owner``). A store loads its own rows only, so runtimes sharing
one file never see, or collide with, each other's record ids. A runtime that takes over
a run of another (an orphan resumed from the run log) adopts its branches instead:
``read_branch`` finds one in any other owner's rows, and ``release_branch`` lets the old
owner's head go (its rows with it, once it holds no branch at all).
"""

from __future__ import annotations

from typing import Any

from opgraph.kernel import RunLogIntegrityError

from .backends import upsert
from .codec import decode, encode
from .database import Database

__all__ = ["BranchJournal", "ShardRows", "load_shard", "read_branch", "release_branch"]

# Upserts both SQLite and PostgreSQL speak (backends.py). A head is deleted and inserted
# again, never updated in place: a head's row number says when it was last written, which
# is how ``read_branch`` tells the newest of several owners' heads.
_RECORD = upsert("runtime_branch_records", ("owner", "shard", "record_id", "parent_id", "parent_len"),
                 ("owner", "shard", "record_id"))
_MESSAGE = upsert("runtime_branch_messages", ("owner", "shard", "record_id", "seq", "message"),
                  ("owner", "shard", "record_id", "seq"))
_UNHEAD = "DELETE FROM runtime_branch_heads WHERE owner = ? AND branch_id = ?"
_HEAD = "INSERT INTO runtime_branch_heads (owner, branch_id, shard, record_id) VALUES (?, ?, ?, ?)"


class BranchJournal:
    """Changes of one shard not yet written, in order; record ids are the shard's own (per owner)."""

    def __init__(self, shard: int, next_id: int = 1, owner: str = "") -> None:
        self.shard = shard
        self.owner = owner
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

    def message(self, record_id: int, seq: int, message: Any, token: Any = None) -> None:
        """``token``: on an append's last message, the append's token (BranchTable.append)."""
        if token is None:
            self.ops.append(("message", record_id, seq, message))
        else:
            self.ops.append(("message", record_id, seq, message, token))

    def forget(self, record_id: int) -> None:
        """The record is unreachable (no branch, no clone sees it): its rows go."""
        self.ops.append(("forget", record_id))

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops

    def write(self, database: Database, ops: list[tuple]) -> int:
        """On the writer thread: ``ops`` in one transaction, in order; about how many bytes went in."""
        statements, size = self.statements(ops)
        if statements:
            database.transaction(statements)
        return size

    def statements(self, ops: list[tuple]) -> tuple[list[tuple[str, Any]], int]:
        """The statements that write ``ops``, in order, and about how many bytes they put in."""
        owner, shard, statements, size = self.owner, self.shard, [], 0
        for op in ops:
            kind = op[0]
            if kind == "record":
                statements.append((_RECORD, (owner, shard, op[1], op[2], op[3])))
            elif kind == "message":
                # The token rides in the message's own row, a second field beside it: no
                # column to add, and a reader that does not know it still finds the message.
                message = encode([[op[3], op[4]]] if len(op) > 4 else [[op[3]]])
                size += len(message)
                statements.append((_MESSAGE, (owner, shard, op[1], op[2], message)))
            elif kind == "head":
                statements.append((_UNHEAD, (owner, op[1])))
                statements.append((_HEAD, (owner, op[1], shard, op[2])))
            elif kind == "unhead":
                statements.append((_UNHEAD, (owner, op[1])))
            elif kind == "forget":
                statements.append(("DELETE FROM runtime_branch_messages WHERE owner = ? AND shard = ? "
                                   "AND record_id = ?", (owner, shard, op[1])))
                statements.append(("DELETE FROM runtime_branch_records WHERE owner = ? AND shard = ? "
                                   "AND record_id = ?", (owner, shard, op[1])))
        return statements, size + ROW_BYTES * len(statements)


ROW_BYTES = 100  # about what a row of ids takes on a page, beside the messages counted by their size


class ShardRows:
    """What a shard holds on disk: records (parents first), their messages, and the heads."""

    def __init__(self, records: list[tuple[int, int | None, int]], messages: dict[int, list[Any]],
                 heads: dict[str, int], tokens: dict[int, set[Any]] | None = None) -> None:
        self.records = records
        self.messages = messages
        self.heads = heads
        self.tokens = tokens or {}  # record id -> the tokens of the appends it holds

    @property
    def next_id(self) -> int:
        return max((record[0] for record in self.records), default=0) + 1


def load_shard(database: Database, shard: int, owner: str = "") -> ShardRows:
    records = [(record_id, parent_id, parent_len) for record_id, parent_id, parent_len in database.query(
        "SELECT record_id, parent_id, parent_len FROM runtime_branch_records WHERE owner = ? AND shard = ? "
        "ORDER BY record_id", (owner, shard))]
    messages: dict[int, list[Any]] = {}
    tokens: dict[int, set[Any]] = {}
    for record_id, _, blob in database.query(
            "SELECT record_id, seq, message FROM runtime_branch_messages WHERE owner = ? AND shard = ? "
            "ORDER BY record_id, seq", (owner, shard)):
        row = _decoded(blob, f"a message of shard {shard}")[0]
        messages.setdefault(record_id, []).append(row[0])
        if len(row) > 1:
            tokens.setdefault(record_id, set()).add(_hashable(row[1]))
    heads = dict(database.query("SELECT branch_id, record_id FROM runtime_branch_heads WHERE owner = ? AND shard = ?",
                                (owner, shard)))
    return ShardRows(records, messages, heads, tokens)


def _decoded(blob: bytes, what: str, branch_id: str | None = None) -> list[list[Any]]:
    """A stored message row, decoded; one that fails its integrity check says which it was."""
    try:
        return decode(blob)
    except RunLogIntegrityError as exc:
        raise RunLogIntegrityError(f"{what} cannot be trusted: {exc.message}", branch_id=branch_id) from None


def _hashable(token: Any) -> Any:
    """A token as it was given: msgpack hands a tuple back as a list."""
    return tuple(_hashable(part) for part in token) if isinstance(token, list) else token


def read_branch(database: Database, branch_id: str, besides: str) -> tuple[str, list[Any]] | None:
    """``branch_id``'s messages as another owner than ``besides`` wrote them: (that owner, messages).

    None when no other owner holds it. Should several, the newest head wins."""
    found = database.query("SELECT owner, shard, record_id FROM runtime_branch_heads WHERE branch_id = ? "
                           "AND owner != ? ORDER BY rowid DESC LIMIT 1", (branch_id, besides))
    if not found:
        return None
    owner, shard, record_id = found[0]
    chain: list[tuple[int, int]] = []  # (record id, how much of its parent it sees), newest first
    while record_id is not None:
        row = database.query("SELECT parent_id, parent_len FROM runtime_branch_records WHERE owner = ? AND shard = ? "
                             "AND record_id = ?", (owner, shard, record_id))
        if not row:
            break  # a record gone missing: the history reaches back as far as what is there
        chain.append((record_id, row[0][1]))
        record_id = row[0][0]
    messages: list[Any] = []
    for index in range(len(chain) - 1, -1, -1):  # oldest first; each sees the first parent_len of the one before
        record_id, _ = chain[index]
        if index + 1 < len(chain):
            del messages[chain[index][1]:]
        rows = database.query("SELECT message FROM runtime_branch_messages WHERE owner = ? AND shard = ? "
                              "AND record_id = ? ORDER BY seq", (owner, shard, record_id))
        messages.extend(_decoded(blob, f"a message of branch {branch_id}", branch_id)[0][0] for (blob,) in rows)
    return owner, messages


def release_branch(database: Database, owner: str, branch_id: str) -> None:
    """``owner`` lets go of ``branch_id`` (another runtime adopted it); an owner left with no
    branch at all is gone for good (its process died), and its rows go too."""
    statements: list[tuple[str, tuple]] = [
        ("DELETE FROM runtime_branch_heads WHERE owner = ? AND branch_id = ?", (owner, branch_id))]
    database.transaction(statements)
    if not database.query("SELECT 1 FROM runtime_branch_heads WHERE owner = ? LIMIT 1", (owner,)):
        database.transaction([("DELETE FROM runtime_branch_messages WHERE owner = ?", (owner,)),
                              ("DELETE FROM runtime_branch_records WHERE owner = ?", (owner,))])
