"""OperationWorker: a pool actor that runs registered operations against branches.

Owns the operation boundary. A worker reads the branch, awaits the registered
operation with its prepared parameters, records the turn, and streams typed outcomes
back in batches. It never raises for an operation failure: an exception becomes a
``failed`` outcome with its type and text, and an outcome that cannot be sent (an
unpicklable result) fails only its own node.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import ray
from ray import cloudpickle

from opgraph.kernel import (
    EscalationRequest,
    ExecutionError,
    SpawnRequest,
    request_sightings,
    to_mapping,
)
from opgraph.kernel.contracts import PLAIN_TYPES, UnpicklableRequest
from opgraph.kernel.failures import (
    BRANCH_STORE_LOST,
    CANCELLED,
    NOT_REGISTERED,
    OPERATION_TIMEOUT,
    UNSERIALISABLE_OUTCOME,
)

from ..calls import BranchStoreStub, ExecutorStub, Tells, WorkerStore, ask
from ..errors import BranchStoreLostError, clean_text
from ..models import parse_model_id
from ..protocol import ACKNOWLEDGED, CallRow, OutcomeRow, RunResources, SharedResult
from ..settings import direct_calls, tune_garbage_collector
from ..statistics import current_rss_mib, peak_rss_mib
from .branch_calls import BranchCalls
from .channel import ChannelServer, WorkerChannels
from .usage import CallUsage, open_usage

__all__ = ["LiveEmissions", "OperationWorker", "RemoteBranch"]


# Seconds outcomes wait to be sent together. 0: one turn of the loop, which gathers the calls
# that ended together. Against 1 ms (bench.setting, both windows, 3 rounds): fan-out 50 ms
# 0.97x, aggregation 0.95x the time, spawns 1.01x; fan-out 0 ms 1.06x (more, smaller messages).
OUTCOME_WINDOW = 0.0
EMISSION_WINDOW = 0.001  # seconds live emissions wait to be sent together (LiveEmissions)
OUTCOME_BATCH = 256  # outcomes per streamed message
# Seconds a stream stays open after its last outcome. Ray reports a stream's end to its
# consumer; when the consumer (an executor) has just died, that report holds the worker's
# event loop for about a second per burst of streams ending (seen: every worker stalled
# 1-2 s after an executor's death, and with it every run). Its outcomes all arrived, so
# the executor stops reading at once; the stream ends once a dead one is long known dead.
STREAM_LINGER_SECONDS = 10.0
FORGOTTEN_KEPT = 1024  # run keys a worker remembers having forgotten (see OperationWorker._take)


class RemoteBranch:
    """The branch handle an operation receives: reads and writes go to the BranchStore.

    ``emit(request)`` sends a SpawnRequest or EscalationRequest to the executor while the
    operation is still running (the record's bus delivery). ``idempotency_key`` is
    ``(run_id, node_id, attempt)``: the same for one attempt wherever it runs, new for a
    retry, so an operation with outside effects can make them once per attempt.
    """

    def __init__(self, branch_id: str | None, worker: OperationWorker, store_index: int, run_id: str,
                 node_id: str, attempt: int, executor: ExecutorStub | None, emitted: list[tuple[str, Any, Any, bool]],
                 identities: dict[int, Any], run: RunResources | None = None) -> None:
        self.id = branch_id
        self._worker = worker
        self._store_index = store_index
        self._store: WorkerStore | None = None  # where its store calls go, made on the first
        self.run_id = run_id
        self.node_id = node_id
        self.attempt = attempt
        self._executor = executor  # the run's own executor (a pool member): its emissions go there
        self._emitted = emitted
        self._identities = identities
        self._run = run or RunResources()

    @property
    def idempotency_key(self) -> tuple[str, str, int]:
        return (self.run_id, self.node_id, self.attempt)

    @property
    def default_model(self) -> str | None:
        """The run's default ``provider/model`` (Session(default_model=...))."""
        return self._run.settings.get("default_model")

    def provider_for(self, model: str) -> Any:
        """The ModelProvider serving ``model``: one registered on the Session, else a built-in."""
        provider_name, _ = parse_model_id(model)
        registered = self._run.providers.get(model) or self._run.providers.get(provider_name)
        if registered is not None:
            return registered
        from ..providers import builtin_provider  # local: providers import httpx lazily

        return builtin_provider(provider_name)

    async def messages(self) -> list[Any]:
        if self.id is None:
            return []
        # Through the worker's BranchCalls: the reads and appends of the operations running here go
        # to their store together, a message per turn of the loop rather than a round trip each.
        return await self._worker.branch_calls.messages(self._store_target(), self.run_id, self.node_id, self.id)

    async def append(self, *messages: Any) -> int:
        if self.id is None:
            return 0
        # One token for this append, kept if it is sent again to a replaced store: an append
        # the dead store had written before it could answer is not made twice.
        return await self._worker.branch_calls.append(self._store_target(), self.run_id, self.node_id, self.id,
                                                      list(messages), os.urandom(8))

    def _store_target(self) -> WorkerStore:
        """Where this branch's store calls go. Should the store be dead, a call waits for its
        replacement (the executor starts it) and is made once more there: a durable store comes
        back with every branch, so the operation never notices; a volatile one comes back
        without, and that is a typed failure of this node (BranchStoreLostError)."""
        if self._store is None:
            self._store = WorkerStore(self._worker, self._store_index, self._executor)
        return self._store

    def emit(self, request: SpawnRequest | EscalationRequest) -> None:
        kind = "escalation" if isinstance(request, EscalationRequest) else "spawn"
        key = self._identities.get(id(request))
        if key is None:
            # The object stays alive in ``emitted``, so its id cannot be reused meanwhile.
            key = self._identities[id(request)] = (self.node_id, self.attempt, len(self._identities))
        # Redelivered with the outcome as well, so a late live message can never lose it.
        self._emitted.append((kind, request, key, True))
        if self._executor is None:
            return
        item = (self.node_id, kind, request, key)
        if not self._worker.live.add(self.run_id, self._executor, item):
            send_requests(self._executor, self.run_id, [item])


def send_requests(executor: ExecutorStub, run_id: str, items: list[tuple[str, str, Any, Any]]) -> None:
    """Tell ``executor`` the requests ``items`` (emitter, kind, request, key) emitted live.

    Ray pickles the batch as it sends it; should a request in it not pickle, each one that does
    not goes as an ``UnpicklableRequest`` under its own key instead, which the executor records
    as a dropped spawn. The emitter's outcome carries the same stand-in, and its worker prints
    the one line that says so (``_shippable``); Ray's own report was 60 lines of traceback.
    """
    try:
        executor.receive_requests(run_id, items)
    except TypeError:  # Ray's "Could not serialize the argument": raised before anything is sent
        executor.receive_requests(run_id, [(emitter, kind, _stand_in(request) or request, key)
                                           for emitter, kind, request, key in items])


class LiveEmissions:
    """What a worker's operations emit while running, sent to each run's executor in one
    message per ``EMISSION_WINDOW``.

    One tell per request cost a Ray call and an admission pass each: an operation that
    emits 1,000 spawns in a loop sent 1,000 messages. Gathered, they travel as one list
    (``GraphExecutor.receive_requests``), in emission order.
    """

    def __init__(self, worker: OperationWorker) -> None:
        self._worker = worker
        self._pending: dict[str, tuple[Any, list[tuple[str, str, Any, Any]]]] = {}
        self.withdrawn = 0  # requests not sent live, since their emitter's outcome carried them

    def add(self, run_id: str, executor: ExecutorStub, item: tuple[str, str, Any, Any]) -> bool:
        """Queue ``(emitter_id, kind, request, key)``; False off the worker's event loop
        (an operation emitting from a thread), where the caller sends it at once instead."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        entry = self._pending.get(run_id)
        if entry is None:
            entry = self._pending[run_id] = (executor, [])
            loop.call_later(EMISSION_WINDOW, self._send, run_id)
        entry[1].append(item)
        return True

    def _send(self, run_id: str) -> None:
        executor, items = self._pending.pop(run_id)
        if items:
            send_requests(executor, run_id, items)

    def withdraw(self, run_id: str, node_id: str, attempt: int) -> None:
        """Take back what one call emitted and is not sent yet: the call has ended, and its
        outcome carries every request it emitted anyway. Sent live as well, each arrived
        twice, and the second copy cost a pass through admission only to be dropped; an
        operation that emits and returns at once (a planner fanning out) paid that for all."""
        entry = self._pending.get(run_id)
        if entry is not None:
            items = entry[1]
            kept = [item for item in items if item[0] != node_id or item[3][1] != attempt]
            self.withdrawn += len(items) - len(kept)
            items[:] = kept


async def _once(fetching: dict[Any, asyncio.Future], key: Any, fetch: Callable[[], Any]) -> Any:
    """``fetch()``'s answer, asked for once while it is out: callers meanwhile share it (and
    one caller cancelled does not cancel it for the others). ``fetch`` removes its key when done."""
    future = fetching.get(key)
    if future is None:
        future = fetching[key] = asyncio.ensure_future(fetch())
    return await asyncio.shield(future)


def _start_call(worker: OperationWorker, run_id: str, call: CallRow, resources: RunResources,
                usage: dict[str, Any] | None = None, slot: int = 0) -> asyncio.Task:
    """The call's task, registered for ``cancel``; cancelled at once if its cancel came first.

    A function, not a method, like ``_execute``: Ray wraps every method of an actor class
    in a tracing shim, and this runs once per call. The loop's ``create_task`` is what
    ``asyncio.ensure_future`` ends in for a coroutine, without its checks on the way.
    """
    task = asyncio.get_running_loop().create_task(_execute(worker, run_id, call, resources, usage=usage,
                                                           executor=worker.executors.get(slot)))
    worker.tasks[(run_id, call[0])] = task
    early = worker.cancelled_early.get(run_id)
    if early and call[0] in early:
        early.discard(call[0])
        task.cancel()
    return task


def _answer_one(tasks: dict[tuple[str, str], asyncio.Task], run_id: str, call: CallRow,
                answer: Callable[[Any], None], task: asyncio.Task) -> None:
    """``start_one``'s call ended: its outcome rows (or the worker's own exception) to ``answer``."""
    tasks.pop((run_id, call[0]), None)
    if task.cancelled():
        now = time.time()
        answer([(call[0], call[1], "cancelled", None, "cancelled", CANCELLED, [], now, now)])
        return
    error = task.exception()
    answer(error if error is not None else [task.result()])


def _collect(done: list[OutcomeRow], wake: asyncio.Event, call: CallRow, task: asyncio.Task) -> None:
    """A call's task finished: queue its outcome row (a task cancelled before it ran yields one too)."""
    if task.cancelled():
        now = time.time()
        done.append((call[0], call[1], "cancelled", None, "cancelled", CANCELLED, [], now, now))
    else:
        done.append(task.result())
    wake.set()


