"""A live run's updates for the console, over server-sent events: one feed per run, shared by every console.

Owns one ``LiveFeed`` per live run the console shows: it reads the run's settled nodes from
the executor's bounded watcher queue (the one ``opgraph run watch`` uses; never one message per
node), notes the nodes that started from the run store's signals, and every ``TICK`` seconds
sends what changed, as one message, to each console subscribed. Ten consoles on a run cost
one watcher and one message built per tick. A group is sent as its counts, never its members.
A feed ends with its run (a last message with the run's status) or when its last console leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ...store import RunStore
from .graph import GraphModel, group_state, node_state
from .views import Console, counts_text, run_state

__all__ = ["SUBSCRIBER_BUFFER", "TICK", "LiveFeed", "LiveFeeds"]

TICK = 0.1  # seconds between two messages of a feed (at most)
STORE_POLL = 1.0  # seconds between two reads of the run's new signals (the nodes that started)
SUBSCRIBER_BUFFER = 256  # messages a slow console may fall behind before it is sent a fresh snapshot
KEEPALIVE = 15.0  # seconds of silence before a comment line keeps the connection open
Watcher = Callable[[str], Awaitable[Any]]  # run id -> an async iterator of watch items, or None


class LiveFeed:
    """One live run's feed: node states, group counts, and the consoles subscribed."""

    def __init__(self, run_id: str, store: RunStore, console: Console, watcher: Watcher,
                 on_close: Callable[[LiveFeed], None]) -> None:
        self.run_id = run_id
        self.store = store
        self.console = console
        self.watcher = watcher
        self.on_close = on_close
        self.subscribers: set[asyncio.Queue[str | None]] = set()
        self.states: dict[str, str] = {}
        self.model: GraphModel | None = None
        self.group_counts: dict[str, dict[str, int]] = {}
        self.changed: set[str] = set()
        self.seq = 0
        self.done = False
        self.ready = asyncio.Event()
        self._flushing: asyncio.TimerHandle | None = None
        self.task = asyncio.create_task(self._run(), name=f"console-feed-{run_id}")

    # -- state ---------------------------------------------------------------------------------
    def _load(self) -> None:
        signals = self.store.run_signals(self.run_id)
        self.seq = signals[-1]["seq"] if signals else 0
        self.states = self.console.states(self.run_id)
        self.model = self.console.model(self.run_id, self.states)
        for shape in self.model.shapes.values():
            if shape.group:
                self.group_counts[shape.id] = self.model.counts(shape.id, self.states)

    def _set(self, node_id: str, state: str) -> None:
        old = self.states.get(node_id, "pending")
        if old == state or (old in _SETTLED and state in ("queued", "running")):
            return  # a settled node does not go back (a late signal)
        self.states[node_id] = state
        shape_id = self.model.shape_of.get(node_id) if self.model is not None else None
        if shape_id is None:
            return
        counts = self.group_counts.get(shape_id)
        if counts is not None:
            counts[old] = counts.get(old, 0) - 1
            if counts[old] <= 0:
                counts.pop(old)
            counts[state] = counts.get(state, 0) + 1
            self.changed.add(shape_id)
        else:
            self.changed.add(node_id)

    def snapshot(self) -> str:
        """Every shape's state: what a console subscribing now is sent first."""
        assert self.model is not None
        nodes = {shape.members[0]: self.states.get(shape.members[0], "pending")
                 for shape in self.model.shapes.values() if not shape.group}
        return self._message(nodes, set(self.group_counts), None)

    def _message(self, nodes: dict[str, str], groups: set[str], run: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"nodes": nodes,
                                "groups": {group: [group_state(self.group_counts[group]),
                                                   counts_text(self.group_counts[group]), self.group_counts[group]]
                                           for group in groups}}
        if run is not None:
            body["run"] = run
            body["done"] = self.done
        return json.dumps(body, separators=(",", ":"))

    def _flush(self, run: dict[str, Any] | None = None) -> None:
        if not self.changed and run is None:
            return
        changed, self.changed = self.changed, set()
        nodes = {key: self.states.get(key, "pending") for key in changed if key not in self.group_counts}
        message = self._message(nodes, {key for key in changed if key in self.group_counts}, run)
        for queue in list(self.subscribers):
            if queue.full():  # a console this far behind gets a fresh start
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        queue.get_nowait()
                queue.put_nowait(self.snapshot())
            queue.put_nowait(message)

    # -- the feed ------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await asyncio.to_thread(self._load)
            self.ready.set()
            watch = await self.watcher(self.run_id)
            polling = asyncio.create_task(self._poll())
            try:
                if watch is not None:
                    await self._watch(watch)  # until the run finishes (or its executor is gone)
                await polling  # until the run's row is terminal
            finally:
                polling.cancel()
            await self._finish()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a feed that fails ends its consoles' streams; pages still load
            self.done = True
            for queue in list(self.subscribers):
                queue.put_nowait(None)
        finally:
            self.ready.set()
            self.on_close(self)

    def _changed(self) -> None:
        """Something changed: send it within ``TICK`` (one message for all that changes meanwhile)."""
        if self.changed and self._flushing is None:
            self._flushing = asyncio.get_running_loop().call_later(TICK, self._tick)

    def _tick(self) -> None:
        self._flushing = None
        self._flush()

    async def _poll(self) -> None:
        """The run store's new signals every ``STORE_POLL`` seconds (the nodes that started, and any settle
        the watcher missed); returns once the run's row is terminal."""
        while not await self._poll_store():
            self._changed()
            await asyncio.sleep(STORE_POLL)

    async def _watch(self, watch: Any) -> None:
        try:
            async for item in watch:
                kind = type(item).__name__
                if kind == "RunFinished":
                    return
                operation_id = getattr(item, "operation_id", None)
                if operation_id is not None:
                    self._set(operation_id, node_state(getattr(item, "status", None)))
                    self._changed()
        finally:
            with contextlib.suppress(Exception):
                await watch.aclose()

    async def _poll_store(self) -> bool:
        """The run's signals since the last read (nodes that started, any settle the watcher missed);
        True once the run's row is terminal."""
        signals, record = await asyncio.to_thread(self._read_store)
        for signal in signals:
            if signal["node_id"] != self.run_id:
                self._set(signal["node_id"], node_state(signal["kind"]))
        return record.terminal

    def _read_store(self) -> tuple[list[dict[str, Any]], Any]:
        signals = self.store.run_signals(self.run_id, self.seq)
        if signals:
            self.seq = signals[-1]["seq"]
        return signals, self.store.get_run(self.run_id)

    async def _finish(self) -> None:
        """The run ended: wait (briefly) until its row says so, then send the last message."""
        record = None
        for _ in range(50):
            signals, record = await asyncio.to_thread(self._read_store)
            for signal in signals:
                if signal["node_id"] != self.run_id:
                    self._set(signal["node_id"], node_state(signal["kind"]))
            if record.terminal:
                break
            await asyncio.sleep(0.1)
        summary = await asyncio.to_thread(self.store.node_summary, [self.run_id])
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        self.done = True
        self._flush({"status": record.status, "state": run_state(record.status),
                     "counts": counts_text(summary.get(self.run_id, {}).get("counts", {}))})
        for queue in list(self.subscribers):
            queue.put_nowait(None)

    # -- consoles --------------------------------------------------------------------------------
    async def subscribe(self) -> AsyncIterator[str]:
        """This run's messages for one console: a snapshot, then what changes, until the run ends."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(SUBSCRIBER_BUFFER + 2)
        await self.ready.wait()
        if self.model is None:
            return
        self.subscribers.add(queue)
        try:
            yield self.snapshot()
            if self.done:
                return
            while True:
                try:
                    message = await asyncio.wait_for(queue.get(), KEEPALIVE)
                except TimeoutError:
                    yield ""
                    continue
                if message is None:
                    return
                yield message
        finally:
            self.subscribers.discard(queue)
            if not self.subscribers and not self.done:
                self.task.cancel()


_SETTLED = frozenset({"completed", "failed", "skipped", "cancelled"})


class LiveFeeds:
    """The live feeds of one server, one per run at most, made when a console first asks."""

    def __init__(self, store: RunStore, console: Console, watcher: Watcher) -> None:
        self.store = store
        self.console = console
        self.watcher = watcher
        self.feeds: dict[str, LiveFeed] = {}

    def feed(self, run_id: str) -> LiveFeed:
        feed = self.feeds.get(run_id)
        if feed is None or feed.task.done():
            feed = self.feeds[run_id] = LiveFeed(run_id, self.store, self.console, self.watcher, self._closed)
        return feed

    def _closed(self, feed: LiveFeed) -> None:
        if self.feeds.get(feed.run_id) is feed:
            del self.feeds[feed.run_id]

    async def stream(self, run_id: str) -> AsyncIterator[bytes]:
        """The run's server-sent events, as bytes."""
        async for message in self.feed(run_id).subscribe():
            yield b": keepalive\n\n" if not message else f"data: {message}\n\n".encode()

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            feed.task.cancel()
        await asyncio.gather(*(feed.task for feed in list(self.feeds.values())), return_exceptions=True)
