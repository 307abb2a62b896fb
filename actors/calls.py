"""The one seam for calls between opgraph's processes: typed stubs, asks, tells and replacements.

Owns every message one actor (or a driver) sends another: the stubs that declare each actor's
remote surface, starting actors, waiting for answers (with timeouts), Ray's errors turned
into opgraph's (``errors.translate``, called from here only), and the one policy that sends a
call again to a replacement when the actor it went to died. It decides nothing else.

Two kinds of message, as in Pykka:

    ask   a stub method that returns a reply (an ``ObjectRef``), sent through ``ask`` below
          (``await ask(target, ExecutorStub.start_run, run_id, graph, options)``), which
          awaits it under the policy and raises opgraph's errors; or awaited as it is
    tell  a stub method that returns None: sent, never awaited, but watched by the
          sender's ``Tells``: a death goes to the actor's supervisor, anything else is
          counted, so no failure is lost (a stub made without ``Tells``, the provider
          limiter's, sends its tells unwatched, as nothing supervises the limiter)

Where a call goes is a target: a stub (that actor, and no other), or a place that finds a
replacement when its actor died. Each kind says how it finds one and how many times one
call may follow it (``resends``); ``SAFE_TO_RESEND`` says which calls may be sent twice:

    PoolSlot      a slot of an executor's pool (workers, branch stores): replaced by the pool
    RuntimeMember a member of a runtime's executor pool: found by name, or started
    FollowedRun   the executor a driver follows its run on: replaced by the runtime, whose
                  new executor rebuilds a durable run from the log (MAX_RECOVERIES a run)
    AttachedRun   the executor of a run attached to by id (RunControl): found again by id
    WorkerStore   a worker's branch store: the run's executor names its replacement

The executor's data path (a worker's calls, the direct channel) awaits its stubs' replies
itself: a worker's failure is an event for the kernel there (``errors.call_failure``), not
an error to raise, and one extra await per node is a cost that path does not pay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import ray

from opgraph.kernel import ExecutionError

from .errors import UnknownRunError, is_actor_death, translate

if TYPE_CHECKING:
    from ray import ObjectRef

    from .branches.store import BranchStore
    from .driver.control import RunControl
    from .driver.runtime import Runtime
    from .executor.actor import GraphExecutor
    from .protocol import AdmittedRow, CallRow, Outcome, OutcomeRow, RunOptions, RunResources
    from .providers.adaptive import RateBudget
    from .providers.limits import ProviderLimiter
    from .workers.supervision import ActorPool
    from .workers.worker import OperationWorker

__all__ = [
    "MAX_RECOVERIES",
    "SAFE_TO_RESEND",
    "ActorStub",
    "Answer",
    "AttachedRun",
    "BranchStoreStub",
    "ExecutorStub",
    "FollowedRun",
    "PoolSlot",
    "ProviderLimiterStub",
    "RuntimeMember",
    "Target",
    "Tells",
    "WorkerStore",
    "WorkerStub",
    "answers",
    "ask",
    "ask_sync",
    "ping",
    "start",
]

MAX_RECOVERIES = 3  # executor replacements a driver follows one run through (FollowedRun)


# -- tells ---------------------------------------------------------------------------------------
class Tells:
    """The tells one process sends (an executor's shell, a worker), watched to their end.

    A tell whose actor died goes to that actor's supervisor (the stub's ``on_death``);
    any other failure is counted in ``failures``, which the sender's ``statistics()`` shows.
    ``loop`` is the sender's event loop, for tells sent from another thread (an operation
    emitting from a thread of its own).
    """

    def __init__(self) -> None:
        self.watching: set[asyncio.Future] = set()
        self.failures = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    def watch(self, reply: Any, on_death: Callable[[], Any] | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a thread of an operation's: watched on the sender's loop
            if self.loop is None:
                raise ExecutionError("a message was sent from a thread before the sender's loop was known") from None
            self.loop.call_soon_threadsafe(self.watch, reply, on_death)
            return
        task = loop.create_task(self._watched(reply, on_death))
        self.watching.add(task)
        task.add_done_callback(self.watching.discard)

    async def _watched(self, reply: Any, on_death: Callable[[], Any] | None) -> None:
        try:
            await reply
        except Exception as exc:  # noqa: BLE001 - routed to the supervisor, or counted
            if on_death is not None and is_actor_death(exc):
                on_death()
            else:
                self.failures += 1


# -- stubs: one method per remote method ---------------------------------------------------------
Actor = TypeVar("Actor")  # the actor class a stub's handle is an instance of


class _Stub(Generic[Actor]):
    """A handle on one actor, as its callers use it: ``handle`` (Ray's, typed as the actor class,
    so that "go to definition" from a stub method lands on the actor's), the actor's current
    ``name`` (for errors), and where its tells are watched (``tells``; ``on_death`` tells its
    supervisor). A stub without ``tells`` sends its tells unwatched."""

    __slots__ = ("handle", "name", "on_death", "tells")

    def __init__(self, handle: Actor, name: str = "", tells: Tells | None = None,
                 on_death: Callable[[], Any] | None = None) -> None:
        self.handle = handle
        self.name = name
        self.tells = tells
        self.on_death = on_death

    def _tell(self, reply: Any) -> None:
        if self.tells is not None:
            self.tells.watch(reply, self.on_death)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name or self.handle!r})"


class ActorStub(_Stub[Actor]):
    """What every supervised opgraph actor answers: ``ping`` (the liveness probe's question)."""

    __slots__ = ()

    def ping(self) -> ObjectRef[Any]:
        return self.handle.ping.remote()


class ExecutorStub(ActorStub["GraphExecutor"]):
    """The GraphExecutor's remote surface (actors/executor/actor.py), one method each."""

    __slots__ = ()
    handle: GraphExecutor

    # -- lifetime and the pool it supervises
    def start(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.start.remote()

    def pool(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.pool.remote()

    def is_standby(self) -> ObjectRef[bool]:
        return self.handle.is_standby.remote()

    def statistics(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.statistics.remote()

    def load(self, exclude: list[str] | tuple[str, ...] = ()) -> ObjectRef[tuple[int, int]]:
        return self.handle.load.remote(exclude)

    def run_durability(self, run_id: str) -> ObjectRef[bool | None]:
        return self.handle.run_durability.remote(run_id)

    # -- runs, from their driver
    def start_run(self, run_id: str, graph: Any, options: RunOptions) -> ObjectRef[str]:
        return self.handle.start_run.remote(run_id, graph, options)

    def resume_run(self, run_id: str, overrides: dict[str, Any] | None = None) -> ObjectRef[bool]:
        return self.handle.resume_run.remote(run_id, overrides)

    def next_events(self, run_id: str, max_items: int = 2048, timeout: float = 5.0,
                    compact: bool = False) -> ObjectRef[tuple[list, bool, Any]]:
        return self.handle.next_events.remote(run_id, max_items, timeout, compact)

    def forget_run(self, run_id: str) -> ObjectRef[bool]:
        return self.handle.forget_run.remote(run_id)

    def wait_result(self, run_id: str, timeout: float = 30.0) -> ObjectRef[tuple[bool, Any]]:
        return self.handle.wait_result.remote(run_id, timeout)

    # -- runs, from any client (the control concurrency group)
    def pause(self, run_id: str) -> ObjectRef[bool]:
        return self.handle.pause.remote(run_id)

    def resume(self, run_id: str) -> ObjectRef[bool]:
        return self.handle.resume.remote(run_id)

    def send_operator_message(self, run_id: str, text: str) -> ObjectRef[bool]:
        return self.handle.send_operator_message.remote(run_id, text)

    def cancel(self, run_id: str) -> ObjectRef[bool]:
        return self.handle.cancel.remote(run_id)

    def inject(self, run_id: str, operation: Any, after: str | None = None,
               independent: bool = False) -> ObjectRef[bool]:
        return self.handle.inject.remote(run_id, operation, after, independent)

    def status(self, run_id: str) -> ObjectRef[dict[str, Any]]:
        return self.handle.status.remote(run_id)

    def admit_many(self, run_id: str, rows: list[AdmittedRow]) -> ObjectRef[list[tuple[bool, str | None]]]:
        return self.handle.admit_many.remote(run_id, rows)

    def release_nodes(self, run_id: str, node_ids: list[str]) -> ObjectRef[int]:
        return self.handle.release_nodes.remote(run_id, node_ids)

    def close_run(self, run_id: str) -> ObjectRef[bool]:
        return self.handle.close_run.remote(run_id)

    def held(self, run_id: str) -> ObjectRef[tuple[list, list]]:
        return self.handle.held.remote(run_id)

    def watch(self, run_id: str, buffer: int = 1024) -> ObjectRef[str]:
        return self.handle.watch.remote(run_id, buffer)

    def next_watch_events(self, watcher_id: str, max_items: int = 2048,
                          timeout: float = 5.0) -> ObjectRef[tuple[list, int, dict[str, Any] | None]]:
        return self.handle.next_watch_events.remote(watcher_id, max_items, timeout)

    def unwatch(self, watcher_id: str) -> ObjectRef[bool]:
        return self.handle.unwatch.remote(watcher_id)

    # -- branches and single turns
    def create_branch(self, branch_id: str, messages: list[Any], scope: str | None = None) -> ObjectRef[int]:
        return self.handle.create_branch.remote(branch_id, messages, scope)

    def branch_messages(self, branch_id: str) -> ObjectRef[list[Any]]:
        return self.handle.branch_messages.remote(branch_id)

    def branch_histories(self, branch_ids: list[str]) -> ObjectRef[list[tuple[list[str], Any]]]:
        return self.handle.branch_histories.remote(branch_ids)

    def drop_scope(self, scope: str) -> ObjectRef[int]:
        return self.handle.drop_scope.remote(scope)

    def register_resources(self, key: str, resources: RunResources | None) -> ObjectRef[None]:
        return self.handle.register_resources.remote(key, resources)

    def turn(self, key: str, call: CallRow) -> ObjectRef[tuple[Any, dict[str, Any], int]]:
        return self.handle.turn.remote(key, call)

    def cancel_turn(self, key: str, node_id: str) -> ObjectRef[bool]:
        return self.handle.cancel_turn.remote(key, node_id)

    # -- from its workers
    def resources(self, key: str) -> ObjectRef[RunResources]:
        return self.handle.resources.remote(key)

    def shared_result(self, run_id: str, node_id: str) -> ObjectRef[Any]:
        return self.handle.shared_result.remote(run_id, node_id)

    def live_store(self, index: int, dead_name: str) -> ObjectRef[tuple[Any, str]]:
        return self.handle.live_store.remote(index, dead_name)

    def report(self, run_id: str, outcomes: list[Outcome]) -> ObjectRef[None]:
        return self.handle.report.remote(run_id, outcomes)

    def receive_requests(self, run_id: str, items: list[tuple[str, str, Any, Any]]) -> None:
        """Told: the outcome carries every request again, so a lost one costs nothing."""
        self._tell(self.handle.receive_requests.remote(run_id, items))


class WorkerStub(ActorStub["OperationWorker"]):
    """The OperationWorker's remote surface (actors/workers/worker.py), one method each."""

    __slots__ = ()
    handle: OperationWorker

    def run_one(self, run_id: str, call: CallRow, slot: int = 0,
                shipped: bytes | None = None) -> ObjectRef[list[OutcomeRow]]:
        return self.handle.run_one.remote(run_id, call, slot, shipped)

    def run_batch(self, run_id: str, calls: list[CallRow], slot: int = 0, shipped: bytes | None = None) -> Any:
        """A stream (Ray's ``ObjectRefGenerator``): ACKNOWLEDGED, then lists of outcome rows."""
        return self.handle.run_batch.options(num_returns="streaming").remote(run_id, calls, slot, shipped)

    def run_turn(self, key: str, call: CallRow, slot: int = 0) -> ObjectRef[tuple[OutcomeRow, dict[str, Any]]]:
        return self.handle.run_turn.remote(key, call, slot)

    def channel_address(self) -> ObjectRef[tuple[str, int, bytes]]:
        return self.handle.channel_address.remote()

    def set_executor(self, executor: Any, slot: int = 0) -> ObjectRef[None]:
        return self.handle.set_executor.remote(executor, slot)

    def set_store(self, index: int, store: Any, name: str) -> ObjectRef[None]:
        return self.handle.set_store.remote(index, store, name)

    def statistics(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.statistics.remote()

    def forget(self, key: str) -> None:
        """Told: the run (or turn key) ended; a worker that misses it keeps a few resources."""
        self._tell(self.handle.forget.remote(key))

    def cancel(self, run_id: str, node_ids: list[str]) -> None:
        """Told: the run's cancel grace bounds what an unanswered cancel can cost."""
        self._tell(self.handle.cancel.remote(run_id, node_ids))


class BranchStoreStub(ActorStub["BranchStore"]):
    """The BranchStore's remote surface (actors/branches/store.py), one method each."""

    __slots__ = ()
    handle: BranchStore

    def create(self, branch_id: str, messages: list[Any] | None = None, exist_ok: bool = False) -> ObjectRef[bool]:
        return self.handle.create.remote(branch_id, messages, exist_ok)

    def clone(self, source: str, destination: str) -> ObjectRef[None]:
        return self.handle.clone.remote(source, destination)

    def clone_many(self, pairs: list[tuple[str, str]]) -> ObjectRef[list[str]]:
        return self.handle.clone_many.remote(pairs)

    def replace_history(self, destination: str, source: str) -> ObjectRef[bool]:
        return self.handle.replace_history.remote(destination, source)

    def append(self, branch_id: str, messages: list[Any], token: Any = None) -> ObjectRef[int]:
        return self.handle.append.remote(branch_id, messages, token)

    def messages(self, branch_id: str) -> ObjectRef[list[Any]]:
        return self.handle.messages.remote(branch_id)

    def serve(self, calls: list[tuple[Any, ...]]) -> ObjectRef[list[tuple[bool, Any]]]:
        return self.handle.serve.remote(calls)

    def channel_address(self) -> ObjectRef[tuple[str, int, bytes]]:
        return self.handle.channel_address.remote()

    def histories(self, branch_ids: list[str]) -> ObjectRef[Any]:
        return self.handle.histories.remote(branch_ids)

    def has(self, branch_id: str) -> ObjectRef[bool]:
        return self.handle.has.remote(branch_id)

    def drop(self, branch_id: str) -> ObjectRef[bool]:
        return self.handle.drop.remote(branch_id)

    def ensure_many(self, branch_ids: list[str]) -> ObjectRef[list[str]]:
        return self.handle.ensure_many.remote(branch_ids)

    def adopt_many(self, branch_ids: list[str]) -> ObjectRef[list[str]]:
        return self.handle.adopt_many.remote(branch_ids)

    def hold_many(self, branch_ids: list[str]) -> ObjectRef[list[str]]:
        return self.handle.hold_many.remote(branch_ids)

    def drop_many(self, branch_ids: list[str]) -> ObjectRef[int]:
        return self.handle.drop_many.remote(branch_ids)

    def statistics(self) -> ObjectRef[dict[str, Any]]:
        return self.handle.statistics.remote()


class ProviderLimiterStub(_Stub["ProviderLimiter"]):
    """The ProviderLimiter's remote surface (actors/providers/limits.py), one method each."""

    __slots__ = ()
    handle: ProviderLimiter

    def acquire(self, provider: str, limit: int, token: str) -> ObjectRef[bool]:
        return self.handle.acquire.remote(provider, limit, token)

    def admit(self, provider: str, budget: RateBudget, tokens: int,
              token: str) -> ObjectRef[tuple[float, float] | None]:
        return self.handle.admit.remote(provider, budget, tokens, token)

    def statistics(self) -> ObjectRef[dict[str, dict[str, int]]]:
        return self.handle.statistics.remote()

    def adaptive_statistics(self) -> ObjectRef[dict[str, dict[str, Any]]]:
        return self.handle.adaptive_statistics.remote()

    def release(self, provider: str, token: str) -> None:
        """Told: a release sent after a cancelled acquire reaches the limiter after it, and undoes it."""
        self._tell(self.handle.release.remote(provider, token))

    def settle(self, provider: str, token: str, outcome: str, retry_after: float | None = None,
               reported: int | None = None) -> None:
        """Told, as ``release``: how one admitted call went."""
        self._tell(self.handle.settle.remote(provider, token, outcome, retry_after, reported))


def start(actor_class: Any, options: dict[str, Any], /, *args: Any) -> Any:
    """Start an actor of ``actor_class`` (a ``@ray.remote`` class) with Ray's ``options`` (name,
    namespace, lifetime; ``get_if_exists`` finds one already so named), constructed with
    ``args``: its handle, at once (the actor comes up on its own; its first reply says it did)."""
    return actor_class.options(**options).remote(*args)


# -- the policy: which calls go again, where, how many times ------------------------------------
#: Calls sent once more, to a replacement, when the actor they went to died: safe to send
#: twice (an answer lost with the actor changed nothing that a second one would undo), and
#: meaningful on a replacement. Every store call (an append carries its token; the rest are
#: reads or idempotent); a run's admission and a branch's creation or drop on a runtime
#: member; and the control calls on a run, which its new executor rebuilt from the log.
SAFE_TO_RESEND = frozenset({
    ExecutorStub.start_run, ExecutorStub.create_branch, ExecutorStub.drop_scope, ExecutorStub.next_events,
    ExecutorStub.pause, ExecutorStub.resume, ExecutorStub.send_operator_message, ExecutorStub.cancel,
    ExecutorStub.inject, ExecutorStub.status, ExecutorStub.watch, ExecutorStub.next_watch_events,
    ExecutorStub.unwatch, ExecutorStub.wait_result,
    # A fed run's: a repeated admission is refused as a duplicate, a repeated release or close does nothing.
    ExecutorStub.admit_many, ExecutorStub.release_nodes, ExecutorStub.close_run, ExecutorStub.held,
    BranchStoreStub.create, BranchStoreStub.clone, BranchStoreStub.clone_many, BranchStoreStub.replace_history,
    BranchStoreStub.append, BranchStoreStub.messages, BranchStoreStub.serve, BranchStoreStub.has, BranchStoreStub.drop,
    BranchStoreStub.ensure_many, BranchStoreStub.adopt_many, BranchStoreStub.hold_many, BranchStoreStub.drop_many,
})


class Target:
    """Where a call goes: ``live()`` is the stub to send it to now (``current()`` is the same
    without waiting, or None while it would have to wait for a replacement); ``died()`` hears
    that a stub's actor died and, when the call may be sent again, returns the live
    replacement (None: none). ``resends``: how many times one call may follow a replacement."""

    resends = 1

    def current(self) -> Any | None:
        return None

    async def live(self) -> Any:
        raise NotImplementedError

    async def died(self, dead: Any, resend: bool, doing: str) -> Any | None:
        raise NotImplementedError


class PoolSlot(Target):
    """Slot ``index`` of an executor's ActorPool (its workers, or its branch stores): the pool
    replaces a dead actor, and ``live()`` waits for the replacement. Its stubs tell through
    ``tells``, and a tell to a dead actor has the pool replace it."""

    def __init__(self, pool: ActorPool, index: int, stub_type: type, tells: Tells | None = None) -> None:
        self.pool = pool
        self.index = index
        self.stub_type = stub_type
        self.tells = tells
        self._stub: Any = None

    def stub(self) -> Any:
        """The slot's current actor's stub (made once per actor), without waiting for a live one."""
        handle = self.pool.handles[self.index]
        stub = self._stub
        if stub is None or stub.handle is not handle:
            on_death = partial(self.pool.mark_dead, self.index, handle, "a message to it failed")
            stub = self._stub = self.stub_type(handle, self.pool.names[self.index], self.tells, on_death)
        return stub

    def current(self) -> Any | None:
        return self.stub() if self.pool.alive[self.index] else None

    async def live(self) -> Any:
        await self.pool.live(self.index)
        return self.stub()

    async def died(self, dead: Any, resend: bool, doing: str) -> Any | None:
        self.pool.mark_dead(self.index, dead.handle, f"{doing} failed")
        return await self.live() if resend else None


class RuntimeMember(Target):
    """Member ``member`` of a runtime's executor pool, from the driver: a death is remembered,
    and the member is replaced (found by its next name, or started) before the next call to it."""

    def __init__(self, runtime: Runtime, member: int = 0) -> None:
        self.runtime = runtime
        self.member = member

    def _stub(self) -> ExecutorStub:
        runtime = self.runtime
        return ExecutorStub(runtime.executors[self.member], runtime.executor_names[self.member])

    def current(self) -> ExecutorStub | None:
        runtime, member = self.runtime, self.member
        return None if runtime.known_dead(member) else self._stub()

    async def live(self) -> ExecutorStub:
        await self.runtime.live_executor(self.member)
        return self._stub()

    async def died(self, dead: ExecutorStub, resend: bool, doing: str) -> ExecutorStub | None:
        self.runtime.mark_dead(dead.handle)
        if not resend:
            return None
        await self.runtime.replace_executor(dead.handle)
        return self._stub()

    def live_sync(self) -> ExecutorStub:
        self.runtime.live_executor_sync(self.member)
        return self._stub()

    def died_sync(self, dead: ExecutorStub, resend: bool, doing: str) -> ExecutorStub | None:
        self.runtime.mark_dead(dead.handle)
        if not resend:
            return None
        self.runtime.replace_executor_sync(dead.handle)
        return self._stub()


class FollowedRun(Target):
    """The executor a driver follows run ``run_id`` on. Should it die, a durable run is rebuilt
    from the run log by the runtime's replacement, and the driver follows it there, at most
    ``MAX_RECOVERIES`` times a run; a run that is not durable died with it."""

    resends = MAX_RECOVERIES

    def __init__(self, runtime: Runtime, executor: Any, run_id: str, durable: bool) -> None:
        self.runtime = runtime
        self.executor = executor
        self.run_id = run_id
        self.durable = durable
        self.recoveries = 0

    def stub(self) -> ExecutorStub:
        return ExecutorStub(self.executor, self.runtime.name_of(self.executor))

    def current(self) -> ExecutorStub:
        return self.stub()

    async def live(self) -> ExecutorStub:
        return self.stub()

    async def died(self, dead: ExecutorStub, resend: bool, doing: str) -> ExecutorStub | None:
        self.runtime.mark_dead(dead.handle)
        if not (resend and self.durable and self.recoveries < MAX_RECOVERIES):
            return None
        self.recoveries += 1
        self.executor = await self.runtime.replace_executor(dead.handle)
        self.replaced()
        return self.stub()

    def replaced(self) -> None:
        """The run is followed on ``self.executor`` from now on (a hook for who shows it)."""


class AttachedRun(Target):
    """The executor of a run a client attached to by id (``RunControl``): should it die, the
    run is looked for again among the namespace's executors (a replacement rebuilt it)."""

    def __init__(self, control: RunControl) -> None:
        self.control = control

    def _stub(self) -> ExecutorStub:
        return ExecutorStub(self.control.executor, self.control.executor_name or "")

    async def live(self) -> ExecutorStub:
        control = self.control
        if control.executor is None:
            raise UnknownRunError(f"run {control.run_id} is not live: `result()` reads how it ended",
                                  run_id=control.run_id)
        return self._stub()

    async def died(self, dead: ExecutorStub, resend: bool, doing: str) -> ExecutorStub | None:
        if resend and await self.control.refind():
            return self._stub()
        return None


class WorkerStore(Target):
    """Branch store ``index`` as a worker calls it for one run's operation: should it die,
    the run's ``executor`` (an ExecutorStub) names its replacement once there is one."""

    def __init__(self, worker: Any, index: int, executor: Any) -> None:
        self.worker = worker
        self.index = index
        self.executor = executor

    def current(self) -> BranchStoreStub:
        return self.worker.store(self.index)

    async def live(self) -> BranchStoreStub:
        return self.worker.store(self.index)

    async def died(self, dead: BranchStoreStub, resend: bool, doing: str) -> BranchStoreStub | None:
        if not resend:
            return None
        return await self.worker.replacement_store(self.index, dead.name, self.executor)


async def ask(target: Any, method: Callable[..., Any], /, *args: Any, timeout: float | None = None,
              run_id: str | None = None, node_id: str | None = None, branch_id: str | None = None,
              doing: str | None = None) -> Any:
    """``method(stub, *args)`` (a stub's ask, e.g. ``ExecutorStub.start_run``) on ``target``'s live
    actor, its answer awaited (for at most ``timeout`` seconds: ``TimeoutError``).

    A failure is raised as opgraph's error, naming the actor, the ids given and what was
    being done (``doing``, else the method's name). Should the actor have died, ``target``
    hears of it; a call in ``SAFE_TO_RESEND`` then goes to its replacement, up to
    ``target.resends`` times. ``target`` may be a stub: that actor, and no replacement.
    """
    if isinstance(target, _Stub):
        stub, target = target, None
    else:
        stub = target.current()  # no await on the common path: the actor there is alive
        if stub is None:
            stub = await target.live()
    resends = 0
    while True:
        try:
            if timeout is None:
                return await method(stub, *args)
            return await asyncio.wait_for(_awaited(method(stub, *args)), timeout)
        except Exception as exc:  # translated, or resent to a replacement
            doing = doing or method.__name__
            if target is not None and is_actor_death(exc):
                resend = resends < target.resends and method in SAFE_TO_RESEND
                replacement = await target.died(stub, resend, doing)
                if replacement is not None:
                    stub, resends = replacement, resends + 1
                    continue
            error = translate(exc, actor=stub.name or None, run_id=run_id, node_id=node_id, branch_id=branch_id,
                              doing=doing)
            if error is exc:
                raise
            raise error from None


def ask_sync(target: Any, method: Callable[..., Any], /, *args: Any, run_id: str | None = None,
             doing: str | None = None) -> Any:
    """``ask`` for a synchronous caller (``Session()``, ``close()``), never from inside an event
    loop; ``target`` is a stub or a RuntimeMember."""
    if isinstance(target, _Stub):
        stub, target = target, None
    else:
        stub = target.live_sync()
    resends = 0
    while True:
        try:
            return ray.get(method(stub, *args))
        except Exception as exc:  # translated, or resent to a replacement
            doing = doing or method.__name__
            if target is not None and is_actor_death(exc):
                resend = resends < target.resends and method in SAFE_TO_RESEND
                replacement = target.died_sync(stub, resend, doing)
                if replacement is not None:
                    stub, resends = replacement, resends + 1
                    continue
            error = translate(exc, actor=stub.name or None, run_id=run_id, doing=doing)
            if error is exc:
                raise
            raise error from None


class Answer(NamedTuple):
    """One actor's answer among several asked together (``answers``): its ``value``, or the
    ``error`` (opgraph's) it failed with, and whether that was because the actor ``died``."""

    value: Any
    error: BaseException | None = None
    died: bool = False


def answers(stubs: Sequence[Any], method: Callable[..., Any], /, *args: Any, timeout: float | None = None,
            doing: str | None = None) -> list[Answer]:
    """``method(stub, *args)`` asked of every stub at once, waited for together (for at most
    ``timeout`` seconds in all), synchronously: one Answer each, in order; none raises.
    An actor that has not answered in time has an ExecutionError saying so."""
    doing = doing or getattr(method, "__name__", "a call")
    replies: list[Any] = []
    for stub in stubs:
        try:
            replies.append(method(stub, *args))
        except Exception as exc:  # noqa: BLE001 - the send itself failed: that actor's answer
            replies.append(_Failed(exc))
    sent = [reply for reply in replies if not isinstance(reply, _Failed)]
    ready = set(ray.wait(sent, num_returns=len(sent), timeout=timeout)[0]) if sent else set()
    found = []
    for stub, reply in zip(stubs, replies, strict=True):
        if isinstance(reply, _Failed):
            found.append(_failed_answer(reply.exc, stub, doing))
        elif reply not in ready:
            found.append(Answer(None, ExecutionError(f"{stub.name or 'an opgraph actor'} did not answer {doing} "
                                                     f"within {timeout} s", actor=stub.name or None)))
        else:
            try:
                found.append(Answer(ray.get(reply)))
            except Exception as exc:  # noqa: BLE001 - that actor's answer, translated
                found.append(_failed_answer(exc, stub, doing))
    return found


class _Failed(NamedTuple):
    exc: BaseException


def _failed_answer(exc: BaseException, stub: Any, doing: str) -> Answer:
    return Answer(None, translate(exc, actor=stub.name or None, doing=doing), is_actor_death(exc))


async def ping(stub: ActorStub, timeout: float) -> BaseException | None:
    """None when ``stub``'s actor answers a ping within ``timeout``; else what the ping raised
    (left as it is: the caller tells a death from a busy actor with ``errors.is_actor_death``)."""
    try:
        await asyncio.wait_for(_awaited(stub.ping()), timeout)
    except TimeoutError as exc:  # alive but busy, or hung: not taken for dead
        return exc
    except Exception as exc:  # noqa: BLE001 - the probe's answer; classified by the caller
        return exc
    return None


async def _awaited(reply: Any) -> Any:
    """``reply`` (an ObjectRef) as a coroutine, for ``asyncio.wait_for``."""
    return await reply
