"""The driver-side Session facade: ``flow()``, ``flow_stream()``, run control and branches.

Owns the caller's view of a run (ADR-0033 D1): it resolves defaults, ships the graph to
the GraphExecutor, relays lifecycle signals to ``on_progress`` and branch hooks, and
returns the result envelope. It never schedules anything itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray

from opgraph.kernel import NODE_PROGRESS_KINDS, ExecutionError, FlowEvent, Graph, OpGraphError, Operation

from .branches import shard_for
from .executor import RunOptions, UnknownRunError
from .runtime import DEFAULT_NAMESPACE, EXECUTOR_NAME, Runtime, connect
from .models import ModelProvider, parse_model_id
from .workers import RegisteredOperation, RunResources

__all__ = ["BranchView", "EventsDropped", "RunControl", "RunFinished", "RuntimeLostError", "Session", "flow_stream"]


def _unwrap(exc: BaseException) -> BaseException:
    """Translate a Ray task error into the typed error raised inside the actor."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        return cause
    return exc


class RuntimeLostError(ExecutionError):
    """An opgraph actor (the executor or a branch store) died; the run cannot be observed."""


def _translated(exc: ray.exceptions.RayError) -> BaseException:
    """The opgraph error for a Ray error: the actor's own typed error, or a lost runtime."""
    if isinstance(exc, ray.exceptions.RayActorError):
        return RuntimeLostError(f"an opgraph actor died: {type(exc).__name__}")
    cause = _unwrap(exc)
    if cause is exc:
        return ExecutionError(f"remote call failed: {exc}")
    return cause


async def _call(ref: Any) -> Any:
    """Await a Ray call, translating Ray's errors into opgraph's at this boundary."""
    try:
        return await ref
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise _translated(exc) from None


async def _start(executor: Any, run_id: str, graph: Graph, options: Any) -> None:
    """Admit a run; if the caller is cancelled meanwhile, the run must not go on undrained.

    The executor may admit it anyway (the call is already on its way), so wait for the
    admission to settle, then cancel and forget the run before re-raising.
    """
    admission = executor.start_run.remote(run_id, graph, options)
    try:
        await _call(admission)
    except asyncio.CancelledError:
        with contextlib.suppress(ray.exceptions.RayError, OpGraphError):
            await admission
            await executor.cancel.remote(run_id)
            executor.forget_run.remote(run_id)
        raise


@dataclass(frozen=True)
class EventsDropped:
    """``RunControl.watch()`` fell behind: ``count`` settled-node events were dropped for it."""

    count: int


@dataclass(frozen=True)
class RunFinished:
    """The last item ``RunControl.watch()`` yields: how the run ended.

    ``status`` is the envelope's ("completed", "failed", "cancelled"), or "error" when the
    run failed as a whole, or "forgotten" when its owner left before it settled.
    """

    status: str
    summary: dict[str, Any]


