"""GraphExecutor: the actor that owns runs, carries out the scheduler's instructions, and feeds outcomes back.

Owns, per run, one kernel ``FlowState`` and every in-flight reference made on its
behalf. All state changes happen on the actor's main event loop, one ``handle`` call at
a time, so admission is atomic without a lock. Control calls (pause, inject, cancel,
status...) arrive on their own concurrency group and are marshalled onto that loop, so
they stay responsive while the data path is saturated. Watchers (other client processes
that attached to a run by id) get their own bounded queues and never hold up the run.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import ray

from opgraph.kernel import (
    AdmissionDecided,
    CancelOperation,
    CancelRequested,
    CloneBranch,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    EmitSignal,
    EscalationRequested,
    EvaluateConditions,
    FinishRun,
    FlowEvent,
    FlowStarted,
    FlowState,
    InjectRequested,
    NodeCompleted,
    NodeFailed,
    NodeSkipped,
    OperationFinished,
    OperatorMessageReceived,
    OpGraphError,
    PauseRequested,
    ReplaceHistory,
    ResumeRequested,
    SpawnRequested,
)

from .histogram import LATENCY_BUCKETS, LatencyHistogram
from .watchers import WATCHER_IDLE_SECONDS, RunWatcher, UnknownWatcherError, envelope_summary
from .workers import CallRow, Outcome, OutcomeRow, RunResources

__all__ = [
    "LATENCY_BUCKETS",
    "GraphExecutor",
    "LatencyHistogram",
    "RunOptions",
    "UnknownRunError",
    "UnknownWatcherError",
    "envelope_summary",
]

_TERMINAL_SIGNALS = {NodeCompleted: "completed", NodeFailed: "failed", NodeSkipped: "skipped"}
DISPATCH_BATCH = 256  # calls per message; measured flat between 64 and 512 on 2 cores
DISPATCH_WINDOW = 0.002  # seconds; bounds added latency, amortises message cost
# Upper bounds (seconds) of the node-latency buckets; +Inf is implied.


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


class _Run:
    """The shell's bookkeeping for one run: its state machine, refs, and driver outbox."""

    def __init__(self, run_id: str, state: FlowState, options: RunOptions) -> None:
        self.run_id = run_id
        self.state = state
        self.options = options
        self.outbox: deque[tuple[str, Any]] = deque()
        self.undelivered_events = 0
        self.wakeup = asyncio.Event()
        self.done = asyncio.Event()
        self.envelope: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.tasks: set[asyncio.Task] = set()
        self.pending_branch_refs: list[Any] = []
        self.pending_dispatch: list[Any] = []
        self.flush_scheduled = False
        self.node_worker: dict[str, int] = {}
        self.inject_waiters: dict[int, asyncio.Future] = {}
        self.started = time.time()
        self.messages = 0
        # What the executor-wide counters have already taken from this run (see _harvest).
        self.harvested_spawns = 0
        self.harvested_drops = 0
        self.harvested_settled: dict[str, int] = {}
        self.watchers: list[RunWatcher] = []

    def post(self, kind: str, item: Any) -> None:
        self.outbox.append((kind, item))
        self.wakeup.set()


