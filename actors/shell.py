"""ExecutorShell: the GraphExecutor's data path, events in and instructions out.

Owns every run's bookkeeping (its kernel ``FlowState``, in-flight references, driver
outbox) and the executor-wide counters. It turns instructions into worker and branch-store
messages and feeds what comes back in as events. It must run only on the actor's main
loop and has no remote surface: a plain class, because Ray wraps every method of an actor
class in a tracing shim, a cost per call this path (several per node) need not pay.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray

from opgraph.kernel import (
    AdmissionDecided,
    CancelOperation,
    CloneBranch,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    EmitSignal,
    EscalationRequested,
    EvaluateConditions,
    ExecutionError,
    FinishRun,
    FlowEvent,
    FlowStarted,
    FlowState,
    NodeCompleted,
    NodeFailed,
    NodeSkipped,
    OperationFinished,
    OpGraphError,
    ReplaceHistory,
    SpawnRequested,
)

from .histogram import LatencyHistogram
from .watchers import RunWatcher, envelope_summary
from .workers import CallRow, Outcome, OutcomeRow

if TYPE_CHECKING:
    from .executor import RunOptions

__all__ = ["DISPATCH_BATCH", "DISPATCH_WINDOW", "ExecutorShell"]

_TERMINAL_SIGNALS = {NodeCompleted: "completed", NodeFailed: "failed", NodeSkipped: "skipped"}
DISPATCH_BATCH = 256  # calls per message; measured flat between 64 and 512 on 2 cores
DISPATCH_WINDOW = 0.002  # seconds; bounds added latency, amortises message cost
LAG_PROBE_SECONDS = 0.25  # period of the loop-lag probe (metric opgraph_executor_loop_lag_seconds)


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
        # What the executor-wide counters have already taken from this run (see harvest).
        self.harvested_spawns = 0
        self.harvested_drops = 0
        self.harvested_settled: dict[str, int] = {}
        self.watchers: list[RunWatcher] = []

    def post(self, kind: str, item: Any) -> None:
        self.outbox.append((kind, item))
        self.wakeup.set()

    def final_summary(self) -> dict[str, Any]:
        if self.error is not None:
            return {"run_id": self.run_id, "status": "error",
                    "error": f"{type(self.error).__name__}: {self.error}"}
        return envelope_summary(self.envelope or {})

    def finish_watchers(self) -> None:
        summary = self.final_summary()
        for watcher in self.watchers:
            watcher.finish(summary)


def _request_event(kind: str, now: float, emitter_id: str, request: Any, key: Any,
                   redelivery: bool) -> SpawnRequested | EscalationRequested:
    """A spawn or escalation request as the scheduler's event, whichever way it arrived."""
    event_type = EscalationRequested if kind == "escalation" else SpawnRequested
    return event_type(now=now, emitter_id=emitter_id, request=request, dedupe_key=key, redelivery=redelivery)


def _finished_event(row: OutcomeRow) -> OperationFinished:
    node_id, attempt, status, response, error, error_type, requests, started, finished = row
    if requests:  # most outcomes carry none: no generator on the common path
        requests = tuple(_request_event(kind, finished, node_id, request, key, redelivery)
                         for kind, request, key, redelivery in requests)
    else:
        requests = ()
    return OperationFinished(finished, node_id, attempt, status, response, error, error_type, requests, True)


