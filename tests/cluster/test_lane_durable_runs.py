"""Lane runs that outlive their process: submitted detached, read back, followed by the API, resumed.

    submit -> `opgraph run result`      a fixed run admitted with Session.submit, settled from its envelope
    the API, submitting                 POST admits with submit, the server follows and settles the row
    owner SIGKILLed -> `opgraph run resume`   in -> n1 -> n2 -> n3 on sim/slow; the owner (its Ray with
                                        it) is killed once n1 settled; `opgraph run resume` in another
                                        process (its own runtime, as a user's) finishes it from the log
    `job workflow --detach` on a head   the job ends at admission; another process reads the result

The run log is the test session's ``OPGRAPH_DB`` (tests/conftest.py), shared by the
subprocesses; each test's run store is a file of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
from api_server import serve

from opgraph.actors.persistence import RunLog, database_path
from opgraph.cluster.cli import main as cli_main
from opgraph.cluster.http import create_app
from opgraph.cluster.jobs import main as job_main
from opgraph.cluster.jobs.submission import job_submit_command
from opgraph.cluster.lanes import (
    FIXED_WORKFLOW,
    LaneCapabilityError,
    lane_adapter,
    open_store,
    recorded_recovery,
    resume_recorded,
)
from opgraph.cluster.processes import kill_session, run_command, run_until, wait_for_line, wait_until

DEADLINE = 120.0  # seconds for a run, a subprocess or a resume


def chain(model: str = "sim/fast", length: int = 1) -> dict[str, Any]:
    """in -> n1 -> ... -> n<length>, each a chat on ``model``; the last is the output."""
    ids = [f"n{index}" for index in range(1, length + 1)]
    nodes = [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}}]
    nodes += [{"id": node, "kind": "chat", "pos": {"x": index, "y": 0},
               "config": {"prompt": f"Step {node}", "model": model}} for index, node in enumerate(ids, start=1)]
    path = ["in", *ids]
    edges = [{"id": f"e{index}", "from": a, "to": b}
             for index, (a, b) in enumerate(zip(path, path[1:], strict=False), start=1)]
    return {"version": 1, "nodes": nodes, "edges": edges, "inputs": ["topic"], "outputs": [ids[-1]]}


def last_json(text: str) -> dict[str, Any]:
    """The JSON object a command printed last (pretty-printed over several lines)."""
    return json.loads(text[text.rindex("\n{") + 1:] if "\n{" in text else text)


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "runs.db") as opened:
        yield opened


def test_a_run_that_is_not_logged_cannot_be_resumed(store):
    """durable=False: no run log, so the invocation publishes no checkpoint resume, and a resume is refused."""
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    pinned = store.create_workflow("unlogged", chain())
    prepared = adapter.prepare_now(adapter.invocation("unlogged", durable=False))
    assert prepared.capabilities.checkpoint_resume is False
    assert adapter.prepare_now(adapter.invocation("unlogged")).capabilities.checkpoint_resume is True
    record = store.create_run(prepared.run_id, session_id="s", provenance=prepared.provenance.to_payload(),
                              inputs={}, workflow=pinned, capabilities=prepared.capabilities.as_metadata(),
                              recovery=recorded_recovery(prepared))
    with pytest.raises(LaneCapabilityError, match="checkpoint resume"):
        asyncio.run(resume_recorded(adapter, record, session=None, store=store))
    assert store.get_run(prepared.run_id).status == "admitted"  # nothing was sent, nothing changed


def test_a_detached_job_needs_a_runtime_that_outlives_it(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_main(["fanout", "--nodes", "3", "--detach"]) == 2
    assert "--detach needs a runtime that outlives this job" in capsys.readouterr().err
    command = job_submit_command(["workflow", "flow.json"], detach=True)
    assert command[-4:] == ["opgraph.cluster.job", "workflow", "flow.json", "--detach"]


@pytest.mark.ray
def test_a_submitted_fixed_run_is_settled_by_run_result(session, store, capsys):
    store.create_workflow("submitted", chain())
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    prepared = asyncio.run(adapter.prepare(adapter.invocation("submitted", inputs={"topic": "durable"})))
    run_id = asyncio.run(adapter.submit(prepared, session=session))
    assert run_id == prepared.run_id and store.get_run(run_id).status == "running"
    for _ in range(2):  # the second reads the settled row and the log again, and answers the same
        assert cli_main(["run", "result", run_id, "--store", store.path]) == 0
        printed = last_json(capsys.readouterr().out)
        assert (printed["run_id"], printed["status"], printed["lane"]) == (run_id, "completed", FIXED_WORKFLOW)
        assert list(printed["outputs"]) == ["n1"] and printed["outputs"]["n1"]["text"]
    record = store.get_run(run_id)
    assert (record.status, list(record.outputs)) == ("completed", ["n1"])
    assert [row["spec_node_id"] for row in store.run_nodes(run_id)] == ["n1"]


@pytest.mark.ray
def test_the_api_submits_its_runs_follows_them_and_settles_their_rows(session, store):
    store.create_workflow("followed", chain())
    store.create_workflow("slow", chain("sim/slow", 3))
    served = serve(create_app(store, session_factory=lambda: session, submit_runs=True))
    try:
        with served.client() as http:
            run_id = http.post("/api/workflows/followed/runs", json={"inputs": {"topic": "x"}}).json()["run_id"]
            run = _wait(http, run_id, {"completed", "failed", "cancelled"})
            assert run["status"] == "completed" and run["outputs"]["n1"]["text"]
            results = http.get(f"/api/runs/{run_id}/results").json()
            assert results["node_results"]["n1"]["status"] == "completed"
            slow = http.post("/api/workflows/slow/runs", json={}).json()["run_id"]
            _wait_for_node(store, slow, "n1")
            cancelled = http.post(f"/api/runs/{slow}/cancel")
            assert cancelled.status_code == 202, cancelled.text
            assert _wait(http, slow, {"completed", "failed", "cancelled"})["status"] == "cancelled"
    finally:
        served.stop()
    assert store.get_run(run_id).owner_pid is not None  # an embedded runtime: the run was this process's


def _wait(http: httpx.Client, run_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE
    while (run := http.get(f"/api/runs/{run_id}").json())["status"] not in statuses:
        assert time.monotonic() < deadline, f"run {run_id} stayed {run['status']}"
        time.sleep(0.05)
    return run


def _wait_for_node(store: Any, run_id: str, spec_node_id: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while spec_node_id not in {row["spec_node_id"] for row in store.run_nodes(run_id)}:
        assert time.monotonic() < deadline, f"{spec_node_id} of run {run_id} never settled"
        time.sleep(0.05)


@pytest.mark.ray
def test_run_resume_continues_an_orphaned_fixed_run_and_refuses_a_changed_source(ray_head, store, tmp_path, capsys):
    """in -> n1 -> n2 -> n3 on sim/slow (1 s each): the owner is SIGKILLed, Ray and all, once n1 settled."""
    definition = tmp_path / "chain.json"
    definition.write_text(json.dumps(chain("sim/slow", 3)))
    # The owner and the Ray it started, every process of it, are killed once its progress says n1 completed.
    run_until([sys.executable, "-m", "opgraph.cluster.cli", "flow", "run", str(definition), "--store", store.path,
               "--plain"],
              lambda lines: any("completed" in line and line.rstrip().endswith(" n1") for line in lines),
              stream="stderr", timeout=DEADLINE)
    (record,) = store.list_runs()
    assert record.orphaned and record.error["error_type"] == "OwnerProcessLost"
    started_before = [s for s in store.run_signals(record.run_id) if s["kind"] == "started"]
    assert [s["spec_node_id"] for s in started_before][:1] == ["n1"]

    original = definition.read_bytes()
    definition.write_bytes(original + b"\n")  # the same definition, other bytes: the pinned hash no longer holds
    assert cli_main(["run", "resume", record.run_id, "--store", store.path]) == 1
    assert "changed since the run pinned it" in capsys.readouterr().err
    assert store.get_run(record.run_id).orphaned  # refused before anything was sent

    definition.write_bytes(original)
    resumed_by = resume_on(ray_head, record.run_id, store)
    assert resumed_by.returncode == 0, resumed_by.stderr
    printed = last_json(resumed_by.stdout)
    assert (printed["status"], list(printed["outputs"])) == ("completed", ["n3"])
    resumed = store.get_run(record.run_id)
    assert (resumed.status, resumed.provenance, resumed.capabilities) == (
        "completed", record.provenance, record.capabilities)
    started = [s["spec_node_id"] for s in store.run_signals(record.run_id) if s["kind"] == "started"]
    assert started.count("n1") == 1, "n1 settled before the kill and was started again"
    assert {row["spec_node_id"] for row in store.run_nodes(record.run_id)} == {"n1", "n2", "n3"}
    assert cli_main(["run", "resume", record.run_id, "--store", store.path]) == 1  # it ended: nothing to resume
    assert "nothing to resume" in capsys.readouterr().err


def resume_on(head: Any, run_id: str, store: Any) -> subprocess.CompletedProcess:
    """`opgraph run resume` in a process of its own, as a user's on their cluster: it joins the
    session's Ray head (the owner's Ray died with it; a second embedded Ray would only cost a start)."""
    return run_command(
        [sys.executable, "-m", "opgraph.cluster.cli", "run", "resume", run_id, "--store", store.path,
         "--address", head.address], env={**head.env(), "OPGRAPH_DB": os.environ["OPGRAPH_DB"]}, timeout=DEADLINE)


def _settled_in_log(run_id: str, node_id: str) -> bool:
    logged = RunLog(database_path()).load(run_id)
    return logged is not None and any(record[0] == "finished" and record[2] == node_id
                                      for batch in logged.batches for record in batch)


@pytest.mark.ray
def test_a_resumed_run_records_every_settled_node_and_says_it_was_resumed(ray_head, store, tmp_path):
    """in -> n1 -> n2 -> n3 on sim/slow. Once n1 is recorded the store is locked, so the owner's
    recorder falls behind: n2 settles in the run log only, and the owner is SIGKILLed then.

    After `opgraph run resume`, as after an undisturbed run, every node has its queued, started
    and completed signals, n2's completed once; and the run's own signals say what happened to
    it: its owner was lost, then it was resumed (issue #32: n2 had no completed signal, and the
    row went from failed to completed without a trace).
    """
    definition = tmp_path / "chain.json"
    definition.write_text(json.dumps(chain("sim/slow", 3)))
    owner = subprocess.Popen([sys.executable, "-m", "opgraph.cluster.cli", "flow", "run", str(definition),
                              "--store", store.path, "--plain"],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = None
    try:
        wait_for_line(owner, r"completed.* n1\s*$", stream=owner.stderr, timeout=DEADLINE, what="the owner")
        (record,) = store.list_runs()
        n2 = next(node_id for node_id, label in record.recovery["labels"].items() if label == "n2")
        lock = sqlite3.connect(store.path, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # the owner's recorder cannot write from now on
        wait_until(lambda: _settled_in_log(record.run_id, n2), timeout=DEADLINE, what="n2 in the run log",
                   process=owner)
    finally:
        kill_session(owner)
        owner.communicate(timeout=DEADLINE)
        if lock is not None:
            lock.rollback()
            lock.close()
    assert store.get_run(record.run_id).orphaned
    assert "completed" not in {s["kind"] for s in store.run_signals(record.run_id) if s["spec_node_id"] == "n2"}

    resumed_by = resume_on(ray_head, record.run_id, store)
    assert resumed_by.returncode == 0, resumed_by.stderr

    assert store.get_run(record.run_id).status == "completed"
    signals = store.run_signals(record.run_id)
    kinds: dict[str, list[str]] = {}
    for signal in signals:
        kinds.setdefault(signal["spec_node_id"] or signal["node_id"], []).append(signal["kind"])
    for node in ("n1", "n2", "n3"):
        assert {"queued", "started", "completed"} <= set(kinds[node]), (node, kinds)
        assert kinds[node].count("completed") == 1, (node, kinds)
    assert kinds[record.run_id] == ["owner_lost", "resumed"], kinds
    assert {row["spec_node_id"]: row["status"] for row in store.run_nodes(record.run_id)} == dict.fromkeys(
        ("n1", "n2", "n3"), "completed")


@pytest.mark.ray
def test_a_detached_workflow_job_is_read_back_by_another_process(ray_head, tmp_path):
    definition = tmp_path / "flow.json"
    definition.write_text(json.dumps(chain("sim/fast", 2)))
    database = tmp_path / "runs.db"
    environment = {**ray_head.env(), "OPGRAPH_DB": os.environ["OPGRAPH_DB"]}
    submitted = run_command(
        [sys.executable, "-m", "opgraph.cluster.job", "workflow", str(definition), "--detach", "--address",
         ray_head.address, "--store", str(database), "--input", "topic=jobs"], env=environment, timeout=DEADLINE)
    assert submitted.returncode == 0, submitted.stderr
    summary = json.loads(submitted.stdout.strip().splitlines()[-1])
    assert summary["status"] == "submitted" and summary["lane"] == FIXED_WORKFLOW
    read = run_command(
        [sys.executable, "-m", "opgraph.cluster.cli", "run", "result", summary["run_id"], "--address",
         ray_head.address, "--store", str(database)], env=environment, timeout=DEADLINE)
    assert read.returncode == 0, read.stderr
    printed = last_json(read.stdout)
    assert (printed["status"], list(printed["outputs"])) == ("completed", ["n2"])
    with open_store(database) as runs:
        record = runs.get_run(summary["run_id"])
    assert (record.status, record.owner_pid, record.source_ref) == ("completed", None, str(definition))
