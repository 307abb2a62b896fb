"""A run's operations reach a worker with the run's first call there (shipped, pickled), or
else are fetched from its executor, once; nothing of a forgotten run is kept either way.

The worker's own class runs here without Ray, its executor a stand-in whose answer the test
releases, so the order of fetch, forget and answer is the test's to choose.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray import cloudpickle

from opgraph.actors.protocol import RegisteredOperation, RunResources
from opgraph.actors.workers.worker import OperationWorker

Worker = OperationWorker.__ray_actor_class__


class _Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> Any:
        return self.answer(*args)


class _HeldExecutor:
    """Answers ``resources(key)`` once the test releases it; a key it does not know raises."""

    def __init__(self, known: dict[str, RunResources]) -> None:
        self.known = known
        self.release = asyncio.Event()
        self.asked: list[str] = []
        self.resources = _Method(self._resources)

    async def _resources(self, key: str) -> RunResources:
        self.asked.append(key)
        await self.release.wait()
        if key not in self.known:
            raise LookupError(f"nothing registered under {key!r}")
        return self.known[key]


def _worker(executor: _HeldExecutor) -> Any:
    return Worker(index=0, executor=executor, name="opgraph-worker-test")


async def _double(branch: Any, value: int = 0) -> int:
    return 2 * value


def _shipped(**operations: Any) -> bytes:
    return cloudpickle.dumps(RunResources(operations={name: RegisteredOperation(fn, record_turn=False)
                                                      for name, fn in operations.items()}))


def _call(node_id: str, value: int) -> tuple:
    return (node_id, 1, "double", {"value": value}, None, 0)


async def _rows(worker: Any, run_id: str, calls: list[tuple], shipped: bytes | None = None) -> list[tuple]:
    items = [item async for item in worker.batches(run_id, calls, 0, shipped)]
    return [row for item in items[1:] for row in item]


def test_resources_shipped_with_a_first_batch_are_kept_and_nothing_is_fetched():
    """The first batch brings them; the run's next batch, without them, finds them here."""

    async def go():
        executor = _HeldExecutor({})
        worker = _worker(executor)
        first = await _rows(worker, "run-1", [_call("a", 1), _call("b", 2)], _shipped(double=_double))
        later = await _rows(worker, "run-1", [_call("c", 3)])
        return worker, executor, first, later

    worker, executor, first, later = asyncio.run(go())
    assert sorted((row[0], row[2], row[3]) for row in first) == [("a", "completed", 2), ("b", "completed", 4)]
    assert [(row[0], row[3]) for row in later] == [("c", 6)]
    assert list(worker.resources) == ["run-1"] and executor.asked == []
    assert (worker.resources_shipped, worker.resource_fetches) == (1, 0)


def test_a_single_call_takes_shipped_resources_on_the_fast_path():
    """start_one (the channel's path for a run's only call in flight) starts the call with the
    resources it brought, instead of declining for want of them."""

    async def go():
        worker = _worker(_HeldExecutor({}))
        answered = asyncio.get_running_loop().create_future()
        started = worker.start_one("run-1", _call("a", 5), 0, _shipped(double=_double), answer=answered.set_result)
        return worker, started, await answered

    worker, started, rows = asyncio.run(go())
    assert started and [(row[0], row[2], row[3]) for row in rows] == [("a", "completed", 10)]
    assert list(worker.resources) == ["run-1"] and worker.resource_fetches == 0


def test_resources_shipped_for_a_forgotten_run_serve_its_call_but_are_not_kept():
    """The call and the forget travel apart (a socket, and Ray): a call that arrives after its
    run was forgotten still gets its outcome, and leaves nothing behind."""

    async def go():
        worker = _worker(_HeldExecutor({}))
        await worker.forget("run-1")
        rows = await _rows(worker, "run-1", [_call("a", 4)], _shipped(double=_double))
        return worker, rows

    worker, rows = asyncio.run(go())
    assert [(row[0], row[2], row[3]) for row in rows] == [("a", "completed", 8)]
    assert worker.resources == {}


def test_a_worker_remembers_a_bounded_number_of_forgotten_runs():
    from opgraph.actors.workers.worker import FORGOTTEN_KEPT

    async def go():
        worker = _worker(_HeldExecutor({}))
        for index in range(FORGOTTEN_KEPT + 5):
            await worker.forget(f"run-{index}")
        return worker

    worker = asyncio.run(go())
    assert len(worker.forgotten) == FORGOTTEN_KEPT
    assert "run-0" not in worker.forgotten and f"run-{FORGOTTEN_KEPT + 4}" in worker.forgotten


def test_shipped_resources_that_will_not_unpickle_fail_every_call_typed():
    """A worker that cannot load what was shipped (here: not a pickle) fails each call of the
    batch with the reason, keeps nothing, and goes on; the fast path declines instead."""

    async def go():
        worker = _worker(_HeldExecutor({}))
        rows = await _rows(worker, "run-1", [_call("a", 1), _call("b", 2)], b"not a pickle")
        declined = worker.start_one("run-1", _call("c", 3), 0, b"not a pickle", answer=lambda rows: None)
        return worker, rows, declined

    worker, rows, declined = asyncio.run(go())
    assert sorted(row[0] for row in rows) == ["a", "b"]
    assert {row[2] for row in rows} == {"failed"} and all(row[5] == "UnpicklingError" for row in rows)
    assert not declined and worker.resources == {}


def test_a_lookup_while_a_fetch_is_out_joins_it():
    """Two calls of a run that arrived without its resources: one round trip, both get them,
    and the worker keeps them for the run."""
    resources = RunResources()

    async def go():
        executor = _HeldExecutor({"run-1": resources})
        worker = _worker(executor)
        first = asyncio.ensure_future(worker._resources_for("run-1"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(worker._resources_for("run-1"))
        await asyncio.sleep(0)
        executor.release.set()
        return worker, executor, await first, await second

    worker, executor, first, second = asyncio.run(go())
    assert first is resources and second is resources and worker.resources == {"run-1": resources}
    assert executor.asked == ["run-1"] and worker.resource_fetches == 1


def test_a_fetch_answered_after_its_run_was_forgotten_is_not_kept():
    """forget arrives while a fetch waits for its answer: the answer is handed to its caller
    but not kept, so a run that ended early leaves nothing behind; a later run's is kept."""

    async def go():
        executor = _HeldExecutor({"run-1": RunResources(), "run-2": RunResources()})
        worker = _worker(executor)
        fetching = asyncio.ensure_future(worker._resources_for("run-1"))
        await asyncio.sleep(0)
        await worker.forget("run-1")
        executor.release.set()
        handed = await fetching
        kept_after_forget = dict(worker.resources)
        await worker._resources_for("run-2")
        return worker, handed, kept_after_forget

    worker, handed, kept_after_forget = asyncio.run(go())
    assert isinstance(handed, RunResources) and kept_after_forget == {}
    assert list(worker.resources) == ["run-2"] and worker._forgotten_fetches == set()


def test_a_fetch_that_fails_is_not_kept_and_every_call_fails_typed():
    async def go():
        executor = _HeldExecutor({})
        executor.release.set()
        worker = _worker(executor)
        with pytest.raises(Exception, match="unknown-run"):
            await worker._resources_for("unknown-run")
        rows = await _rows(worker, "unknown-run", [_call("a", 1)])
        return worker, rows

    worker, rows = asyncio.run(go())
    assert worker.resources == {} and worker.resource_fetches == 2
    assert [(row[0], row[2]) for row in rows] == [("a", "failed")] and "unknown-run" in rows[0][4]