class ExecutorShell:
    """What a GraphExecutor contains: its runs, workers, branch locations and counters."""

    def __init__(self, workers: list[Any], stores: list[Any], *, detached: bool = False,
                 namespace: str | None = None) -> None:
        self.detached = detached
        self.namespace = namespace
        self.workers = list(workers)
        self.stores = list(stores)
        self.runs: dict[str, _Run] = {}
        self.location: dict[str, int] = {}  # branch id -> store index; clones live beside their source
        self.loop: asyncio.AbstractEventLoop | None = None
        self.self_handle = None
        self.next_worker = 0
        self.loop_lag = 0.0
        self.worker_deaths = 0
        self.totals = {"runs": 0, "dispatched": 0, "settled": 0, "spawned": 0, "messages": 0}
        # Executor-wide, monotonic across forget_run: what metrics export as counters.
        self.settled_by_status: dict[str, int] = {}
        self.dropped_spawns_by_reason: dict[str, int] = {}
        self.node_latency: dict[str, LatencyHistogram] = {}  # outcome status -> histogram

    # -- runs: admitted, reported to, forgotten -----------------------------------------
    async def start_run(self, run_id: str, graph: Any, options: RunOptions) -> None:
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
            write_back=False,  # this graph is the executor's copy; the driver mirrors the envelope
            progress_signals=options.want_signals,  # queued/started/spawned reach only signal subscribers
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

    async def report(self, run_id: str, outcomes: list[Outcome]) -> None:
        run = self.runs.get(run_id)
        if run is not None:
            await self.feed(run, [_finished_event(o.row()) for o in outcomes])

    async def receive_requests(self, run_id: str, items: list[tuple[str, str, Any, Any]]) -> None:
        """Spawns and escalations sent live, as (emitter_id, kind, request, key), in emission order."""
        run = self.runs.get(run_id)
        if run is None or run.state.finished:
            return
        run.messages += 1
        now, states = time.time(), run.state.state
        # Once an emitter has settled, its outcome already carried the request.
        await self.feed(run, [_request_event(kind, now, emitter_id, request, key, states.get(emitter_id) != "running")
                              for emitter_id, kind, request, key in items])

    def forget_run(self, run_id: str) -> bool:
        run = self.runs.pop(run_id, None)
        if run is None:
            return False
        self.harvest(run, run.state.statistics())
        for watcher in run.watchers:
            # Forgotten before it settled (its driver gave up): watchers must not hang.
            watcher.finish({"run_id": run_id, "status": "forgotten",
                            "detail": "the owning client left before the run settled"})
        for task in run.tasks:
            task.cancel()
        for worker in self.workers:
            worker.forget.remote(run_id)
        return True

    def harvest(self, run: _Run, stats: dict[str, Any]) -> None:
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

    def _bind_loop(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
            self.self_handle = ray.get_runtime_context().current_actor
            self._probe_lag(self.loop.time())

    def _probe_lag(self, scheduled: float) -> None:
        """Measure how late the loop ran this timer, then set the next one.

        A timer chain, not a task: when the driver exits, Ray ends this process with the
        loop still running, and a pending task would be reported ("Task was destroyed
        but it is pending!") in the driver's output at the end of every script.
        """
        now = self.loop.time()
        self.loop_lag = max(0.0, now - scheduled)
        self.loop.call_at(now + LAG_PROBE_SECONDS, self._probe_lag, now + LAG_PROBE_SECONDS)

    # -- events in, instructions out ------------------------------------------------------
    async def feed(self, run: _Run, events: list[Any]) -> None:
        """The one entry point for events: handle them, then carry out the instructions."""
        if not events:
            return
        try:
            instructions = run.state.handle(*events)
        except OpGraphError as exc:
            self._fail_run(run, exc)
            return
        except Exception as exc:  # a scheduler bug: end the run with it, never leave it open
            self._fail_run(run, ExecutionError(
                f"the scheduler of run {run.run_id} failed on {type(events[0]).__name__}: {type(exc).__name__}: {exc}"))
            return
        await self._carry_out(run, instructions)

    def _fail_run(self, run: _Run, exc: BaseException) -> None:
        run.error = exc
        run.done.set()
        run.wakeup.set()
        run.finish_watchers()

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
                run.finish_watchers()
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
            self._spawn_task(run, self.feed(run, [DispatchHeld(now=time.time(), held=True)]))

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
            if len(calls) == 1:
                # One call (a chain's every link): a plain call answers in one message,
                # where a stream costs its item and its end, ~1 ms more per link here.
                await self._settle_rows(run, pending, await worker.run_one.remote(run.run_id, calls[0]))
                return
            stream = worker.run_batch.options(num_returns="streaming").remote(run.run_id, calls)
            async for ref in stream:
                await self._settle_rows(run, pending, await ref)
        except ray.exceptions.RayActorError as exc:
            self.worker_deaths += 1
            await self._fail_pending(run, pending, f"operation worker {index} died: {type(exc).__name__}",
                                     "WorkerDied")
            await self._replace_worker(index, worker)
        except ray.exceptions.RayTaskError as exc:
            # The worker is alive but its batch loop raised: a bug, not a death.
            await self._fail_pending(run, pending, f"operation worker {index} failed: {exc}", "WorkerError")
        except Exception as exc:  # an outcome that could not be fetched or read (lost, unpicklable)
            await self._fail_pending(run, pending, f"outcome from operation worker {index} could not be received: "
                                     f"{type(exc).__name__}: {exc}", "OutcomeLost")

    async def _settle_rows(self, run: _Run, pending: dict[str, int], rows: list[OutcomeRow]) -> None:
        """One worker message of outcome rows: observed, then fed to the run as events."""
        run.messages += 1
        histograms = self.node_latency
        for row in rows:
            pending.pop(row[0], None)
            histogram = histograms.get(row[2])
            if histogram is None:
                histogram = histograms[row[2]] = LatencyHistogram()
            histogram.observe(row[8] - row[7])
        await self.feed(run, [_finished_event(row) for row in rows])

    async def _fail_pending(self, run: _Run, pending: dict[str, int], reason: str, kind: str) -> None:
        now = time.time()
        await self.feed(run, [
            OperationFinished(now=now, node_id=node_id, attempt=attempt, status="failed", error=reason, error_type=kind)
            for node_id, attempt in pending.items()
        ])

    async def _replace_worker(self, index: int, dead: Any) -> None:
        if index < len(self.workers) and self.workers[index] is dead:
            from .runtime import start_worker  # local: runtime imports the executor, which imports this module

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
        await self.feed(run, [ConditionsEvaluated(now=time.time(), node_id=instruction.node_id,
                                                  results=tuple(results), error=error)])


class _SetupBranch:
    """The branch handed to ``spawn_branch_setup``: writes are awaited before the child runs."""

    def __init__(self, branch_id: str, store: Any, pending: list[Any]) -> None:
        self.id = branch_id
        self._store = store
        self._pending = pending

    def append(self, *messages: Any) -> None:
        self._pending.append(self._store.append.remote(self.id, list(messages)))
