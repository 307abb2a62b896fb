"""What a lane's run writes to the run store while it goes: each signal, each settled node, its branches.

Owns the run's side of durability: every lifecycle signal and every settled node's
status and result go to the store's writer thread at the end of the loop pass in which
the driver hears of them, one write per pass, so a killed owner loses at most the write
in progress; the caller's progress display shows a signal only once it is committed; and
the event loop never waits on SQLite (only when the writer falls ``MAX_BACKLOG`` behind).
It must not decide a run's status or outcome: the lane does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opgraph.kernel import FlowEvent

from .runs import RunStore

__all__ = ["MAX_BACKLOG", "RunRecorder"]

# Writes the writer may hold before a settled node waits for it: a bound on memory, and
# on what a kill could lose, that a wide run at full speed stays under (one burst).
MAX_BACKLOG = 2000
BRANCH_READS = 32  # branch histories read at once when a run's branches are recorded


@dataclass
class _Batch:
    signals: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    shown: list[tuple[str, str, str, float]] = field(default_factory=list)
    written: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class RunRecorder:
    """Records one run through ``store.writer``; every method is a no-op without a store.

    ``progress`` is the Session's ``on_progress``; it calls the caller's once the signal is
    committed. ``settled`` is the Session's ``on_settled``. A write that fails, or a
    caller's ``on_progress`` that raises, is kept as ``failure`` (the first one) for the
    runner to report; it never stops the run.
    """

    def __init__(self, store: RunStore | None, run_id: str, labels: Mapping[str, str],
                 on_progress: Callable[[str, str, str, float], Any] | None = None) -> None:
        self.store = store
        # Taken once: asking the store for its writer takes a lock a commit may hold.
        self.writer = store.writer if store is not None else None
        self.run_id = run_id
        self.spec_ids = dict(labels)  # graph node id -> the lane's own name for it (an authored id)
        self.on_progress = on_progress
        self.branches: list[Any] = []
        self.failure: BaseException | None = None
        self._batch: _Batch | None = None

    # -- the run row: awaited, since the run's lifecycle depends on it ---------------------
    async def write(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on the writer thread, awaited; the write survives a cancel."""
        if self.writer is None:
            return None
        future = self.writer.submit(method, *args, **kwargs)
        return await asyncio.shield(asyncio.wrap_future(future))

    # -- as the run goes -----------------------------------------------------------------
    # What the Session hands over in one pass of its drain loop (a batch of signals and
    # settled nodes) leaves for the writer as one write, at the end of that pass.
    def progress(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        spec_id = self.spec_ids.get(op_id)
        shown = (spec_id or op_id, name, status, elapsed)
        if self.writer is None:
            if self.on_progress is not None:
                self.on_progress(*shown)
            return
        self._pending().signals.append(
            {"node_id": op_id, "spec_node_id": spec_id, "kind": status, "elapsed": elapsed, "at": time.time()})
        if self.on_progress is not None:
            self._batch.shown.append(shown)

    async def settled(self, event: FlowEvent) -> None:
        if self.writer is None:
            return
        batch = self._pending()
        batch.nodes.append({"node_id": event.operation_id, "spec_node_id": self.spec_ids.get(event.operation_id),
                            "status": event.status, "result": event.result, "settled_at": time.time()})
        if self.writer.backlog > MAX_BACKLOG:
            # The writer fell behind: hand this batch over now and wait for it.
            self._flush()
            await asyncio.wrap_future(batch.written)

    def _pending(self) -> _Batch:
        if self._batch is None:
            self._batch = _Batch()
            asyncio.get_running_loop().call_soon(self._flush)
        return self._batch

    def _flush(self) -> None:
        batch, self._batch = self._batch, None
        if batch is None:
            return
        loop = asyncio.get_running_loop()
        written = self.writer.record(self.run_id, signals=batch.signals, nodes=batch.nodes)
        written.add_done_callback(self._keep_failure)
        written.add_done_callback(lambda done: batch.written.set_result(None) if not batch.written.done() else None)
        if batch.shown:
            # The caller hears of a signal once it is committed, with the node results that
            # came with it, so a progress line never runs ahead of the store.
            written.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(self._show, batch.shown))

    def _show(self, shown: list[tuple[str, str, str, float]]) -> None:
        for line in shown:
            try:
                self.on_progress(*line)
            except Exception as exc:  # noqa: BLE001 - a caller's display error is the run's recorded error
                if self.failure is None:
                    self.failure = exc

    async def drain(self) -> None:
        """Hand over what is pending and wait until the writer has committed it."""
        if self.writer is None:
            return
        batch = self._batch
        self._flush()
        if batch is not None:
            await asyncio.wrap_future(batch.written)

    def branch_created(self, branch: Any) -> None:
        self.branches.append(branch)

    async def record_branches(self, default_branch: str, messages: Callable[[str], Awaitable[Any]], *,
                              messages_many: Callable[[list[str]], Awaitable[list[Any]]] | None = None,
                              then: Callable[[], Awaitable[Any]] | None = None,
                              extra: Mapping[str, str] | None = None) -> None:
        """Record the run's branches (its default one and each clone) in one write; ``messages_many``,
        when given, reads every history in one call (else ``messages``, BRANCH_READS at a time).
        ``then`` is awaited beside the write, once every history is read (the branches are let go
        while their records go in, not after); with no store, at once. ``extra`` (branch id -> the
        node id it is recorded under) are more branches to record with them, a lane's own."""
        if self.store is None:
            if then is not None:
                await then()
            return
        wanted = {}
        for branch_id, node_id in [(default_branch, None)] + [(b.id, b.node_id) for b in self.branches]:
            wanted.setdefault(branch_id, node_id)
        for branch_id, node_id in (extra or {}).items():
            wanted[branch_id] = node_id
        # A reactive run has a clone per node: their histories are read BRANCH_READS at a time
        # and written in one transaction (one at a time, each committed, took seconds at 700).
        slots = asyncio.Semaphore(BRANCH_READS)

        async def read(branch_id: str) -> Any:
            async with slots:
                return await messages(branch_id)

        if messages_many is not None:
            histories = await messages_many(list(wanted))
        else:
            histories = await asyncio.gather(*(read(branch_id) for branch_id in wanted))
        written = self.write(self.store.record_branches, self.run_id,
                             [(branch_id, self.spec_ids.get(node_id, node_id), history)
                              for (branch_id, node_id), history in zip(wanted.items(), histories, strict=True)])
        if then is None:
            await written
            return
        outcome, _ = await asyncio.gather(written, then(), return_exceptions=True)  # both end before either's error
        if isinstance(outcome, BaseException):
            raise outcome

    def _keep_failure(self, future: concurrent.futures.Future) -> None:
        if self.failure is None and not future.cancelled() and future.exception() is not None:
            self.failure = future.exception()
