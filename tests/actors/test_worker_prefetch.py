"""A worker fetches a run's operations when the executor admits the run, not when its first call
arrives; a fetch answered after the run was forgotten is handed over but never kept.

The worker's own class runs here without Ray, its executor a stand-in whose answer the test
releases, so the order of fetch, forget and answer is the test's to choose.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from opgraph.actors.protocol import RunResources
from opgraph.actors.workers import OperationWorker

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


def test_a_prefetched_run_is_fetched_once_and_its_first_call_finds_it_here():
    """prefetch, then a call's lookup while the fetch is out: one round trip, both get the
    resources, and the worker keeps them for the run."""
    resources = RunResources()

    async def go():
        executor = _HeldExecutor({"run-1": resources})
        worker = _worker(executor)
        prefetching = asyncio.ensure_future(worker.prefetch("run-1"))
        await asyncio.sleep(0)
        looking = asyncio.ensure_future(worker._resources_for("run-1"))
        await asyncio.sleep(0)
        executor.release.set()
        await prefetching
        return worker, executor, await looking

    worker, executor, found = asyncio.run(go())
    assert found is resources and worker.resources == {"run-1": resources}
    assert executor.asked == ["run-1"] and (worker.resource_fetches, worker.prefetches) == (1, 1)


def test_a_fetch_answered_after_its_run_was_forgotten_is_not_kept():
    """forget arrives while the prefetch waits for its answer: the answer is not kept, so a
    run that ended early leaves nothing behind; a later run's prefetch is kept as usual."""

    async def go():
        executor = _HeldExecutor({"run-1": RunResources(), "run-2": RunResources()})
        worker = _worker(executor)
        prefetching = asyncio.ensure_future(worker.prefetch("run-1"))
        await asyncio.sleep(0)
        await worker.forget("run-1")
        executor.release.set()
        await prefetching
        kept_after_forget = dict(worker.resources)
        await worker.prefetch("run-2")
        return worker, kept_after_forget

    worker, kept_after_forget = asyncio.run(go())
    assert kept_after_forget == {}
    assert list(worker.resources) == ["run-2"] and worker._forgotten_fetches == set()


def test_a_prefetch_that_fails_raises_nothing_and_leaves_the_first_call_to_fail_typed():
    async def go():
        executor = _HeldExecutor({})
        executor.release.set()
        worker = _worker(executor)
        await worker.prefetch("unknown-run")  # swallowed: nobody waits on a prefetch
        assert worker.resources == {}
        with pytest.raises(Exception, match="unknown-run"):
            await worker._resources_for("unknown-run")
        return worker

    worker = asyncio.run(go())
    assert worker.resource_fetches == 2 and worker.prefetches == 1
