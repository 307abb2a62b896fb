"""OperationWorker: a pool actor that runs registered operations against branches.

Owns the operation boundary. A worker reads the branch, awaits the registered
operation with its prepared parameters, records the turn, and streams typed outcomes
back in batches. It never raises for an operation failure: an exception becomes a
``failed`` outcome with its type and text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from opgraph.kernel import EscalationRequest, ExecutionError, SpawnRequest, extract_requests, to_mapping

from .models import parse_model_id

__all__ = ["BranchStoreLostError", "OperationCall", "OperationWorker", "Outcome", "RegisteredOperation", "RemoteBranch", "RunResources"]


OUTCOME_WINDOW = 0.002  # seconds
OUTCOME_BATCH = 256  # outcomes per streamed message


@dataclass(slots=True)
class OperationCall:
    """One dispatch as the worker receives it (node id and attempt travel with it)."""

    node_id: str
    attempt: int
    operation: str
    parameters: dict[str, Any]
    branch_id: str | None
    store_index: int


@dataclass(slots=True)
class Outcome:
    """What a worker returns for one call; never an exception."""

    node_id: str
    attempt: int
    status: str  # completed | failed | cancelled
    response: Any = None
    error: str | None = None
    error_type: str | None = None
    requests: list[tuple[str, Any, Any, bool]] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0


@dataclass(slots=True)
class RunResources:
    """What a run ships to each worker once: operations, providers and settings."""

    operations: dict[str, Any] = field(default_factory=dict)
    providers: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RegisteredOperation:
    """A user operation: ``async fn(branch, **parameters)``.

    ``record_turn`` appends the instruction and response to the branch; ``timeout``
    (seconds) turns a hung call into a failed outcome of type ``OperationTimeout``.
    """

    fn: Callable[..., Any]
    record_turn: bool = True
    timeout: float | None = None


class RemoteBranch:
    """The branch handle an operation receives: reads and writes go to the BranchStore.

    ``emit(request)`` sends a SpawnRequest or EscalationRequest to the executor while the
    operation is still running (the record's bus delivery).
    """

    def __init__(self, branch_id: str | None, store: Any, run_id: str, node_id: str,
                 executor: Any, emitted: list[tuple[str, Any, Any, bool]],
                 run: RunResources | None = None) -> None:
        self.id = branch_id
        self._store = store
        self.run_id = run_id
        self.node_id = node_id
        self._executor = executor
        self._emitted = emitted
        self._run = run or RunResources()

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
        from .providers import builtin_provider  # local: providers import httpx lazily

        return builtin_provider(provider_name)

    async def messages(self) -> list[Any]:
        if self.id is None:
            return []
        return await _branch_call(self._store.messages.remote(self.id), self.id)

    async def append(self, *messages: Any) -> int:
        if self.id is None:
            return 0
        return await _branch_call(self._store.append.remote(self.id, list(messages)), self.id)

    def emit(self, request: SpawnRequest | EscalationRequest) -> None:
        kind = "escalation" if isinstance(request, EscalationRequest) else "spawn"
        key = (self.node_id, id(request))
        # Keep the object alive (its id is the de-duplication key) and redeliver it with
        # the outcome, so a late live message can never lose the request.
        self._emitted.append((kind, request, key, True))
        if self._executor is not None:
            self._executor.receive_request.remote(self.run_id, self.node_id, kind, request, key)


class BranchStoreLostError(ExecutionError):
    """The BranchStore holding this branch died; its messages cannot be read or written."""


async def _branch_call(ref: Any, branch_id: str) -> Any:
    """Await a store call, translating Ray's errors at this boundary."""
    try:
        return await ref
    except ray.exceptions.RayActorError as exc:
        raise BranchStoreLostError(f"branch store died: {type(exc).__name__}", branch_id=branch_id) from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ExecutionError):
            raise cause from None
        raise ExecutionError(f"branch store call failed: {exc}", branch_id=branch_id) from None


def _settled(task: asyncio.Task, call: OperationCall) -> Outcome:
    """The task's outcome; a task cancelled before it started still yields one."""
    if task.cancelled():
        now = time.time()
        return Outcome(call.node_id, call.attempt, "cancelled", error="cancelled",
                       error_type="Cancelled", started=now, finished=now)
    return task.result()


def _turn_text(response: Any) -> Any:
    """The response as branch-message content: plain data, never a live object."""
    content = to_mapping(response)
    if isinstance(content, (str, int, float, bool, dict, list)) or content is None:
        return content
    return repr(content)


