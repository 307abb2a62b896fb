"""ExecutorShell: the GraphExecutor's data path, events in and instructions out.

Owns every run's bookkeeping (its kernel ``FlowState``, in-flight calls, driver outbox)
and the executor-wide counters. It turns instructions into worker and branch-store
messages and feeds what comes back, failures included, in as events: the kernel
decides what a failure means. It runs only on the actor's main loop and has no remote
surface: a plain class, because Ray wraps every method of an actor class in a tracing
shim, a cost per call this path (several per node) need not pay.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import time
from collections import deque
from typing import Any

from ray import cloudpickle

from opgraph.kernel import (
    AdmissionDecided,
    AppendRecords,
    CancelGraceExpired,
    CancelOperation,
    CloneBranch,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    DispatchUndelivered,
    EmitSignal,
    EscalationRequested,
    EvaluateConditions,
    ExecutionError,
    FinishRun,
    FlowEvent,
    FlowStarted,
    FlowState,
    NodeCancelled,
    NodeCompleted,
    NodeFailed,
    NodeSkipped,
    OperationFinished,
    OpGraphError,
    ReplaceHistory,
    SpawnRequested,
    compact_envelope,
)
from opgraph.kernel.failures import BRANCH_STORE_LOST, WORKER_DIED

from .. import settings
from ..branches.registry import BranchRegistry
from ..calls import BranchStoreStub, PoolSlot, Tells, WorkerStub, ask, ping
from ..errors import RuntimeLostError, call_failure, is_actor_death
from ..protocol import CallRow, CompactEnvelope, Outcome, OutcomeRow, RunOptions, RunResources, SharedResult
from ..settings import PROBE_TIMEOUT_SECONDS
from ..statistics import LatencyHistogram
from ..workers.channel import ChannelLost, WorkerChannels
from ..workers.supervision import ActorPool
from .durability import RunLogger, decode_header, encode_header
from .watchers import RunWatcher, envelope_summary

__all__ = ["DISPATCH_BATCH", "DISPATCH_WINDOW", "ExecutorShell"]

_TERMINAL_SIGNALS = {NodeCompleted: "completed", NodeFailed: "failed", NodeSkipped: "skipped"}
DISPATCH_BATCH = 256  # calls per message; measured flat between 64 and 512 on 2 cores
# Seconds dispatches wait to be sent together. 0: one turn of the loop, so what the outcomes
# already read decided goes as one batch, and no call waits for a timer (see OUTCOME_WINDOW).
DISPATCH_WINDOW = 0.0
# A dependency result its dependents share goes to workers as a SharedResult, fetched once
# per worker and run, from this size (pickled) on; a smaller one travels in each call.
SHARED_RESULT_BYTES = 16 * 1024
LAG_PROBE_SECONDS = 0.25  # period of the loop-lag probe (metric opgraph_executor_loop_lag_seconds)
LARGE_RUN_NODES = 10_000  # forgetting a run this large triggers a full garbage collection
COLLECT_DELAY_SECONDS = 0.05  # ... this long after, once the forgetting call has been answered


class _Run:
    """The shell's bookkeeping for one run: its state machine, calls in flight, and driver outbox."""

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
        self.pending_branch_work: list[Any] = []  # store calls (tasks, coroutines) a dispatch must wait for
        # Branch id -> the task cloning it, for clones no dispatch needed when they were decided:
        # awaited only by the flush that dispatches that branch's node.
        self.deferred_clones: dict[str, asyncio.Task] = {}
        # Source branch id -> the tasks cloning it (deferred ones): a dispatch that appends to a
        # source waits for them, so a clone holds its source as it was when the clone was decided.
        self.deferred_sources: dict[str, set[asyncio.Task]] = {}
        self.pending_dispatch: list[Any] = []
        self.flush_scheduled = False
        self.node_worker: dict[str, int] = {}  # node id -> worker index, while its call is in flight
        # The run's operations as workers receive them with their first call (``_ship``): pickled
        # once, and the workers (by actor) that were sent them.
        self.shipped: bytes | None = None
        self.shipped_to: set[Any] = set()
        self.inject_waiters: dict[int, asyncio.Future] = {}
        self.started = time.time()
        self.messages = 0
        self.grace_timer: asyncio.TimerHandle | None = None
        # Dependency results the dependents share (FlowState.shared_results): each one looked
        # at, kept here so that its id stays its own, and id -> node id for the large ones.
        self.shared_checked: dict[str, Any] = {}
        self.shared_marks: dict[int, str] = {}
        self.unclaimed_timer: asyncio.TimerHandle | None = None  # lets it go if no driver forgets it
        self.hook_errors: list[dict[str, Any]] = []
        self.lost_branches: list[dict[str, Any]] = []
        # What the executor-wide counters have already taken from this run (see harvest).
        self.harvested_spawns = 0
        self.harvested_drops = 0
        self.harvested_settled: dict[str, int] = {}
        self.watchers: list[RunWatcher] = []
        # The durable run log (durability.py): batches appended and made durable, what
        # waits for them, and who waits for the run's end (detached runs have no driver).
        self.log_seq = 0
        self.flushed_seq = 0
        self.gate_seq = 0
        self.gated: deque[tuple[int, str, Any]] = deque()
        self.durable_waiters: list[asyncio.Future] = []
        self.log_error: BaseException | None = None
        self.result_waiters: list[asyncio.Future] = []
        self.ending: asyncio.Task | None = None  # the envelope's write, after the driver was answered
        # How many nodes the submitted graph had (-1: not known). The kernel registers them first,
        # in the graph's order, and only ever adds nodes: while it holds this many, the envelope's
        # node ids are the submitted graph's, which its driver has (``compact_result``).
        self.submitted_nodes = -1

    def post(self, kind: str, item: Any) -> None:
        """Hand ``item`` to the driver (or, ``kind`` "watch", to the watchers); held back until the
        batch that decided it is durable."""
        if self.gate_seq > self.flushed_seq:
            self.gated.append((self.gate_seq, kind, item))
            return
        self._deliver(kind, item)

    def _deliver(self, kind: str, item: Any) -> None:
        if kind == "watch":
            for watcher in self.watchers:
                watcher.push(item)
            return
        self.outbox.append((kind, item))
        self.wakeup.set()

    def release_gated(self) -> None:
        gated = self.gated
        while gated and gated[0][0] <= self.flushed_seq:
            _, kind, item = gated.popleft()
            self._deliver(kind, item)

    def final_summary(self) -> dict[str, Any]:
        if self.error is not None:
            return {"run_id": self.run_id, "status": "error",
                    "error": f"{type(self.error).__name__}: {self.error}"}
        return envelope_summary(self.envelope or {})

    def finish_watchers(self) -> None:
        summary = self.final_summary()
        for watcher in self.watchers:
            watcher.finish(summary)


