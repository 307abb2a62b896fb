"""A call's path through a worker goes through no method of the actor class.

Ray wraps every method of an actor class in a tracing shim (an extra call, and for an
async method an extra coroutine, even with tracing off). Per call, that cost sits where a
fan-out's waves turn over (issue #18), so the per-call steps are module functions. Here
the worker's own class runs without Ray, with every method wrapped in a counter the way
Ray wraps them: a batch of 50 calls must cost as many method calls as a batch of 5.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections import Counter
from typing import Any

from opgraph.actors.protocol import ACKNOWLEDGED, RegisteredOperation, RunResources
from opgraph.actors.workers.worker import OperationWorker

Worker = OperationWorker.__ray_actor_class__


def _counted_class(counts: Counter) -> type:
    """``Worker`` with every method Ray would wrap (not static, class or generator methods)
    counting its calls."""
    namespace: dict[str, Any] = {}
    for name, member in inspect.getmembers(Worker, inspect.isfunction):
        static = inspect.getattr_static(Worker, name)
        if isinstance(static, (staticmethod, classmethod)) or name == "__del__":
            continue
        if inspect.isgeneratorfunction(member) or inspect.isasyncgenfunction(member):
            continue
        if inspect.iscoroutinefunction(member):
            async def wrapper(self, *args, _method=member, _name=name, **kwargs):
                counts[_name] += 1
                return await _method(self, *args, **kwargs)
        else:
            def wrapper(self, *args, _method=member, _name=name, **kwargs):
                counts[_name] += 1
                return _method(self, *args, **kwargs)
        namespace[name] = functools.wraps(member)(wrapper)
    return type("CountedWorker", (Worker,), namespace)


async def _echo(branch: Any, value: int = 0) -> int:
    await asyncio.sleep(0)
    return value


def _calls(count: int, first: int = 0) -> list[tuple]:
    return [(f"node-{first + i}", 1, "echo", {"value": first + i}, None, 0) for i in range(count)]


def _batch_method_calls(count: int) -> tuple[Counter, list]:
    counts: Counter = Counter()
    worker = _counted_class(counts)(index=0, name="opgraph-worker-test")
    worker.resources["run-1"] = RunResources(operations={"echo": RegisteredOperation(_echo, record_turn=False)})
    counts.clear()  # what the constructor called is not the call path

    async def go() -> list:
        return [item async for item in worker.batches("run-1", _calls(count))]

    return counts, asyncio.run(go())


def test_a_batch_calls_no_method_per_call():
    few, few_items = _batch_method_calls(5)
    many, many_items = _batch_method_calls(50)
    assert few_items[0] == ACKNOWLEDGED and many_items[0] == ACKNOWLEDGED  # the stream opens acknowledged
    rows = [row for item in many_items[1:] for row in item]
    assert sorted(row[3] for row in rows) == list(range(50))
    assert {row[2] for row in rows} == {"completed"}
    assert many == few, f"method calls grew with the batch: {dict(few)} for 5 calls, {dict(many)} for 50"


def test_a_single_call_costs_only_its_own_entry_point():
    """``start_one`` (the direct channel's path for a chain's every link) is the one method
    a single call goes through; its task and its answer are not methods."""
    counts: Counter = Counter()
    worker = _counted_class(counts)(index=0, name="opgraph-worker-test")
    worker.resources["run-1"] = RunResources(operations={"echo": RegisteredOperation(_echo, record_turn=False)})
    counts.clear()

    async def go() -> list:
        answered = asyncio.get_running_loop().create_future()
        assert worker.start_one("run-1", _calls(1, first=7)[0], 0, answer=answered.set_result)
        return await answered

    rows = asyncio.run(go())
    assert [(row[0], row[2], row[3]) for row in rows] == [("node-7", "completed", 7)]
    assert counts == Counter({"start_one": 1})
    assert worker.tasks == {}  # its task was let go when it answered
