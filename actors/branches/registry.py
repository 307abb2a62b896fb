"""Where every branch lives, who owns it, and the executor's calls to the branch stores.

Owns the executor's branch bookkeeping: branch id -> store shard, branch scopes (a
Session's branches, a run's branches) so that they are dropped together, and the
branches lost with a store that died. Its store calls go through the call seam
(``actors/calls.py``): a dead store is replaced by its pool and the call sent once more there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from ..calls import BranchStoreStub, PoolSlot, ask
from ..errors import UnknownBranchError
from ..workers.supervision import ActorPool
from .store import Histories, shard_for

__all__ = ["BranchRegistry"]


class BranchRegistry:
    """Branch locations and scopes for one executor, over its pool of BranchStores.

    A scope is a name (``session-<id>``, ``run-<id>``) owning a set of branches; a scope
    may have a parent, and dropping a scope drops its children too. A branch belongs to
    at most one scope.
    """

    def __init__(self, stores: ActorPool) -> None:
        self.stores = stores
        self.slots = [PoolSlot(stores, index, BranchStoreStub) for index in range(len(stores))]
        self.location: dict[str, int] = {}
        self.scopes: dict[str, set[str]] = {}
        self.children: dict[str, set[str]] = {}  # scope -> nested scopes
        self.owner: dict[str, str] = {}  # branch id -> its scope
        self.lost: set[str] = set()  # branches that died with their store, not yet recreated
        # Branches a run here uses that belong to no scope here (a Session's branches, made on
        # another executor of the pool): branch id -> those runs, and run id -> its branches.
        # Their location is forgotten with the last such run, since their owner drops them.
        self.borrowers: dict[str, set[str]] = {}
        self.borrowed: dict[str, list[str]] = {}

    # -- where a branch lives ---------------------------------------------------------------
    def shard_of(self, branch_id: str | None, default: int = 0) -> int:
        if branch_id is None:
            return default
        return self.location.get(branch_id, default)

    def home_shard(self, branch_id: str) -> int:
        return shard_for(branch_id, len(self.stores))

    def place(self, branch_id: str, shard: int, scope: str | None = None) -> None:
        self.location[branch_id] = shard
        if scope is not None:
            self.adopt(scope, [branch_id])

    def adopt(self, scope: str, branch_ids: Iterable[str], parent: str | None = None) -> None:
        """Put ``branch_ids`` under ``scope`` (created on first use, nested under ``parent``)."""
        owned = self.scopes.get(scope)
        if owned is None:
            owned = self.scopes[scope] = set()
            if parent is not None:
                self.children.setdefault(parent, set()).add(scope)
        owner = self.owner
        for branch_id in branch_ids:
            previous = owner.get(branch_id)
            if previous is not None and previous != scope:
                self.scopes.get(previous, set()).discard(branch_id)
            owner[branch_id] = scope
            owned.add(branch_id)

    def knows(self, branch_id: str) -> bool:
        return branch_id in self.location

    # -- store calls ------------------------------------------------------------------------
    def store(self, shard: int) -> PoolSlot:
        """Where a call to store ``shard`` goes (``calls.ask``): a dead store is replaced, and the call
        sent once more to the replacement (which may start empty: callers handle missing branches)."""
        return self.slots[shard]

    async def create(self, branch_id: str, messages: list[Any], scope: str | None) -> int:
        shard = self.home_shard(branch_id)
        await ask(self.slots[shard], BranchStoreStub.create, branch_id, messages, True, branch_id=branch_id)
        self.lost.discard(branch_id)
        self.place(branch_id, shard, scope)
        return shard

    async def ensure(self, branches: dict[str, int], scope: str | None = None,
                     borrower: str | None = None) -> list[str]:
        """Make sure each branch (id -> shard) exists; returns the ids found lost and recreated empty.

        Called when a run starts with branches this executor does not know (it replaced
        a dead one) or knows to be lost (their store died): they come back empty, and the
        run reports them lost instead of failing on a missing branch. ``borrower`` (a run
        id) borrows those that are new here and no scope's here, until ``release``.
        """
        # A store being replaced has lost its branches; only once that is known can they be found.
        await self.stores.settled()
        new = {branch_id for branch_id in branches if branch_id not in self.location} if borrower else set()
        wanted: dict[int, list[str]] = {}
        for branch_id, shard in branches.items():
            if branch_id in self.lost or branch_id not in self.location:
                if shard >= len(self.stores):
                    shard = self.home_shard(branch_id)
                wanted.setdefault(shard, []).append(branch_id)
        recreated: list[str] = []
        for shard, branch_ids in wanted.items():
            created = set(await ask(self.slots[shard], BranchStoreStub.ensure_many, branch_ids))
            for branch_id in branch_ids:
                if branch_id in created or branch_id in self.lost:
                    recreated.append(branch_id)
                self.lost.discard(branch_id)
                self.location[branch_id] = shard
        if scope is not None:
            self.adopt(scope, [b for b in branches if b not in self.owner])
        if borrower is not None:
            mine = [b for b in branches if b not in self.owner and (b in new or b in self.borrowers)]
            for branch_id in mine:
                self.borrowers.setdefault(branch_id, set()).add(borrower)
            if mine:
                self.borrowed[borrower] = mine
        return recreated

    def release(self, borrower: str) -> int:
        """Run ``borrower`` ended here: forget where the branches it was the last to borrow live.
        Returns how many were forgotten (the stores keep them: their owner drops them)."""
        forgotten = 0
        for branch_id in self.borrowed.pop(borrower, ()):
            runs = self.borrowers.get(branch_id)
            if runs is None:
                continue
            runs.discard(borrower)
            if runs:
                continue
            del self.borrowers[branch_id]
            if branch_id not in self.owner:
                self.location.pop(branch_id, None)
                self.lost.discard(branch_id)
                forgotten += 1
        return forgotten

    async def take_over(self, branch_ids: Iterable[str], scope: str | None = None,
                        scoped: Iterable[str] = ()) -> list[str]:
        """Find the branches of a run rebuilt from the log that this executor does not know:
        a durable store holds them, or adopts them from the rows of the runtime that ran the
        run before (``BranchStore.adopt_many``). Returns those found. The ones of ``scoped``
        (the run's own: its clones, an isolated default), and every one found here for the
        first time (no Session of this runtime knows it), go under ``scope``, to be dropped
        with it. Branches found nowhere are left to the run: a clone not made yet is made as usual."""
        await self.stores.settled()
        wanted: dict[int, list[str]] = {}
        for branch_id in dict.fromkeys(branch_ids):
            if branch_id and branch_id not in self.location:
                wanted.setdefault(self.home_shard(branch_id), []).append(branch_id)
        found: list[str] = []
        for shard, ids in wanted.items():
            for branch_id in await ask(self.slots[shard], BranchStoreStub.hold_many, ids):
                self.location[branch_id] = shard
                found.append(branch_id)
        if scope is not None:
            self.adopt(scope, [*found, *(branch_id for branch_id in scoped if branch_id in self.location)])
        return found

    async def messages(self, branch_id: str) -> list[Any]:
        shard = self.location.get(branch_id)
        if shard is None:
            raise UnknownBranchError("this runtime holds no such branch", branch_id=branch_id)
        if branch_id in self.lost:
            raise UnknownBranchError("the branch was lost with its branch store", branch_id=branch_id)
        return await ask(self.slots[shard], BranchStoreStub.messages, branch_id, branch_id=branch_id)

    async def histories(self, branch_ids: list[str]) -> list[tuple[list[str], Histories]]:
        """The messages of each of ``branch_ids`` this runtime holds, as ``(branch ids, their
        histories)`` per store shard (one call each; ``expand_histories`` makes them lists); branches
        it does not hold, or lost, are left out."""
        by_shard: dict[int, list[str]] = {}
        for branch_id in branch_ids:
            shard = self.location.get(branch_id)
            if shard is not None and branch_id not in self.lost:
                by_shard.setdefault(shard, []).append(branch_id)
        shards = list(by_shard)
        answers = await asyncio.gather(*(ask(self.slots[shard], BranchStoreStub.histories, by_shard[shard])
                                         for shard in shards))
        return [(by_shard[shard], histories) for shard, histories in zip(shards, answers, strict=True)]

    # -- dropping -----------------------------------------------------------------------------
    async def drop_scope(self, scope: str) -> int:
        """Drop every branch of ``scope`` and of the scopes nested in it; returns how many."""
        scopes = [scope]
        for name in scopes:  # grows while walking: nested scopes, breadth first
            scopes.extend(self.children.pop(name, ()))
        by_shard: dict[int, list[str]] = {}
        for name in scopes:
            for branch_id in self.scopes.pop(name, ()):
                self.owner.pop(branch_id, None)
                self.lost.discard(branch_id)
                shard = self.location.pop(branch_id, None)
                if shard is not None:
                    by_shard.setdefault(shard, []).append(branch_id)
        for parent_children in self.children.values():
            parent_children.difference_update(scopes)
        dropped = 0
        for shard, branch_ids in by_shard.items():
            dropped += await ask(self.slots[shard], BranchStoreStub.drop_many, branch_ids)
        return dropped

    # -- a store died and was replaced ----------------------------------------------------------
    async def store_replaced(self, index: int) -> list[str]:
        """The branches of shard ``index`` the replacement does not hold are lost.

        A durable store reloads its shard, so none is; otherwise each is recreated empty at
        once, so later nodes find their branch (with no history) instead of failing, and it
        stays in ``lost`` until a run that names it has reported the loss.
        """
        candidates = [branch_id for branch_id, shard in self.location.items() if shard == index]
        lost = await ask(self.slots[index], BranchStoreStub.ensure_many, candidates) if candidates else []
        self.lost.update(lost)
        return lost

    def load_locations(self, database: Any, owner: str) -> int:
        """Learn where every durable branch of this runtime (``owner``) lives (a new executor,
        before recovering runs)."""
        rows = database.query("SELECT branch_id, shard FROM runtime_branch_heads WHERE owner = ?", (owner,))
        for branch_id, shard in rows:
            self.location.setdefault(branch_id, shard)
        return len(rows)

    def statistics(self) -> dict[str, Any]:
        return {"branches": len(self.location), "scopes": len(self.scopes), "lost": len(self.lost)}