class _Outgoing:
    """What one batch of instructions asks of the stores and workers, gathered to be sent together."""

    __slots__ = ("cancels", "clones", "dispatches", "reactive_clones", "replaces")

    def __init__(self) -> None:
        self.clones: dict[int, list[tuple[str, str]]] = {}  # store shard -> (source, new branch) pairs
        self.replaces: list[ReplaceHistory] = []
        self.reactive_clones: list[CloneBranch] = []
        self.cancels: list[CancelOperation] = []
        self.dispatches: list[DispatchOperation] = []


def _request_event(kind: str, now: float, emitter_id: str, request: Any, key: Any,
                   redelivery: bool) -> SpawnRequested | EscalationRequested:
    """A spawn or escalation request as the scheduler's event, whichever way it arrived."""
    event_type = EscalationRequested if kind == "escalation" else SpawnRequested
    return event_type(now=now, emitter_id=emitter_id, request=request, dedupe_key=key, redelivery=redelivery)


async def _received(stream: Any):
    """The items of a Ray object-ref stream, each awaited in turn."""
    async for ref in stream:
        yield await ref


def _finished_event(row: OutcomeRow) -> OperationFinished:
    node_id, attempt, status, response, error, error_type, requests, started, finished = row
    if requests:  # most outcomes carry none: no generator on the common path
        requests = tuple(_request_event(kind, finished, node_id, request, key, redelivery)
                         for kind, request, key, redelivery in requests)
    else:
        requests = ()
    return OperationFinished(finished, node_id, attempt, status, response, error, error_type, requests, True)


