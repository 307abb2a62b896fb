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
from functools import partial
from typing import Any

import ray

from opgraph.kernel import EscalationRequest, ExecutionError, SpawnRequest, extract_requests, to_mapping
from opgraph.kernel.contracts import PLAIN_TYPES

from .models import parse_model_id

__all__ = [
    "BranchStoreLostError", "CallRow", "OperationWorker", "Outcome", "OutcomeRow", "RegisteredOperation", "RemoteBranch",
    "RunResources",
]


OUTCOME_WINDOW = 0.002  # seconds
OUTCOME_BATCH = 256  # outcomes per streamed message

# A call travels to a worker, and its outcome travels back, as a plain tuple: a batch of
# builtin tuples pickles in C, where a dataclass per item cost ~6 us each way in Python
# reduce and setstate, the largest per-node cost of a 10,000-node fan-out. (DESIGN.md
# names pydantic models through the kernel's msgpack codec as the wire format; on this
# per-node path that would cost more still, so these rows are a deliberate exception.)
#   CallRow:    (node_id, attempt, operation, parameters, branch_id, store_index)
#   OutcomeRow: (node_id, attempt, status, response, error, error_type, requests, started, finished)
# ``requests`` is a list of (kind, request, dedupe key, redelivery).
CallRow = tuple[str, int, str, dict[str, Any], "str | None", int]
OutcomeRow = tuple[str, int, str, Any, "str | None", "str | None", list, float, float]


@dataclass(slots=True)
class Outcome:
    """What a worker returns for one call, never an exception; ``row()`` is its wire form."""

    node_id: str
    attempt: int
    status: str  # completed | failed | cancelled
    response: Any = None
    error: str | None = None
    error_type: str | None = None
    requests: list[tuple[str, Any, Any, bool]] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0

    def row(self) -> OutcomeRow:
        return (self.node_id, self.attempt, self.status, self.response, self.error, self.error_type,
                self.requests, self.started, self.finished)


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
                 run: RunResources | None = None, live: LiveEmissions | None = None) -> None:
        self.id = branch_id
        self._store = store
        self.run_id = run_id
        self.node_id = node_id
        self._executor = executor
        self._emitted = emitted
        self._run = run or RunResources()
        self._live = live

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
        if self._executor is None:
            return
        if self._live is None or not self._live.add(self.run_id, self._executor, (self.node_id, kind, request, key)):
            self._executor.receive_request.remote(self.run_id, self.node_id, kind, request, key)


class LiveEmissions:
    """What a worker's operations emit while running, sent to each run's executor in one
    message per ``OUTCOME_WINDOW``.

    One tell per request cost a Ray call and an admission pass each: an operation that
    emits 1,000 spawns in a loop sent 1,000 messages. Gathered, they travel as one list
    (``GraphExecutor.receive_requests``), in emission order.
    """

    def __init__(self) -> None:
        self._pending: dict[str, tuple[Any, list[tuple[str, str, Any, Any]]]] = {}

    def add(self, run_id: str, executor: Any, item: tuple[str, str, Any, Any]) -> bool:
        """Queue ``(emitter_id, kind, request, key)``; False off the worker's event loop
        (an operation emitting from a thread), where the caller sends it at once instead."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        entry = self._pending.get(run_id)
        if entry is None:
            entry = self._pending[run_id] = (executor, [])
            loop.call_later(OUTCOME_WINDOW, self._send, run_id)
        entry[1].append(item)
        return True

    def _send(self, run_id: str) -> None:
        executor, items = self._pending.pop(run_id)
        executor.receive_requests.remote(run_id, items)


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


def _collect(done: list[OutcomeRow], wake: asyncio.Event, call: CallRow, task: asyncio.Task) -> None:
    """A call's task finished: queue its outcome row (a task cancelled before it ran yields one too)."""
    if task.cancelled():
        now = time.time()
        done.append((call[0], call[1], "cancelled", None, "cancelled", "Cancelled", [], now, now))
    else:
        done.append(task.result())
    wake.set()


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
        self.live = LiveEmissions()
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

    async def run_one(self, run_id: str, call: CallRow) -> list[OutcomeRow]:
        """Run a single call and answer with its outcome row (a plain call, not a stream).

        The batch loop with one call: its outcome is the whole batch, so no window waits.
        """
        return [row async for batch in self.run_batch(run_id, [call]) for row in batch]

    async def run_batch(self, run_id: str, calls: list[CallRow]):
        """Run calls concurrently; yield lists of outcome rows as they finish (a streaming generator)."""
        resources = self.runs.get(run_id) or RunResources()
        executor = self.executors.get(run_id)
        done: list[OutcomeRow] = []
        wake = asyncio.Event()
        tasks = self.tasks
        for call in calls:
            task = asyncio.ensure_future(_execute(self, run_id, call, resources, executor))
            tasks[(run_id, call[0])] = task
            task.add_done_callback(partial(_collect, done, wake, call))
        remaining = len(calls)
        while remaining:
            if not done:
                wake.clear()
                await wake.wait()
            if remaining > len(done):
                # A short window gathers outcomes that finish together into one message.
                await asyncio.sleep(OUTCOME_WINDOW)
            batch = done[:OUTCOME_BATCH]
            del done[:OUTCOME_BATCH]
            remaining -= len(batch)
            for row in batch:
                tasks.pop((run_id, row[0]), None)
            yield batch

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