async def _settled(task: asyncio.Task, call: CallRow) -> OutcomeRow:
    """A call task's outcome row, also when it was cancelled before it started running."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():
            raise  # the worker itself is being cancelled, not the call
        now = time.time()
        return (call[0], call[1], "cancelled", None, "cancelled", CANCELLED, [], now, now)


def _turn_text(response: Any) -> Any:
    """The response as branch-message content: plain data, never a live object."""
    content = to_mapping(response)
    if isinstance(content, (str, int, float, bool, dict, list)) or content is None:
        return content
    return repr(content)


@ray.remote
class OperationWorker:
    """An async actor; thousands of I/O-bound operations share its event loop.

    Every executor of the runtime's pool uses it (and supervises it). A call carries the
    pool slot of the executor that owns its run: a run's resources (its operations,
    providers, settings) come with its first call here, or else are fetched from that
    executor, and the run's live emissions go there. ``executor`` is slot ``slot``'s handle
    when the worker is started by it.
    """

    def __init__(self, index: int = 0, stores: list[Any] | None = None, store_names: list[str] | None = None,
                 executor: Any = None, name: str = "", slot: int = 0) -> None:
        tune_garbage_collector()
        self.index = index
        self.name = name or f"opgraph-worker-{index}"
        # Messages sent without waiting (live emissions to an executor): watched, and counted should
        # one fail (the outcome carries what it carried). Its loop is the actor's, for emissions
        # sent from an operation's own thread.
        self.tells = Tells()
        names = list(store_names or [f"opgraph-branches-{i}" for i in range(len(stores or []))])
        self.stores: list[BranchStoreStub | None] = [BranchStoreStub(store, name)
                                                     for store, name in zip(stores or [], names, strict=False)]
        # Pool slot -> the executor of that slot (the newest one introduced).
        self.executors: dict[int, ExecutorStub] = {}
        if executor is not None:
            self.executors[slot] = self._executor_stub(executor)
        self.resources: dict[str, RunResources] = {}
        self._fetching: dict[str, asyncio.Future] = {}
        self._forgotten_fetches: set[str] = set()  # keys forgotten while their fetch was out
        self.resource_fetches = 0  # round trips to an executor for a run's resources
        self.resources_shipped = 0  # runs whose resources came with their first call here
        # Keys forgotten lately, oldest first: resources shipped with a call that was on its
        # way when its run was forgotten (the call and the forget travel apart) are not kept.
        self.forgotten: dict[str, None] = {}
        # Run id -> node id -> a large result the run's dependents share (SharedResult),
        # fetched from the run's executor once; let go with the run's resources.
        self.shared: dict[str, dict[str, Any]] = {}
        self._fetching_shared: dict[tuple[str, str], asyncio.Future] = {}
        self.shared_fetches = 0
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        # Cancels that arrived before their call did (it was still fetching resources, or
        # in transit): the call is cancelled as soon as it arrives.
        self.cancelled_early: dict[str, set[str]] = {}
        self.live = LiveEmissions(self)
        self.branch_calls = BranchCalls(WorkerChannels(direct_calls(), stub=BranchStoreStub))
        self.executed = 0
        self.failed = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        # Per pool slot, bumped when another executor takes that slot over (its predecessor
        # died): streams opened by the one before stop (see run_batch), and their calls are
        # counted as orphaned. Other slots' streams go on.
        self.epochs: dict[int, int] = {}
        self.orphaned = 0
        self.channel: ChannelServer | None = None  # opened by the first executor that asks

    async def ping(self) -> int:
        self.tells.loop = asyncio.get_running_loop()
        return self.index

    @property
    def executor(self) -> ExecutorStub | None:
        """Pool slot 0's executor (the one a single-executor runtime has)."""
        return self.executors.get(0)

    @property
    def tell_failures(self) -> int:
        return self.tells.failures

    def _executor_stub(self, executor: Any) -> ExecutorStub:
        return ExecutorStub(executor, "executor", self.tells)

    async def set_executor(self, executor: Any, slot: int = 0) -> None:
        """The executor of pool slot ``slot`` now (one that adopted this worker, maybe after its
        predecessor in that slot died)."""
        previous = self.executors.get(slot)
        if previous is not None and getattr(previous.handle, "_actor_id", None) != getattr(executor, "_actor_id", None):
            self.epochs[slot] = self.epochs.get(slot, 0) + 1
        self.executors[slot] = self._executor_stub(executor)

    # -- what the executor tells it ----------------------------------------------------
    async def set_store(self, index: int, store: Any, name: str) -> None:
        """A branch store was replaced: later calls use the new one."""
        while len(self.stores) <= index:
            self.stores.append(None)
        previous = self.stores[index]
        self.stores[index] = BranchStoreStub(store, name)
        if previous is not None and self.branch_calls.channels is not None:
            # A call never waits on a socket to a store that is gone (one on a lost machine sends no end).
            self.branch_calls.channels.close(previous.handle, f"branch store {previous.name} was replaced")

    async def forget(self, key: str) -> None:
        self.resources.pop(key, None)
        self.cancelled_early.pop(key, None)
        self.shared.pop(key, None)
        self.forgotten[key] = None
        if len(self.forgotten) > FORGOTTEN_KEPT:
            del self.forgotten[next(iter(self.forgotten))]
        if key in self._fetching:  # answered after this: handed to its waiters, not kept
            self._forgotten_fetches.add(key)

    async def cancel(self, run_id: str, node_ids: list[str]) -> int:
        cancelled = 0
        for node_id in node_ids:
            task = self.tasks.get((run_id, node_id))
            if task is None:
                self.cancelled_early.setdefault(run_id, set()).add(node_id)
            elif not task.done():
                task.cancel()
                cancelled += 1
        return cancelled

    async def replacement_store(self, index: int, dead_name: str,
                                executor: ExecutorStub | None = None) -> BranchStoreStub | None:
        """The store that replaced ``dead_name`` (waited for, from ``executor``, the asking run's),
        or None when none can be had."""
        current = self.store(index)
        if current.name != dead_name:  # already told of the replacement
            return current
        executor = executor if executor is not None else self.executor
        if executor is None:
            return None
        try:
            handle, name = await ask(executor, ExecutorStub.live_store, index, dead_name)
        except Exception:  # noqa: BLE001 - no replacement to be had: the caller's own typed error stands
            return None
        await self.set_store(index, handle, name)
        return self.stores[index]

    def store(self, index: int) -> BranchStoreStub:
        store = self.stores[index] if index < len(self.stores) else None
        if store is None:
            raise ExecutionError(f"this worker knows no branch store {index}", actor=self.name)
        return store

    # -- resources: shipped with a run's first call here, else fetched once per run ------
    def _take(self, key: str, shipped: bytes) -> RunResources:
        """The resources an executor shipped with a call (pickled), kept for the run's later calls
        unless the run was forgotten meanwhile."""
        resources = self.resources.get(key)
        if resources is not None:  # another call brought them first
            return resources
        if self.tells.loop is None:
            self.tells.loop = asyncio.get_running_loop()
        resources = cloudpickle.loads(shipped)
        self.resources_shipped += 1
        if key not in self.forgotten:
            self.resources[key] = resources
        return resources

    async def _resources_for(self, key: str, slot: int = 0) -> RunResources:
        if self.tells.loop is None:
            self.tells.loop = asyncio.get_running_loop()
        resources = self.resources.get(key)
        if resources is not None:
            return resources
        return await _once(self._fetching, key, lambda: self._fetch(key, slot))

    async def _fetch(self, key: str, slot: int) -> RunResources:
        try:
            executor = self.executors.get(slot)
            if executor is None:
                return RunResources()
            self.resource_fetches += 1
            resources = await ask(executor, ExecutorStub.resources, key, run_id=key,
                                  doing="fetching the run's operations")  # raised: every call of the run fails typed
            if key in self._forgotten_fetches:  # forgotten meanwhile: kept, they would never be let go
                return resources
            self.resources[key] = resources
            return resources
        finally:
            self._fetching.pop(key, None)
            self._forgotten_fetches.discard(key)

    # -- results shared by a run's dependents, fetched once per run ---------------------------
    async def with_shared_results(self, run_id: str, node_id: str, parameters: dict[str, Any],
                                  executor: Any) -> dict[str, Any]:
        """``parameters`` with each SharedResult in its context replaced by the value."""
        context = dict(parameters["context"])
        for key, value in context.items():
            if type(value) is SharedResult:
                context[key] = await self._shared_result(run_id, node_id, value.node_id, executor)
        return {**parameters, "context": context}

    async def _shared_result(self, run_id: str, node_id: str, source: str, executor: Any) -> Any:
        kept = self.shared.get(run_id)
        if kept is not None and source in kept:
            return kept[source]
        return await _once(self._fetching_shared, (run_id, source),
                           lambda: self._fetch_shared(run_id, node_id, source, executor))

    async def _fetch_shared(self, run_id: str, node_id: str, source: str, executor: Any) -> Any:
        try:
            if executor is None:
                raise ExecutionError(f"no executor to fetch the result of {source} from", run_id=run_id,
                                     node_id=node_id, actor=self.name)
            value = await ask(executor, ExecutorStub.shared_result, run_id, source, run_id=run_id, node_id=node_id,
                              doing=f"fetching the result of {source} it depends on")  # raised: the node fails, typed
            self.shared_fetches += 1
            if run_id in self.resources:  # not kept for a run already let go
                self.shared.setdefault(run_id, {})[source] = value
            return value
        finally:
            self._fetching_shared.pop((run_id, source), None)

    # -- calls -------------------------------------------------------------------------------
    async def run_one(self, run_id: str, call: CallRow, slot: int = 0,
                      shipped: bytes | None = None) -> list[OutcomeRow]:
        """Run a single call and answer with its outcome row (a plain call, not a stream).

        Used for a run's only call in flight (a chain's every link), where a stream's
        extra messages would cost about a millisecond per link. ``shipped``: the run's
        resources, pickled, when this is the run's first call here.
        """
        resources = await self._resources_or_failure(run_id, [call], slot, shipped)
        if isinstance(resources, list):
            return resources
        task = _start_call(self, run_id, call, resources, slot=slot)
        try:
            return [await _settled(task, call)]
        finally:
            self.tasks.pop((run_id, call[0]), None)

    def start_one(self, run_id: str, call: CallRow, slot: int = 0, shipped: bytes | None = None, *,
                  answer: Callable[[Any], None]) -> bool:
        """Start a single call now, when its run's resources are here or came with it
        (``shipped``): ``answer`` is called with its outcome rows as it ends, from the call's
        own task. False (nothing started) when they must be fetched first, or will not
        unpickle: use ``run_one``, which fails the call typed.

        The direct channel's path for ``run_one``: no task of its own to wait in, so the
        outcome goes out in the same turn of the loop as the call ends (a chain's every link).
        """
        resources = self.resources.get(run_id)
        if resources is None:
            if shipped is None:
                return False
            try:
                resources = self._take(run_id, shipped)
            except Exception:  # noqa: BLE001 - run_one tries again, and fails the call typed
                return False
        task = _start_call(self, run_id, call, resources, slot=slot)
        task.add_done_callback(partial(_answer_one, self.tasks, run_id, call, answer))
        return True

    async def run_batch(self, run_id: str, calls: list[CallRow], slot: int = 0, shipped: bytes | None = None):
        """Run calls concurrently; yield lists of outcome rows as they finish (a streaming generator).

        The first item is ``ACKNOWLEDGED``: every call has started. Should the worker die
        before that item is out, the executor knows none of them ran. ``slot``: the pool
        slot of the executor that owns the run. ``shipped``: the run's resources, pickled,
        when these are the run's first calls here.
        """
        async for item in self.batches(run_id, calls, slot, shipped):
            yield item
        await asyncio.sleep(STREAM_LINGER_SECONDS)

    async def channel_address(self) -> tuple[str, int, bytes]:
        """Where an executor reaches this worker directly, and the secret it must show
        (actors/workers/channel.py); handed out over Ray's own authenticated channel."""
        if self.channel is None:
            self.channel = ChannelServer(self)
        return await self.channel.address()

    async def batches(self, run_id: str, calls: list[CallRow], slot: int = 0, shipped: bytes | None = None):
        """``run_batch``'s items, for Ray's stream and the direct channel alike (ACKNOWLEDGED first)."""
        yield ACKNOWLEDGED
        resources = self.resources.get(run_id)
        if resources is None:  # a run's first calls here: shipped with them, or fetched
            resources = await self._resources_or_failure(run_id, calls, slot, shipped)
            if isinstance(resources, list):
                yield resources
                return
        done: list[OutcomeRow] = []
        wake = asyncio.Event()
        tasks = self.tasks
        epochs = self.epochs
        epoch = epochs.get(slot, 0)
        for call in calls:
            _start_call(self, run_id, call, resources, slot=slot).add_done_callback(partial(_collect, done, wake, call))
        remaining = len(calls)
        while remaining:
            if not done:
                wake.clear()
                await wake.wait()
            if remaining > len(done):
                # A window (a turn of the loop) gathers outcomes that finish together into one message.
                await asyncio.sleep(OUTCOME_WINDOW)
            batch = done[:OUTCOME_BATCH]
            del done[:OUTCOME_BATCH]
            remaining -= len(batch)
            for row in batch:
                tasks.pop((run_id, row[0]), None)
            if epochs.get(slot, 0) != epoch:
                # The executor that opened this stream died and another adopted this worker,
                # which sends these calls again as new attempts: nobody reads the rest.
                self.orphaned += len(batch) + remaining
                break
            yield batch

    async def run_turn(self, key: str, call: CallRow, slot: int = 0) -> tuple[OutcomeRow, dict[str, Any]]:
        """One call outside any graph (``Session.turn``): its outcome row and its token usage."""
        resources = await self._resources_or_failure(key, [call], slot)
        if isinstance(resources, list):
            return resources[0], CallUsage().as_dict()
        usage: dict[str, Any] = {}
        task = _start_call(self, key, call, resources, usage, slot)
        try:
            row = await _settled(task, call)
        finally:
            self.tasks.pop((key, call[0]), None)
        return row, usage

    async def _resources_or_failure(self, run_id: str, calls: list[CallRow], slot: int = 0,
                                    shipped: bytes | None = None) -> RunResources | list[OutcomeRow]:
        try:
            if shipped is not None:
                return self._take(run_id, shipped)
            return await self._resources_for(run_id, slot)
        except Exception as exc:  # noqa: BLE001 - every call fails with it, typed; the worker goes on
            now = time.time()
            text = clean_text(str(exc))
            return [(call[0], call[1], "failed", None, text, type(exc).__name__, [], now, now) for call in calls]

    async def statistics(self) -> dict[str, Any]:
        from ..providers.limits import (  # local: providers import httpx lazily
            latency_totals,
            usage_totals,
        )

        return {
            "index": self.index,
            "name": self.name,
            "pid": os.getpid(),
            "in_flight": self.in_flight,
            "orphaned": self.orphaned,
            "channel": None if self.channel is None else {
                "connections": self.channel.connections, "refused": self.channel.refused,
                "unanswered": self.channel.unanswered},
            "peak_in_flight": self.peak_in_flight,
            "executed": self.executed,
            "live_withdrawn": self.live.withdrawn,
            "branch_batches": self.branch_calls.batches,
            "branch_calls_batched": self.branch_calls.batched,
            "branch_calls_direct": self.branch_calls.direct,
            "shared_fetches": self.shared_fetches,
            "resource_fetches": self.resource_fetches,
            "resources_shipped": self.resources_shipped,
            "failed": self.failed,
            "runs": len(self.resources),
            "tell_failures": self.tell_failures,
            "max_rss_mib": peak_rss_mib(),
            "rss_mib": current_rss_mib(),
            # Model calls run in this process, so its totals are this worker's provider usage.
            "providers": usage_totals(),
            "provider_latency": latency_totals(),
        }