class ExecutorShell:
    """What a GraphExecutor contains: its runs, its supervised workers and stores, and counters."""

    def __init__(self, workers: ActorPool, stores: ActorPool, logger: RunLogger | None = None,
                 slot: int = 0) -> None:
        self.workers = workers
        # Calls and outcomes travel on direct sockets (actors/workers/channel.py), Ray's calls where
        # none can be opened. A worker found dead has its channel closed at once.
        self.channels = WorkerChannels(settings.direct_calls())
        workers.on_dead = lambda index, handle: self.channels.close(handle, "the worker was found dead")
        self.slot = slot  # this executor's place in the runtime's pool: workers reach it by that
        self.logger = logger
        self.branches = BranchRegistry(stores)
        self.runs: dict[str, _Run] = {}
        # Operations, providers and settings by key (a run id, or a Session's turn key),
        # fetched by workers the first time a call of that key reaches them.
        self.resources: dict[str, RunResources] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.collection_due = False  # a full collection is scheduled (see forget_run)
        self.loop_lag = 0.0
        self.worker_deaths = 0
        # The workers as this shell calls them (their stubs), and the tells it sends them:
        # a tell to a dead worker has its pool replace it.
        self.tells = Tells()
        self.worker_slots = [PoolSlot(workers, index, WorkerStub, self.tells) for index in range(len(workers))]
        self.totals = {"runs": 0, "dispatched": 0, "settled": 0, "spawned": 0, "messages": 0, "undelivered": 0,
                       "turns": 0, "recovered": 0, "unclaimed": 0}
        # Executor-wide, monotonic across forget_run: what metrics export as counters.
        self.settled_by_status: dict[str, int] = {}
        self.dropped_spawns_by_reason: dict[str, int] = {}
        self.node_latency: dict[str, LatencyHistogram] = {}  # outcome status -> histogram
        # Instruction type -> the method that carries it out (``_carry_out``).
        self.carriers: dict[type, Any] = {
            AppendRecords: self._append_records, DispatchOperation: self._dispatch_operation,
            EmitSignal: self._emit_signal, CloneBranch: self._clone_branch, ReplaceHistory: self._replace_history,
            CancelOperation: self._cancel_operation, EvaluateConditions: self._evaluate_conditions,
            AdmissionDecided: self._admission_decided, FinishRun: self._finish_run,
        }

    @property
    def stores(self) -> ActorPool:
        return self.branches.stores

    def worker(self, index: int) -> WorkerStub:
        """Worker slot ``index``'s current actor, as this shell calls it."""
        return self.worker_slots[index].stub()

    @property
    def told(self) -> set[asyncio.Future]:
        """The tells (and the executor's probes) still on their way."""
        return self.tells.watching

    @property
    def tell_failures(self) -> int:
        return self.tells.failures

    # -- runs: admitted, reported to, forgotten -----------------------------------------
    async def start_run(self, run_id: str, graph: Any, options: RunOptions) -> None:
        """Validate and start a run; raise the kernel's typed error for a bad graph.

        ``graph`` arrives pickled (bytes) for a durable run: those bytes go into the run's
        header as they are, so the graph is pickled once, by the caller, not again here."""
        self.bind_loop()
        shipped = graph if isinstance(graph, bytes) else None
        if shipped is not None:
            graph = cloudpickle.loads(shipped)
        if run_id in self.runs:
            raise OpGraphError(f"run {run_id} already exists on this executor", run_id=run_id)
        if options.isolated:
            own = f"run-{run_id}-default"
            options.default_branch_id = own
            options.clone_source_branch_id = own
        options.durable = bool(options.durable and self.logger is not None)
        header = encode_header(shipped if shipped is not None else graph, options, time.time(), run_id=run_id) \
            if options.durable else b""
        state = FlowState(graph, **_flow_options(run_id, options))
        run = _Run(run_id, state, options)
        run.submitted_nodes = len(graph.nodes)
        instructions = state.handle(FlowStarted(now=run.started))  # raises OperationError on a bad graph
        if not options.durable:
            await self._admit(run, instructions)
            return
        # Admitted and durable before anyone hears of it: the header goes in one transaction
        # with the run's first batch, which its first dispatches wait for anyway.
        self.logger.open(run, header)
        await self._admit(run, instructions)
        try:
            await self.logger.durable(run, 0)
        except Exception as exc:  # not durable: not admitted, and the caller is told why
            self.forget_run(run_id)
            raise ExecutionError(f"run {run_id} could not be logged: {type(exc).__name__}: {exc}",
                                 run_id=run_id) from exc

    async def recover_run(self, run_id: str, header: bytes, batches: list,
                          overrides: dict[str, Any] | None = None) -> None:
        """Continue a durable run from its log: rebuilt, then every attempt in flight sent again.

        ``overrides`` change how the run is followed from now on (``want_signals``,
        ``detached``: a run resumed by a new driver is drained by it); ``providers`` among
        them are the resuming caller's, built from its environment, used for the providers
        the header describes (it keeps no key): else they are built from this process's."""
        self.bind_loop()
        overrides = dict(overrides or {})
        graph, options, started = decode_header(header, overrides.pop("providers", None))
        for name, value in overrides.items():
            setattr(options, name, value)
        submitted = len(graph.nodes)
        state = FlowState.rebuild(graph, batches, started_at=started, **_flow_options(run_id, options))
        run = _Run(run_id, state, options)
        run.started, run.submitted_nodes = started, submitted
        await self.logger.begin(run, header)
        if options.isolated:  # its own default branch: back with the other durable branches, or recreated
            options.known_branches = {**options.known_branches, options.default_branch_id: 0}
        # The run's branches as its log names them: held here, or adopted from the runtime
        # that ran it before (an orphan resumed elsewhere); its own go under its scope again.
        own = {branch_id for branch_id in state.branch.values() if branch_id}
        if options.isolated:
            own.add(options.default_branch_id)
        if options.branch_scope is not None:
            self.branches.adopt(options.branch_scope, (), parent=options.scope_parent)
        await self.branches.take_over([*options.known_branches, *own, state.clone_source_branch_id],
                                      options.branch_scope, own)
        self.totals["recovered"] += 1
        await self._admit(run, state.recover(time.time()))

    async def _admit(self, run: _Run, instructions: list[Any]) -> None:
        run_id, options, state = run.run_id, run.options, run.state
        registry = self.branches
        if options.branch_scope is not None:
            registry.adopt(options.branch_scope, (), parent=options.scope_parent)
        if options.isolated and options.default_branch_id not in options.known_branches:
            await registry.create(options.default_branch_id, [], options.branch_scope)
        # Members of a pool other than the first borrow the Sessions' branches (made on the first).
        lost = await registry.ensure(dict(options.known_branches), borrower=run_id if self.slot else None)
        run.lost_branches.extend({"branch_id": branch_id, "reason": "its branch store died; recreated empty"}
                                 for branch_id in lost)
        # Nodes restored as already settled were counted by the run that settled them.
        run.harvested_settled = dict(state.statistics()["settled_by_status"])
        self.runs[run_id] = run
        self.resources[run_id] = options.resources  # what a worker that lacks them fetches
        self.totals["runs"] += 1
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
        if run.grace_timer is not None:
            run.grace_timer.cancel()
        if run.unclaimed_timer is not None:
            # A pending timer holds the run, its graph and its state: 300 s of a 20,000-node
            # run is 15 MiB, and a reused executor grew by that much with every run.
            run.unclaimed_timer.cancel()
            run.unclaimed_timer = None
        self._fail_waiters(run, None)
        self.release_resources(run_id)
        self.branches.release(run_id)
        if len(run.state.state) >= LARGE_RUN_NODES and not self.collection_due:
            # A large run leaves reference cycles (tasks, closures) that the youngest
            # generations never reach at this process's GC thresholds; collected soon, a
            # long-lived executor stays flat run after run instead of growing until a
            # full collection happens to run. Soon, not now: a full collection holds this
            # process 40 ms after a 10,000-node run, which the driver waited for in
            # ``forget_run`` before ``flow()`` returned.
            self.collection_due = True
            self.bind_loop()
            self.loop.call_later(COLLECT_DELAY_SECONDS, self._collect)
        return True

    def _collect(self) -> None:
        self.collection_due = False
        gc.collect()

    def release_resources(self, key: str) -> None:
        """Forget ``key``'s resources here and on every live worker."""
        if self.resources.pop(key, None) is not None:
            for index in range(len(self.workers)):
                if self.workers.alive[index]:
                    self.worker(index).forget(key)

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

    def bind_loop(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
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
            if exc.run_id is None:
                exc.run_id = run.run_id
            self._fail_run(run, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a scheduler bug: end the run with it, never leave it open
            self._fail_run(run, ExecutionError(
                f"the scheduler failed on {type(events[0]).__name__}: {type(exc).__name__}: {exc}",
                run_id=run.run_id))
            return
        await self._carry_out(run, instructions)

    def _fail_run(self, run: _Run, exc: BaseException) -> None:
        run.error = exc
        run.done.set()
        run.wakeup.set()
        run.gated.clear()
        run.finish_watchers()
        self._fail_waiters(run, exc)
        self._answer_results(run)
        if run.options.durable and self.logger is not None:
            self.tell_failure_recorded(run, exc)

    def tell_failure_recorded(self, run: _Run, exc: BaseException) -> None:
        """Record that the run ended with an error, so the log does not keep it live."""
        self._spawn_task(run, self.logger.writer.run(self.logger.log.finish, run.run_id, "error", None,
                                                    f"{type(exc).__name__}: {exc}"))

    @staticmethod
    def _answer_results(run: _Run) -> None:
        waiters, run.result_waiters = run.result_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(run.error if run.error is not None else run.envelope)

    @staticmethod
    def _fail_waiters(run: _Run, exc: BaseException | None) -> None:
        """Injections still waiting for admission get an answer: the run's error, or refused."""
        for token, waiter in run.inject_waiters.items():
            if not waiter.done():
                if exc is None:
                    waiter.set_result(AdmissionDecided(token, False, None, "not_running"))
                else:
                    waiter.set_exception(exc)
        run.inject_waiters.clear()

    async def admit_many(self, run: _Run, decisions: list[asyncio.Future], events: list[Any]) -> list[Any]:
        """Feed a batch of ``InjectRequested`` (one ``handle``) and answer once the batch that
        admitted them is durable: an admission its caller heard of survives this process.
        ``decisions`` are the events' waiters, in order; returns their ``AdmissionDecided``."""
        await self.feed(run, events)
        decided = await asyncio.gather(*decisions)
        if run.options.durable and self.logger is not None and not run.done.is_set():
            await self.logger.durable(run, run.log_seq)
        return decided

    # -- instructions out: one method per kind ------------------------------------------------
    async def _carry_out(self, run: _Run, instructions: list[Any]) -> None:
        """Carry out what the kernel decided, each instruction by the method of its kind (``carriers``).

        Store and worker work is gathered first and sent after, in this order: the branch
        clones, the history replacements, the spawn setup hooks (which wait for both), the
        cancels, and last the dispatches, whose flush waits for the branch work they need.
        """
        outgoing = _Outgoing()
        carriers = self.carriers
        for instruction in instructions:
            carriers[type(instruction)](run, outgoing, instruction)
        if outgoing.clones:
            self._send_clones(run, outgoing.clones, outgoing.dispatches)
        if outgoing.replaces:
            self._send_history_replacements(run, outgoing.replaces)
        if outgoing.reactive_clones and run.options.spawn_branch_setup is not None:
            await self._await_branch_work(run)
            for clone in outgoing.reactive_clones:
                self._run_spawn_setup(run, clone)
        if outgoing.cancels:
            self._cancel_in_flight(run, outgoing.cancels)
        if outgoing.dispatches:
            self._schedule_dispatch(run, outgoing.dispatches)

    def _append_records(self, run: _Run, outgoing: _Outgoing, instruction: AppendRecords) -> None:
        """The batch's records go to the run log; what it decided is held back until they are durable.
        (The kernel puts this instruction first, so the gate is up before anything is posted.)"""
        run.gate_seq = self.logger.append(run, instruction.records)

    def _dispatch_operation(self, run: _Run, outgoing: _Outgoing, instruction: DispatchOperation) -> None:
        outgoing.dispatches.append(instruction)

    def _clone_branch(self, run: _Run, outgoing: _Outgoing, instruction: CloneBranch) -> None:
        """Place the new branch beside its source (sent by ``_send_clones``), and tell whoever watches branches."""
        options = run.options
        source = instruction.source if instruction.source is not None else options.default_branch_id
        registry = self.branches
        shard = registry.location.get(source)
        if shard is None:
            shard = registry.shard_of(options.default_branch_id)
        registry.place(instruction.branch_id, shard)
        pairs = outgoing.clones.get(shard)
        if pairs is None:
            pairs = outgoing.clones[shard] = []
        pairs.append((source, instruction.branch_id))
        if options.want_signals:
            run.post("branch", (instruction.node_id, instruction.branch_id, instruction.reactive))
        if instruction.reactive:
            outgoing.reactive_clones.append(instruction)

    def _replace_history(self, run: _Run, outgoing: _Outgoing, instruction: ReplaceHistory) -> None:
        outgoing.replaces.append(instruction)

    def _cancel_operation(self, run: _Run, outgoing: _Outgoing, instruction: CancelOperation) -> None:
        outgoing.cancels.append(instruction)

    def _evaluate_conditions(self, run: _Run, outgoing: _Outgoing, instruction: EvaluateConditions) -> None:
        """Conditions that are not kernel expressions run here, in a task: their answer is an event."""
        self._spawn_task(run, self._conditions_evaluated(run, instruction))

    def _admission_decided(self, run: _Run, outgoing: _Outgoing, instruction: AdmissionDecided) -> None:
        """An ``inject`` waiting for its admission hears the decision (accepted, or why not)."""
        waiter = run.inject_waiters.pop(instruction.token, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(instruction)

    def _finish_run(self, run: _Run, outgoing: _Outgoing, instruction: FinishRun) -> None:
        if run.options.durable:
            # The envelope is an acknowledgement like any other: durable first.
            self._spawn_task(run, self._finish_durably(run, instruction.envelope))
            return
        self._settle(run, instruction.envelope)

    def _send_clones(self, run: _Run, clones: dict[int, list[tuple[str, str]]],
                     dispatches: list[DispatchOperation]) -> None:
        """Send the batch's clones, one message per store shard.

        The clones this batch's dispatches need go first, and so do the clones of a branch one of
        them appends to (a clone is its source as it was when the clone was decided, never with a
        turn that raced it). The rest (a planner's 900 children beyond the capacity, a chain's every
        later link) follow in the background, each awaited by the flush that dispatches its node or
        appends to its source. A spawn setup hook writes to every new branch at once, so with one
        they all go first.
        """
        options = run.options
        if options.branch_scope is not None:
            self.branches.adopt(options.branch_scope, [pair[1] for pairs in clones.values() for pair in pairs])
        needed = {dispatch.branch_id for dispatch in dispatches} if options.spawn_branch_setup is None else None
        for shard, pairs in clones.items():
            now, later = pairs, ()
            if needed is not None:
                now = [pair for pair in pairs if pair[1] in needed or pair[0] in needed]
                later = [pair for pair in pairs if pair[1] not in needed and pair[0] not in needed]
            first = self._start_branch_work(run, self._store_clones(run, shard, now)) if now else None
            if later:
                deferred = self._store_task(run, self._clones_after(run, first, shard, later))
                run.deferred_clones.update(dict.fromkeys([pair[1] for pair in later], deferred))
                for source in {pair[0] for pair in later}:
                    run.deferred_sources.setdefault(source, set()).add(deferred)
            run.messages += 1 + bool(now and later)

    def _send_history_replacements(self, run: _Run, replaces: list[ReplaceHistory]) -> None:
        """Each ReplaceHistory as its store call, which the run's next dispatches wait for."""
        registry, default_branch_id = self.branches, run.options.default_branch_id
        default_shard = registry.shard_of(default_branch_id)
        for replace in replaces:
            source = replace.source if replace.source is not None else default_branch_id
            shard = registry.shard_of(replace.branch_id, default_shard)
            self._start_branch_work(run, self._store_history(run, shard, replace.branch_id, source))
            run.messages += 1

    def _schedule_dispatch(self, run: _Run, dispatches: list[DispatchOperation]) -> None:
        """Queue ``dispatches`` for the run's next flush, which sends them in batched messages."""
        run.pending_dispatch.extend(dispatches)
        if not run.flush_scheduled:
            # Coalesce dispatches from every event handled within one short window
            # into a few batched messages instead of one round trip per feed. When
            # nothing else is in flight no outcome can arrive to join the batch, so
            # waiting would only add latency (a chain's every link): send at once.
            run.flush_scheduled = True
            if len(run.state.running) > len(run.pending_dispatch):
                self.loop.call_later(DISPATCH_WINDOW, self._spawn_task, run, self._flush(run))
            else:  # its first step runs after every callback already queued: they still join
                self._spawn_task(run, self._flush(run))
        elif len(run.pending_dispatch) >= DISPATCH_BATCH:
            # A full batch gains nothing by waiting: it goes now, and the window's flush
            # takes what follows. A wave's outcomes arrive as several messages; held back
            # until the last was handled, every call of the next wave started late.
            self._spawn_task(run, self._flush(run))

    async def _finish_durably(self, run: _Run, envelope: dict[str, Any]) -> None:
        """Answer once the batch that finished the run is durable; write the envelope after.

        The records decide the end: should this process die before the envelope row is
        written, a rebuild from them finishes the run again and writes it. So the driver
        is answered as soon as the records are in, and the envelope (for 10,000 nodes a
        megabyte) is written while the driver takes the result; ``forget_run`` waits for
        it, so ``flow()`` returns with the log saying how the run ended. A detached run
        has no driver: whoever asks later reads the envelope, so it goes in first.
        """
        try:
            await self.logger.durable(run, run.log_seq)
            if run.options.detached:
                await self.logger.finish(run, envelope["status"], envelope)
        except Exception as exc:  # noqa: BLE001 - a run whose end cannot be made durable ends with that error
            self._fail_run(run, ExecutionError(f"the run could not be made durable: {type(exc).__name__}: {exc}",
                                               run_id=run.run_id))
            return
        if not run.options.detached:
            # Not a task of the run's: forget_run cancels those, and this write must happen.
            run.ending = self.loop.create_task(self._record_end(run, envelope))
        self._settle(run, envelope)

    async def _record_end(self, run: _Run, envelope: dict[str, Any]) -> None:
        try:
            await self.logger.finish(run, envelope["status"], envelope)
        except Exception:  # noqa: BLE001 - the driver has its result; a rebuild from the records writes it
            self.logger.end_failures += 1

    def _settle(self, run: _Run, envelope: dict[str, Any]) -> None:
        run.envelope = envelope
        envelope["run_id"] = run.run_id
        envelope["scheduler_messages"] = run.messages
        if run.options.isolated:
            envelope["default_branch"] = run.options.default_branch_id  # the run's own, for reading it back
        if run.hook_errors:
            envelope["hook_errors"] = list(run.hook_errors)
        if run.lost_branches:
            envelope["lost_branches"] = list(run.lost_branches)
        if run.grace_timer is not None:
            run.grace_timer.cancel()
            run.grace_timer = None
        run.done.set()
        run.wakeup.set()
        run.finish_watchers()
        self._fail_waiters(run, None)
        self._answer_results(run)
        self.release_resources(run.run_id)
        if run.options.detached:  # nobody drains it: done once its end is durable and told
            self.forget_run(run.run_id)
        else:  # its driver forgets it once it has the result; one that never comes is not waited for
            run.unclaimed_timer = self.loop.call_later(settings.UNCLAIMED_RUN_SECONDS, self._forget_unclaimed, run)

    @staticmethod
    def compact_result(run: _Run) -> CompactEnvelope:
        """``run``'s envelope as its driver receives it (protocol ``CompactEnvelope``): without the
        node ids when they are the submitted graph's, in its order."""
        rest, columns = compact_envelope(run.envelope)
        if columns and len(columns["ids"]) == run.submitted_nodes:
            columns["count"], columns["ids"] = run.submitted_nodes, None
        return CompactEnvelope(rest, columns)

    def _forget_unclaimed(self, run: _Run) -> None:
        """Let an ended run go that no driver took (``settings.UNCLAIMED_RUN_SECONDS`` after its
        end): its driver died, or it was recovered for one that is gone. Ideal over
        retrospective: such a run stayed in the executor's memory for good."""
        if self.runs.get(run.run_id) is not run:
            return  # forgotten by its driver, as it should be
        if run.ending is not None and not run.ending.done():
            run.ending.add_done_callback(lambda _: self._forget_unclaimed(run))  # its envelope goes in first
            return
        self.totals["unclaimed"] += 1
        self.forget_run(run.run_id)

    def _cancel_in_flight(self, run: _Run, cancels: list[CancelOperation]) -> None:
        """Ask the workers to cancel; give the operations ``cancel_grace`` seconds to stop."""
        by_worker: dict[int, list[str]] = {}
        for cancel in cancels:
            by_worker.setdefault(run.node_worker.get(cancel.node_id, 0), []).append(cancel.node_id)
        for index, node_ids in by_worker.items():
            if index < len(self.workers) and self.workers.alive[index]:
                self.worker(index).cancel(run.run_id, node_ids)
        if run.grace_timer is None:
            run.grace_timer = self.loop.call_later(run.options.cancel_grace, self._grace_expired, run)

    def _grace_expired(self, run: _Run) -> None:
        run.grace_timer = None
        if not run.done.is_set():
            self._spawn_task(run, self.feed(run, [CancelGraceExpired(now=time.time())]))

    async def _flush(self, run: _Run) -> None:
        run.flush_scheduled = False
        dispatches, run.pending_dispatch = run.pending_dispatch, []
        if dispatches:
            await self._await_branch_work(run)
            if run.deferred_clones or run.deferred_sources:
                await self._await_deferred_clones(run, dispatches)
            if run.options.durable and run.flushed_seq < run.log_seq:
                try:  # what decided these dispatches must outlive this process before they go out
                    await self.logger.durable(run, run.log_seq)
                except Exception as exc:  # noqa: BLE001 - the run cannot go on durably: it ends, typed
                    self._fail_run(run, ExecutionError(f"the run log could not be written: {exc}",
                                                       run_id=run.run_id))
                    return
            single = self._dispatch(run, dispatches)
            if single is not None:
                await single

    def _start_branch_work(self, run: _Run, coroutine: Any) -> asyncio.Task:
        """A store call the run's next dispatches wait for, sent now rather than when the flush
        gets to it: the stores work while this loop goes on. For 1,000 spawns, the clones (30 ms
        in the store) waited for the loop to encode the batch that admitted them (19 ms)."""
        task = self._store_task(run, coroutine)
        run.pending_branch_work.append(task)
        return task

    def _store_task(self, run: _Run, coroutine: Any) -> asyncio.Task:
        """A task of the run's for a store call, whose error its flush raises (``_branch_work_done``)."""
        task = self._spawn_task(run, coroutine)
        task.add_done_callback(_branch_work_done)
        return task

    async def _clones_after(self, run: _Run, first: asyncio.Task | None, shard: int,
                           pairs: list[tuple[str, str]]) -> None:
        """Clones no dispatch waits for yet, sent once ``first`` (the ones one does) is done, so
        the store and the database's write lock serve those first."""
        if first is not None:
            await asyncio.wait([first])  # its end, not its outcome: a failure is its flush's to raise
        await self._store_clones(run, shard, pairs)

    async def _await_deferred_clones(self, run: _Run, dispatches: list[DispatchOperation]) -> None:
        """Wait for the deferred clones of the branches ``dispatches`` run on, and for those taken
        of them (a dispatch's turn must not land in a clone decided before it)."""
        deferred, sources = run.deferred_clones, run.deferred_sources
        waits = {deferred.pop(dispatch.branch_id) for dispatch in dispatches if dispatch.branch_id in deferred}
        for dispatch in dispatches:
            waits.update(sources.pop(dispatch.branch_id, ()))
        # Done and fine (a chain's later links, cloned long before): no turn of the loop to wait for them.
        if any(not task.done() or task.cancelled() or task.exception() is not None for task in waits):
            await self._await_store_calls(run, waits)

    async def _await_branch_work(self, run: _Run) -> None:
        work, run.pending_branch_work = run.pending_branch_work, []
        await self._await_store_calls(run, work)

    async def _await_store_calls(self, run: _Run, calls: Any) -> None:
        """Wait for ``calls`` (tasks, coroutines) to the stores; one that failed for good ends the run."""
        if calls:
            try:
                await asyncio.gather(*calls)
            except OpGraphError as exc:  # a store failed for good (its replacement too): the run ends, typed
                if exc.run_id is None:
                    exc.run_id = run.run_id
                self._fail_run(run, exc)

    async def _store_clones(self, run: _Run, shard: int, pairs: list[tuple[str, str]]) -> None:
        missing = await ask(self.branches.store(shard), BranchStoreStub.clone_many, pairs, run_id=run.run_id)
        if missing:
            lost = set(missing)
            run.lost_branches.extend({"branch_id": source, "reason": "its branch store died; clones start empty"}
                                     for source in sorted(lost))

    async def _store_history(self, run: _Run, shard: int, branch_id: str, source: str) -> None:
        if not await ask(self.branches.store(shard), BranchStoreStub.replace_history, branch_id, source,
                         run_id=run.run_id, branch_id=branch_id):
            run.lost_branches.append({"branch_id": source, "reason": "its branch store died; history not inherited"})

    def _run_spawn_setup(self, run: _Run, clone: CloneBranch) -> None:
        child = run.state.graph.nodes[clone.node_id]
        handle = _SetupBranch(clone.branch_id, self.branches.shard_of(clone.branch_id), self.branches,
                              run.pending_branch_work, run.run_id)
        try:
            run.options.spawn_branch_setup(child, handle)
        except Exception as exc:  # noqa: BLE001 - a user hook: reaches the caller in the envelope, never a crash
            run.hook_errors.append({"hook": "spawn_branch_setup", "node_id": clone.node_id,
                                    "error": f"{type(exc).__name__}: {exc}"})

    def _emit_signal(self, run: _Run, outgoing: _Outgoing, instruction: EmitSignal) -> None:
        kind = instruction.kind
        if kind in _TERMINAL_SIGNALS:
            self.totals["settled"] += 1
            if run.options.want_events or run.watchers:
                node_id = instruction.op_id
                # The signal's own node: the run's graph is let go once the run has ended.
                node = instruction.node if instruction.node is not None else run.state.graph.nodes[node_id]
                event = FlowEvent(node_id, node.metadata.get("reference_id") or node.operation,
                                  _TERMINAL_SIGNALS[kind], run.state.results.get(node_id),
                                  bool(node.metadata.get("spawned")))
                if run.watchers:
                    run.post("watch", event)
                if run.options.want_events:
                    run.post("event", event)
                    run.undelivered_events += 1
        elif kind is NodeCancelled:
            self.totals["settled"] += 1
        if run.options.want_signals:
            run.post("signal", instruction.signal)

    # -- dispatch ------------------------------------------------------------------------------
    def _dispatch(self, run: _Run, dispatches: list[DispatchOperation]) -> Any:
        """Send ``dispatches`` out, each batch in a task of the run's. A run's only call in
        flight is returned instead (a coroutine), for the flush to await in its own task."""
        if run.done.is_set():
            return None
        registry, default_shard = self.branches, self.branches.shard_of(run.options.default_branch_id)
        location = registry.location
        calls: list[CallRow] = [(*d, location.get(d.branch_id, default_shard)) for d in dispatches]
        shared = run.state.shared_results()
        if shared:
            calls = _share_large_results(run, shared, calls)
        self.totals["dispatched"] += len(calls)
        if len(calls) == 1 and len(run.state.running) == 1:
            # The run's only call in flight (a chain's every link): a plain call answers in
            # one message, where a stream costs its acknowledgement, item and end.
            single = self._drive_single(run, calls[0])
        else:
            single = None
            live = max(1, sum(self.workers.alive))
            per_worker = max(1, min(DISPATCH_BATCH, -(-len(calls) // live)))
            for start in range(0, len(calls), per_worker):
                self._spawn_task(run, self._drive_batch(run, calls[start:start + per_worker]))
        if run.options.want_events and run.undelivered_events >= run.options.stream_buffer and not run.state.held:
            self._spawn_task(run, self.feed(run, [DispatchHeld(now=time.time(), held=True)]))
        return single

    def _spawn_task(self, run: _Run, coroutine) -> asyncio.Task:
        """``coroutine`` as a task of the run's (cancelled when the run is forgotten)."""
        task = self.loop.create_task(coroutine)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
        return task

    def _ship(self, run: _Run, worker: Any) -> bytes | None:
        """The run's operations, pickled, for the first call ``worker`` is sent; None after that.

        They travel with that call. Workers used to be told to fetch them from here when the
        run was admitted; the fetch (a Ray call each way) ended after the run's first calls had
        arrived, and those waited for it: about 3 ms of a one-node run's path, and of a
        10,000-node fan-out's first call. A worker that misses them still fetches them (a
        call lost with its channel). Cloudpickle, as Ray would: an operation defined in the
        caller's script travels by value.
        """
        key = WorkerChannels.key(worker)
        if key in run.shipped_to:
            return None
        if run.shipped is None:
            run.shipped = cloudpickle.dumps(run.options.resources)
        run.shipped_to.add(key)
        return run.shipped

    async def _live_worker(self, run: _Run, calls: list[CallRow]) -> tuple[int, WorkerStub] | None:
        """A live worker for ``calls``; None (the calls failed, typed) when none can come back."""
        try:
            index, _ = await self.workers.live()
            return index, self.worker(index)
        except OpGraphError as exc:
            await self.feed(run, [OperationFinished(now=time.time(), node_id=call[0], attempt=call[1],
                                                    status="failed", error=exc.message, error_type=WORKER_DIED)
                                  for call in calls])
            return None

    async def _drive_single(self, run: _Run, call: CallRow) -> None:
        """One call, answered in one message. Should its worker die, nothing says whether the
        call had started, so it counts as in flight (WorkerDied: failed, or retried)."""
        chosen = await self._live_worker(run, [call])
        if chosen is None:
            return
        index, worker = chosen
        run.node_worker[call[0]] = index
        pending = {call[0]: call[1]}
        run.messages += 1
        try:
            channel = await self.channels.get(worker.handle, worker.name)
            shipped = self._ship(run, worker.handle)
            if channel is not None:
                rows = await channel.call_one(run.run_id, call, self.slot, shipped)
            else:
                rows = await worker.run_one(run.run_id, call, self.slot, shipped)
            await self._settle_rows(run, pending, rows)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an event for the kernel
            await self._batch_failed(run, index, worker, pending, exc, acknowledged=True)

    async def _drive_batch(self, run: _Run, calls: list[CallRow]) -> None:
        """Stream one batch's outcomes back as events.

        The stream's first item acknowledges that every call started. A worker that dies
        before it never ran the batch: its calls go back to the kernel as undelivered and
        run again elsewhere. One that dies after it fails (or retries) what is left.
        """
        chosen = await self._live_worker(run, calls)
        if chosen is None:
            return
        index, worker = chosen
        for call in calls:
            run.node_worker[call[0]] = index
        pending = {call[0]: call[1] for call in calls}  # node id -> attempt, until its outcome arrives
        run.messages += 1
        acknowledged = False
        try:
            channel = await self.channels.get(worker.handle, worker.name)
            shipped = self._ship(run, worker.handle)
            if channel is not None:
                stream = channel.stream(run.run_id, calls, self.slot, shipped)
            else:
                stream = _received(worker.run_batch(run.run_id, calls, self.slot, shipped))
            async for rows in stream:
                if not acknowledged:
                    acknowledged = True  # the first item: ACKNOWLEDGED
                    continue
                await self._settle_rows(run, pending, rows)
                if not pending:
                    break  # every outcome is in; the worker ends the stream later (workers.STREAM_LINGER_SECONDS)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an event for the kernel
            await self._batch_failed(run, index, worker, pending, exc, acknowledged=acknowledged)

    async def _batch_failed(self, run: _Run, index: int, worker: WorkerStub, pending: dict[str, int],
                            exc: BaseException, *, acknowledged: bool) -> None:
        """A call or stream to worker ``index`` failed: tell the kernel what that means for each call."""
        if not pending:
            return
        died = None
        if isinstance(exc, ChannelLost):  # the socket says nothing of why: ask Ray whether the worker lives
            answer = await ping(worker, PROBE_TIMEOUT_SECONDS)
            died = answer is not None and is_actor_death(answer)
        now = time.time()
        failure = call_failure(exc, worker.name, f"the operation (run {run.run_id})", died=died)
        if failure.died:
            if self.workers.mark_dead(index, worker.handle, f"while running run {run.run_id}"):
                self.worker_deaths += 1
            if not acknowledged:
                self.totals["undelivered"] += len(pending)
                await self.feed(run, [DispatchUndelivered(now, node_id, attempt,
                                                          f"worker {worker.name} was dead")
                                      for node_id, attempt in pending.items()])
                return
        await self.feed(run, [OperationFinished(now=now, node_id=node_id, attempt=attempt, status="failed",
                                                error=failure.text, error_type=failure.error_type)
                              for node_id, attempt in pending.items()])

    async def _settle_rows(self, run: _Run, pending: dict[str, int], rows: list[OutcomeRow]) -> None:
        """One worker message of outcome rows: observed, then fed to the run as events."""
        run.messages += 1
        histograms, node_worker = self.node_latency, run.node_worker
        for row in rows:
            pending.pop(row[0], None)
            node_worker.pop(row[0], None)  # a settled call is never cancelled; kept, this grew by a node each
            if row[5] == BRANCH_STORE_LOST:  # a worker met a dead store: have it noticed now
                self.stores.check(PROBE_TIMEOUT_SECONDS)
            histogram = histograms.get(row[2])
            if histogram is None:
                histogram = histograms[row[2]] = LatencyHistogram()
            histogram.observe(row[8] - row[7])
        await self.feed(run, [_finished_event(row) for row in rows])

    async def _conditions_evaluated(self, run: _Run, instruction: EvaluateConditions) -> None:
        edges = run.state.graph.edges
        results = []
        error = None
        try:
            for edge_id, result in instruction.edges:
                outcome = edges[edge_id].condition.apply({"result": result, "context": instruction.context})
                if asyncio.iscoroutine(outcome):
                    outcome = await outcome
                results.append((edge_id, bool(outcome)))
        except Exception as exc:  # noqa: BLE001 - user condition: becomes a failed node, typed
            error = f"{type(exc).__name__}: {exc}"
        await self.feed(run, [ConditionsEvaluated(now=time.time(), node_id=instruction.node_id,
                                                  results=tuple(results), error=error)])

    # -- supervision hooks ------------------------------------------------------------------------
    async def store_replaced(self, index: int, handle: Any) -> None:
        """A branch store was replaced: workers learn the new handle; its branches are lost."""
        name = self.stores.name_of(index)
        lost = await self.branches.store_replaced(index)
        for run in self.runs.values():
            if not run.state.finished:
                mine = [b for b in lost if b in run.state.branch.values() or b == run.options.default_branch_id]
                run.lost_branches.extend({"branch_id": b, "reason": f"branch store {name} died"} for b in mine)
        await asyncio.gather(*(self._update_worker_store(slot, index, handle, name)
                               for slot in self.worker_slots if self.workers.alive[slot.index]))

    async def _update_worker_store(self, slot: PoolSlot, index: int, handle: Any, name: str) -> None:
        worker = slot.stub()
        try:
            await ask(worker, WorkerStub.set_store, index, handle, name)
        except RuntimeLostError:  # a worker that cannot be told is taken for dead if it is
            self.workers.mark_dead(slot.index, worker.handle, "could not be told of a new branch store")
        except OpGraphError:
            self.tells.failures += 1


def _branch_work_done(task: asyncio.Task) -> None:
    """Its error is the flush's to raise (``_await_branch_work``); taken here as well, so a run
    that ends before any flush awaits it logs no "exception was never retrieved"."""
    if not task.cancelled():
        task.exception()


class _SetupBranch:
    """The branch handed to ``spawn_branch_setup``: writes are awaited before the child runs."""

    def __init__(self, branch_id: str, shard: int, registry: BranchRegistry, pending: list[Any],
                 run_id: str) -> None:
        self.id = branch_id
        self._shard = shard
        self._registry = registry
        self._pending = pending
        self._run_id = run_id

    def append(self, *messages: Any) -> None:
        self._pending.append(ask(self._registry.store(self._shard), BranchStoreStub.append, self.id, list(messages),
                                 os.urandom(8), run_id=self._run_id, branch_id=self.id))


def _share_large_results(run: _Run, shared: dict[str, Any], calls: list[CallRow]) -> list[CallRow]:
    """``calls`` with each large shared dependency result in a context replaced by a
    ``SharedResult``: a planner's 1,000 spawn requests went to each of its 1,000 children,
    pickled again for every message and unpickled again on the worker for each."""
    if len(shared) != len(run.shared_checked):
        for node_id, value in shared.items():
            if node_id not in run.shared_checked:
                run.shared_checked[node_id] = value
                if _pickled_size(value) >= SHARED_RESULT_BYTES:
                    run.shared_marks[id(value)] = node_id
    marks = run.shared_marks
    if not marks:
        return calls
    marked = []
    for call in calls:
        context = call[3].get("context")
        if context and any(id(value) in marks for value in context.values()):
            context = {key: SharedResult(marks[id(value)]) if id(value) in marks else value
                       for key, value in context.items()}
            call = (call[0], call[1], call[2], {**call[3], "context": context}, call[4], call[5])
        marked.append(call)
    return marked


def _pickled_size(value: Any) -> int:
    try:
        return len(pickle.dumps(value, protocol=5))
    except Exception:  # noqa: BLE001 - one that will not pickle travels as it is, and fails as it would
        return 0


def _flow_options(run_id: str, options: RunOptions) -> dict[str, Any]:
    """The FlowState options of a run, from what its Session decided."""
    return {
        "run_id": run_id, "context": options.context, "max_concurrent": options.max_concurrent,
        "parallel": options.parallel, "reactive": options.reactive, "max_spawn": options.max_spawn,
        "node_builder": options.node_builder, "spawn_type": options.spawn_type,
        "default_branch_id": options.default_branch_id, "clone_source_branch_id": options.clone_source_branch_id,
        "known_branches": set(options.known_branches), "reducers": options.reducers,
        "retry_policies": options.retry_policies, "durable": options.durable,
        "write_back": False,  # this graph is the executor's copy; the driver mirrors the envelope
        "progress_signals": options.want_signals,  # queued/started/spawned reach only signal subscribers
        "keep_open": options.keep_open,
    }
