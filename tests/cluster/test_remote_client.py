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
import time
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


# Client A for the watch test: 60 nodes, each held until the file argv[4] exists, then 0.2 s.
GATED_OWNER = r"""
import asyncio, json, os, sys
from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder

address, namespace, run_id, gate = sys.argv[1:5]

async def gated(branch, index=0, **parameters):
    while not os.path.exists(gate):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return index

session = Session(address=address, namespace=namespace, detached=True)
session.register_operation("gated", gated, record_turn=False)
builder = OperationGraphBuilder("gated")
for index in range(60):
    builder.add_operation("gated", depends_on=[], index=index)
envelope = asyncio.run(session.flow(builder.get_graph(), max_concurrent=3, run_id=run_id, isolated=True))
print(json.dumps({"status": envelope["status"], "completed": len(envelope["completed_operations"])}), flush=True)
"""

# Once a watcher is attached to run argv[1], open the gate (argv[4]); once 10 nodes have completed,
# SIGKILL the run's executor.
EXECUTOR_KILLER = r"""
import asyncio, os, signal, sys, time, ray
from opgraph.actors import RunControl, UnknownRunError

run_id, address, namespace, gate = sys.argv[1:5]
deadline = time.monotonic() + 90
while True:
    try:
        control = RunControl.attach(run_id, address=address, namespace=namespace)
        break
    except UnknownRunError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)

async def until(predicate):
    while not predicate(await control.status()):
        if time.monotonic() > deadline:
            raise TimeoutError(await control.status())
        await asyncio.sleep(0.05)

asyncio.run(until(lambda status: status["watchers"] >= 1))
open(gate, "w").close()
asyncio.run(until(lambda status: status["settled_by_status"]["completed"] >= 10))
os.kill(ray.get(control.executor.statistics.remote())["pid"], signal.SIGKILL)
print("killed", flush=True)
"""


def test_run_watch_reports_an_executor_replacement_and_keeps_watching(ray_head, tmp_path):
    """A owns a durable run of 60 nodes (3 at a time), held until `opgraph run watch R` is attached;
    once 10 have completed, R's executor is SIGKILLed.

    A's runtime replaces the executor and the replacement rebuilds R from the run log: the watch
    prints one "reconnected" line naming the new executor, then settled lines again, then
    "finished" completed, and exits 0 (issue #32: it crashed on the reconnection).
    """
    run_id = f"watched-{uuid.uuid4().hex[:8]}"
    namespace = f"opgraph-watch-{uuid.uuid4().hex[:8]}"
    gate = str(tmp_path / "gate")
    environment = {**ray_head.env(), "OPGRAPH_DB": str(tmp_path / "runs.db")}
    owner_log = tmp_path / "client-a.log"
    with open(owner_log, "w") as log:
        owner = subprocess.Popen([sys.executable, "-c", GATED_OWNER, ray_head.address, namespace, run_id, gate],
                                 env=environment, stdout=log, stderr=subprocess.STDOUT)
    killer = subprocess.Popen([sys.executable, "-c", EXECUTOR_KILLER, run_id, ray_head.address, namespace, gate],
                              env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watcher = None
    try:
        deadline = time.monotonic() + CLIENT_TIMEOUT
        while True:  # A may not have admitted the run yet
            watcher = subprocess.Popen(
                [sys.executable, "-m", "opgraph.cluster.cli", "run", "watch", run_id, "--address",
                 ray_head.address, "--namespace", namespace],
                env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            watched, errors = watcher.communicate(timeout=CLIENT_TIMEOUT)
            if watcher.returncode != 1 or "unknown or already finished" not in errors:
                break
            assert time.monotonic() < deadline, errors
        killed, _ = killer.communicate(timeout=CLIENT_TIMEOUT)
        assert killer.returncode == 0 and "killed" in killed, killed
        assert watcher.returncode == 0, errors
        assert owner.wait(timeout=CLIENT_TIMEOUT) == 0, owner_log.read_text()
    finally:
        for process in (owner, killer, watcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert json_lines(owner_log.read_text())[-1] == {"status": "completed", "completed": 60}
    lines = json_lines(watched)
    events = [line["event"] for line in lines]
    assert events.count("reconnected") == 1, lines
    at = events.index("reconnected")
    assert lines[at]["run_id"] == run_id and lines[at]["executor"].startswith("opgraph-executor-"), lines[at]
    assert "settled" in events[:at] and "settled" in events[at:], events  # watched before and after
    assert lines[-1]["event"] == "finished" and lines[-1]["status"] == "completed"


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