async def _execute(worker: OperationWorker, run_id: str, call: CallRow, resources: RunResources,
                   usage: dict[str, Any] | None = None, executor: Any = None) -> OutcomeRow:
    """Run one call to its outcome row. A function, not a method: Ray wraps every method of
    an actor class in a tracing shim, a cost per call this path (once per node) need not pay.
    """
    node_id, attempt, operation, parameters, branch_id, store_index = call
    started = time.time()
    emitted: list[tuple[str, Any, Any, bool]] = []
    identities: dict[int, Any] = {}
    worker.in_flight += 1
    if worker.in_flight > worker.peak_in_flight:
        worker.peak_in_flight = worker.in_flight
    tally = open_usage() if usage is not None else None
    try:
        registered = resources.operations.get(operation)
        if registered is None:
            known = ", ".join(sorted(resources.operations)) or "none"
            return (node_id, attempt, "failed", None,
                    f"operation {operation!r} is not registered (known: {known})", NOT_REGISTERED, [],
                    started, time.time())
        context = parameters.get("context")
        if context:
            for value in context.values():
                if type(value) is SharedResult:
                    parameters = await worker.with_shared_results(run_id, node_id, parameters, executor)
                    break
        branch = RemoteBranch(branch_id, worker, store_index, run_id, node_id, attempt,
                              executor, emitted, identities, resources)
        if registered.timeout is None:
            response = await registered.fn(branch, **parameters)
        else:
            try:
                response = await asyncio.wait_for(registered.fn(branch, **parameters), registered.timeout)
            except TimeoutError:
                worker.failed += 1
                return (node_id, attempt, "failed", None,
                        f"operation {operation!r} exceeded its {registered.timeout} s timeout", OPERATION_TIMEOUT,
                        list(emitted), started, time.time())
        if registered.record_turn and branch_id is not None:
            turn = [{"role": "user", "content": parameters.get("instruction", "")},
                    {"role": "assistant", "content": _turn_text(response)}]
            await branch.append(*turn)
        requests = list(emitted)
        if type(response) not in PLAIN_TYPES:  # nothing to walk
            kinds = (resources.spawn_type or SpawnRequest, EscalationRequest)
            for found, _ in request_sightings(response, kinds):
                kind = "escalation" if isinstance(found, EscalationRequest) else "spawn"
                # The same object keeps one key, whether sent live or seen again here: a true
                # second sighting, which the scheduler records as a duplicate (ADR-0023 D6).
                key = identities.get(id(found))
                if key is None:
                    key = identities[id(found)] = (node_id, attempt, len(identities))
                requests.append((kind, found, key, False))
            problem, requests = _travelling(node_id, response, requests)
            if problem is not None:
                worker.failed += 1
                return (node_id, attempt, "failed", None, f"node {node_id}: {problem}", UNSERIALISABLE_OUTCOME,
                        [], started, time.time())
        elif emitted:
            requests = _travelling(node_id, None, requests)[1]
        worker.executed += 1
        if emitted:
            worker.live.withdraw(run_id, node_id, attempt)
        return (node_id, attempt, "completed", response, None, None, requests, started, time.time())
    except asyncio.CancelledError:
        return (node_id, attempt, "cancelled", None, "cancelled", CANCELLED, _sendable(node_id, emitted), started,
                time.time())
    except BranchStoreLostError as exc:
        worker.failed += 1
        return (node_id, attempt, "failed", None, str(exc), BRANCH_STORE_LOST, _sendable(node_id, emitted), started,
                time.time())
    except Exception as exc:  # noqa: BLE001 - an operation failure is an outcome, never a raise
        worker.failed += 1
        return (node_id, attempt, "failed", None, clean_text(str(exc) or type(exc).__name__), type(exc).__name__,
                _sendable(node_id, emitted), started, time.time())
    finally:
        worker.in_flight -= 1
        if tally is not None:
            usage.update(tally.as_dict())


