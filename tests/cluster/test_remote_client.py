"""A second client finds a run by id on a real local head and controls it.

    client A (subprocess): python -m opgraph.cluster.job fanout --detached --run-id R  -> owns R
    client B (subprocess): RunControl.attach(R): status, pause, message, resume, watch
    `opgraph run status|watch|cancel R` (subprocesses)                               -> A sees "cancelled"

All three talk to the head at 127.0.0.1; this pytest process never joins it. Waits
poll status against deadlines; the one fixed window is the pause check, which must
watch for a while to show that nothing is dispatched.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import uuid

from opgraph.actors import EventsDropped, RunFinished, UnknownWatcherError
from opgraph.cluster.jobs import fanout_graph
from opgraph.cluster.processes import run_command
from opgraph.kernel import FlowEvent

CLIENT_TIMEOUT = 120.0  # seconds any one client process may take
PAUSE_WINDOW = 1.5  # seconds the paused run is watched for new dispatches
STEER = "steer from client B"

# Client B: everything through the library surface, one JSON line per step.
CLIENT_B = r"""
import asyncio, json, sys, time
from opgraph.actors import RunControl, UnknownRunError
from opgraph.kernel import FlowEvent

run_id, address, pause_window, steer = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]

def report(step, **fields):
    print(json.dumps({"step": step, **fields}, default=repr), flush=True)

deadline = time.monotonic() + 90
while True:  # client A may not have started the run yet
    try:
        control = RunControl.attach(run_id, address=address)
        break
    except UnknownRunError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)

async def until(predicate, seconds):
    end = time.monotonic() + seconds
    while True:
        status = await control.status()
        if predicate(status):
            return status
        if time.monotonic() > end:
            raise TimeoutError(f"status never satisfied the condition: {status}")
        await asyncio.sleep(0.05)

async def main():
    status = await until(lambda s: s["dispatched"] > 0, 30)
    report("attached", nodes=status["nodes"], dispatched=status["dispatched"])
    report("pause", accepted=await control.pause())
    drained = await until(lambda s: s["running"] == 0, 30)
    samples = []
    end = time.monotonic() + pause_window
    while time.monotonic() < end:
        samples.append(await control.status())
        await asyncio.sleep(0.1)
    report("paused", dispatched=drained["dispatched"], paused=[s["paused"] for s in samples],
           dispatched_while_paused=sorted({s["dispatched"] for s in samples}),
           running_while_paused=sorted({s["running"] for s in samples}))
    report("message", accepted=await control.send_operator_message(steer))
    report("resume", accepted=await control.resume())
    events = []
    watch = control.watch()
    async for item in watch:
        assert isinstance(item, FlowEvent), item
        events.append(item.status)
        if len(events) == 5:
            break
    await watch.aclose()
    report("watched", statuses=events)

