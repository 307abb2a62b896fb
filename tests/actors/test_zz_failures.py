"""A worker process killed mid-operation: typed failures, no stranded waiter, a working pool after.

Named to run last in tests/actors: it kills one of the shared OperationWorkers (the
executor starts a replacement), and the second test checks that the pool recovered.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from opgraph.kernel import OperationGraphBuilder

FLOW_TIMEOUT = 60.0
SIGNAL_TIMEOUT = 30.0
LABELS = ("n0", "n1", "n2", "n3")


def run(coroutine: Any) -> Any:
    """Drive one test's coroutine; a run that hangs fails the test instead."""
    return asyncio.run(asyncio.wait_for(coroutine, FLOW_TIMEOUT))


def held_operation(gauge: Any):
    """An operation that tells the Gauge which worker runs it, then holds until ``key`` is released."""

    async def held(branch: Any, key: str, label: str, **parameters: Any) -> str:
        worker = ray.get_runtime_context().get_actor_id()
        entered = gauge.enter.remote(key, label, worker)
        try:
            await entered
            await gauge.wait_released.remote(key)
        finally:
            await gauge.exit.remote(key)
        return label

    return held


class Failures:
    """on_progress that counts failed nodes; ``wait_count(n)`` returns once n have failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.changed = asyncio.Event()

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        if status == "failed":
            self.failed.append(op_id)
            self.changed.set()

    async def wait_count(self, count: int) -> None:
        while len(self.failed) < count:
            self.changed.clear()
            await self.changed.wait()


def labelled_fan_out(operation: str, key: str) -> tuple[Any, dict[str, str]]:
    builder = OperationGraphBuilder("labelled")
    ids = {label: builder.add_operation(operation, depends_on=[], key=key, label=label) for label in LABELS}
    return builder.get_graph(), ids


def test_killing_a_worker_mid_operation_fails_only_its_operations(session, gauge):
    """n0..n3 (independent, held in flight) spread over the pool; one worker is killed mid-run.

    The nodes it held fail with error_type WorkerDied, the others complete, and flow
    returns instead of waiting for outcomes that will never come.
    """
    session.register_operation("held", held_operation(gauge), record_turn=False)
    graph, ids = labelled_fan_out("held", "kill")

    failures = Failures()

    async def scenario() -> tuple[dict[str, Any], dict[str, str], str]:
        flow = asyncio.create_task(session.flow(graph, max_concurrent=len(LABELS), on_progress=failures))
        await asyncio.wait_for(gauge.wait_entered.remote("kill", len(LABELS)), SIGNAL_TIMEOUT)
        placement = await gauge.worker_of.remote("kill")
        victim = placement["n0"]
        [handle] = [w for w in session.runtime.workers if w._actor_id.hex() == victim]
        ray.kill(handle, no_restart=True)
        # Release the survivors only once the victim's nodes have failed, so that none of
        # them can slip out a result before the kill lands.
        on_victim = sum(1 for worker in placement.values() if worker == victim)
        await asyncio.wait_for(failures.wait_count(on_victim), SIGNAL_TIMEOUT)
        await gauge.release.remote("kill")
        return await flow, placement, victim

    envelope, placement, victim = run(scenario())

    on_victim = {ids[label] for label, worker in placement.items() if worker == victim}
    elsewhere = set(ids.values()) - on_victim
    assert elsewhere, "the fan-out should have been spread over both workers"
    statuses = envelope["operation_statuses"]
    assert {node_id for node_id, status in statuses.items() if status == "failed"} == on_victim
    assert {node_id for node_id, status in statuses.items() if status == "completed"} == elsewhere
    assert all(envelope["operation_results"][node_id]["error_type"] == "WorkerDied" for node_id in on_victim)
    assert envelope["status"] == "failed"
    assert sorted(envelope["failed_operations"]) == sorted(on_victim)


def test_a_lone_call_whose_worker_dies_fails_with_worker_died(session, gauge):
    """n0 alone (sent as one plain call, not a stream) is held; its worker is killed: it fails, typed."""
    session.register_operation("held_alone", held_operation(gauge), record_turn=False)
    builder = OperationGraphBuilder("lone")
    node = builder.add_operation("held_alone", depends_on=[], key="lone", label="n0")
    graph = builder.get_graph()

    async def scenario() -> dict[str, Any]:
        flow = asyncio.create_task(session.flow(graph))
        await asyncio.wait_for(gauge.wait_entered.remote("lone", 1), SIGNAL_TIMEOUT)
        victim = (await gauge.worker_of.remote("lone"))["n0"]
        # By name: an earlier test killed a worker, and its replacement is not in the
        # session's own list of handles.
        pool = [ray.get_actor(f"opgraph-worker-{i}") for i in range(len(session.runtime.workers))]
        [handle] = [w for w in pool if w._actor_id.hex() == victim]
        ray.kill(handle, no_restart=True)
        return await flow

    envelope = run(scenario())

    assert envelope["operation_statuses"] == {node: "failed"}
    assert envelope["operation_results"][node]["error_type"] == "WorkerDied"


def test_the_pool_runs_flows_after_a_worker_died(session, gauge):
    """n0..n3 again, after the kill: every node completes on live workers."""
    session.register_operation("held_after_kill", held_operation(gauge), record_turn=False)
    graph, ids = labelled_fan_out("held_after_kill", "after-kill")
    ray.get(gauge.release.remote("after-kill"))  # nothing to hold this time

    envelope = run(session.flow(graph, max_concurrent=len(LABELS)))

    assert envelope["status"] == "completed"
    assert envelope["completed_operations"] == list(ids.values())
    statistics = ray.get(session.runtime.executor.statistics.remote())
    assert statistics["worker_deaths"] >= 1
    assert statistics["workers"] == len(session.runtime.workers)
