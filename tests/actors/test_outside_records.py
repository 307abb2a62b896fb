"""What happens outside the records: a hung call, and an outcome reported from outside.

Dead workers, stores and executors are tests/actors/test_supervision.py's.
"""

from __future__ import annotations

import asyncio
import uuid

from running import run

from opgraph.kernel import Graph, create_operation


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
