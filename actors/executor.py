"""GraphExecutor: the actor that owns runs, as a remote surface around an ``ExecutorShell``.

Owns the remote methods, ``RunOptions``, ``UnknownRunError`` and the watcher registry; the
data path (instructions out, outcomes in) is the shell's, in actors/shell.py. All state
changes happen on the actor's main event loop, one ``handle`` call at a time, so admission
is atomic without a lock. Control calls (pause, inject, cancel, status...) arrive on their
own concurrency group and are marshalled onto that loop, so they stay responsive while
the data path is saturated. Watchers (other client processes that attached to a run by
id) get their own bounded queues and never hold up the run.
"""

from __future__ import annotations

import asyncio
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from opgraph.kernel import (
    CancelRequested,
    DispatchHeld,
    FlowEvent,
    InjectRequested,
    OperatorMessageReceived,
    OpGraphError,
    PauseRequested,
    ResumeRequested,
)

from .histogram import LATENCY_BUCKETS, LatencyHistogram
from .shell import ExecutorShell, _Run
from .watchers import WATCHER_IDLE_SECONDS, RunWatcher, UnknownWatcherError, envelope_summary
from .workers import Outcome, RunResources

__all__ = [
    "LATENCY_BUCKETS",
    "GraphExecutor",
    "LatencyHistogram",
    "RunOptions",
    "UnknownRunError",
    "UnknownWatcherError",
    "envelope_summary",
]


