"""The store's writer thread: every write a run makes, performed in order, off every event loop.

Owns one thread per store that runs the writes it is handed, in the order they came, and
merges the progress of a run (signals, settled nodes) queued behind one another into one
transaction, so a wide run pays a transaction per burst, not per node. It knows nothing
about SQLite or runs beyond calling the store: what a write means is the store's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from .errors import WorkflowStoreError

__all__ = ["ProgressStore", "StoreWriter"]

T = TypeVar("T")


class ProgressStore(Protocol):
    def record_progress(self, run_id: str, *, signals: Iterable[Mapping[str, Any]] = (),
                        nodes: Iterable[Mapping[str, Any]] = ()) -> int: ...


@dataclass
class _Progress:
    run_id: str
    signals: list[Mapping[str, Any]]
    nodes: list[Mapping[str, Any]]
    futures: list[concurrent.futures.Future] = field(default_factory=list)


_STOP = object()


class StoreWriter:
    """Runs ``store`` writes on one daemon thread, in submission order.

    ``submit(fn, *args)`` returns a ``concurrent.futures.Future``; ``call`` awaits one from
    a coroutine. ``record(run_id, signals, nodes)`` queues a run's progress: consecutive
    progress of one run is written in one ``store.record_progress`` transaction. ``backlog``
    counts what is queued and not yet written, so callers can wait when it grows.
    ``close()`` writes what is queued, then stops the thread.
    """

    def __init__(self, store: ProgressStore, *, name: str = "opgraph-store-writer") -> None:
        self._store = store
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._backlog = 0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def backlog(self) -> int:
        return self._backlog

    def _put(self, item: Any) -> None:
        with self._lock:
            if self._closed:
                raise WorkflowStoreError("the run store is closed; nothing more can be written")
            self._backlog += 1
            self._queue.put(item)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._put((future, fn, args, kwargs))
        return future

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the writer thread; its result or its error, awaited."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def record(self, run_id: str, *, signals: Iterable[Mapping[str, Any]] = (),
               nodes: Iterable[Mapping[str, Any]] = ()) -> concurrent.futures.Future[int]:
        """Queue a run's lifecycle signals and settled nodes; resolves once they are committed."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._put(_Progress(run_id, list(signals), list(nodes), [future]))
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------
    def _work(self) -> None:
        carried: Any = None
        while True:
            item = carried if carried is not None else self._queue.get()
            carried = None
            if item is _STOP:
                return
            if isinstance(item, _Progress):
                carried = self._write_progress(item)
            else:
                self._write_one(item)

    def _write_one(self, item: tuple[concurrent.futures.Future, Callable[..., Any], tuple, dict]) -> None:
        future, fn, args, kwargs = item
        try:
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller through its future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            self._done(1)

    def _write_progress(self, first: _Progress) -> Any:
        """Merge the queued progress of ``first``'s run behind it; return the item that ended the merge."""
        merged, count, following = first, 1, None
        while True:
            try:
                following = self._queue.get_nowait()
            except queue.Empty:
                following = None
                break
            if not (isinstance(following, _Progress) and following.run_id == merged.run_id):
                break
            merged.signals += following.signals
            merged.nodes += following.nodes
            merged.futures += following.futures
            count += 1
        try:
            result = self._store.record_progress(merged.run_id, signals=merged.signals, nodes=merged.nodes)
        except BaseException as exc:  # noqa: BLE001 - handed to every caller through its future
            for future in merged.futures:
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
        else:
            for future in merged.futures:
                if future.set_running_or_notify_cancel():
                    future.set_result(result)
        finally:
            self._done(count)
        return following

    def _done(self, count: int) -> None:
        with self._lock:
            self._backlog -= count