class RunControl:
    """Live control of one run (the ``executor_ref`` handle): pause, resume, inject, steer, cancel.

    A second client process finds a run by id with ``RunControl.attach(run_id, address=...)``
    and can also ``watch()`` its settled nodes. The run lives as long as the client that
    started it waits on ``flow()``; that client owns the result envelope.
    """

    def __init__(self, executor: Any, run_id: str) -> None:
        self.executor = executor
        self.run_id = run_id

    @classmethod
    def attach(cls, run_id: str, *, address: str | None = "auto",
               namespace: str = DEFAULT_NAMESPACE) -> RunControl:
        """Join the cluster at ``address`` and find run ``run_id`` on the namespace's executor.

        Raises ``UnknownRunError`` when the namespace has no executor or the executor has
        no such run (never started, or already settled and returned to its owner).
        Starts no actors. Call it outside a running event loop, like ``Session()``.
        """
        connect(address, namespace=namespace)
        try:
            executor = ray.get_actor(EXECUTOR_NAME, namespace=namespace)
        except ValueError:
            raise UnknownRunError(f"no opgraph executor in namespace {namespace!r}: "
                                  f"nothing has run there; check --address and --namespace") from None
        try:
            ray.get(executor.status.remote(run_id))
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
            raise _translated(exc) from None
        return cls(executor, run_id)

    async def pause(self) -> bool:
        return await _call(self.executor.pause.remote(self.run_id))

    async def resume(self) -> bool:
        return await _call(self.executor.resume.remote(self.run_id))

    async def inject(self, operation: Operation, *, after: Operation | str | None = None,
                     independent: bool = False) -> bool:
        """Admit a prebuilt operation; False outside a running reactive run (ADR-0023 D6)."""
        after_id = getattr(after, "id", after)
        return await _call(self.executor.inject.remote(self.run_id, operation, after_id, independent))

    async def send_operator_message(self, text: str) -> bool:
        return await _call(self.executor.send_operator_message.remote(self.run_id, text))

    async def cancel(self) -> bool:
        return await _call(self.executor.cancel.remote(self.run_id))

    async def status(self) -> dict[str, Any]:
        return await _call(self.executor.status.remote(self.run_id))

    async def watch(self, *, buffer: int = 1024, poll_timeout: float = 5.0,
                    ) -> AsyncIterator[FlowEvent | EventsDropped | RunFinished]:
        """Yield this run's settled nodes from now on, then one ``RunFinished``.

        Ideal over retrospective: a watcher has its own bounded queue on the executor
        and never slows the run; when it falls ``buffer`` events behind, the oldest are
        dropped and an ``EventsDropped`` says how many. Nodes settled before attaching
        are not replayed (``status()`` counts them). Leaving early detaches the watcher.
        """
        executor = self.executor
        watcher_id = await _call(executor.watch.remote(self.run_id, buffer))
        finished = False
        try:
            while True:
                items, dropped, summary = await _call(
                    executor.next_watch_events.remote(watcher_id, 2048, poll_timeout))
                if dropped:
                    yield EventsDropped(dropped)
                for event in items:
                    yield event
                if summary is not None:
                    finished = True
                    yield RunFinished(str(summary.get("status")), summary)
                    return
        finally:
            if not finished:
                await _call(executor.unwatch.remote(watcher_id))


class BranchView:
    """What branch hooks receive on the driver: the branch id and a way to read it."""

    def __init__(self, session: Session, branch_id: str, node_id: str | None, reactive: bool) -> None:
        self.id = branch_id
        self.node_id = node_id
        self.reactive = reactive
        self._session = session

    async def messages(self) -> list[Any]:
        return await self._session.messages(self.id)


async def _noop(branch: Any, **parameters: Any) -> Any:
    return parameters.get("result", parameters.get("instruction"))


async def _sleep(branch: Any, seconds: float = 0.0, **parameters: Any) -> Any:
    await asyncio.sleep(seconds)
    return parameters.get("result", "slept")


