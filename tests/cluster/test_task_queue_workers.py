"""Workers on the leased task queue: routing by action_kind, retries, cancellation, lost leases,
SIGTERM's grace, and a worker SIGKILLed mid-task whose run another worker continues from the run log.

    task --claim--> worker --registry[action_kind]--> adapter --> run (lane or Session.flow)
    worker SIGKILLed --lease lapses--> reap --> worker 2 --resume_recorded--> same run, n1 not run again
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from control_clock import FakeClock

from opgraph.cluster.control import ControlDatabase, TaskQueue
from opgraph.cluster.control.actions import ActionOutcome, ActionRegistry
from opgraph.cluster.control.adapters import WORKFLOW
from opgraph.cluster.control.worker import Worker
from opgraph.cluster.lanes import open_store
from opgraph.cluster.processes import run_until

DEADLINE = 120.0


class Scripted:
    """An adapter whose runs do what the test says: complete, raise, or sleep until cancelled."""

    def __init__(self, action_kind: str, behaviour: str = "complete", seconds: float = 0.0) -> None:
        self.action_kind, self.behaviour, self.seconds = action_kind, behaviour, seconds
        self.runs: list[str] = []

    async def run(self, task, context):
        self.runs.append(task.task_id)
        await context.started(f"{task.task_id}-a{task.attempts}")
        if self.seconds:
            await asyncio.sleep(self.seconds)
        if self.behaviour == "raise":
            raise RuntimeError("the model provider is down")
        return ActionOutcome("completed", {"answer": task.target})


def registry(*adapters) -> ActionRegistry:
    found = ActionRegistry(builtin={})
    for adapter in adapters:
        found.register(adapter)
    return found


@pytest.fixture
def database(tmp_path):
    opened = ControlDatabase(tmp_path / "control.db")
    yield opened
    opened.close()


def test_task_queue_worker_routes_by_action_kind_and_leaves_what_it_cannot_route(database):
    agent = Scripted("agent")
    queue = TaskQueue(database)
    done, _ = queue.submit("agent", "hello")
    waiting, _ = queue.submit("play", "triage")
    worker = Worker(database, registry=registry(agent), poll=0.01, log=lambda line: None)
    counts = asyncio.run(worker.run(until_idle=True))
    assert counts["succeeded"] == 1 and agent.runs == [done.task_id]
    assert queue.get(done.task_id).result == {"answer": "hello"}
    assert queue.get(done.task_id).run_id == f"{done.task_id}-a1"
    left = queue.get(waiting.task_id)
    assert left.state == "queued"
    assert "no live worker on queue 'default'" in queue.why_waiting(left)  # the worker stopped
    (seen,) = queue.workers()
    assert (seen.state, seen.action_kinds) == ("stopped", ("agent",))


def test_task_queue_worker_retries_with_backoff_then_dead(database):
    failing = Scripted("agent", "raise")
    queue = TaskQueue(database)
    task, _ = queue.submit("agent", "x", max_attempts=2, backoff_base=0.01, backoff_max=0.01)
    worker = Worker(database, registry=registry(failing), poll=0.01, log=lambda line: None)
    asyncio.run(worker.run(max_tasks=2))
    dead = queue.get(task.task_id)
    assert dead.state == "dead" and "attempt 2 of 2 failed: RuntimeError: the model provider is down" in dead.reason
    assert len(failing.runs) == 2


def test_task_queue_worker_unknown_workflow_fails_once_with_a_clear_error(database, tmp_path):
    with open_store(tmp_path / "runs.db") as store:
        queue = TaskQueue(database)
        task, _ = queue.submit("workflow", "no-such-workflow")
        worker = Worker(database, registry=registry(WORKFLOW), store=store, poll=0.01, log=lambda line: None)
        asyncio.run(worker.run(max_tasks=1))
    failed = queue.get(task.task_id)
    assert failed.state == "failed" and failed.attempts == 1
    assert "no workflow named 'no-such-workflow'" in failed.reason


def test_task_queue_worker_stops_a_task_asked_to_cancel_and_drops_a_lost_lease(database):
    slow = Scripted("agent", seconds=30)
    queue = TaskQueue(database)
    asked, _ = queue.submit("agent", "cancel me", priority=1)
    lost, _ = queue.submit("agent", "lose me")

    async def scenario():
        worker = Worker(database, registry=registry(slow), concurrency=2, lease_seconds=0.3, poll=0.01,
                        log=lambda line: None)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        while len(slow.runs) < 2:
            await asyncio.sleep(0.01)
        queue.cancel(asked.task_id, terminate=False)  # asked: the worker stops it and records it
        queue.cancel(lost.task_id)  # terminated: the lease ends now; the worker must write nothing
        while worker.active:
            await asyncio.sleep(0.01)
        stop.set()
        return await running

    counts = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert counts["cancelled"] == 1 and counts["lease_lost"] == 1
    assert queue.get(asked.task_id).state == "cancelled"
    assert [event["kind"] for event in queue.events(lost.task_id)][-1] == "cancelled"


@pytest.mark.parametrize("grace, state", [(5.0, "succeeded"), (0.05, "queued")])
def test_task_queue_worker_sigterm_finishes_within_grace_or_gives_the_lease_back(database, grace, state):
    slow = Scripted("agent", seconds=0.5)
    queue = TaskQueue(database)
    task, _ = queue.submit("agent", "finish me")

    async def scenario():
        worker = Worker(database, registry=registry(slow), grace=grace, poll=0.01, log=lambda line: None)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        while not slow.runs:
            await asyncio.sleep(0.01)
        stop.set()  # what SIGTERM does in `opgraph worker`
        return await running

    asyncio.run(scenario())
    after = queue.get(task.task_id)
    assert after.state == state
    if state == "queued":
        assert after.attempts == 0 and after.run_id is None and "stopped before the task ended" in after.reason
        assert TaskQueue(database).claim("default", "next") is not None  # nothing leaked


def test_task_queue_fake_clock_drives_lease_expiry_for_workers(tmp_path):
    clock = FakeClock()
    database = ControlDatabase(tmp_path / "c.db", clock=clock)
    queue = TaskQueue(database)
    queue.submit("agent", "x")
    claim = queue.claim("default", "dead-worker", lease_seconds=10)
    clock.advance(11)
    agent = Scripted("agent")
    counts = asyncio.run(Worker(database, registry=registry(agent), poll=0.01, log=lambda line: None)
                         .run(max_tasks=1))
    assert counts["succeeded"] == 1 and queue.get(claim.task.task_id).attempts == 2
    database.close()


def chain(length: int = 3) -> dict:
    ids = [f"n{index}" for index in range(1, length + 1)]
    nodes = [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}}]
    nodes += [{"id": node, "kind": "chat", "pos": {"x": index, "y": 0},
               "config": {"prompt": f"Step {node}", "model": "sim/slow"}} for index, node in enumerate(ids, start=1)]
    path = ["in", *ids]
    pairs = zip(path, path[1:], strict=False)
    edges = [{"id": f"e{index}", "from": a, "to": b} for index, (a, b) in enumerate(pairs, start=1)]
    return {"version": 1, "nodes": nodes, "edges": edges, "inputs": ["topic"], "outputs": [ids[-1]]}


@pytest.mark.ray
def test_task_queue_worker_killed_mid_task_lease_lapses_and_another_continues_the_run(session, tmp_path):
    """`opgraph worker` runs in -> n1 -> n2 -> n3 (sim/slow, ~1 s a node) and is SIGKILLed, Ray and all,
    once n1 settled. Its 4 s lease lapses; a worker here claims the task, finds the run orphaned in the
    run store, and continues it from the run log: n1 is not started again; the task succeeds on attempt 2."""
    definition = tmp_path / "chain.json"
    definition.write_text(json.dumps(chain()))
    store = open_store(tmp_path / "runs.db")
    database = ControlDatabase(store.path)
    queue = TaskQueue(database)
    task, _ = queue.submit("workflow", str(definition), payload={"inputs": {"topic": "leases"}})
    run_until([sys.executable, "-m", "opgraph.cluster.cli", "worker", "--store", store.path, "--lease", "4",
               "--no-schedules", "--max-tasks", "1"],
              lambda lines: any("completed" in line and line.rstrip().endswith(" n1") for line in lines),
              stream="stderr", timeout=DEADLINE)
    killed = queue.get(task.task_id)
    assert killed.state == "running" and killed.run_id is not None
    started = time.monotonic()
    worker = Worker(database, store=store, session_factory=lambda: session, lease_seconds=5, poll=0.1,
                    log=lambda line: None)
    counts = asyncio.run(asyncio.wait_for(worker.run(max_tasks=1), DEADLINE))
    assert counts["succeeded"] == 1, queue.events(task.task_id)
    done = queue.get(task.task_id)
    assert done.state == "succeeded" and done.attempts == 2 and done.result["run_id"] == killed.run_id
    assert "lease_expired" in [event["kind"] for event in queue.events(task.task_id)]
    signals = store.run_signals(killed.run_id)
    assert [s["spec_node_id"] for s in signals if s["kind"] == "started"].count("n1") == 1, \
        "n1 settled before the kill and was started again"
    assert store.get_run(killed.run_id).status == "completed"
    assert time.monotonic() - started < DEADLINE
    database.close()
    store.close()
