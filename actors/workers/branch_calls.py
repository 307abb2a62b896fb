"""A worker's branch reads and appends, sent to each branch store once a loop turn.

Owns gathering the branch calls of a worker's running operations into one message per
store (``BranchStore.serve``). Each operation of a planned run read its branch and
appended its turn in a round trip of its own: 1,400 Ray calls for a 700-op plan, each
costing the worker and the store about a millisecond of CPU, where the model's work was
50 ms. Operations dispatched together start together and end together, so their calls
meet in one turn of the loop: one message carries them, and the store answers each call
on its own (an unknown branch fails that call only) and acknowledges the appends once
written, together. The message goes on the store's direct channel (a socket, as an
executor's calls reach a worker) when there is one, else through Ray; a call alone
through Ray goes as before, and a batch that fails as a whole (its store died and was
not replaced) is sent again call by call, so each fails as it would have.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..calls import BranchStoreStub, WorkerStore, ask
from ..errors import name_error
from .channel import WorkerChannels

__all__ = ["BranchCalls"]

# (future, run id, node id, branch id) of one call waiting in a batch
_Waiter = tuple[asyncio.Future, str, str, str]


class BranchCalls:
    """The branch calls of one worker's operations, gathered per store for one turn of its loop."""

    def __init__(self, channels: WorkerChannels | None = None) -> None:
        self.channels = channels  # direct channels to the stores (None, or disabled: every call through Ray)
        self.direct = 0  # messages sent on a channel
        # (store index, "messages" or "append") -> (where its calls go, the calls, their waiters)
        self._pending: dict[tuple[int, str], tuple[WorkerStore, list[tuple[Any, ...]], list[_Waiter]]] = {}
        self._sending: set[asyncio.Task] = set()
        self.batches = 0  # messages sent with more than one call
        self.batched = 0  # calls they carried

    def messages(self, target: WorkerStore, run_id: str, node_id: str, branch_id: str) -> asyncio.Future:
        return self._add(target, ("messages", branch_id), run_id, node_id, branch_id)

    def append(self, target: WorkerStore, run_id: str, node_id: str, branch_id: str, messages: list[Any],
               token: Any) -> asyncio.Future:
        return self._add(target, ("append", branch_id, messages, token), run_id, node_id, branch_id)

    def _add(self, target: WorkerStore, call: tuple[Any, ...], run_id: str, node_id: str,
             branch_id: str) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        # Reads and appends go in messages of their own: a read is answered at once, where an
        # append waits for the journal's write (a read beside it waited as long).
        key = (target.index, call[0])
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = (target, [], [])
            loop.call_soon(self._send, key)
        pending[1].append(call)
        pending[2].append((future, run_id, node_id, branch_id))
        return future

    def _send(self, key: tuple[int, str]) -> None:
        target, calls, waiters = self._pending.pop(key)
        task = asyncio.get_running_loop().create_task(self._serve(target, calls, waiters))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _serve(self, target: WorkerStore, calls: list[tuple[Any, ...]], waiters: list[_Waiter]) -> None:
        stub = target.current()
        answers = await self._direct(stub, calls)
        if answers is None:
            if len(calls) == 1:
                await _alone(target, calls[0], waiters[0])
                return
            try:
                answers = await ask(target, BranchStoreStub.serve, calls, doing="reads and appends on branches")
            except Exception:  # noqa: BLE001 - the batch failed as a whole: each call alone says how it fails
                await asyncio.gather(*(_alone(target, call, waiter)
                                       for call, waiter in zip(calls, waiters, strict=True)))
                return
            stub = target.current()
        if len(calls) > 1:
            self.batches += 1
            self.batched += len(calls)
        actor = stub.name or None
        for call, (ok, value), (future, run_id, node_id, branch_id) in zip(calls, answers, waiters, strict=True):
            if future.done():  # its operation was cancelled meanwhile
                continue
            if not ok:
                future.set_exception(name_error(value, actor=actor, run_id=run_id, node_id=node_id,
                                                branch_id=branch_id))
            elif call[0] == "messages" and type(value) is int:  # the same messages as an earlier read
                future.set_result(list(answers[value][1]))
            else:
                future.set_result(value)


    async def _direct(self, stub: BranchStoreStub, calls: list[tuple[Any, ...]]) -> list[tuple[bool, Any]] | None:
        """``serve``'s answers over the store's direct channel; None when there is none, or it failed
        (the caller sends the calls through Ray, which finds a dead store's replacement: an append
        the store made before the channel broke is made once, by its token)."""
        if self.channels is None or not self.channels.enabled:
            return None
        try:
            channel = await self.channels.get(stub.handle, stub.name)
            if channel is None:
                return None
            answers = await channel.call_one(calls)
        except Exception:  # noqa: BLE001 - ChannelLost, or the store's own failure: Ray's path says which
            return None
        self.direct += 1
        return answers


async def _alone(target: WorkerStore, call: tuple[Any, ...], waiter: _Waiter) -> None:
    """One call in a message of its own (``BranchStore.messages`` or ``append``), its answer or error to its waiter."""
    future, run_id, node_id, branch_id = waiter
    try:
        if call[0] == "messages":
            value = await ask(target, BranchStoreStub.messages, call[1], run_id=run_id, node_id=node_id,
                              branch_id=branch_id, doing="messages on the branch")
        else:
            value = await ask(target, BranchStoreStub.append, call[1], call[2], call[3], run_id=run_id,
                              node_id=node_id, branch_id=branch_id, doing="append on the branch")
    except Exception as exc:  # noqa: BLE001 - the operation's own error, raised where it awaits
        if not future.done():
            future.set_exception(exc)
        return
    if not future.done():
        future.set_result(value)