def tune_garbage_collector() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700.

    A run allocates several small objects per settlement; with the default threshold
    the collector repeatedly scans a heap holding the whole graph. Measured with
    ``python -m opgraph.cluster.kernel_bench``: about a third of scheduler time.
    """
    _, second, third = gc.get_threshold()
    gc.set_threshold(50_000, second, third)


class UnknownRunError(OpGraphError):
    """No run with this id is owned by this executor."""


@dataclass
class RunOptions:
    """Everything ``Session.flow`` decides for one run, shipped to the executor once."""

    context: dict[str, Any] | None = None
    max_concurrent: int | None = 5
    parallel: bool = True
    reactive: bool = False
    max_spawn: int = 50
    spawn_type: type | None = None
    node_builder: Any = None
    reducers: dict[str, Any] | None = None
    default_branch_id: str | None = None
    default_store_index: int = 0
    known_branches: dict[str, int] = field(default_factory=dict)
    resources: RunResources = field(default_factory=RunResources)
    spawn_branch_setup: Any = None
    want_signals: bool = True
    want_events: bool = False
    stream_buffer: int = 1024


@ray.remote(concurrency_groups={"control": 32})
class GraphExecutor:
    """One executor hosts many runs; it is long-lived and never started per node."""

    def __init__(self, workers: list[Any], stores: list[Any], name: str = "", detached: bool = False,
                 namespace: str | None = None) -> None:
        tune_garbage_collector()
        self.name = name
        # Every data-path method lives on the shell: Ray's tracing shim wraps only this class.
        self.shell = ExecutorShell(workers, stores, detached=detached, namespace=namespace)
        self.next_token = 0
        self.watchers: dict[str, RunWatcher] = {}  # watcher id -> watcher; outlives forget_run

    # -- data path (main loop) ------------------------------------------------
    async def start_run(self, run_id: str, graph: Any, options: RunOptions) -> str:
        """Validate and start a run; raise the kernel's typed error for a bad graph."""
        await self.shell.start_run(run_id, graph, options)
        return run_id

    async def report(self, run_id: str, outcomes: list[Outcome]) -> None:
        """Outcomes pushed by a worker outside a batch stream (kept for external workers)."""
        await self.shell.report(run_id, outcomes)

    async def receive_requests(self, run_id: str, items: list[tuple[str, str, Any, Any]]) -> None:
        """Spawns and escalations sent live by running operations (a tell, one per worker
        window): ``(emitter_id, kind, request, dedupe key)`` each, in emission order."""
        await self.shell.receive_requests(run_id, items)

    async def receive_request(self, run_id: str, emitter_id: str, kind: str, request: Any, key: Any) -> None:
        """One spawn or escalation sent live (an operation emitting off its worker's loop)."""
        await self.shell.receive_requests(run_id, [(emitter_id, kind, request, key)])

    async def next_events(self, run_id: str, max_items: int = 2048, timeout: float = 5.0) -> tuple[list, bool, Any]:
        """Long-poll for the driver: (items, done, envelope-or-error)."""
        run = self._run(run_id)
        if not run.outbox and not run.done.is_set():
            run.wakeup.clear()
            try:
                await asyncio.wait_for(run.wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        items = []
        while run.outbox and len(items) < max_items:
            items.append(run.outbox.popleft())
        delivered_events = sum(1 for kind, _ in items if kind == "event")
        run.undelivered_events -= delivered_events
        if run.state.held and run.undelivered_events < run.options.stream_buffer // 2:
            await self.shell.feed(run, [DispatchHeld(now=time.time(), held=False)])
        done = run.done.is_set() and not run.outbox
        result = None
        if done:
            result = run.error if run.error is not None else run.envelope
        return items, done, result

    async def forget_run(self, run_id: str) -> bool:
        return self.shell.forget_run(run_id)

    async def next_watch_events(self, watcher_id: str, max_items: int = 2048,
                                timeout: float = 5.0) -> tuple[list[FlowEvent], int, dict[str, Any] | None]:
        """Long-poll for a watcher: (events, dropped since last poll, summary once the run ended).

        A watcher is removed once it has been handed its summary with nothing left queued.
        """
        watcher = self.watchers.get(watcher_id)
        if watcher is None:
            raise UnknownWatcherError(f"watcher {watcher_id} is not known to this executor")
        items, dropped, finished = await watcher.next_items(max_items, timeout)
        if finished is not None:
            self._remove_watcher(watcher)
        return items, dropped, finished

    # -- control surface (own concurrency group, marshalled to the main loop) ---------
    @ray.method(concurrency_group="control")
    async def pause(self, run_id: str) -> bool:
        return await self._on_main(self._control(run_id, PauseRequested(now=time.time())))

    @ray.method(concurrency_group="control")
    async def resume(self, run_id: str) -> bool:
        return await self._on_main(self._control(run_id, ResumeRequested(now=time.time())))

    @ray.method(concurrency_group="control")
    async def send_operator_message(self, run_id: str, text: str) -> bool:
        event = OperatorMessageReceived(now=time.time(), text=text, ts=time.time())
        return await self._on_main(self._control(run_id, event))

    @ray.method(concurrency_group="control")
    async def cancel(self, run_id: str) -> bool:
        return await self._on_main(self._control(run_id, CancelRequested(now=time.time())))

    @ray.method(concurrency_group="control")
    async def inject(self, run_id: str, operation: Any, after: str | None = None, independent: bool = False) -> bool:
        return await self._on_main(self._inject(run_id, operation, after, independent))

    @ray.method(concurrency_group="control")
    async def watch(self, run_id: str, buffer: int = 1024) -> str:
        """Attach a watcher to a run; poll it with ``next_watch_events``. Raises UnknownRunError."""
        return await self._on_main(self._watch(run_id, buffer))

    @ray.method(concurrency_group="control")
    async def unwatch(self, watcher_id: str) -> bool:
        return await self._on_main(self._unwatch(watcher_id))

    @ray.method(concurrency_group="control")
    async def status(self, run_id: str) -> dict[str, Any]:
        return await self._on_main(self._status(run_id))

    @ray.method(concurrency_group="control")
    async def statistics(self) -> dict[str, Any]:
        if self.shell.loop is None:
            # No run has started, so nothing lives on the main loop yet: safe to read here.
            return await self._statistics()
        return await self._on_main(self._statistics())

    @ray.method(concurrency_group="control")
    async def ping(self) -> str:
        return self.name

    async def _on_main(self, coroutine):
        if self.shell.loop is None:
            coroutine.close()
            raise UnknownRunError("this executor has not started any run")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.shell.loop)
        return await asyncio.wrap_future(future)

    async def _control(self, run_id: str, event: Any) -> bool:
        run = self.shell.runs.get(run_id)
        if run is None or run.state.finished:
            return False
        await self.shell.feed(run, [event])
        return True

    async def _inject(self, run_id: str, operation: Any, after: Any, independent: bool) -> bool:
        run = self.shell.runs.get(run_id)
        if run is None or run.state.finished or not run.state.reactive:
            return False
        self.next_token += 1
        token = self.next_token
        waiter = self.shell.loop.create_future()
        run.inject_waiters[token] = waiter
        after_id = getattr(after, "id", after)
        await self.shell.feed(run, [InjectRequested(now=time.time(), operation=operation, after=after_id,
                                                      independent=independent, token=token)])
        return await waiter

    async def _watch(self, run_id: str, buffer: int) -> str:
        self._drop_idle_watchers()
        run = self._run(run_id)
        self.next_token += 1
        watcher = RunWatcher(f"{run_id}/watcher-{self.next_token}", run_id, buffer)
        self.watchers[watcher.id] = watcher
        run.watchers.append(watcher)
        if run.done.is_set():
            watcher.finish(run.final_summary())
        return watcher.id

    async def _unwatch(self, watcher_id: str) -> bool:
        watcher = self.watchers.get(watcher_id)
        if watcher is None:
            return False
        self._remove_watcher(watcher)
        watcher.finish({"run_id": watcher.run_id, "status": "unwatched"})
        return True

    def _remove_watcher(self, watcher: RunWatcher) -> None:
        self.watchers.pop(watcher.id, None)
        run = self.shell.runs.get(watcher.run_id)
        if run is not None and watcher in run.watchers:
            run.watchers.remove(watcher)

    def _drop_idle_watchers(self) -> None:
        """Watchers whose client died never poll again; bound what they hold."""
        cutoff = time.monotonic() - WATCHER_IDLE_SECONDS
        for watcher in list(self.watchers.values()):
            if watcher.idle_since(cutoff):
                self._remove_watcher(watcher)

    async def _status(self, run_id: str) -> dict[str, Any]:
        run = self._run(run_id)
        stats = run.state.statistics()
        stats["elapsed"] = time.time() - run.started
        stats["undelivered_events"] = run.undelivered_events
        stats["held"] = run.state.held
        stats["messages"] = run.messages
        stats["watchers"] = len(run.watchers)
        return stats

    async def _statistics(self) -> dict[str, Any]:
        shell = self.shell
        runs = {}
        for run_id, run in shell.runs.items():
            runs[run_id] = run.state.statistics()
            shell.harvest(run, runs[run_id])
        import resource  # local: only statistics reads process memory

        return {
            "name": self.name,
            "active_runs": sum(1 for r in shell.runs.values() if not r.state.finished),
            "in_flight": sum(len(r.state.running) for r in shell.runs.values() if not r.state.finished),
            "queued": sum(len(r.state.ready) for r in shell.runs.values() if not r.state.finished),
            "loop_lag_seconds": shell.loop_lag,
            "worker_deaths": shell.worker_deaths,
            "workers": len(shell.workers),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **shell.totals,
            # totals["runs"] counts runs; it used to hide the per-run snapshots under the same key.
            "runs_started": shell.totals["runs"],
            "runs": runs,
            "settled_by_status": dict(shell.settled_by_status),
            "dropped_spawns_by_reason": dict(shell.dropped_spawns_by_reason),
            "node_latency_seconds": {status: h.snapshot() for status, h in shell.node_latency.items()},
        }

    def _run(self, run_id: str) -> _Run:
        run = self.shell.runs.get(run_id)
        if run is None:
            raise UnknownRunError(f"run {run_id} is not owned by this executor")
        return run