@ray.remote
class OperationWorker:
    """An async actor; thousands of I/O-bound operations share its event loop."""

    def __init__(self, stores: list[Any], index: int = 0) -> None:
        from .executor import tune_garbage_collector  # local: executor imports this module

        tune_garbage_collector()
        self.stores = stores
        self.index = index
        self.runs: dict[str, RunResources] = {}
        # run id -> the executor that owns it, for live emissions. Sent once with
        # ``prepare``: an actor handle in every batch cost a deserialisation per batch.
        self.executors: dict[str, Any] = {}
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.executed = 0
        self.failed = 0
        self.in_flight = 0
        self.peak_in_flight = 0

    async def ping(self) -> int:
        return self.index

    async def prepare(self, run_id: str, resources: RunResources, executor: Any = None) -> int:
        """Load a run's operations, providers and settings (shipped once per run by cloudpickle).

        ``executor`` is the run's owner, which receives what operations ``emit``.
        """
        self.runs[run_id] = resources
        self.executors[run_id] = executor
        return len(resources.operations)

    async def forget(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        self.executors.pop(run_id, None)

    async def cancel(self, run_id: str, node_ids: list[str]) -> int:
        cancelled = 0
        for node_id in node_ids:
            task = self.tasks.get((run_id, node_id))
            if task is not None and not task.done():
                task.cancel()
                cancelled += 1
        return cancelled

    async def run_batch(self, run_id: str, calls: list[OperationCall]):
        """Run calls concurrently; yield lists of outcomes as they finish (a streaming generator)."""
        queue: asyncio.Queue[Outcome] = asyncio.Queue()
        executor = self.executors.get(run_id)
        for call in calls:
            task = asyncio.ensure_future(self._execute(run_id, call, executor))
            self.tasks[(run_id, call.node_id)] = task
            task.add_done_callback(lambda t, q=queue, c=call: q.put_nowait(_settled(t, c)))
        remaining = len(calls)
        while remaining:
            batch = [await queue.get()]
            if remaining > 1:
                # A short window gathers outcomes that finish together into one message.
                await asyncio.sleep(OUTCOME_WINDOW)
            while not queue.empty() and len(batch) < OUTCOME_BATCH:
                batch.append(queue.get_nowait())
            remaining -= len(batch)
            for outcome in batch:
                self.tasks.pop((run_id, outcome.node_id), None)
            yield batch

    async def _execute(self, run_id: str, call: OperationCall, executor: Any) -> Outcome:
        started = time.time()
        emitted: list[tuple[str, Any, Any, bool]] = []
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            resources = self.runs.get(run_id) or RunResources()
            registered = resources.operations.get(call.operation)
            if registered is None:
                known = ", ".join(sorted(resources.operations)) or "none"
                return Outcome(call.node_id, call.attempt, "failed",
                               error=f"operation {call.operation!r} is not registered (known: {known})",
                               error_type="OperationError", started=started, finished=time.time())
            store = self.stores[call.store_index] if self.stores else None
            branch = RemoteBranch(call.branch_id, store, run_id, call.node_id, executor, emitted, resources)
            if registered.timeout is None:
                response = await registered.fn(branch, **call.parameters)
            else:
                try:
                    response = await asyncio.wait_for(registered.fn(branch, **call.parameters), registered.timeout)
                except asyncio.TimeoutError:
                    self.failed += 1
                    return Outcome(call.node_id, call.attempt, "failed",
                                   error=f"operation {call.operation!r} exceeded its {registered.timeout} s timeout",
                                   error_type="OperationTimeout", requests=list(emitted),
                                   started=started, finished=time.time())
            if registered.record_turn and call.branch_id is not None and store is not None:
                turn = [{"role": "user", "content": call.parameters.get("instruction", "")},
                        {"role": "assistant", "content": _turn_text(response)}]
                await _branch_call(store.append.remote(call.branch_id, turn), call.branch_id)
            requests = list(emitted)
            for found in extract_requests(response, (SpawnRequest, EscalationRequest)):
                kind = "escalation" if isinstance(found, EscalationRequest) else "spawn"
                # The same object as a live emission shares its key: a true second
                # sighting, which the scheduler records as a duplicate.
                requests.append((kind, found, (call.node_id, id(found)), False))
            self.executed += 1
            return Outcome(call.node_id, call.attempt, "completed", response=response,
                           requests=requests, started=started, finished=time.time())
        except asyncio.CancelledError:
            return Outcome(call.node_id, call.attempt, "cancelled", error="cancelled",
                           error_type="Cancelled", requests=list(emitted), started=started, finished=time.time())
        except Exception as exc:  # an operation failure is an outcome, never a raise
            self.failed += 1
            return Outcome(call.node_id, call.attempt, "failed", error=str(exc) or type(exc).__name__,
                           error_type=type(exc).__name__, requests=list(emitted),
                           started=started, finished=time.time())
        finally:
            self.in_flight -= 1

    async def statistics(self) -> dict[str, Any]:
        import resource  # local: only statistics reads process memory

        from .providers.limits import latency_totals, usage_totals  # local: providers import httpx lazily

        return {
            "index": self.index,
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "executed": self.executed,
            "failed": self.failed,
            "runs": len(self.runs),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            # Model calls run in this process, so its totals are this worker's provider usage.
            "providers": usage_totals(),
            "provider_latency": latency_totals(),
        }
