"""Live run control through ``executor_ref``: pause, resume, operator steer and cancel.

Control calls travel on the executor's own concurrency group while operations are in
flight in the worker pool; the tests wait on lifecycle signals, never on sleeps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray
from gauged_operations import gauged_operation
from running import run

from opgraph.kernel import Graph, OperationGraphBuilder

SIGNAL_TIMEOUT = 30.0


def fan_out(operation: str, count: int, **parameters: Any) -> Graph:
    builder = OperationGraphBuilder("fan-out")
    for _ in range(count):
        builder.add_operation(operation, depends_on=[], **parameters)
    return builder.get_graph()


class Started:
    """on_progress that sets an event when a node starts (and remembers which did)."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.started: list[str] = []

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        if status == "started":
            self.started.append(op_id)
            self.first.set()


async def watch_dispatches(control: Any, baseline: int, dispatched: asyncio.Event) -> None:
    """Set ``dispatched`` as soon as the run has dispatched more than ``baseline`` operations."""
    while True:
        if (await control.status())["dispatched"] > baseline:
            dispatched.set()
            return
        await asyncio.sleep(0.05)


def test_operator_steer_is_rendered_into_the_next_dispatched_operation_only(session, gauge):
    """a -> b -> c: steer while a is held in flight (pause, message, resume, release a).

    b, the next operation dispatched, carries the steer; c does not.
    """

    async def echo_instruction(branch: Any, instruction: str = "", hold: str | None = None,
                               **parameters: Any) -> str:
        if hold is not None:
            await gauge.wait_released.remote(hold)
        return instruction

    session.register_operation("echo_instruction", echo_instruction, record_turn=False)
    builder = OperationGraphBuilder("steer")
    a = builder.add_operation("echo_instruction", instruction="step a", hold="steer")
    b = builder.add_operation("echo_instruction", instruction="step b")
    c = builder.add_operation("echo_instruction", instruction="step c")
    started = Started()
    executor_ref: dict[str, Any] = {}

    async def scenario() -> dict[str, Any]:
        flow = asyncio.create_task(
            session.flow(builder.get_graph(), executor_ref=executor_ref, on_progress=started)
        )
        await asyncio.wait_for(started.first.wait(), SIGNAL_TIMEOUT)
        control = executor_ref["executor"]
        assert await control.pause() is True
        assert await control.send_operator_message("go left") is True
        assert await control.resume() is True
        await gauge.release.remote("steer")
        return await flow

    envelope = run(scenario())

    results = envelope["operation_results"]
    assert results[a] == "step a"
    assert results[b].startswith("[OPERATOR STEER]")
    assert "go left" in results[b]
    assert results[b].endswith("step b")
    assert results[c] == "step c"
    # The steer's breadcrumb names the one operation that consumed it.
    assert [entry["rendered_into_op"] for entry in envelope["final_context"]["operator_messages"]] == [b]


def test_pause_stops_new_dispatch_while_in_flight_operations_finish(session, gauge):
    """Six slow roots at max_concurrent=2: after pause nothing new starts; resume finishes all."""

    session.register_operation("slow_pausable", gauged_operation(gauge, 0.25), record_turn=False)
    graph = fan_out("slow_pausable", 6, key="pause")
    started = Started()
    executor_ref: dict[str, Any] = {}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        flow = asyncio.create_task(
            session.flow(graph, max_concurrent=2, executor_ref=executor_ref, on_progress=started)
        )
        await asyncio.wait_for(started.first.wait(), SIGNAL_TIMEOUT)
        control = executor_ref["executor"]
        assert await control.pause() is True
        baseline = (await control.status())["dispatched"]
        dispatched = asyncio.Event()
        watcher = asyncio.create_task(watch_dispatches(control, baseline, dispatched))
        # Long enough for every in-flight operation (0.25 s) to finish while paused.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(dispatched.wait(), 1.0)
        watcher.cancel()
        paused = await control.status()
        assert await control.resume() is True
        envelope = await flow
        return paused, envelope, {"baseline": baseline}

    paused, envelope, seen = run(scenario())

    assert paused["paused"] is True
    assert paused["running"] == 0  # in-flight operations were not stopped: they finished
    assert paused["dispatched"] == seen["baseline"]
    assert 1 <= seen["baseline"] <= 5
    assert paused["settled_by_status"]["completed"] == seen["baseline"]
    assert envelope["status"] == "completed"
    assert len(envelope["completed_operations"]) == 6
    assert ray.get(gauge.snapshot.remote("pause")) == {"in_flight": 0, "peak": 2, "entered": 6}


def test_cancel_mid_run_settles_promptly_as_cancelled(session):
    """Six roots that would each sleep 5 s, max_concurrent=2: cancel after the first start."""
    graph = fan_out("sleep", 6, seconds=5.0)
    started = Started()
    executor_ref: dict[str, Any] = {}

    async def scenario() -> tuple[dict[str, Any], float]:
        flow = asyncio.create_task(
            session.flow(graph, max_concurrent=2, executor_ref=executor_ref, on_progress=started)
        )
        await asyncio.wait_for(started.first.wait(), SIGNAL_TIMEOUT)
        cancelled_at = time.monotonic()
        assert await executor_ref["executor"].cancel() is True
        envelope = await flow
        return envelope, time.monotonic() - cancelled_at

    envelope, seconds_to_settle = run(scenario())

    assert seconds_to_settle < 3.0  # in-flight operations were cancelled, not awaited
    assert envelope["status"] == "cancelled"
    assert sorted(envelope["cancelled_operations"]) == sorted(graph.nodes)
    assert envelope["completed_operations"] == []
    assert set(envelope["operation_statuses"].values()) == {"cancelled"}


def test_control_after_the_run_returns_is_refused(session):
    """A finished run is no longer controllable: pause and cancel answer False."""
    executor_ref: dict[str, Any] = {}

    async def scenario() -> tuple[bool, bool]:
        await session.flow(fan_out("noop", 1), executor_ref=executor_ref)
        control = executor_ref["executor"]
        return await control.pause(), await control.cancel()

    assert run(scenario()) == (False, False)
