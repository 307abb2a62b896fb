"""Conversation branches: a copy-on-write table and the BranchStore actor that hosts it.

Owns branch state. ``BranchTable`` is plain Python (testable without Ray); the
``BranchStore`` actor holds one table and serves many branches, so 10,000 branches are
10,000 small records, never 10,000 processes. A clone shares its parent's frozen prefix
and stores only its own new messages. A durable store journals every change and
acknowledges a change only once it is written, and a replacement reloads its shard.
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import ray

from opgraph.kernel import ExecutionError

from ..errors import UnknownBranchError
from ..persistence import Database, Writer
from ..persistence.branchlog import BranchJournal, ShardRows, load_shard, read_branch, release_branch
from ..persistence.database import Checkpointer
from ..statistics import current_rss_mib
from ..workers.channel import ChannelServer

__all__ = ["BranchStore", "BranchTable", "Histories", "UnknownBranchError", "expand_histories", "shard_for"]


# The largest journal write committed on the store's loop (SQLite); a larger one goes to the writer thread.
INLINE_BYTES = 256 << 10


def shard_for(branch_id: str, shards: int) -> int:
    """The home shard of a root branch (clones live beside their source)."""
    return zlib.crc32(branch_id.encode()) % shards


def _size_of(message: Any) -> int:
    try:
        return len(json.dumps(message, default=str))
    except (TypeError, ValueError):
        return len(repr(message))


# (records as (parent's place or -1, how many of its messages, own messages), each branch's record or None)
Histories = tuple[list[tuple[int, int, list[Any]]], list[int | None]]


def expand_histories(histories: Histories) -> list[list[Any] | None]:
    """Each branch's messages from ``BranchTable.histories`` (None for one not held). The lists
    share their message objects (one decoded copy of a common prefix): read them, do not change them."""
    records, heads = histories
    full: list[list[Any]] = []
    for parent, parent_len, own in records:
        full.append(own if parent < 0 else full[parent][:parent_len] + own)
    return [None if head is None else list(full[head]) for head in heads]


class _Record:
    """One branch: a frozen view of a parent record's first ``parent_len`` messages + own."""

    __slots__ = ("parent", "parent_len", "own", "own_bytes", "record_id", "tokens", "__weakref__")

    def __init__(self, parent: _Record | None, parent_len: int, own: list[Any] | None = None) -> None:
        self.parent = parent
        self.parent_len = parent_len
        self.own: list[Any] = own if own is not None else []
        self.own_bytes = sum(_size_of(m) for m in self.own)
        self.record_id = 0  # durable tables only: the record's row
        self.tokens: set[Any] | None = None  # the tokens of the appends made to this record

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
    """Branch id -> copy-on-write record. Every operation is O(1) except reading messages.

    With a ``journal`` every change is also noted there, for the store to write: a record
    made, a head moved, a message appended, and a record forgotten once nothing (no
    branch, no clone) refers to it any more, which Python's reference counting tells.
    """

    def __init__(self, journal: BranchJournal | None = None) -> None:
        self._records: dict[str, _Record] = {}
        self.clones = 0
        self.journal = journal

    @classmethod
    def loaded(cls, journal: BranchJournal, rows: ShardRows) -> BranchTable:
        """A durable table holding what ``rows`` (a shard read back) hold."""
        table = cls(journal)
        by_id: dict[int, _Record] = {}
        for record_id, parent_id, parent_len in rows.records:  # parents first: ids grow
            record = _Record(by_id.get(parent_id), parent_len, rows.messages.get(record_id, []))
            record.tokens = rows.tokens.get(record_id)
            table._adopt(record, record_id)
            by_id[record_id] = record
        for branch_id, record_id in rows.heads.items():
            if record_id in by_id:
                table._records[branch_id] = by_id[record_id]
        return table  # ``by_id`` goes: records no head reaches are forgotten now

    def _adopt(self, record: _Record, record_id: int) -> None:
        record.record_id = record_id
        weakref.finalize(record, self.journal.forget, record_id)

    def _new(self, parent: _Record | None, parent_len: int, own: list[Any]) -> _Record:
        record = _Record(parent, parent_len, own)
        if self.journal is not None:
            self._adopt(record, self.journal.new_record(parent.record_id if parent else None, parent_len, own))
        return record

    def _set(self, branch_id: str, record: _Record) -> None:
        self._records[branch_id] = record
        if self.journal is not None:
            self.journal.head(branch_id, record.record_id)

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
        self._set(branch_id, self._new(None, 0, list(messages)))
        return True

    def ensure(self, branch_id: str) -> bool:
        """Create ``branch_id`` empty unless it exists; True when it had to be created."""
        if branch_id in self._records:
            return False
        self._set(branch_id, self._new(None, 0, []))
        return True

    def clone(self, source: str, destination: str) -> None:
        """O(1): the destination sees the source's current messages, then diverges."""
        parent = self._get(source)
        if destination in self._records:
            raise ExecutionError("clone destination already exists", branch_id=destination)
        self._set(destination, self._new(parent, len(parent), []))
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
        self._set(destination, self._new(parent, len(parent), []))
        return True

    def append(self, branch_id: str, messages: Iterable[Any], token: Any = None) -> int:
        """Append ``messages``; returns the branch's length.

        ``token`` (any hashable the caller makes once per append) makes the append happen at
        most once: the same token again appends nothing. A caller whose store died after the
        append was written, but before it answered, sends the append again to the store's
        replacement, which loaded it, token and all, from the database."""
        record = self._get(branch_id)
        if token is not None:
            if record.tokens is not None and token in record.tokens:
                return len(record)
            messages = list(messages)
        journal = self.journal
        last = len(messages) - 1 if token is not None else -1
        for index, message in enumerate(messages):
            if journal is not None:
                journal.message(record.record_id, len(record.own), message, token if index == last else None)
            record.own.append(message)
            record.own_bytes += _size_of(message)
        if token is not None and messages:
            if record.tokens is None:
                record.tokens = set()
            record.tokens.add(token)
        return len(record)

    def messages(self, branch_id: str) -> list[Any]:
        return self._get(branch_id).materialise()

    def histories(self, branch_ids: Iterable[str]) -> Histories:
        """The messages of each of ``branch_ids`` as the records they share (``expand_histories``
        makes them lists again): a run's 500 clones of a 200-message branch are its 200
        messages and 500 short tails, not 100,000 messages. A branch not held heads to None."""
        position: dict[int, int] = {}  # id(record) -> its place in ``records``
        records: list[tuple[int, int, list[Any]]] = []
        heads: list[int | None] = []
        for branch_id in branch_ids:
            head = self._records.get(branch_id)
            if head is None:
                heads.append(None)
                continue
            chain, record = [], head
            while record is not None and id(record) not in position:
                chain.append(record)
                record = record.parent
            for record in reversed(chain):  # parents first
                position[id(record)] = len(records)
                parent = -1 if record.parent is None else position[id(record.parent)]
                records.append((parent, record.parent_len, record.own))
            heads.append(position[id(head)])
        return records, heads

    def length(self, branch_id: str) -> int:
        return len(self._get(branch_id))

    def drop(self, branch_id: str) -> bool:
        """Forget a branch. Clones taken from it keep their view (they hold its record)."""
        if self._records.pop(branch_id, None) is None:
            return False
        if self.journal is not None:
            self.journal.unhead(branch_id)
        return True

    def __contains__(self, branch_id: object) -> bool:
        return branch_id in self._records

    def statistics(self) -> dict[str, Any]:
        return {
            "branches": len(self._records),
            "own_messages": sum(len(r.own) for r in self._records.values()),
            "bytes": sum(r.own_bytes for r in self._records.values()),
            "clones": self.clones,
        }