class Session:
    """A caller's session: connection, default and named branches, registered operations.

    ``Session()`` joins the embedded local Ray (started quietly on first use); pass
    ``address`` ("auto", "ray://host:port", "host:port") to join a running cluster.
    """

    def __init__(self, address: str | None = None, *, workers: int = 2, branch_stores: int = 1,
                 namespace: str = "opgraph", detached: bool = False,
                 default_model: str | None = None) -> None:
        if default_model is not None:
            parse_model_id(default_model)  # fail fast on "gpt-4" instead of "openai/gpt-4"
        self.default_model = default_model or os.environ.get("OPGRAPH_DEFAULT_MODEL", "sim/default")
        self.providers: dict[str, ModelProvider] = {}
        connect(address, namespace=namespace)
        self.id = str(uuid.uuid4())
        # Actors are named per namespace: a Session in another namespace gets its own runtime.
        self.runtime = Runtime.get_or_start(workers=workers, branch_stores=branch_stores, detached=detached,
                                            namespace=namespace)
        self.branches: dict[str, str] = {}
        self._locations: dict[str, int] = {}
        from .verbs import VERB_OPERATIONS  # local: verbs pull in the tool machinery

        self.operations: dict[str, RegisteredOperation] = {
            **VERB_OPERATIONS,
            "noop": RegisteredOperation(_noop, record_turn=False),
            "sleep": RegisteredOperation(_sleep, record_turn=False),
        }
        self.default_branch = self._create_branch(f"session-{self.id}-default", [])

    # -- branches and operations ---------------------------------------------------
    def _create_branch(self, branch_id: str, messages: list[Any]) -> str:
        shard = shard_for(branch_id, len(self.runtime.stores))
        ray.get(self.runtime.stores[shard].create.remote(branch_id, messages, True))
        self._locations[branch_id] = shard
        return branch_id

    def new_branch(self, name: str | None = None, messages: list[Any] | None = None) -> str:
        """Create a named branch (a role's conversation) and return its id."""
        branch_id = f"session-{self.id}-{name or uuid.uuid4()}"
        if name is not None and name in self.branches:
            raise OpGraphError(f"branch {name!r} already exists", branch_id=self.branches[name])
        self._create_branch(branch_id, list(messages or []))
        if name is not None:
            self.branches[name] = branch_id
        return branch_id

    def register_operation(self, name: str, fn: Callable[..., Any], *, record_turn: bool = True,
                           timeout: float | None = None) -> None:
        """Register ``async fn(branch, **parameters)``; shipped to workers per run by cloudpickle.

        ``timeout`` (seconds) bounds each call: a hung model or tool call becomes a
        failed operation of type ``OperationTimeout`` instead of a stuck run.
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
        self.operations[name] = RegisteredOperation(fn, record_turn, timeout)

    def register_provider(self, name: str, provider: ModelProvider) -> None:
        """Serve ``name`` (a provider prefix like "scripted", or one "provider/model") with ``provider``.

        Shipped to workers with each run, so a scripted provider built in the driver is
        what operations call. Stateful providers are copied per worker process.
        """
        if not isinstance(provider, ModelProvider):
            raise OpGraphError(f"provider for {name!r} must implement async complete(request)")
        self.providers[name] = provider

    async def messages(self, branch: str) -> list[Any]:
        """A branch's messages, wherever its store shard is."""
        branch_id = self.branches.get(branch, branch)
        shard = self._locations.get(branch_id)
        stores = self.runtime.stores
        if shard is None:
            for index, store in enumerate(stores):
                if await store.has.remote(branch_id):
                    shard = index
                    break
        if shard is None:
            raise OpGraphError("branch not found in any store", branch_id=branch_id)
        return await _call(stores[shard].messages.remote(branch_id))

    def _resolve_branch(self, branch: Any) -> str:
        if branch is None:
            return self.default_branch
        branch_id = str(getattr(branch, "id", branch))
        return self.branches.get(branch_id, branch_id)

    # -- flow -------------------------------------------------------------------------
    def _options(self, *, context, max_concurrent, parallel, reactive, max_spawn, spawn_type,
                 node_builder, default_branch, spawn_branch_setup, reducers, want_signals,
                 want_events, stream_buffer) -> RunOptions:
        if max_concurrent is None:
            max_concurrent = int(os.environ.get("OPGRAPH_MAX_CONCURRENCY", "10000"))
        default_branch_id = self._resolve_branch(default_branch)
        known = dict(self._locations)
        return RunOptions(
            context=context,
            max_concurrent=max_concurrent,
            parallel=parallel,
            reactive=reactive,
            max_spawn=max_spawn,
            spawn_type=spawn_type,
            node_builder=node_builder,
            reducers=reducers,
            default_branch_id=default_branch_id,
            default_store_index=known.get(default_branch_id, 0),
            known_branches=known,
            resources=RunResources(dict(self.operations), dict(self.providers),
                                   {"default_model": self.default_model}),
            spawn_branch_setup=spawn_branch_setup,
            want_signals=want_signals,
            want_events=want_events,
            stream_buffer=stream_buffer,
        )

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
        on_settled: Callable[[FlowEvent], Awaitable[Any]] | None = None,
    ) -> dict[str, Any]:
        """Run ``graph`` on the executor and return the result envelope (ADR-0033 D1).

        Ideal over retrospective: lifecycle signals are emitted for every run and
        drained before return; ``on_branch_created`` fires for reactive clones too.
        ``alcall_params`` is accepted for signature compatibility and has no effect:
        capacity is the executor's counter, not an in-process limiter. ``run_id`` names
        the run (default: a fresh uuid) so another process can ``RunControl.attach`` to it.
        ``on_settled`` (async) is awaited with each settled node's ``FlowEvent``, result
        included, as the run goes: how a run store records outputs before the run ends.
        """
        del alcall_params
        options = self._options(
            context=context, max_concurrent=max_concurrent, parallel=parallel, reactive=reactive,
            max_spawn=max_spawn, spawn_type=spawn_type, node_builder=node_builder,
            default_branch=default_branch, spawn_branch_setup=spawn_branch_setup, reducers=reducers,
            want_signals=bool(on_progress or verbose or on_branch_created),
            want_events=on_settled is not None, stream_buffer=1 << 30,
        )
        run_id = run_id or str(uuid.uuid4())
        executor = self.runtime.executor
        await _start(executor, run_id, graph, options)
        if executor_ref is not None:
            executor_ref["executor"] = RunControl(executor, run_id)
            executor_ref["run_id"] = run_id
        try:
            envelope = await self._drain(run_id, graph, on_progress, on_branch_created, verbose, on_settled)
        except BaseException:
            # Stop the run's remaining work, then re-raise; a dead executor has nothing to stop.
            with contextlib.suppress(ray.exceptions.RayError):
                await executor.cancel.remote(run_id)
            raise
        finally:
            executor.forget_run.remote(run_id)
        return envelope

    async def _drain(self, run_id: str, graph: Graph, on_progress, on_branch_created, verbose,
                     on_event: Callable[[FlowEvent], Any] | None = None) -> dict[str, Any]:
        executor = self.runtime.executor
        while True:
            items, done, result = await _call(executor.next_events.remote(run_id))
            for kind, item in items:
                if kind == "signal":
                    progress = NODE_PROGRESS_KINDS.get(item.kind)
                    if verbose:
                        print(f"[opgraph] {item.kind:<9} {getattr(item, 'name', '') or item.op_id}")
                    if progress is not None and on_progress is not None:
                        on_progress(item.op_id, item.name, progress, item.elapsed)
                elif kind == "branch" and on_branch_created is not None:
                    node_id, branch_id, reactive = item
                    on_branch_created(BranchView(self, branch_id, node_id, reactive))
                elif kind == "event" and on_event is not None:
                    await on_event(item)
            if done:
                if isinstance(result, BaseException):
                    raise result
                self._write_back(graph, result)
                return result

    @staticmethod
    def _write_back(graph: Graph, envelope: dict[str, Any]) -> None:
        """Mirror final statuses and results onto the caller's graph objects."""
        results = envelope.get("operation_results", {})
        for node_id, status in envelope.get("operation_statuses", {}).items():
            node = graph.nodes.get(node_id)
            if node is None:
                continue
            node.status = status
            if status == "completed":
                node.response = results.get(node_id)
            elif status == "failed":
                node.error = str(results.get(node_id, {}).get("error")) if isinstance(results.get(node_id), dict) else None

    def run_control(self, run_id: str) -> RunControl:
        """Control of a run on this session's executor, by id (started here or elsewhere)."""
        return RunControl(self.runtime.executor, run_id)

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
    options = session._options(
        context=context, max_concurrent=max_concurrent, parallel=True, reactive=True,
        max_spawn=max_spawn, spawn_type=spawn_type, node_builder=node_builder,
        default_branch=branch, spawn_branch_setup=None, reducers=None,
        want_signals=verbose, want_events=True, stream_buffer=max(1, buffer),
    )
    run_id = str(uuid.uuid4())
    executor = session.runtime.executor
    await _start(executor, run_id, graph, options)
    finished = False
    try:
        while True:
            items, done, result = await _call(executor.next_events.remote(run_id))
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
            await _call(executor.cancel.remote(run_id))
            while True:
                _, done, _ = await _call(executor.next_events.remote(run_id))
                if done:
                    break
        executor.forget_run.remote(run_id)
