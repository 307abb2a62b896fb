"""What happens outside the records: a hung call, a dead branch store, a dead executor.

Each case kills or stalls something on purpose and asserts a typed outcome. The store
and executor cases use a runtime of their own (another namespace), so the shared
session's actors are never harmed.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import ray

from opgraph.actors import RuntimeLostError, Session
from opgraph.kernel import Graph, create_operation


def run(coroutine, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def fan_out(operation: str, count: int) -> Graph:
    graph = Graph("fan-out")
    for index in range(count):
        graph.add_node(create_operation(operation, {"instruction": f"node {index}"}))
    return graph


def test_a_hung_operation_times_out_as_a_typed_failure_and_the_run_goes_on(session):
    """hangs (never returns) | quick: the hung node fails with OperationTimeout, quick completes."""

    async def hangs(branch, **parameters):
        await asyncio.sleep(3600)

    async def quick(branch, **parameters):
        return "done"

    session.register_operation("hangs_for_timeout", hangs, timeout=0.3)
    session.register_operation("quick_beside_hang", quick)
    graph = Graph("hang")
    hung = graph.add_node(create_operation("hangs_for_timeout", {"instruction": "wait forever"}))
    fine = graph.add_node(create_operation("quick_beside_hang", {"instruction": "go"}))

    envelope = run(session.flow(graph), timeout=30)

    assert envelope["operation_statuses"] == {hung.id: "failed", fine.id: "completed"}
    assert envelope["operation_results"][hung.id]["error_type"] == "OperationTimeout"
    assert envelope["status"] == "failed"


@pytest.fixture()
def isolated(session):
    """A runtime of its own (executor, worker, store) in a throwaway namespace."""
    own = Session(namespace=f"opgraph-kill-{uuid.uuid4().hex[:8]}", workers=1)
    yield own
    for handle in [own.runtime.executor, *own.runtime.workers, *own.runtime.stores]:
        try:
            ray.kill(handle)
        except ValueError:  # already dead
            pass


def test_a_dead_branch_store_fails_the_nodes_that_touch_it_with_a_typed_error(isolated):
    """reads_branch x3: the store dies while they wait; each fails with BranchStoreLostError."""

    async def reads_branch(branch, **parameters):
        await asyncio.sleep(0.5)
        return await branch.messages()

    isolated.register_operation("reads_branch", reads_branch, record_turn=False)

    async def scenario():
        flow = asyncio.ensure_future(isolated.flow(fan_out("reads_branch", 3), max_concurrent=3))
        await asyncio.sleep(0.2)
        ray.kill(isolated.runtime.stores[0])
        return await flow

    envelope = run(scenario(), timeout=60)

    assert set(envelope["operation_statuses"].values()) == {"failed"}
    assert {result["error_type"] for result in envelope["operation_results"].values()} == {"BranchStoreLostError"}


def test_a_dead_executor_raises_runtime_lost_instead_of_hanging(isolated):
    """slow x4: the executor is killed mid-run; flow() raises RuntimeLostError promptly."""

    async def slow(branch, **parameters):
        await asyncio.sleep(5)

    isolated.register_operation("slow_until_killed", slow, record_turn=False)

    async def scenario():
        flow = asyncio.ensure_future(isolated.flow(fan_out("slow_until_killed", 4), max_concurrent=4))
        await asyncio.sleep(0.5)
        ray.kill(isolated.runtime.executor)
        return await flow

    with pytest.raises(RuntimeLostError):
        run(scenario(), timeout=30)


def test_an_outcome_reported_from_outside_settles_the_node(session, gauge):
    """held (in flight on a worker); an external worker reports its outcome first through
    ``GraphExecutor.report``: the node completes with that response and the run returns
    without waiting for the pool's copy, whose late outcome finds the run forgotten."""
    from opgraph.actors import Outcome

    async def held(branch, hold: str, **parameters):
        entered = gauge.enter.remote(hold)
        await entered
        await gauge.wait_released.remote(hold)
        return "from the pool"

    session.register_operation("held_for_report", held)
    graph = Graph("reported")
    node = graph.add_node(create_operation("held_for_report", {"hold": "report"}))
    run_id = f"reported-{uuid.uuid4().hex[:8]}"
    executor = session.runtime.executor

    async def scenario():
        flow = asyncio.create_task(session.flow(graph, run_id=run_id))
        await asyncio.wait_for(gauge.wait_entered.remote("report", 1), 30)
        await executor.report.remote(run_id, [Outcome(node.id, 1, "completed", response="from outside")])
        envelope = await flow
        await gauge.release.remote("report")
        return envelope

    envelope = run(scenario())

    assert envelope["operation_statuses"] == {node.id: "completed"}
    assert envelope["operation_results"][node.id] == "from outside"
