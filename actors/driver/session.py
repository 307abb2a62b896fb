"""The driver-side Session facade: ``flow()``, ``flow_stream()``, ``turn()``, branches and their lifetime.

Owns the caller's view of a run (ADR-0033 D1): it resolves defaults, ships the graph to
the GraphExecutor, relays lifecycle signals to ``on_progress``, ``on_signal`` and branch
hooks, and returns the result envelope. It never schedules anything itself, and no model
call runs here: single turns run on the worker pool too. A Session's branches live until
it is closed; a run started ``isolated`` has branches of its own, released with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray import cloudpickle

from opgraph.kernel import (
    NODE_PROGRESS_KINDS,
    ExecutionError,
    FlowEvent,
    Graph,
    OperationError,
    OpGraphError,
    RetryPolicy,
    require_graph,
    settle_completed,
)

from ..builtin_operations import builtin_operations
from ..calls import ExecutorStub, FollowedRun, ask, ask_sync
from ..errors import RuntimeLostError, TurnError, UnknownRunError
from ..models import ModelProvider, parse_model_id
from ..persistence import database_path
from ..protocol import CompactEnvelope, RegisteredOperation, RunOptions, RunResources, TurnResult
from ..settings import DEFAULT_NAMESPACE, cancel_grace_seconds, default_max_concurrency, durable_by_default
from .control import EventsDropped, RunControl, RunFinished
from .runtime import Runtime, connect, joined_with_address

__all__ = ["BranchView", "EventsDropped", "RunControl", "RunFinished", "RuntimeLostError", "Session", "flow_stream"]


FORGET_HEAD_START_SECONDS = 0.0005  # how long flow() lets its forget_run call leave before the write-back
POLL_ITEMS, POLL_SECONDS = 2048, 5.0  # what one long poll of a run's executor takes, and waits for


class _Following(FollowedRun):
    """Which executor a driver is following its run on: it changes when one dies (``FollowedRun``)."""

    def __init__(self, runtime: Any, executor: Any, run_id: str, durable: bool) -> None:
        super().__init__(runtime, executor, run_id, durable)
        self.control: RunControl | None = None
        # The submitted graph's node ids, in order, when this driver has them: its envelope
        # then comes without them (protocol ``CompactEnvelope``).
        self.node_ids: list[str] | None = None

    def replaced(self) -> None:
        if self.control is not None:  # the caller's handle on the run follows it too
            self.control.executor = self.executor
            self.control.executor_name = self.runtime.name_of(self.executor)


class BranchView:
    """What branch hooks receive on the driver: the branch id and a way to read it."""

    def __init__(self, session: Session, branch_id: str, node_id: str | None, reactive: bool) -> None:
        self.id = branch_id
        self.node_id = node_id
        self.reactive = reactive
        self._session = session

    async def messages(self) -> list[Any]:
        return await self._session.messages(self.id)


class Session:
    """A caller's session: connection, default and named branches, registered operations.

    ``Session()`` joins the embedded local Ray (started quietly on first use); pass
    ``address`` ("auto", "ray://host:port", "host:port") to join a running cluster.
    ``detached`` (default: True when joining through an address) shares the runtime's
    actors by name with every process of the namespace, so no process's exit ends
    another's run; otherwise this process owns its runtime.

    The Session's branches (its default branch, named branches, and the clones of its
    runs) live until ``close()`` (or the end of a ``with``/``async with`` block), which
    drops them from the stores. ``cancel_grace`` bounds how long cancelled operations
    may keep running before they are reported cancelled (default ``OPGRAPH_CANCEL_GRACE``,
    5 s).

    ``durable`` (default on; ``OPGRAPH_DURABLE=0`` turns it off) keeps the runtime's run
    log and branches in the database at ``OPGRAPH_DB`` (SQLite, ``~/.opgraph/opgraph.db``
    by default), so a run outlives its executor and its branch stores: a replacement
    rebuilds it from the log and this Session's ``flow()`` keeps waiting for it. Whoever
    starts a runtime decides whether it is durable.

    ``executors`` is the size of the runtime's executor pool (default ``OPGRAPH_EXECUTORS``,
    else one per alive Ray node: 1 on one machine). Each run is owned by one member,
    the least loaded when it is admitted; the members share the workers and branch
    stores, and a member that dies is replaced and its durable runs recovered, while the
    other members' runs go on untouched. Whoever starts a runtime decides its size.
    """

    def __init__(self, address: str | None = None, *, workers: int = 2, branch_stores: int = 1,
                 namespace: str = DEFAULT_NAMESPACE, detached: bool | None = None,
                 default_model: str | None = None, cancel_grace: float | None = None,
                 durable: bool | None = None, executors: int | None = None) -> None:
        if default_model is not None:
            parse_model_id(default_model)  # fail fast on "gpt-4" instead of "openai/gpt-4"
        if cancel_grace is not None and (isinstance(cancel_grace, bool) or not isinstance(cancel_grace, (int, float))
                                         or cancel_grace <= 0):
            raise OperationError(f"cancel_grace must be a number of seconds above 0, got {cancel_grace!r}")
        self.default_model = default_model or os.environ.get("OPGRAPH_DEFAULT_MODEL", "sim/default")
        self.cancel_grace = float(cancel_grace) if cancel_grace is not None else cancel_grace_seconds()
        self.providers: dict[str, ModelProvider] = {}
        connect(address, namespace=namespace)
        if detached is None:
            detached = address is not None or joined_with_address()
        self.id = str(uuid.uuid4())
        self.scope = f"session-{self.id}"
        if durable is None:
            durable = durable_by_default()
        self.runtime = Runtime.get_or_start(workers=workers, branch_stores=branch_stores, detached=detached,
                                            namespace=namespace, executors=executors,
                                            database=str(database_path()) if durable else None)
        self.branches: dict[str, str] = {}
        self._locations: dict[str, int] = {}
        # The built-ins as they are, the objects a run's header names instead of pickling them.
        self.operations: dict[str, RegisteredOperation] = dict(builtin_operations())
        self._turn_key: str | None = None
        self._turn_executor: Any = None
        self._resources_version = 0
        self.closed = False
        self.default_branch = self._create_branch(f"session-{self.id}-default", [])

    # -- lifetime -------------------------------------------------------------------------
    def close(self) -> int:
        """Drop every branch of this Session from the stores; returns how many. Idempotent.

        Not from inside a running event loop: use ``await session.aclose()`` there.
        """
        if self.closed:
            return 0
        self.closed = True
        dropped = self.runtime.drop_scope_sync(self.scope)
        if self._turn_key is not None:
            ask_sync(self.runtime.member(0), ExecutorStub.register_resources, self._turn_key, None)
        return dropped

    async def aclose(self) -> int:
        if self.closed:
            return 0
        self.closed = True
        dropped = await self.runtime.drop_scope(self.scope)
        if self._turn_key is not None:
            await ask(self.runtime.member(0), ExecutorStub.register_resources, self._turn_key, None)
        return dropped

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self.closed:
            raise OpGraphError("this Session is closed; its branches were dropped. Start a new Session")

    # -- branches and operations ---------------------------------------------------
    def _create_branch(self, branch_id: str, messages: list[Any]) -> str:
        shard = ask_sync(self.runtime.member(0), ExecutorStub.create_branch, branch_id, messages, self.scope)
        self._locations[branch_id] = shard
        return branch_id

    def new_branch(self, name: str | None = None, messages: list[Any] | None = None) -> str:
        """Create a named branch (a role's conversation) and return its id."""
        self._check_open()
        branch_id = f"session-{self.id}-{name or uuid.uuid4()}"
        if name is not None and name in self.branches:
            raise OpGraphError(f"branch {name!r} already exists", branch_id=self.branches[name])
        self._create_branch(branch_id, list(messages or []))
        if name is not None:
            self.branches[name] = branch_id
        return branch_id

    def register_operation(self, name: str, fn: Callable[..., Any], *, record_turn: bool = True,
                           timeout: float | None = None, retry: RetryPolicy | int | None = None) -> None:
        """Register ``async fn(branch, **parameters)``; shipped to workers per run by cloudpickle.

        ``timeout`` (seconds) bounds each call: a hung model or tool call becomes a
        failed operation of type ``OperationTimeout`` instead of a stuck run. ``retry``
        (a RetryPolicy, or a number of attempts retried after ``WorkerDied``) runs a
        failed attempt again as a new attempt; ``branch.idempotency_key`` tells them apart.
        The ``context`` parameter is input: a predecessor's ``<id>_result`` in it may be
        the same object for sibling operations in one worker batch (as in the record's
        in-process flow), so copy a value before changing it in place.
        """
        if not isinstance(name, str) or not name:
            raise OpGraphError(f"an operation name must be a non-empty string, got {name!r}")
        if not asyncio.iscoroutinefunction(fn):
            raise OpGraphError(f"operation {name!r} must be an async function")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise OpGraphError(f"operation {name!r} timeout must be a number of seconds above 0, got {timeout!r}")
        if retry is not None and not isinstance(retry, RetryPolicy):
            retry = RetryPolicy.of(retry)
        self.operations[name] = RegisteredOperation(fn, record_turn, timeout, retry)
        self._resources_version += 1

    def register_provider(self, name: str, provider: ModelProvider) -> None:
        """Serve ``name`` (a provider prefix like "scripted", or one "provider/model") with ``provider``.

        Shipped to workers with each run, so a scripted provider built in the driver is
        what operations call. Stateful providers are copied per worker process.
        """
        if not isinstance(provider, ModelProvider):
            raise OpGraphError(f"provider for {name!r} must implement async complete(request)")
        self.providers[name] = provider
        self._resources_version += 1

    async def messages(self, branch: str) -> list[Any]:
        """A branch's messages, wherever its store shard is."""
        branch_id = self.branches.get(branch, branch)
        return await self.runtime.branch_messages(branch_id)

    async def messages_many(self, branches: list[str]) -> list[list[Any]]:
        """``messages`` of each of ``branches``, in a call per runtime member rather than one each."""
        branch_ids = [self.branches.get(branch, branch) for branch in branches]
        found = await self.runtime.branch_messages_many(branch_ids)
        return [found[branch_id] for branch_id in branch_ids]

    def _resolve_branch(self, branch: Any) -> str:
        if branch is None:
            return self.default_branch
        branch_id = str(getattr(branch, "id", branch))
        return self.branches.get(branch_id, branch_id)

    def _resources(self) -> RunResources:
        return RunResources(dict(self.operations), dict(self.providers), {"default_model": self.default_model})

    # -- single turns ----------------------------------------------------------------
    async def turn(self, branch: Any, operation: str, /, *, timeout: float | None = None,
                   **parameters: Any) -> TurnResult:
        """Run one registered operation (a verb such as ``operate``) on ``branch``, on a worker.

        A single call, not a graph, with a graph node's supervision: a dead worker is a
        ``WorkerDied`` attempt (retried under the operation's RetryPolicy), a timeout an
        ``OperationTimeout``. A failure raises ``TurnError`` with its ``error_type``.
        Cancelling the awaiting task cancels the turn on its worker.
        """
        self._check_open()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise OperationError(f"turn timeout must be a number of seconds above 0, got {timeout!r}")
        if operation not in self.operations:
            known = ", ".join(sorted(self.operations))
            raise OperationError(f"operation {operation!r} is not registered (known: {known})")
        branch_id = self._resolve_branch(branch)
        key = await self._turn_resources()
        node_id = f"turn-{uuid.uuid4()}"
        call = (node_id, 1, operation, parameters, branch_id, 0)
        started = time.perf_counter()
        home = self.runtime.member(0)
        request = asyncio.ensure_future(ask(home, ExecutorStub.turn, key, call))
        try:
            row, usage, attempt = await asyncio.wait_for(asyncio.shield(request), timeout)
        except (TimeoutError, asyncio.CancelledError) as stopped:
            with contextlib.suppress(OpGraphError):
                await ask(home, ExecutorStub.cancel_turn, key, node_id)
            if isinstance(stopped, asyncio.TimeoutError):
                # The worker answers a cancelled call with its row and the usage of the model
                # calls it made: wait for that (bounded), so a timed-out turn's tokens are counted.
                spent = await self._usage_of_cancelled(request)
                raise TurnError(f"the turn exceeded its {timeout} s timeout", error_type="OperationTimeout",
                                usage=spent, branch_id=branch_id, node_id=node_id) from None
            request.cancel()
            raise
        if row[2] == "completed":
            return TurnResult(row[3], usage, branch_id, attempt, time.perf_counter() - started)
        raise TurnError(row[4] or f"the turn ended {row[2]}", error_type=row[5] or row[2], usage=usage,
                        branch_id=branch_id, node_id=node_id)

    async def _usage_of_cancelled(self, request: asyncio.Future) -> dict[str, Any]:
        """The usage a cancelled turn's worker reports, waited for at most ``cancel_grace``; {} without it."""
        try:
            _, usage, _ = await asyncio.wait_for(asyncio.shield(request), self.cancel_grace)
        except (TimeoutError, OpGraphError):
            request.cancel()
            return {}
        except asyncio.CancelledError:
            request.cancel()
            raise
        return usage

    async def _turn_resources(self) -> str:
        """Register this Session's operations for turns with the executor when they changed."""
        executor = await self.runtime.live_executor()
        key = f"{self.scope}/v{self._resources_version}"
        if key != self._turn_key or executor is not self._turn_executor:
            home = self.runtime.member(0)
            await ask(home, ExecutorStub.register_resources, key, self._resources())
            if self._turn_key is not None and self._turn_key != key:
                await ask(home, ExecutorStub.register_resources, self._turn_key, None)
            self._turn_key, self._turn_executor = key, executor
        return key

    # -- flow -------------------------------------------------------------------------
    def _options(self, *, run_id: str, max_concurrent, default_branch, isolated: bool = False, durable: bool = True,
                 **passed: Any) -> RunOptions:
        """A run's options. ``passed`` are the ``RunOptions`` fields a caller gives as they are (context,
        parallel, reactive, max_spawn, spawn_type, node_builder, reducers, spawn_branch_setup,
        want_signals, want_events, stream_buffer, detached); the rest come from this Session."""
        self._check_open()
        if max_concurrent is None:
            max_concurrent = default_max_concurrency()
        resources = self._resources()
        resources.spawn_type = passed["spawn_type"]
        return RunOptions(
            **passed,
            max_concurrent=max_concurrent,
            default_branch_id=self._resolve_branch(default_branch),
            clone_source_branch_id=self.default_branch,
            known_branches=dict(self._locations),
            resources=resources,
            retry_policies={name: op.retry for name, op in self.operations.items() if op.retry is not None},
            branch_scope=f"run-{run_id}" if isolated else self.scope,
            scope_parent=self.scope if isolated else None,
            isolated=isolated,
            cancel_grace=self.cancel_grace,
            durable=bool(durable and self.runtime.database),
        )

    async def _start(self, run_id: str, graph: Graph, options: RunOptions, member: int | None = None) -> Any:
        """Admit a run on the least loaded member of the pool (or ``member``), replaced first if it
        died idle; returns that member's executor, the run's owner.

        If the caller is cancelled meanwhile, the run must not go on undrained: the
        executor may admit it anyway (the call is on its way), so wait for the admission
        to settle, then cancel and forget the run before re-raising.
        """
        # A non-graph, or an edge to a missing node, is refused before anything is shipped.
        require_graph(graph).check_references()
        # Shipped pickled: the executor logs a durable run's very bytes as its header instead of
        # pickling the graph again (for 10,000 nodes, tens of ms of its loop). Pickled here, with
        # no await since the caller's call, the graph shipped is the one ``flow()`` read its
        # node ids from.
        shipped = cloudpickle.dumps(graph)
        runtime = self.runtime
        if member is None:
            member = await runtime.place(run_id)
        owner = runtime.member(member)
        with runtime.admitting(member, run_id):
            admission = asyncio.ensure_future(ask(owner, ExecutorStub.start_run, run_id, shipped, options,
                                                  run_id=run_id))
            try:
                await asyncio.shield(admission)
            except asyncio.CancelledError:
                with contextlib.suppress(OpGraphError):
                    await admission
                    await ask(owner, ExecutorStub.cancel, run_id, run_id=run_id)
                    await ask(owner, ExecutorStub.forget_run, run_id, run_id=run_id)
                raise
        return runtime.executors[member]

    async def flow(
        self,
        graph: Graph,
        *,
        context: dict[str, Any] | None = None,
        parallel: bool = True,
        max_concurrent: int | None = 5,
        verbose: bool = False,
        default_branch: Any = None,
        alcall_params: Any = None,
        on_progress: Callable[[str, str, str, float], Any] | None = None,
        reactive: bool = False,
        spawn_type: type | None = None,
        node_builder: Any = None,
        max_spawn: int = 50,
        executor_ref: dict[str, Any] | None = None,
        on_branch_created: Callable[[Any], Any] | None = None,
        spawn_branch_setup: Callable[[Any, Any], Any] | None = None,
        reducers: dict[str, Callable[[Any, Any], Any]] | None = None,
        run_id: str | None = None,
        on_signal: Callable[[Any], Any] | None = None,
        isolated: bool = False,
        on_settled: Callable[[FlowEvent], Awaitable[Any]] | None = None,
        durable: bool = True,
    ) -> dict[str, Any]:
        """Run ``graph`` on the executor and return the result envelope (ADR-0033 D1).

        Ideal over retrospective: lifecycle signals are emitted for every run and
        drained before return; ``on_branch_created`` fires for reactive clones too;
        ``on_signal`` receives every canonical lifecycle signal (queued, started,
        completed, failed, skipped, spawned, paused, escalated, and cancelled) as its
        typed model. ``alcall_params`` is accepted for signature compatibility and has
        no effect: capacity is the executor's counter, not an in-process limiter.
        ``run_id`` names the run (default: a fresh uuid) so another process can
        ``RunControl.attach`` to it.

        ``isolated``: the run gets a default branch of its own, and its branches belong
        to it rather than to the Session, so nothing of another run reaches it; they
        stay readable after the run (to record them) until ``release_run(run_id)``.
        Without it the record's semantics hold: dependent nodes clone the Session's
        default branch, and every branch lives until the Session is closed.

        ``on_settled`` (async) is awaited with each settled node's ``FlowEvent``, result
        included, as the run goes: how a run store records outputs before the run ends.

        On a durable runtime every run is logged as it goes (``durable=False`` turns that
        off for this run): should the executor die, its replacement rebuilds the run from
        the log, and ``flow()`` keeps waiting and returns the whole envelope.
        """
        del alcall_params
        require_graph(graph)  # before ``graph.nodes`` below: a builder or a dict is the typed refusal
        run_id = run_id or str(uuid.uuid4())
        options = self._options(
            run_id=run_id, context=context, max_concurrent=max_concurrent, parallel=parallel, reactive=reactive,
            max_spawn=max_spawn, spawn_type=spawn_type, node_builder=node_builder,
            default_branch=default_branch, spawn_branch_setup=spawn_branch_setup, reducers=reducers,
            want_signals=bool(on_progress or verbose or on_branch_created or on_signal),
            want_events=on_settled is not None, stream_buffer=1 << 30, isolated=isolated, durable=durable,
        )
        node_ids = list(graph.nodes)  # as shipped: ``_start`` pickles the graph before it first yields
        executor = await self._start(run_id, graph, options)
        following = _Following(self.runtime, executor, run_id, options.durable)
        following.node_ids = node_ids
        if executor_ref is not None:
            following.control = RunControl(executor, run_id, self.runtime.name_of(executor), self.runtime.namespace,
                                           durable=options.durable)
            executor_ref["executor"] = following.control
            executor_ref["run_id"] = run_id
        forgetting = None
        try:
            envelope = await self._drain(following, on_progress, on_branch_created, verbose,
                                         on_event=on_settled, on_signal=on_signal)
            # Asked before the write-back, which it waits beside: forgetting waits for the log
            # to record the end (8-10 ms of a 10,000-node run), mirroring costs 7-8 ms.
            forgetting = self._forget(following)
            # A short pause lets the call leave first: its task's first step submits it, and
            # Ray sends it from a thread of its own that needs this thread's GIL, which the
            # write-back holds throughout. Traced without the pause, forget_run reached the
            # executor only after the write-back; with it, 0.2-2.6 ms after the pause.
            await asyncio.sleep(FORGET_HEAD_START_SECONDS)
            self._write_back(graph, envelope)
        except BaseException:
            # Stop the run's remaining work, then re-raise; a dead executor has nothing to stop.
            if forgetting is None:
                with contextlib.suppress(OpGraphError):
                    await asyncio.shield(ask(following, ExecutorStub.cancel, run_id, run_id=run_id))
            raise
        finally:
            with contextlib.suppress(OpGraphError):
                await asyncio.shield(forgetting if forgetting is not None else self._forget(following))
        return envelope

    async def submit(self, graph: Graph, *, run_id: str | None = None, context: dict[str, Any] | None = None,
                     parallel: bool = True, max_concurrent: int | None = 5, reactive: bool = False,
                     spawn_type: type | None = None, node_builder: Any = None, max_spawn: int = 50,
                     reducers: dict[str, Callable[[Any, Any], Any]] | None = None, default_branch: Any = None,
                     isolated: bool = True) -> str:
        """Admit ``graph`` as a detached run and return its id once it is admitted and durable.

        Nobody needs to wait on it: the run goes on after this process exits (on a runtime
        joined through an address, which no process owns), and its envelope is read later,
        from any process, with ``RunControl.attach(run_id).result()`` or ``opgraph run
        result``. Needs a durable runtime. Isolated by default: a detached run's branches
        are its own, released with it.
        """
        if not self.runtime.database:
            raise OperationError("submit needs a durable runtime (Session(durable=True), the default)")
        run_id = run_id or str(uuid.uuid4())
        options = self._options(
            run_id=run_id, context=context, max_concurrent=max_concurrent, parallel=parallel, reactive=reactive,
            max_spawn=max_spawn, spawn_type=spawn_type, node_builder=node_builder, default_branch=default_branch,
            spawn_branch_setup=None, reducers=reducers, want_signals=False, want_events=False,
            stream_buffer=1 << 30, isolated=isolated, durable=True, detached=True,
        )
        if isolated:  # owned by the run alone: a Session closing must not drop a run that outlives it
            options.scope_parent = None
        await self._start(run_id, graph, options)
        return run_id

    async def follow_recovered(self, run_id: str, *, on_progress: Callable[[str, str, str, float], Any] | None = None,
                               on_signal: Callable[[Any], Any] | None = None,
                               on_branch_created: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """Have this Session's executor rebuild ``run_id`` from the run log, and drain it to its envelope.

        For a run whose owner died (``RunControl.resume_from_log``); the run's graph is the
        one in its log, so nothing is mirrored onto a caller's graph objects. The providers
        the log describes (it keeps no key) are this Session's where it has one by that name."""
        member = await self.runtime.place()
        executor = await self.runtime.live_executor(member)
        # The run's log keeps its HTTP providers without their keys: this Session's (built from
        # this process's environment) stand in for them.
        overrides = {"detached": False, "want_signals": bool(on_progress or on_signal or on_branch_created),
                     "providers": dict(self.providers)}
        following = _Following(self.runtime, executor, run_id, True)
        if not await ask(following, ExecutorStub.resume_run, run_id, overrides, run_id=run_id):
            reasons = (await ask(self.runtime.member(member), ExecutorStub.statistics))["recovery_errors"]
            raise ExecutionError(f"run {run_id} could not be rebuilt from the run log: "
                                 f"{reasons.get(run_id, 'unknown reason')}", run_id=run_id)
        try:
            return await self._drain(following, on_progress, on_branch_created, False, on_signal=on_signal)
        finally:
            with contextlib.suppress(OpGraphError):
                await asyncio.shield(self._forget(following))

    async def release_run(self, run_id: str) -> int:
        """Drop the branches of a finished ``isolated`` run (once recorded); returns how many.

        Asked of every member of the pool: the run's owner knows its branches, and this call
        may come from a process that does not know which member that was."""
        return await self.runtime.drop_scope(f"run-{run_id}")

    async def _next_events(self, following: _Following) -> tuple[list, bool, Any]:
        """One long poll of the run's executor. Should it die with a durable run, its replacement
        (started here, or by another client) rebuilds the run from the log, and the poll follows
        it there (``FollowedRun``)."""
        try:
            return await ask(following, ExecutorStub.next_events, following.run_id, POLL_ITEMS, POLL_SECONDS,
                             following.node_ids is not None, run_id=following.run_id)
        except UnknownRunError:
            if not following.recoveries:
                raise
            raise RuntimeLostError("the executor died and its replacement could not recover the run "
                                   "from the run log", run_id=following.run_id,
                                   actor=self.runtime.name_of(following.executor)) from None

    def _forget(self, following: _Following) -> asyncio.Future:
        """``forget_run`` of the followed run, sent now: a future of its answer."""
        return asyncio.ensure_future(ask(following, ExecutorStub.forget_run, following.run_id,
                                         run_id=following.run_id))

    async def _drain(self, following: _Following, on_progress, on_branch_created, verbose,
                     on_event: Callable[[FlowEvent], Any] | None = None,
                     on_signal: Callable[[Any], Any] | None = None) -> dict[str, Any]:
        """The run's items handed to the callbacks as they come, until its envelope (returned)
        or its error (raised)."""
        while True:
            items, done, result = await self._next_events(following)
            for kind, item in items:
                if kind == "signal":
                    progress = NODE_PROGRESS_KINDS.get(item.kind)
                    if verbose:
                        print(f"[opgraph] {item.kind:<9} {getattr(item, 'name', '') or item.op_id}")
                    if progress is not None and on_progress is not None:
                        on_progress(item.op_id, item.name, progress, item.elapsed)
                    if on_signal is not None:
                        on_signal(item)
                elif kind == "branch" and on_branch_created is not None:
                    node_id, branch_id, reactive = item
                    on_branch_created(BranchView(self, branch_id, node_id, reactive))
                elif kind == "event" and on_event is not None:
                    await on_event(item)
            if done:
                if isinstance(result, BaseException):
                    raise result
                if isinstance(result, CompactEnvelope):
                    try:
                        return result.expand(following.node_ids)
                    except ValueError as exc:
                        raise ExecutionError(f"the run's result could not be read: {exc}",
                                             run_id=following.run_id) from None
                return result

    @staticmethod
    def _write_back(graph: Graph, envelope: dict[str, Any]) -> None:
        """Mirror final statuses and results onto the caller's graph objects."""
        results, nodes = envelope.get("operation_results", {}), graph.nodes
        for node_id, status in envelope.get("operation_statuses", {}).items():
            node = nodes.get(node_id)
            if node is None:
                continue
            if status == "completed":
                settle_completed(node, results.get(node_id))
            elif status == "failed":
                result = results.get(node_id)
                node.settle(status, error=str(result.get("error")) if isinstance(result, dict) else None)
            else:
                node.settle(status)

    def run_control(self, run_id: str) -> RunControl:
        """Control of a run of this session's runtime, by id (started here or elsewhere): on the
        member of the pool that has it (member 0 when none has it), knowing whether it is durable."""
        runtime = self.runtime
        held = zip(runtime.executors, runtime.run_durability_sync(run_id), strict=True)
        executor, durable = next(((handle, durability) for handle, durability in held if durability is not None),
                                 (runtime.executor, None))
        return RunControl(executor, run_id, runtime.name_of(executor), runtime.namespace, durable=durable)

    def run(self, graph: Graph, **kwargs: Any) -> dict[str, Any]:
        """Synchronous ``flow`` for scripts (not from inside a running event loop)."""
        return asyncio.run(self.flow(graph, **kwargs))


async def flow_stream(
    session: Session,
    graph: Graph,
    *,
    branch: Any = None,
    context: dict[str, Any] | None = None,
    max_concurrent: int | None = None,
    verbose: bool = False,
    alcall_params: Any = None,
    spawn_type: type | None = None,
    node_builder: Any = None,
    max_spawn: int = 50,
    buffer: int = 1024,
) -> AsyncIterator[FlowEvent]:
    """Yield one FlowEvent per settled operation, in completion order (always reactive).

    Ideal over retrospective: the buffer is bounded (``buffer`` undelivered events);
    when it is full the executor stops dispatching until the consumer catches up. Closing
    the generator early (``aclose()``, or leaving ``contextlib.aclosing``) cancels the
    run's remaining work and awaits its settlement. Nothing here is asyncio-private.
    """
    del alcall_params
    run_id = str(uuid.uuid4())
    options = session._options(
        run_id=run_id, context=context, max_concurrent=max_concurrent, parallel=True, reactive=True,
        max_spawn=max_spawn, spawn_type=spawn_type, node_builder=node_builder,
        default_branch=branch, spawn_branch_setup=None, reducers=None,
        want_signals=verbose, want_events=True, stream_buffer=max(1, buffer),
    )
    following = _Following(session.runtime, await session._start(run_id, graph, options), run_id, options.durable)
    finished = False
    try:
        while True:
            items, done, result = await session._next_events(following)
            for kind, item in items:
                if kind == "event":
                    yield item
                elif kind == "signal" and verbose:
                    print(f"[opgraph] {item.kind:<9} {getattr(item, 'name', '') or item.op_id}")
            if done:
                finished = True
                if isinstance(result, BaseException):
                    raise result
                return
    finally:
        if not finished:
            # Early close: cancel what remains and wait until the run has settled.
            await ask(following, ExecutorStub.cancel, run_id, run_id=run_id)
            while True:
                _, done, _ = await session._next_events(following)
                if done:
                    break
        with contextlib.suppress(OpGraphError):
            await ask(following, ExecutorStub.forget_run, run_id, run_id=run_id)