async def _execute(worker: OperationWorker, run_id: str, call: CallRow, resources: RunResources,
                   executor: Any) -> OutcomeRow:
    """Run one call to its outcome row. A function, not a method: Ray wraps every method of
    an actor class in a tracing shim, a cost per call this path (once per node) need not pay.
    """
    node_id, attempt, operation, parameters, branch_id, store_index = call
    started = time.time()
    emitted: list[tuple[str, Any, Any, bool]] = []
    worker.in_flight += 1
    if worker.in_flight > worker.peak_in_flight:
        worker.peak_in_flight = worker.in_flight
    try:
        registered = resources.operations.get(operation)
        if registered is None:
            known = ", ".join(sorted(resources.operations)) or "none"
            return (node_id, attempt, "failed", None,
                    f"operation {operation!r} is not registered (known: {known})", "OperationError", [],
                    started, time.time())
        store = worker.stores[store_index] if worker.stores else None
        branch = RemoteBranch(branch_id, store, run_id, node_id, executor, emitted, resources, worker.live)
        if registered.timeout is None:
            response = await registered.fn(branch, **parameters)
        else:
            try:
                response = await asyncio.wait_for(registered.fn(branch, **parameters), registered.timeout)
            except asyncio.TimeoutError:
                worker.failed += 1
                return (node_id, attempt, "failed", None,
                        f"operation {operation!r} exceeded its {registered.timeout} s timeout", "OperationTimeout",
                        list(emitted), started, time.time())
        if registered.record_turn and branch_id is not None and store is not None:
            turn = [{"role": "user", "content": parameters.get("instruction", "")},
                    {"role": "assistant", "content": _turn_text(response)}]
            await _branch_call(store.append.remote(branch_id, turn), branch_id)
        requests = list(emitted)
        if type(response) not in PLAIN_TYPES:  # nothing to walk
            for found in extract_requests(response, (SpawnRequest, EscalationRequest)):
                kind = "escalation" if isinstance(found, EscalationRequest) else "spawn"
                # The same object as a live emission shares its key: a true second
                # sighting, which the scheduler records as a duplicate.
                requests.append((kind, found, (node_id, id(found)), False))
        worker.executed += 1
        return (node_id, attempt, "completed", response, None, None, requests, started, time.time())
    except asyncio.CancelledError:
        return (node_id, attempt, "cancelled", None, "cancelled", "Cancelled", list(emitted), started, time.time())
    except Exception as exc:  # an operation failure is an outcome, never a raise
        worker.failed += 1
        return (node_id, attempt, "failed", None, str(exc) or type(exc).__name__, type(exc).__name__,
                list(emitted), started, time.time())
    finally:
        worker.in_flight -= 1