asyncio.run(main())
"""


def run_client(ray_head, *arguments: str) -> subprocess.CompletedProcess:
    return run_command([sys.executable, *arguments], env=ray_head.env(), timeout=CLIENT_TIMEOUT)


def opgraph_run(ray_head, action: str, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    return run_client(ray_head, "-m", "opgraph.cluster.cli", "run", action, run_id, *extra,
                      "--address", ray_head.address)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_second_client_controls_a_detached_run_found_by_id(ray_head, tmp_path):
    """A runs 600 x 0.2 s at max_concurrent=3 (40 s if left alone); B and the CLI steer it, then cancel."""
    run_id = f"remote-{uuid.uuid4().hex[:8]}"
    owner_log = tmp_path / "client-a.log"
    with open(owner_log, "w") as log:
        owner = subprocess.Popen(
            [sys.executable, "-m", "opgraph.cluster.job", "fanout", "--nodes", "600", "--latency", "0.2",
             "--max-concurrent", "3", "--address", ray_head.address, "--detached", "--run-id", run_id],
            env=ray_head.env(), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        steered = run_client(ray_head, "-c", CLIENT_B, run_id, ray_head.address, str(PAUSE_WINDOW), STEER)
        assert steered.returncode == 0, steered.stdout + steered.stderr + owner_log.read_text()
        steps = {line["step"]: line for line in json_lines(steered.stdout)}
        assert steps["attached"]["nodes"] == 600
        assert steps["pause"]["accepted"] is True
        paused = steps["paused"]
        assert set(paused["paused"]) == {True}
        assert paused["dispatched_while_paused"] == [paused["dispatched"]]  # nothing new started
        assert paused["running_while_paused"] == [0]
        assert steps["message"]["accepted"] is True
        assert steps["resume"]["accepted"] is True
        assert steps["watched"]["statuses"] == ["completed"] * 5

        status = opgraph_run(ray_head, "status", run_id)
        assert status.returncode == 0, status.stderr
        (counters,) = json_lines(status.stdout)
        assert counters["run_id"] == run_id and counters["paused"] is False
        assert counters["watchers"] == 0  # B's watcher detached when it stopped watching
        assert counters["dispatched"] > paused["dispatched"]

        watched = opgraph_run(ray_head, "watch", run_id, "--limit", "3")
        assert watched.returncode == 0, watched.stderr
        assert [line["event"] for line in json_lines(watched.stdout)] == ["settled"] * 3

        cancelled = opgraph_run(ray_head, "cancel", run_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert json_lines(cancelled.stdout) == [{"run_id": run_id, "action": "cancel", "accepted": True}]

        assert owner.wait(timeout=CLIENT_TIMEOUT) == 1, owner_log.read_text()  # not completed -> non-zero
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    summary = json_lines(owner_log.read_text())[-1]
    assert summary["run_id"] == run_id
    assert summary["status"] == "cancelled"
    assert summary["operator_messages"] == [STEER]
    assert 0 < summary["by_status"]["completed"] < 600
    assert summary["by_status"]["completed"] + summary["by_status"]["cancelled"] == 600

    # The owner has its envelope, so the run is forgotten: a late client is told so.
    late = opgraph_run(ray_head, "status", run_id)
    assert late.returncode == 1
    assert f"run {run_id} is unknown or already finished" in late.stderr


def test_a_slow_watcher_loses_its_oldest_events_not_the_run(session):
    """40 sleepers of 50 ms at max_concurrent=2; a watcher with room for 3 events stops reading.

    The run completes at full speed; when the watcher reads again (after its owner has
    the envelope and the run is forgotten) it is told how many events it missed, gets
    the newest 3, then how the run ended.
    """
    async def scenario():
        executor_ref: dict = {}
        owner = asyncio.create_task(session.flow(fanout_graph(40, 0.05), max_concurrent=2,
                                                 executor_ref=executor_ref, run_id=f"slow-{uuid.uuid4()}"))
        deadline = asyncio.get_running_loop().time() + 30
        while "run_id" not in executor_ref:
            assert asyncio.get_running_loop().time() < deadline, "the run never started"
            await asyncio.sleep(0.01)
        watch = session.run_control(executor_ref["run_id"]).watch(buffer=3)
        first = await watch.__anext__()
        envelope = await owner
        rest = [item async for item in watch]
        return envelope, first, rest

    envelope, first, rest = asyncio.run(scenario())
    assert envelope["status"] == "completed"
    assert isinstance(first, FlowEvent)
    # The first poll may have fetched a few events at once: those come before the drop.
    (drop_at,) = [index for index, item in enumerate(rest) if isinstance(item, EventsDropped)]
    fetched_with_first, dropped, events, finished = rest[:drop_at], rest[drop_at], rest[drop_at + 1:-1], rest[-1]
    assert all(isinstance(event, FlowEvent) for event in fetched_with_first + events)
    assert dropped.count >= 1 and len(events) == 3
    settled_seen = 1 + len(fetched_with_first) + dropped.count + len(events)
    assert settled_seen <= 40  # nodes settled before attaching are not replayed
    assert isinstance(finished, RunFinished) and finished.status == "completed"
    assert finished.summary["nodes"] == 40 and finished.summary["by_status"] == {"completed": 40}


def test_watcher_errors_pickle_with_their_message():
    copy = pickle.loads(pickle.dumps(UnknownWatcherError("watcher r/watcher-1 is not known")))
    assert isinstance(copy, UnknownWatcherError) and copy.message == "watcher r/watcher-1 is not known"