def _travelling(node_id: str, response: Any, requests: list[tuple[str, Any, Any, bool]],
               ) -> tuple[str | None, list[tuple[str, Any, Any, bool]]]:
    """(Why this outcome's result cannot travel to the executor, or None; its requests as they can.)

    Checked here, per node, because Ray pickles a whole batch of outcomes at once: one
    result that will not pickle used to fail every node of its batch. Everything is tried
    in one plain pickle first (shared objects once); only should that fail is each part
    tried on its own, to name it. One at a time, a planner returning 1,000 requests cost
    its worker 8 ms before its outcome could leave; together, 3 ms. A result that cannot
    travel fails its node; a request that cannot travels as an ``UnpicklableRequest``.
    """
    try:
        pickle.dumps((response, [item[1] for item in requests]), protocol=5)
        return None, requests
    except Exception:  # noqa: BLE001 - something in it needs cloudpickle, or cannot travel: find which
        pass
    problem = _pickling_problem(response)
    if problem is not None:
        return f"its result ({type(response).__name__}) cannot be serialised: {problem}", requests
    return None, _shippable(node_id, requests)


def _shippable(node_id: str, requests: list[tuple[str, Any, Any, bool]]) -> list[tuple[str, Any, Any, bool]]:
    """``requests`` with each one that cannot be pickled replaced by its ``UnpicklableRequest``, and one
    line on this worker's stderr for each, naming the node and the reason."""
    shippable = []
    for kind, request, key, redelivery in requests:
        stand_in = _stand_in(request)
        if stand_in is not None:
            print(f"opgraph: node {node_id}: a {kind} request it emitted ({stand_in.type_name}) cannot be pickled "
                  f"and is dropped: {stand_in.problem}", file=sys.stderr, flush=True)
            request = stand_in
        shippable.append((kind, request, key, redelivery))
    return shippable


def _stand_in(request: Any) -> UnpicklableRequest | None:
    """The ``UnpicklableRequest`` that travels in place of ``request``, or None when it can travel itself."""
    problem = _pickling_problem(request)
    return None if problem is None else UnpicklableRequest(type(request).__name__, problem)


def _pickling_problem(value: Any) -> str | None:
    """None when Ray can ship ``value``: plain pickle first (C, fast), cloudpickle for what it
    alone handles (local classes, lambdas)."""
    try:
        pickle.dumps(value, protocol=5)
    except Exception:  # noqa: BLE001 - not picklable by value: cloudpickle may still manage
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any pickling failure is the answer
            return clean_text(f"{type(exc).__name__}: {exc}", 300)
    return None


def _sendable(node_id: str, emitted: list[tuple[str, Any, Any, bool]]) -> list[tuple[str, Any, Any, bool]]:
    """The emissions of a failed or cancelled call, as they can travel."""
    if not emitted:
        return []
    return _travelling(node_id, None, emitted)[1]