class _DirectCalls:
    """What a store's ``ChannelServer`` calls: a ``serve`` call, answered as Ray would answer it."""

    def __init__(self, store: BranchStore) -> None:
        self.store = store

    def start_one(self, *args: Any, answer: Any = None) -> bool:
        return False  # never answered synchronously: ``run_one`` is

    async def run_one(self, calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        return await self.store.serve(calls)


@ray.remote
class BranchStore:
    """A Ray actor serving one shard of branches; every method is a short, atomic call.

    ``database`` (a path) makes the shard durable: it is loaded from there when the store
    starts (a replacement finds every branch its predecessor acknowledged), and a change
    is acknowledged only once written (group commit on a writer thread). ``owner`` names
    the runtime the rows belong to (``ActorNames.owner``): a store loads its owner's rows
    only, and adopts a branch another owner wrote when asked for one it does not hold.
    """

    def __init__(self, shard: int = 0, database: str | None = None, owner: str = "") -> None:
        self.shard = shard
        self.owner = owner
        self.database = Database(database) if database else None
        self.writer: Writer | None = None
        self.checkpointer: Checkpointer | None = None
        self.written = 0
        self.commits = 0
        self._flushing: asyncio.Task | None = None
        self._waiters: list[asyncio.Future] = []
        self._error: BaseException | None = None
        self.channel: ChannelServer | None = None  # workers' direct calls (``channel_address``)
        if self.database is None:
            self.table = BranchTable()
        else:
            rows = load_shard(self.database, shard, owner)
            self.table = BranchTable.loaded(BranchJournal(shard, rows.next_id, owner), rows)
            self.writer = Writer(f"opgraph-branches-{shard}")
            # As the executor's run log does: a turn's append never waits for a WAL checkpoint.
            self.checkpointer = self.database.checkpoint_elsewhere()

    async def _durable(self) -> None:
        """Return once every change made so far is written (nothing to do without a database)."""
        journal = self.table.journal
        if journal is None or not journal.ops:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
        await waiter

    async def _flush(self) -> None:
        journal = self.table.journal
        try:
            while journal.ops:
                ops, waiters = journal.take(), self._waiters
                self._waiters = []
                try:
                    statements, size = journal.statements(ops)
                    if not self._write_here(statements, size):
                        await self.writer.run(self._write, statements, size)
                except Exception as exc:  # noqa: BLE001 - every waiting change fails, typed
                    error = ExecutionError(f"branch store {self.shard} could not write: {exc}")
                    for waiter in waiters:
                        if not waiter.done():
                            waiter.set_exception(error)
                    continue
                self.written += len(ops)
                self.commits += 1
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
        finally:
            self._flushing = None

    def _write(self, statements: list[tuple[str, Any]], size: int) -> None:
        """On the writer thread: the ops' statements in one transaction, then a checkpoint if the WAL ran long."""
        if statements:
            self.database.transaction(statements)
        if self.checkpointer is not None and self.checkpointer.written(size):
            self.checkpointer.checkpoint_writer()

    def _write_here(self, statements: list[tuple[str, Any]], size: int) -> bool:
        """A SQLite write of at most ``INLINE_BYTES``, committed on the loop if nobody holds the
        database; False (nothing written) sends it to the writer thread.

        As the executor's run log does (``RunLogger._commit_here``): a WAL commit without a
        sync is tens of microseconds for a turn's few messages, where the round trip to the
        writer thread costs two thread wake-ups under the GIL, and every append of an
        operation waits for it (seen: 35 ms a round trip at a load of 30 on 2 cores)."""
        if self.checkpointer is None or size > INLINE_BYTES or not self.database.try_transaction(statements):
            return False
        if self.checkpointer.written(size):
            self.writer.submit(self.checkpointer.checkpoint_writer)
        return True

    async def create(self, branch_id: str, messages: list[Any] | None = None, exist_ok: bool = False) -> bool:
        created = self.table.create(branch_id, messages or (), exist_ok=exist_ok)
        await self._durable()
        return created

    async def clone(self, source: str, destination: str) -> None:
        self.table.clone(source, destination)
        await self._durable()

    async def clone_many(self, pairs: list[tuple[str, str]]) -> list[str]:
        """Clone each (source, destination); returns the sources this store does not hold.

        A source can be missing only when it was lost (its store died and this one
        replaced it without it): the destination is then created empty, and the caller
        reports the loss, instead of every later node of the run failing on a missing branch.
        """
        missing = []
        table = self.table
        for source, destination in pairs:
            if source in table:
                table.clone(source, destination)
            else:
                missing.append(source)
                table.ensure(destination)
        await self._durable()
        return missing

    async def ensure_many(self, branch_ids: list[str]) -> list[str]:
        """Create each branch that does not exist yet, empty; returns those created.

        A durable store first adopts any of them another runtime wrote (``adopt_many``):
        those come back with their history and are not counted as created."""
        await self.adopt_many(branch_ids)
        created = [branch_id for branch_id in branch_ids if self.table.ensure(branch_id)]
        await self._durable()
        return created

    async def adopt_many(self, branch_ids: list[str]) -> list[str]:
        """Take over each branch this store does not hold but another owner's rows do (a run
        resumed from the run log, whose old runtime is gone); returns those adopted.

        The history is copied into this owner's rows and written before the old owner's
        head is let go, so a crash in between leaves the branch in both, never in neither."""
        if self.database is None:
            return []
        wanted = [branch_id for branch_id in dict.fromkeys(branch_ids) if branch_id not in self.table]
        if not wanted:
            return []
        database, owner = self.database, self.owner

        def read() -> list[tuple[str, str, list[Any]]]:
            found = []
            for branch_id in wanted:
                held = read_branch(database, branch_id, owner)
                if held is not None:
                    found.append((branch_id, held[0], held[1]))
            return found

        found = await self.writer.run(read)
        for branch_id, _, messages in found:
            self.table.create(branch_id, messages, exist_ok=True)
        await self._durable()

        def release() -> None:
            for branch_id, old_owner, _ in found:
                release_branch(database, old_owner, branch_id)

        if found:
            await self.writer.run(release)
        return [branch_id for branch_id, _, _ in found]

    async def hold_many(self, branch_ids: list[str]) -> list[str]:
        """Which of ``branch_ids`` this store holds, once it has adopted what other owners wrote."""
        await self.adopt_many(branch_ids)
        return [branch_id for branch_id in branch_ids if branch_id in self.table]

    async def drop_many(self, branch_ids: list[str]) -> int:
        dropped = sum(1 for branch_id in branch_ids if self.table.drop(branch_id))
        await self._durable()
        return dropped

    async def ping(self) -> int:
        return self.shard

    async def replace_history(self, destination: str, source: str) -> bool:
        replaced = self.table.replace_history(destination, source)
        await self._durable()
        return replaced

    async def append(self, branch_id: str, messages: list[Any], token: Any = None) -> int:
        """See ``BranchTable.append``: with a ``token``, sending it twice appends once."""
        length = self.table.append(branch_id, messages, token)
        await self._durable()
        return length

    async def serve(self, calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]]:
        """Reads and appends of several operations in one message (a worker's ``BranchCalls``):
        ``("messages", branch_id)`` and ``("append", branch_id, messages, token)``, made in order.

        Each answer is ``(True, value)`` or ``(False, the error it raised)``: one unknown branch
        fails its own call only. The appends are acknowledged once written, together (one
        wait for the journal, not one each). A branch read twice with no append between comes
        back once: the second answer is ``(True, index of the first)``, which the caller resolves.
        """
        table = self.table
        answers: list[tuple[bool, Any]] = []
        read: dict[str, int] = {}  # branch id -> the answer holding its current messages
        appended: list[int] = []
        for call in calls:
            branch_id = call[1]
            try:
                if call[0] == "messages":
                    earlier = read.get(branch_id)
                    if earlier is not None:
                        answers.append((True, earlier))
                        continue
                    read[branch_id] = len(answers)
                    answers.append((True, table.messages(branch_id)))
                else:
                    read.pop(branch_id, None)
                    appended.append(len(answers))
                    answers.append((True, table.append(branch_id, call[2], call[3])))
            except Exception as exc:  # noqa: BLE001 - this call's own failure, returned to its caller
                answers.append((False, exc))
        if appended:
            try:
                await self._durable()
            except Exception as exc:  # noqa: BLE001 - none of the appends is acknowledged
                for index in appended:
                    if answers[index][0]:
                        answers[index] = (False, exc)
        return answers

    async def channel_address(self) -> tuple[str, int, bytes]:
        """Where a worker sends its ``serve`` calls directly, and the secret it must show
        (actors/workers/channel.py, as an executor reaches a worker); handed out over Ray's
        own authenticated channel. A Ray call cost each side about a millisecond of CPU and
        2-3 ms of latency; a frame on the socket, about a tenth of that."""
        if self.channel is None:
            self.channel = ChannelServer(_DirectCalls(self))
        return await self.channel.address()

    async def messages(self, branch_id: str) -> list[Any]:
        return self.table.messages(branch_id)

    async def histories(self, branch_ids: list[str]) -> Histories:
        """The messages of each branch, in one call, as the records they share (a run's clones,
        recorded at its end: ``expand_histories`` makes them lists)."""
        return self.table.histories(branch_ids)

    async def has(self, branch_id: str) -> bool:
        return branch_id in self.table

    async def drop(self, branch_id: str) -> bool:
        dropped = self.table.drop(branch_id)
        await self._durable()
        return dropped

    async def statistics(self) -> dict[str, Any]:
        import resource  # local: only statistics reads process memory

        stats = self.table.statistics()
        stats["shard"] = self.shard
        stats["pid"] = os.getpid()
        stats["durable"] = self.database is not None
        stats["journal_rows_written"] = self.written
        stats["journal_commits"] = self.commits
        stats["checkpoints"] = self.checkpointer.checkpoints if self.checkpointer else None
        stats["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        stats["rss_mib"] = current_rss_mib()
        return stats
