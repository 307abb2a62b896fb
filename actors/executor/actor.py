"""GraphExecutor: the actor that owns runs and supervises the workers and stores they use.

Owns the remote surface, the watcher registry and the supervision of its actor pools;
the data path (instructions out, outcomes in) is the shell's, in actors/executor/shell.py. All
state changes happen on the actor's main event loop, one ``handle`` call at a time, so
admission is atomic without a lock. Control calls (pause, inject, cancel, status...)
arrive on their own concurrency group and are marshalled onto that loop, so they stay
responsive while the data path is saturated. Watchers (other client processes that
attached to a run by id) get their own bounded queues and never hold up the run.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray

from opgraph.kernel import (
    CancelRequested,
    CloseRequested,
    DispatchHeld,
    ExecutionError,
    FlowEvent,
    InjectRequested,
    OperatorMessageReceived,
    OpGraphError,
    PauseRequested,
    ReleaseRequested,
    ResumeRequested,
    admitted_operation,
)

from ..branches.store import BranchStore
from ..calls import ActorStub, WorkerStub, ask, start
from ..errors import RuntimeLostError, UnknownRunError
from ..persistence import RunLog, Writer
from ..protocol import AdmittedRow, CallRow, Outcome, RunOptions, RunResources
from ..settings import (
    PROBE_INTERVAL_SECONDS,
    PROBE_TIMEOUT_SECONDS,
    WORKER_CONCURRENCY,
    ActorNames,
    names_in,
    newest_generation,
    tune_garbage_collector,
)
from ..statistics import LATENCY_BUCKETS, LatencyHistogram, current_rss_mib, peak_rss_mib
from ..workers.supervision import REPLACEMENT_ATTEMPTS, ActorPool
from ..workers.turns import run_turn
from ..workers.worker import OperationWorker
from .durability import RunLogger
from .shell import ExecutorShell, _Run
from .watchers import (
    WATCHER_IDLE_SECONDS,
    RunWatcher,
    UnknownWatcherError,
    envelope_summary,
)

__all__ = [
    "LATENCY_BUCKETS",
    "GraphExecutor",
    "LatencyHistogram",
    "RunOptions",
    "UnknownRunError",
    "UnknownWatcherError",
    "envelope_summary",
    "tune_garbage_collector",
]


@ray.remote(concurrency_groups={"control": 32})
class GraphExecutor:
    """One executor hosts many runs; it is long-lived and never started per node.

    It starts (or, on a detached runtime, adopts) its workers and branch stores and
    supervises them: a dead one is replaced under the next generation's name.

    ``standby``: started beside the executor of a durable owned runtime, under the next
    generation's name, and idle until that executor dies: then ``start()`` promotes it
    (it adopts the newest workers and stores, and recovers the runs), so a replacement
    costs no process start. Ideal over retrospective: the records' executor lives in
    its caller's process; here it is a process of its own, and one kept warm.

    ``member``: this executor's place in the runtime's pool of executors. Every member
    owns the runs admitted to it (the run log names them by the member's first name, so
    a member's replacement recovers that member's runs and no other's), and all members
    share, and each supervises, the same workers and branch stores.
    """

    def __init__(self, names: ActorNames, workers: int = 2, branch_stores: int = 1, detached: bool = False,
                 namespace: str | None = None, generation: int = 0, database: str | None = None,
                 standby: bool = False, member: int = 0) -> None:
        tune_garbage_collector()
        # When this executor came up and recovered (wall clock): how long a replacement took.
        self.timeline: dict[str, float] = {"created": time.time()}
        self.names = names
        self.member = member
        self.base_name = names.executor_member(member)  # what the run log knows this member's runs by
        self.name = names.executor_of(generation, member)
        # The runtime's database (None: nothing is durable): the run log and durable branches.
        self.database = database
        self.run_log = RunLog(database) if database else None
        self.detached = detached
        self.namespace = namespace
        self.self_handle = ray.get_runtime_context().current_actor
        existing = names_in(namespace or ray.get_runtime_context().namespace)
        stores, store_names, store_generations = self._adopt_or_start(
            branch_stores, names.store, self._start_store, existing)
        self.store_pool = ActorPool("branch store", stores, store_names, start=self._start_store,
                                    on_replaced=self._store_replaced, newest=self._newest_of(names.store))
        self.store_pool.generations = store_generations
        workers_found, worker_names, worker_generations = self._adopt_or_start(
            workers, names.worker, self._start_worker, existing)
        self.worker_pool = ActorPool("operation worker", workers_found, worker_names, start=self._start_worker,
                                     setup=self._setup_worker, newest=self._newest_of(names.worker))
        self.worker_pool.generations = worker_generations
        # Every data-path method lives on the shell: Ray's tracing shim wraps only this class.
        logger = RunLogger(self.run_log, Writer("opgraph-run-log"), self.base_name) if self.run_log else None
        self.shell = ExecutorShell(self.worker_pool, self.store_pool, logger, slot=member)
        self.recovered: list[str] = []
        self.recovery_errors: dict[str, str] = {}
        self.next_token = 0
        self.watchers: dict[str, RunWatcher] = {}  # watcher id -> watcher; outlives forget_run
        self.probing = False
        self.probes = 0
        self._promotion: asyncio.Future | None = None  # a standby's adoption of the newest workers and stores
        self._recovery: asyncio.Future | None = None  # the rebuilding of the runs a predecessor left
        self.standby = standby
        if standby:  # open the connections now, so that promotion finds them ready (no answer needed)
            for handle in [*self.worker_pool.handles, *self.store_pool.handles]:
                ActorStub(handle).ping()

    # -- the actors it supervises ------------------------------------------------------
    def _adopt_or_start(self, count: int, name_of, start, existing: set[str]) -> tuple[list, list, list]:
        """Adopt the newest generation of each actor there is (the driver started an owned runtime's
        first ones; a former executor may have left newer ones), else start one.

        An adopted actor may be dead (one a former executor owned died with it): the probe
        finds out within a second and it is replaced like any other."""
        handles, names, generations = [], [], []
        for index in range(count):
            found = newest_generation(existing, name_of(index))
            generation, handle = 0, None
            if found is not None:
                generation = found[1]
                try:
                    handle = ray.get_actor(found[0], namespace=self.namespace)
                except ValueError:  # gone since it was listed
                    generation += 1
            for _ in range(REPLACEMENT_ATTEMPTS):
                if handle is not None:
                    break
                try:
                    handle = start(index, generation)
                except ValueError:  # the name is still held by a dead actor: the next generation's
                    generation += 1
            else:
                if handle is None:
                    raise RuntimeLostError(f"could not start {name_of(index)}: every name was taken",
                                           actor=self.name)
            handles.append(handle)
            names.append(name_of(index, generation))
            generations.append(generation)
        return handles, names, generations

    def _lifetime(self) -> str | None:
        return "detached" if self.detached else None

    # A name that exists is taken as it is (get_if_exists): another executor of the pool may
    # have started that generation already. One that turns out dead fails its setup, and
    # the next generation is tried.
    def _start_store(self, index: int, generation: int) -> Any:
        options = {"name": self.names.store(index, generation), "namespace": self.namespace, "get_if_exists": True,
                   "lifetime": self._lifetime()}
        return start(BranchStore, options, index, self.database, self.names.owner(self.namespace))

    def _start_worker(self, index: int, generation: int) -> Any:
        stores = getattr(self, "store_pool", None)
        name = self.names.worker(index, generation)
        options = {"name": name, "namespace": self.namespace, "get_if_exists": True,
                   "max_concurrency": WORKER_CONCURRENCY, "lifetime": self._lifetime()}
        return start(OperationWorker, options, index, list(stores.handles) if stores else [],
                     list(stores.names) if stores else [], self.self_handle, name, self.member)

    async def _setup_worker(self, index: int, handle: Any) -> None:
        """A replacement worker (started here, or by another executor of the pool) learns this
        executor's slot before it gets work from it."""
        await WorkerStub(handle, self.worker_pool.names[index]).set_executor(self.self_handle, self.member)

    def _newest_of(self, name_of):
        def newest(index: int) -> int | None:
            found = newest_generation(names_in(self.namespace or ray.get_runtime_context().namespace),
                                      name_of(index))
            return None if found is None else found[1]
        return newest

    async def _store_replaced(self, index: int, handle: Any) -> None:
        await self.shell.store_replaced(index, handle)

    async def start(self) -> dict[str, Any]:
        """Bind the main loop, start the liveness probe and recover the runs a predecessor left.

        Called by whoever starts or finds this executor, so that an idle runtime's deaths
        are noticed too, not only those met by a call. Every run the run log shows live
        on this runtime's executor (one that died) is rebuilt and goes on here. Returns
        the runtime's actor names.
        """
        if self.standby:
            self.standby = False
            self._promotion = asyncio.ensure_future(asyncio.to_thread(self._adopt_newest))
        if self._promotion is not None:
            await asyncio.shield(self._promotion)
            self.timeline.setdefault("promoted", time.time())
        self._bind()
        await self._introduce_to_workers()
        self.timeline.setdefault("started", time.time())
        if self.run_log is not None:
            # One recovery, which every caller waits for: two callers that met the same death
            # (a fed run's admission and its poll) both start the replacement, and the second
            # must not be answered while the first is still rebuilding the run (its admissions
            # were refused as `not_running`, seen at 100,000 rows with a long log to read).
            if self._recovery is None:
                self._recovery = asyncio.ensure_future(self._recover_live_runs())
            await asyncio.shield(self._recovery)
            self.timeline.setdefault("recovered", time.time())
        return await self.pool()

    def _adopt_newest(self) -> None:
        """A standby promoted: the executor it stood by for may have replaced workers or
        stores since; take the newest generation of each."""
        existing = names_in(self.namespace or ray.get_runtime_context().namespace)
        for pool, name_of in ((self.store_pool, self.names.store), (self.worker_pool, self.names.worker)):
            for index in range(len(pool.handles)):
                found = newest_generation(existing, name_of(index))
                if found is None or found[1] <= pool.generations[index]:
                    continue
                try:
                    pool.handles[index] = ray.get_actor(found[0], namespace=self.namespace)
                except ValueError:  # gone since listed: the probe replaces it
                    continue
                pool.names[index], pool.generations[index], pool.alive[index] = found[0], found[1], True

    async def _recover_live_runs(self) -> None:
        writer = self.shell.logger.writer
        await writer.run(self.shell.branches.load_locations, self.run_log.database,
                         self.names.owner(self.namespace))
        live = await writer.run(lambda: self.run_log.runs(status="live", executor=self.base_name))
        for entry in live:
            if entry.run_id in self.shell.runs:
                continue
            await self.resume_run(entry.run_id)

    async def resume_run(self, run_id: str, overrides: dict[str, Any] | None = None) -> bool:
        """Rebuild ``run_id`` from the run log and go on with it here (it must not be live elsewhere).

        False, with the reason in ``recovery_errors``, when it cannot be rebuilt (its header no
        longer unpickles: code that changed since; or a row fails the run log's integrity
        check, ``RunLogIntegrityError``, and nothing of it was read).
        """
        self._bind()
        if self.run_log is None:
            raise UnknownRunError("this runtime keeps no run log (it is not durable)", run_id=run_id, actor=self.name)
        if run_id in self.shell.runs:
            return True
        try:
            logged = await self.shell.logger.writer.run(self.run_log.load, run_id)
            if logged is None:
                raise UnknownRunError(f"run {run_id} is not in the run log", run_id=run_id, actor=self.name)
            await self.shell.recover_run(run_id, logged.header, logged.batches, overrides)
        except UnknownRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, and the run is marked so in the log
            reason = f"{type(exc).__name__}: {exc}"
            self.recovery_errors[run_id] = reason
            await self.shell.logger.writer.run(self.run_log.finish, run_id, "error", None,
                                               f"could not be recovered: {reason}")
            return False
        self.recovered.append(run_id)
        return True

    async def _introduce_to_workers(self) -> None:
        """Adopted workers learn who fetches their resources and takes their emissions: this executor."""
        pool = self.worker_pool

        async def introduce(index: int) -> None:
            worker = self.shell.worker(index)
            try:
                await ask(worker, WorkerStub.set_executor, self.self_handle, self.member)
            except RuntimeLostError:  # an adopted worker that is gone: replaced like any dead one
                pool.mark_dead(index, worker.handle, "found dead when adopted")
            except OpGraphError:  # alive, but it could not be told: counted, as a failed tell is
                self.shell.tells.failures += 1

        await asyncio.gather(*(introduce(index) for index in range(len(pool)) if pool.alive[index]))

    def _bind(self) -> None:
        self.shell.bind_loop()
        if not self.probing:
            self.probing = True
            self.shell.loop.call_later(PROBE_INTERVAL_SECONDS, self._probe_soon)

    def _probe_soon(self) -> None:
        # A timer chain (see ExecutorShell._probe_lag); each probe is one short task.
        task = self.shell.loop.create_task(self._probe())
        self.shell.told.add(task)
        task.add_done_callback(self.shell.told.discard)

    async def _probe(self) -> None:
        try:
            await asyncio.gather(self.worker_pool.probe(PROBE_TIMEOUT_SECONDS),
                                 self.store_pool.probe(PROBE_TIMEOUT_SECONDS))
            self.probes += 1
        finally:
            self.shell.loop.call_later(PROBE_INTERVAL_SECONDS, self._probe_soon)

    async def pool(self) -> dict[str, Any]:
        """The live handles and names of this executor's workers and stores."""
        return {"executor": self.name, "workers": list(self.worker_pool.handles),
                "worker_names": list(self.worker_pool.names), "stores": list(self.store_pool.handles),
                "store_names": list(self.store_pool.names)}

    # -- data path (main loop) ------------------------------------------------
    async def start_run(self, run_id: str, graph: Any, options: RunOptions) -> str:
        """Validate and start a run; raise the kernel's typed error for a bad graph."""
        self._bind()
        await self.shell.start_run(run_id, graph, options)
        return run_id

    async def resources(self, key: str) -> RunResources:
        """A run's (or a Session's turn key's) operations, providers and settings, for a worker
        that lacks them: a run's come with its first call to each worker (``ExecutorShell._ship``)."""
        resources = self.shell.resources.get(key)
        if resources is None:
            raise UnknownRunError(f"nothing registered under {key!r} on {self.name}", run_id=key, actor=self.name)
        return resources

    async def shared_result(self, run_id: str, node_id: str) -> Any:
        """The settled result of ``node_id`` as its dependents' contexts hold it, for a worker
        that was sent a ``SharedResult`` in its place."""
        run = self._run(run_id)
        try:
            return run.state.dependency_result(node_id)
        except KeyError:
            raise ExecutionError(f"node {node_id} of run {run_id} has no settled result on {self.name}",
                                 run_id=run_id, node_id=node_id, actor=self.name) from None

    async def register_resources(self, key: str, resources: RunResources | None) -> None:
        """What a Session's turns run with (``Session.turn``), under ``key``; None removes it."""
        self._bind()
        self.shell.release_resources(key)
        if resources is not None:
            self.shell.resources[key] = resources

    async def turn(self, key: str, call: CallRow) -> tuple[Any, dict[str, Any], int]:
        """Run one call on a live worker (``Session.turn``): (outcome row, usage, attempt)."""
        self._bind()
        return await run_turn(self.shell, key, call)

    async def cancel_turn(self, key: str, node_id: str) -> bool:
        for index in range(len(self.worker_pool)):
            if self.worker_pool.alive[index]:
                self.shell.worker(index).cancel(key, [node_id])
        return True

    async def live_store(self, index: int, dead_name: str) -> tuple[Any, str]:
        """A worker found store ``dead_name`` dead: the live store of that slot, once it is replaced."""
        pool = self.store_pool
        if pool.names[index] == dead_name and pool.alive[index]:
            pool.check(PROBE_TIMEOUT_SECONDS)  # see for ourselves: the worker may be wrong
        await pool.settled()  # a replacement is done once what it lost is known (and recreated)
        chosen, handle = await pool.live(index)
        return handle, pool.names[chosen]

    async def report(self, run_id: str, outcomes: list[Outcome]) -> None:
        """Outcomes pushed by a worker outside a batch stream (kept for external workers)."""
        await self.shell.report(run_id, outcomes)

    async def receive_requests(self, run_id: str, items: list[tuple[str, str, Any, Any]]) -> None:
        """Spawns and escalations sent live by running operations (a tell, one per worker
        window, or one per request emitted off its worker's loop): ``(emitter_id, kind,
        request, dedupe key)`` each, in emission order."""
        await self.shell.receive_requests(run_id, items)

    async def next_events(self, run_id: str, max_items: int = 2048, timeout: float = 5.0,
                          compact: bool = False) -> tuple[list, bool, Any]:
        """Long-poll for the driver: (items, done, envelope-or-error). ``compact``: the envelope
        comes as a ``CompactEnvelope``, for a driver that holds the submitted graph."""
        run = self._run(run_id)
        if not run.outbox and not run.done.is_set():
            run.wakeup.clear()
            try:
                await asyncio.wait_for(run.wakeup.wait(), timeout)
            except TimeoutError:
                pass  # nothing new within the poll window: the driver polls again
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
            if run.error is not None:
                result = run.error
            else:
                result = self.shell.compact_result(run) if compact else run.envelope
        return items, done, result

    async def forget_run(self, run_id: str) -> bool:
        """Forget a run its driver has drained; returns once the log records how it ended."""
        run = self.shell.runs.get(run_id)
        if run is not None and run.ending is not None:
            await asyncio.shield(run.ending)
        return self.shell.forget_run(run_id)

    async def wait_result(self, run_id: str, timeout: float = 30.0) -> tuple[bool, Any]:
        """Long-poll for a run's end: (done, envelope-or-error); (False, None) while it goes on."""
        run = self._run(run_id)
        if not run.done.is_set():
            waiter = self.shell.loop.create_future()
            run.result_waiters.append(waiter)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except TimeoutError:
                return False, None
        return True, run.error if run.error is not None else run.envelope

    # -- branches (main loop) ----------------------------------------------------------
    async def create_branch(self, branch_id: str, messages: list[Any], scope: str | None = None) -> int:
        self._bind()
        return await self.shell.branches.create(branch_id, messages, scope)

    async def branch_messages(self, branch_id: str) -> list[Any]:
        self._bind()
        return await self.shell.branches.messages(branch_id)

    async def branch_histories(self, branch_ids: list[str]) -> list[tuple[list[str], Any]]:
        """The messages of the branches of ``branch_ids`` this member holds (others left out), per
        store shard as the records they share (``BranchRegistry.histories``)."""
        self._bind()
        return await self.shell.branches.histories(branch_ids)

    async def drop_scope(self, scope: str) -> int:
        """Drop every branch of ``scope`` (a Session's, or a run's) and of the scopes it holds."""
        self._bind()
        for run in self.shell.runs.values():
            if run.options.branch_scope == scope and not run.done.is_set():
                run.options.branch_scope = None  # still running: its later clones belong to nobody
        return await self.shell.branches.drop_scope(scope)

    async def next_watch_events(self, watcher_id: str, max_items: int = 2048,
                                timeout: float = 5.0) -> tuple[list[FlowEvent], int, dict[str, Any] | None]:
        """Long-poll for a watcher: (events, dropped since last poll, summary once the run ended).

        A watcher is removed once it has been handed its summary with nothing left queued.
        """
        watcher = self.watchers.get(watcher_id)
        if watcher is None:
            raise UnknownWatcherError(f"watcher {watcher_id} is not known to this executor", actor=self.name)
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

    # -- a fed run (``FedRun``): its feeder admits in batches and releases what it recorded --------
    @ray.method(concurrency_group="control")
    async def admit_many(self, run_id: str, rows: list[AdmittedRow]) -> list[tuple[bool, str | None]]:
        """Admit the operations ``rows`` describe (protocol ``AdmittedRow``) into a reactive run, each
        independent, in one scheduler step; answer once their admission is durable: per row,
        (accepted, why not). One already in the run is refused as ``duplicate``: its feeder sent
        it before."""
        return await self._on_main(self._admit_many(run_id, rows))

    @ray.method(concurrency_group="control")
    async def release_nodes(self, run_id: str, node_ids: list[str]) -> int:
        """Let the run forget settled nodes whose outcomes its feeder recorded; returns how many went."""
        return await self._on_main(self._release(run_id, node_ids))

    @ray.method(concurrency_group="control")
    async def close_run(self, run_id: str) -> bool:
        """A run kept open takes no more admissions: it ends once nothing is open or in flight."""
        return await self._on_main(self._control(run_id, CloseRequested(now=time.time())))

    @ray.method(concurrency_group="control")
    async def held(self, run_id: str) -> tuple[list, list]:
        """What a feeder that lost track reconciles with: (settled nodes not yet released, as (id,
        status, result, metadata); open nodes, as (id, metadata))."""
        return await self._on_main(self._held(run_id))

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
    @ray.method(concurrency_group="control")
    async def is_standby(self) -> bool:
        """True for a spare executor not yet promoted: it runs nothing and supervises nothing."""
        return self.standby

    async def run_durability(self, run_id: str) -> bool | None:
        """None when this executor does not hold ``run_id``; else whether the run is durable (logged,
        so a replacement would rebuild it should this executor die)."""
        run = self.shell.runs.get(run_id)
        return None if run is None else bool(run.options.durable)

    async def load(self, exclude: list[str] | tuple[str, ...] = ()) -> tuple[int, int]:
        """(live runs, their nodes not yet settled): what placing a new run on this member weighs;
        runs in ``exclude`` (the asking client's admissions in flight, which it counts itself) aside.

        On the main loop, like the data path, so it reads the runs between two ``handle``
        calls; the cost is one pass over the live runs, not their graphs."""
        skip = set(exclude)
        live = [run.state for run_id, run in self.shell.runs.items() if not run.state.finished and run_id not in skip]
        return len(live), sum(state.open_nodes for state in live)

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
            raise UnknownRunError("this executor has not started any run", actor=self.name)
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
        return (await waiter).accepted

    async def _admit_many(self, run_id: str, rows: list[AdmittedRow]) -> list[tuple[bool, str | None]]:
        run = self.shell.runs.get(run_id)
        if run is None or run.state.finished or not run.state.reactive:
            return [(False, "not_running")] * len(rows)
        now, loop, events, waiters = time.time(), self.shell.loop, [], []
        for node_id, operation, parameters, metadata in rows:
            self.next_token += 1
            waiter = run.inject_waiters[self.next_token] = loop.create_future()
            waiters.append(waiter)
            events.append(InjectRequested(now=now, operation=admitted_operation(node_id, operation, parameters,
                                                                                metadata),
                                          independent=True, token=self.next_token))
        decided = await self.shell.admit_many(run, waiters, events)
        return [(decision.accepted, decision.reason) for decision in decided]

    async def _release(self, run_id: str, node_ids: list[str]) -> int:
        run = self.shell.runs.get(run_id)
        if run is None or run.state.finished:
            return 0
        before = run.state.counters["released"]
        await self.shell.feed(run, [ReleaseRequested(now=time.time(), node_ids=tuple(node_ids))])
        return run.state.counters["released"] - before

    async def _held(self, run_id: str) -> tuple[list, list]:
        state = self._run(run_id).state
        return state.settled_outcomes(), state.open_admissions()

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
        stats["executor"] = self.name
        return stats

    async def _statistics(self) -> dict[str, Any]:
        shell = self.shell
        runs = {}
        for run_id, run in shell.runs.items():
            runs[run_id] = run.state.statistics()
            shell.harvest(run, runs[run_id])
        return {
            "name": self.name,
            "member": self.member,
            "pid": os.getpid(),
            "active_runs": sum(1 for r in shell.runs.values() if not r.state.finished),
            "in_flight": sum(len(r.state.running) for r in shell.runs.values() if not r.state.finished),
            "queued": sum(len(r.state.ready) for r in shell.runs.values() if not r.state.finished),
            "loop_lag_seconds": shell.loop_lag,
            "worker_deaths": shell.worker_deaths,
            "workers": len(self.worker_pool),
            "worker_pool": self.worker_pool.statistics(),
            "channels": shell.channels.statistics(),
            "store_pool": self.store_pool.statistics(),
            "branches": shell.branches.statistics(),
            "probes": self.probes,
            "durable": self.run_log is not None,
            "recovered_runs": list(self.recovered),
            "timeline": dict(self.timeline),
            "standby": self.standby,
            "recovery_errors": dict(self.recovery_errors),
            "run_log": self.shell.logger.statistics() if self.shell.logger else None,
            "tell_failures": shell.tell_failures,
            "max_rss_mib": peak_rss_mib(),
            "rss_mib": current_rss_mib(),
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
            raise UnknownRunError(f"run {run_id} is unknown or already finished on {self.name}",
                                  run_id=run_id, actor=self.name)
        return run