@ray.remote(concurrency_groups={"control": 32})
class GraphExecutor:
    """One executor hosts many runs; it is long-lived and never started per node."""

    def __init__(self, workers: list[Any], stores: list[Any], name: str = "", detached: bool = False,
                 namespace: str | None = None) -> None:
        tune_garbage_collector()
        self.detached = detached
        self.namespace = namespace
        self.workers = list(workers)
        self.stores = list(stores)
        self.name = name
        self.runs: dict[str, _Run] = {}
        self.location: dict[str, int] = {}  # branch id -> store index; clones live beside their source
        self.loop: asyncio.AbstractEventLoop | None = None
        self.self_handle = None
        self.next_worker = 0
        self.next_token = 0
        self.loop_lag = 0.0
        self.worker_deaths = 0
        self.totals = {"runs": 0, "dispatched": 0, "settled": 0, "spawned": 0, "messages": 0}
        # Executor-wide, monotonic across forget_run: what metrics export as counters.
        self.settled_by_status: dict[str, int] = {}
        self.dropped_spawns_by_reason: dict[str, int] = {}
        self.node_latency: dict[str, LatencyHistogram] = {}  # outcome status -> histogram
        self.watchers: dict[str, RunWatcher] = {}  # watcher id -> watcher; outlives forget_run
        self._lag_task: asyncio.Task | None = None

    # -- data path (main loop) ------------------------------------------------
    async def start_run(self, run_id: str, graph: Any, options: RunOptions) -> str:
        """Validate and start a run; raise the kernel's typed error for a bad graph."""
        self._bind_loop()
        if run_id in self.runs:
            raise OpGraphError(f"run {run_id} already exists on this executor")
        state = FlowState(
            graph,
            run_id=run_id,
            context=options.context,
            max_concurrent=options.max_concurrent,
            parallel=options.parallel,
            reactive=options.reactive,
            max_spawn=options.max_spawn,
            node_builder=options.node_builder,
            spawn_type=options.spawn_type,
            default_branch_id=options.default_branch_id,
            known_branches=set(options.known_branches),
            reducers=options.reducers,
        )
        run = _Run(run_id, state, options)
        self.location.update(options.known_branches)
        if options.default_branch_id is not None:
            self.location[options.default_branch_id] = options.default_store_index
        instructions = state.handle(FlowStarted(now=time.time()))  # raises OperationError on a bad graph
        # Nodes restored as already settled were counted by the run that settled them.
        run.harvested_settled = dict(state.statistics()["settled_by_status"])
        self.runs[run_id] = run
        self.totals["runs"] += 1
        await asyncio.gather(*(w.prepare.remote(run_id, options.resources, self.self_handle) for w in self.workers))
        await self._carry_out(run, instructions)
        return run_id

    async def report(self, run_id: str, outcomes: list[Outcome]) -> None:
        """Outcomes pushed by a worker outside a batch stream (kept for external workers)."""
        run = self.runs.get(run_id)
        if run is not None:
            await self._feed(run, [self._finished_event(o.row()) for o in outcomes])

    async def receive_request(self, run_id: str, emitter_id: str, kind: str, request: Any, key: Any) -> None:
        """A spawn or escalation sent live by a running operation (a tell)."""
        run = self.runs.get(run_id)
        if run is None or run.state.finished:
            return
        # Once the emitter has settled, its outcome already carried this request.
        redelivery = run.state.state.get(emitter_id) != "running"
        event_type = EscalationRequested if kind == "escalation" else SpawnRequested
        await self._feed(run, [event_type(now=time.time(), emitter_id=emitter_id, request=request,
                                          dedupe_key=key, redelivery=redelivery)])

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
            await self._feed(run, [DispatchHeld(now=time.time(), held=False)])
        done = run.done.is_set() and not run.outbox
        result = None
        if done:
            result = run.error if run.error is not None else run.envelope
        return items, done, result

    async def forget_run(self, run_id: str) -> bool:
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self._harvest(run, run.state.statistics())
        for watcher in run.watchers:
            # Forgotten before it settled (its driver gave up): watchers must not hang.
            watcher.finish({"run_id": run_id, "status": "forgotten",
                            "detail": "the owning client left before the run settled"})
        for task in run.tasks:
            task.cancel()
        for worker in self.workers:
            worker.forget.remote(run_id)
        return True

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
        if self.loop is None:
            # No run has started, so nothing lives on the main loop yet: safe to read here.
            return await self._statistics()
        return await self._on_main(self._statistics())

    @ray.method(concurrency_group="control")
    async def ping(self) -> str:
        return self.name

    async def _on_main(self, coroutine):
        if self.loop is None:
            coroutine.close()
            raise UnknownRunError("this executor has not started any run")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        return await asyncio.wrap_future(future)

    async def _control(self, run_id: str, event: Any) -> bool:
        run = self.runs.get(run_id)
        if run is None or run.state.finished:
            return False
        await self._feed(run, [event])
        return True

    async def _inject(self, run_id: str, operation: Any, after: Any, independent: bool) -> bool:
        run = self.runs.get(run_id)
        if run is None or run.state.finished or not run.state.reactive:
            return False
        self.next_token += 1
        token = self.next_token
        waiter = self.loop.create_future()
        run.inject_waiters[token] = waiter
        after_id = getattr(after, "id", after)
        await self._feed(run, [InjectRequested(now=time.time(), operation=operation, after=after_id,
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
            watcher.finish(self._final_summary(run))
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
        run = self.runs.get(watcher.run_id)
        if run is not None and watcher in run.watchers:
            run.watchers.remove(watcher)

    def _drop_idle_watchers(self) -> None:
        """Watchers whose client died never poll again; bound what they hold."""
        cutoff = time.monotonic() - WATCHER_IDLE_SECONDS
        for watcher in list(self.watchers.values()):
            if watcher.idle_since(cutoff):
                self._remove_watcher(watcher)

    @staticmethod
    def _final_summary(run: _Run) -> dict[str, Any]:
        if run.error is not None:
            return {"run_id": run.run_id, "status": "error",
                    "error": f"{type(run.error).__name__}: {run.error}"}
        return envelope_summary(run.envelope or {})

    def _finish_watchers(self, run: _Run) -> None:
        summary = self._final_summary(run)
        for watcher in run.watchers:
            watcher.finish(summary)

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
        runs = {}
        for run_id, run in self.runs.items():
            runs[run_id] = run.state.statistics()
            self._harvest(run, runs[run_id])
        import resource  # local: only statistics reads process memory

        return {
            "name": self.name,
            "active_runs": sum(1 for r in self.runs.values() if not r.state.finished),
            "in_flight": sum(len(r.state.running) for r in self.runs.values() if not r.state.finished),
            "queued": sum(len(r.state.ready) for r in self.runs.values() if not r.state.finished),
            "loop_lag_seconds": self.loop_lag,
            "worker_deaths": self.worker_deaths,
            "workers": len(self.workers),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **self.totals,
            # totals["runs"] counts runs; it used to hide the per-run snapshots under the same key.
            "runs_started": self.totals["runs"],
            "runs": runs,
            "settled_by_status": dict(self.settled_by_status),
            "dropped_spawns_by_reason": dict(self.dropped_spawns_by_reason),
            "node_latency_seconds": {status: h.snapshot() for status, h in self.node_latency.items()},
        }

    def _harvest(self, run: _Run, stats: dict[str, Any]) -> None:
        """Fold what ``run`` counted since the last harvest into the executor-wide counters.

        Runs are forgotten once their driver has the envelope; harvesting at every
        snapshot and once more in ``forget_run`` keeps the totals monotonic across that.
        """
        self.totals["spawned"] += stats["spawned"] - run.harvested_spawns
        run.harvested_spawns = stats["spawned"]
        dropped = run.state.dropped_spawns
        for entry in dropped[run.harvested_drops:]:
            reason = entry["reason"]
            self.dropped_spawns_by_reason[reason] = self.dropped_spawns_by_reason.get(reason, 0) + 1
        run.harvested_drops = len(dropped)
        for status, count in stats["settled_by_status"].items():
            new = count - run.harvested_settled.get(status, 0)
            if new > 0:
                self.settled_by_status[status] = self.settled_by_status.get(status, 0) + new
                run.harvested_settled[status] = count

    # -- the shell: events in, instructions out ---------------------------------------
    def _bind_loop(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.self_handle = ray.get_runtime_context().current_actor
            self._lag_task = self.loop.create_task(self._measure_lag())

    async def _measure_lag(self) -> None:
        while True:
            before = self.loop.time()
            await asyncio.sleep(0.25)
            self.loop_lag = max(0.0, self.loop.time() - before - 0.25)

    def _run(self, run_id: str) -> _Run:
        run = self.runs.get(run_id)
        if run is None:
            raise UnknownRunError(f"run {run_id} is not owned by this executor")
        return run

    async def _feed(self, run: _Run, events: list[Any]) -> None:
        """The one entry point for events: handle them, then carry out the instructions."""
        if not events:
            return
        try:
            instructions = run.state.handle(*events)
        except OpGraphError as exc:
            self._fail_run(run, exc)
            return
        await self._carry_out(run, instructions)

    def _fail_run(self, run: _Run, exc: BaseException) -> None:
        run.error = exc
        run.done.set()
        run.wakeup.set()
        self._finish_watchers(run)

    @staticmethod
    def _finished_event(row: OutcomeRow) -> OperationFinished:
        node_id, attempt, status, response, error, error_type, requests, started, finished = row
        if requests:
            requests = tuple(
                (EscalationRequested if kind == "escalation" else SpawnRequested)(
                    now=finished, emitter_id=node_id, request=request, dedupe_key=key, redelivery=redelivery,
                )
                for kind, request, key, redelivery in requests
            )
        else:
            requests = ()
        return OperationFinished(finished, node_id, attempt, status, response, error, error_type, requests, True)

    async def _carry_out(self, run: _Run, instructions: list[Any]) -> None:
        """Turn instructions into messages. Branch work is awaited before dispatch."""
        clones: dict[int, list[tuple[str, str]]] = {}
        replaces: list[ReplaceHistory] = []
        dispatches: list[DispatchOperation] = []
        cancels: list[CancelOperation] = []
        reactive_clones: list[CloneBranch] = []
        for instruction in instructions:
            kind = type(instruction)
            if kind is DispatchOperation:
                dispatches.append(instruction)
            elif kind is EmitSignal:
                self._deliver_signal(run, instruction)
            elif kind is CloneBranch:
                source = instruction.source if instruction.source is not None else run.options.default_branch_id
                shard = self.location.get(source, run.options.default_store_index)
                self.location[instruction.branch_id] = shard
                clones.setdefault(shard, []).append((source, instruction.branch_id))
                if run.options.want_signals:
                    run.post("branch", (instruction.node_id, instruction.branch_id, instruction.reactive))
                if instruction.reactive:
                    reactive_clones.append(instruction)
            elif kind is ReplaceHistory:
                replaces.append(instruction)
            elif kind is CancelOperation:
                cancels.append(instruction)
            elif kind is EvaluateConditions:
                self._spawn_task(run, self._evaluate_conditions(run, instruction))
            elif kind is AdmissionDecided:
                waiter = run.inject_waiters.pop(instruction.token, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(instruction.accepted)
            elif kind is FinishRun:
                run.envelope = instruction.envelope
                run.envelope["run_id"] = run.run_id
                run.envelope["scheduler_messages"] = run.messages
                run.done.set()
                run.wakeup.set()
                self._finish_watchers(run)
                for worker in self.workers:
                    worker.forget.remote(run.run_id)
        for shard, pairs in clones.items():
            run.pending_branch_refs.append(self.stores[shard].clone_many.remote(pairs))
            run.messages += 1
        for replace in replaces:
            source = replace.source if replace.source is not None else run.options.default_branch_id
            shard = self.location.get(replace.branch_id, run.options.default_store_index)
            run.pending_branch_refs.append(self.stores[shard].replace_history.remote(replace.branch_id, source))
            run.messages += 1
        if reactive_clones and run.options.spawn_branch_setup is not None:
            await self._await_branch_work(run)
            for clone in reactive_clones:
                self._run_spawn_setup(run, clone)
        if cancels:
            by_worker: dict[int, list[str]] = {}
            for cancel in cancels:
                by_worker.setdefault(run.node_worker.get(cancel.node_id, 0), []).append(cancel.node_id)
            for index, node_ids in by_worker.items():
                if index < len(self.workers):
                    self.workers[index].cancel.remote(run.run_id, node_ids)
        if dispatches:
            run.pending_dispatch.extend(dispatches)
            if not run.flush_scheduled:
                # Coalesce dispatches from every event handled within one short window
                # into a few batched messages instead of one round trip per feed. When
                # nothing else is in flight no outcome can arrive to join the batch, so
                # waiting would only add latency (a chain's every link): send at once.
                run.flush_scheduled = True
                window = DISPATCH_WINDOW if len(run.state.running) > len(run.pending_dispatch) else 0.0
                self.loop.call_later(window, self._spawn_task, run, self._flush(run))

    async def _flush(self, run: _Run) -> None:
        run.flush_scheduled = False
        dispatches, run.pending_dispatch = run.pending_dispatch, []
        if dispatches:
            await self._await_branch_work(run)
            self._dispatch(run, dispatches)

    async def _await_branch_work(self, run: _Run) -> None:
        refs, run.pending_branch_refs = run.pending_branch_refs, []
        if refs:
            try:
                await asyncio.gather(*refs)
            except Exception as exc:  # a branch store failure fails the run, typed
                self._fail_run(run, OpGraphError(f"branch store failed: {exc}"))

    def _run_spawn_setup(self, run: _Run, clone: CloneBranch) -> None:
        child = run.state.graph.nodes[clone.node_id]
        store = self.stores[self.location.get(clone.branch_id, 0)]
        handle = _SetupBranch(clone.branch_id, store, run.pending_branch_refs)
        try:
            run.options.spawn_branch_setup(child, handle)
        except Exception as exc:  # user hook: recorded on the run, never a crash
            run.post("hook_error", {"node_id": clone.node_id, "error": f"{type(exc).__name__}: {exc}"})

    def _deliver_signal(self, run: _Run, instruction: EmitSignal) -> None:
        kind = instruction.kind
        if kind in _TERMINAL_SIGNALS:
            self.totals["settled"] += 1
            if run.options.want_events or run.watchers:
                node_id = instruction.op_id
                node = run.state.graph.nodes[node_id]
                event = FlowEvent(node_id, node.metadata.get("reference_id") or node.operation,
                                  _TERMINAL_SIGNALS[kind], run.state.results.get(node_id),
                                  bool(node.metadata.get("spawned")))
                for watcher in run.watchers:
                    watcher.push(event)
                if run.options.want_events:
                    run.post("event", event)
                    run.undelivered_events += 1
        if run.options.want_signals:
            run.post("signal", instruction.signal)

    def _dispatch(self, run: _Run, dispatches: list[DispatchOperation]) -> None:
        if run.done.is_set():
            return
        location, default_store = self.location, run.options.default_store_index
        calls: list[CallRow] = [(*d, location.get(d.branch_id, default_store)) for d in dispatches]
        self.totals["dispatched"] += len(calls)
        workers = len(self.workers)
        per_worker = max(1, min(DISPATCH_BATCH, -(-len(calls) // workers)))
        for start in range(0, len(calls), per_worker):
            chunk = calls[start:start + per_worker]
            index = self.next_worker % workers
            self.next_worker += 1
            for call in chunk:
                run.node_worker[call[0]] = index
            self._spawn_task(run, self._drive_batch(run, index, chunk))
        if run.options.want_events and run.undelivered_events >= run.options.stream_buffer and not run.state.held:
            self._spawn_task(run, self._feed(run, [DispatchHeld(now=time.time(), held=True)]))

    def _spawn_task(self, run: _Run, coroutine) -> None:
        task = self.loop.create_task(coroutine)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _drive_batch(self, run: _Run, index: int, calls: list[CallRow]) -> None:
        """Stream one batch's outcomes back as events; a dead worker fails what is left."""
        worker = self.workers[index]
        pending = {call[0]: call[1] for call in calls}  # node id -> attempt, until its outcome arrives
        run.messages += 1
        try:
            stream = worker.run_batch.options(num_returns="streaming").remote(run.run_id, calls)
            async for ref in stream:
                rows = await ref
                run.messages += 1
                histograms = self.node_latency
                for row in rows:
                    pending.pop(row[0], None)
                    latency = row[8] - row[7]
                    histogram = histograms.get(row[2])
                    if histogram is None:
                        histogram = histograms[row[2]] = LatencyHistogram()
                    histogram.observe(latency)
                await self._feed(run, [self._finished_event(row) for row in rows])
        except ray.exceptions.RayActorError as exc:
            self.worker_deaths += 1
            await self._fail_pending(run, pending, f"operation worker {index} died: {type(exc).__name__}",
                                     "WorkerDied")
            await self._replace_worker(index, worker)
        except ray.exceptions.RayTaskError as exc:
            # The worker is alive but its batch loop raised: a bug, not a death.
            await self._fail_pending(run, pending, f"operation worker {index} failed: {exc}", "WorkerError")

    async def _fail_pending(self, run: _Run, pending: dict[str, int], reason: str, kind: str) -> None:
        now = time.time()
        await self._feed(run, [
            OperationFinished(now=now, node_id=node_id, attempt=attempt, status="failed", error=reason, error_type=kind)
            for node_id, attempt in pending.items()
        ])

    async def _replace_worker(self, index: int, dead: Any) -> None:
        if index < len(self.workers) and self.workers[index] is dead:
            from .runtime import start_worker  # local: runtime imports this module

            replacement = start_worker(self.stores, index, namespace=self.namespace, detached=self.detached)
            self.workers[index] = replacement
            for run in self.runs.values():
                if not run.state.finished:
                    await replacement.prepare.remote(run.run_id, run.options.resources, self.self_handle)

    async def _evaluate_conditions(self, run: _Run, instruction: EvaluateConditions) -> None:
        edges = run.state.graph.edges
        results = []
        error = None
        try:
            for edge_id, result in instruction.edges:
                outcome = edges[edge_id].condition.apply({"result": result, "context": instruction.context})
                if asyncio.iscoroutine(outcome):
                    outcome = await outcome
                results.append((edge_id, bool(outcome)))
        except Exception as exc:  # user condition: becomes a failed node, typed
            error = f"{type(exc).__name__}: {exc}"
        await self._feed(run, [ConditionsEvaluated(now=time.time(), node_id=instruction.node_id,
                                                   results=tuple(results), error=error)])


class _SetupBranch:
    """The branch handed to ``spawn_branch_setup``: writes are awaited before the child runs."""

    def __init__(self, branch_id: str, store: Any, pending: list[Any]) -> None:
        self.id = branch_id
        self._store = store
        self._pending = pending

    def append(self, *messages: Any) -> None:
        self._pending.append(self._store.append.remote(self.id, list(messages)))

