"""The fixed-workflow HTTP API over real HTTP: uvicorn on a loopback port, httpx as the client.

One server (and SQLite store) serves the module; its runs use the shared Session on real
actors with the built-in ``sim/`` provider. The base definition is ``in -> draft``;
``sim/slow`` (1 s per call) keeps a run in flight long enough to observe and control it.
Each test uses its own workflow names, so tests do not see each other's rows.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import httpx
import pytest
from api_server import serve
from workflow_specs import draft_spec

from opgraph.cluster.http import RunStateConflictError, create_app
from opgraph.cluster.lanes import open_store
from opgraph.cluster.lanes.fixed import FIXED_WORKFLOW_CAPABILITIES, fixed_workflow_provenance
from opgraph.kernel import OpGraphError

RUN_DEADLINE = 20.0  # seconds for a sim run to end
SLOW_RUNTIME_START = 3.0  # seconds a stand-in runtime takes to start


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("api") / "opgraph.db") as opened:
        yield opened


@pytest.fixture(scope="module")
def client(session, store):
    served = serve(create_app(store, session_factory=lambda: session))
    try:
        with served.client() as http:
            yield http
    finally:
        served.stop()


def _create(client: httpx.Client, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    reply = client.post("/api/workflows", json={"name": name, "spec": spec})
    assert reply.status_code == 201, reply.text
    return reply.json()


def _start(client: httpx.Client, name: str, **body: Any) -> dict[str, Any]:
    reply = client.post(f"/api/workflows/{name}/runs", json=body)
    assert reply.status_code == 202, reply.text
    return reply.json()


def _wait_for(client: httpx.Client, run_id: str, statuses: set[str]) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_DEADLINE
    while True:
        run = client.get(f"/api/runs/{run_id}").json()
        if run["status"] in statuses:
            return run
        assert time.monotonic() < deadline, f"run stayed {run['status']}, expected one of {statuses}"
        time.sleep(0.05)


# -- definitions ------------------------------------------------------------------------
def test_definition_lifecycle_create_get_put_versions_delete(client):
    created = _create(client, "drafts", draft_spec())
    assert created["name"] == "drafts" and created["version"] == 1
    assert created["content_hash"].startswith("sha256:") and len(created["id"]) == 12
    assert created["spec"] == draft_spec()

    conflict = client.post("/api/workflows", json={"name": " drafts ", "spec": draft_spec(prompt="other")})
    assert conflict.status_code == 409
    assert conflict.json()["name"] == "drafts" and "already exists" in conflict.json()["error"]

    assert client.get("/api/workflows/drafts").json()["content_hash"] == created["content_hash"]
    assert client.get(f"/api/workflows/{created['id']}").json()["name"] == "drafts"  # by id too

    second = client.put("/api/workflows/drafts", json={"spec": draft_spec(prompt="Second"), "description": "v2"})
    assert second.status_code == 200
    assert second.json()["version"] == 2 and second.json()["created"] is True
    same = client.put("/api/workflows/drafts", json={"spec": draft_spec(prompt="Second")})
    assert same.status_code == 200
    assert same.json()["version"] == 2 and same.json()["created"] is False  # same hash: no new version

    assert client.get("/api/workflows/drafts").json()["version"] == 2
    first = client.get("/api/workflows/drafts", params={"version": 1}).json()
    assert first["spec"]["nodes"][1]["config"]["prompt"] == "Draft"
    versions = client.get("/api/workflows/drafts/versions").json()
    assert [v["version"] for v in versions["versions"]] == [1, 2]
    assert "spec" not in versions["versions"][0]
    listed = {w["name"]: w for w in client.get("/api/workflows").json()["workflows"]}
    assert listed["drafts"]["latest_version"] == 2

    assert client.get("/api/workflows/drafts", params={"version": 9}).status_code == 404
    deleted = client.delete("/api/workflows/drafts")
    assert deleted.status_code == 204 and deleted.content == b""
    missing = client.get("/api/workflows/drafts")
    assert missing.status_code == 404 and "drafts" in missing.json()["error"]
    assert "drafts" not in {w["name"] for w in client.get("/api/workflows").json()["workflows"]}
    assert client.delete("/api/workflows/drafts").status_code == 404
    assert _create(client, "drafts", draft_spec())["version"] == 1  # the name is free again


def test_invalid_spec_and_name_are_422_problem_lists_with_ids(client):
    bad = draft_spec(extra_nodes=[{"id": "g", "kind": "gate", "pos": {"x": 2, "y": 0}}],
                extra_edges=[{"id": "e9", "from": "draft", "to": "nowhere"}])
    reply = client.post("/api/workflows", json={"name": "bad", "spec": bad})
    assert reply.status_code == 422
    errors = reply.json()["errors"]
    assert any(e["node_id"] == "g" for e in errors)
    assert any(e["edge_id"] == "e9" for e in errors)
    assert all(set(e) == {"error", "node_id", "edge_id"} for e in errors)
    assert client.get("/api/workflows/bad").status_code == 404  # nothing was stored

    blank = client.post("/api/workflows", json={"name": "   ", "spec": draft_spec()})
    assert blank.status_code == 422 and "name" in blank.json()["errors"][0]["error"]

    _create(client, "puts-bad", draft_spec())
    put = client.put("/api/workflows/puts-bad", json={"spec": bad})
    assert put.status_code == 422 and any(e["node_id"] == "g" for e in put.json()["errors"])
    assert client.get("/api/workflows/puts-bad").json()["version"] == 1


def test_malformed_bodies_are_422_in_the_same_problem_shape(client):
    for body in ({"name": "x"}, {"name": "x", "spec": [1, 2]}, {"name": 5, "spec": draft_spec()},
                 {"name": "x", "spec": draft_spec(), "surprise": True}):
        reply = client.post("/api/workflows", json=body)
        assert reply.status_code == 422, body
        assert "detail" not in reply.json()
        assert reply.json()["errors"] and all(set(e) == {"error", "node_id", "edge_id"}
                                              for e in reply.json()["errors"])
    not_json = client.post("/api/workflows", content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and not_json.json()["errors"]
    _create(client, "malformed-run", draft_spec())
    reply = client.post("/api/workflows/malformed-run/runs", json={"inputs": "not a mapping", "version": 0})
    assert reply.status_code == 422 and len(reply.json()["errors"]) == 2
    assert client.get("/api/runs", params={"workflow": "malformed-run"}).json()["runs"] == []


# -- runs -------------------------------------------------------------------------------
def test_a_run_is_admitted_at_once_then_completes_with_ordered_signals(client):
    """in -> draft (sim/slow, 1 s): the 202 comes back long before the model answers."""
    _create(client, "slow-drafts", draft_spec(model="sim/slow"))
    started = time.monotonic()
    admitted = _start(client, "slow-drafts", inputs={"topic": "actors"})
    # The model alone takes 1 s, so a 202 inside that second did not wait for the run.
    assert time.monotonic() - started < 1.0, "the 202 waited for the run"
    assert admitted["status"] in ("admitted", "running")
    assert admitted["lane"] == "fixed_workflow" and admitted["workflow"] == "slow-drafts"
    assert admitted["version"] == 1 and admitted["content_hash"].startswith("sha256:")
    assert admitted["lane_capabilities"]["cancel"] is True
    assert admitted["lane_capabilities"]["live_message"] is False
    run_id = admitted["run_id"]
    assert admitted["links"]["self"] == f"/api/runs/{run_id}"

    running = client.get(f"/api/runs/{run_id}").json()
    assert running["status"] in ("admitted", "running") and "outputs" not in running
    early = client.get(f"/api/runs/{run_id}/results")
    assert early.status_code == 409 and early.json()["status"] in ("admitted", "running")

    done = _wait_for(client, run_id, {"completed", "failed", "cancelled"})
    assert done["status"] == "completed", done
    assert done["provenance"]["lane"] == "fixed_workflow"
    assert done["provenance"]["source"]["ref"] == "slow-drafts" and done["provenance"]["planner"]["used"] is False
    assert done["inputs"] == {"topic": "actors"}
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    assert done["outputs"]["draft"]["model"] == "sim/slow"

    signals = client.get(f"/api/runs/{run_id}/signals").json()
    seqs = [s["seq"] for s in signals["signals"]]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    kinds = [s["kind"] for s in signals["signals"] if s["spec_node_id"] == "draft"]
    assert kinds == ["queued", "started", "completed"]
    later = client.get(f"/api/runs/{run_id}/signals", params={"after": seqs[0]}).json()
    assert [s["seq"] for s in later["signals"]] == seqs[1:] and later["next_after"] == seqs[-1]

    results = client.get(f"/api/runs/{run_id}/results").json()
    assert results["status"] == "completed" and set(results["outputs"]) == {"draft"}
    assert "Draft" in results["outputs"]["draft"]["text"]
    assert results["nodes"] == {"draft": "completed"}
    assert results["node_results"]["draft"]["status"] == "completed"
    assert results["node_results"]["draft"]["result"] == results["outputs"]["draft"]
    assert run_id in {run["run_id"] for run in client.get("/api/runs").json()["runs"]}
    assert [r["run_id"] for r in client.get("/api/runs", params={"workflow": "slow-drafts"}).json()["runs"]] == [run_id]


def test_a_conditional_edge_skips_a_node(client):
    """in -> classify -> urgent (priority == 'high') | routine (priority != 'high')."""
    spec = draft_spec(extra_nodes=[
        {"id": "urgent", "kind": "chat", "pos": {"x": 2, "y": 0},
         "config": {"prompt": "Escalate", "model": "sim/fast"}},
        {"id": "routine", "kind": "chat", "pos": {"x": 2, "y": 1}, "config": {"prompt": "Reply", "model": "sim/fast"}},
    ], extra_edges=[
        {"id": "e2", "from": "draft", "to": "urgent", "condition": "context.priority == 'high'"},
        {"id": "e3", "from": "draft", "to": "routine",
         "condition": "result.text != None and context.priority != 'high'"},
    ])
    spec["outputs"] = ["urgent", "routine"]
    _create(client, "triage", spec)
    run_id = _start(client, "triage", inputs={"priority": "low"})["run_id"]
    assert _wait_for(client, run_id, {"completed", "failed", "cancelled"})["status"] == "completed"
    results = client.get(f"/api/runs/{run_id}/results").json()
    assert results["nodes"] == {"draft": "completed", "urgent": "skipped", "routine": "completed"}
    assert set(results["outputs"]) == {"routine"}  # declared outputs, skipped ones absent


def test_a_compile_error_is_422_and_creates_no_run(client):
    spec = draft_spec(extra_nodes=[{"id": "p", "kind": "parse", "pos": {"x": 2, "y": 0}}],
                 extra_edges=[{"id": "e2", "from": "draft", "to": "p"}])
    _create(client, "with-parse", spec)  # parse is a stored kind; it fails at compile time
    reply = client.post("/api/workflows/with-parse/runs", json={})
    assert reply.status_code == 422
    assert any(e["node_id"] == "p" for e in reply.json()["errors"])
    assert client.get("/api/runs", params={"workflow": "with-parse"}).json()["runs"] == []
    bad_model = client.post("/api/workflows/with-parse/runs", json={"model": "no-provider-prefix"})
    assert bad_model.status_code == 422


def test_a_failing_node_fails_the_run(client):
    """in -> draft on ``nosuch/model``: no such provider, so the node and the run fail."""
    _create(client, "failing", draft_spec(model="nosuch/model"))
    run_id = _start(client, "failing")["run_id"]
    run = _wait_for(client, run_id, {"completed", "failed", "cancelled"})
    assert run["status"] == "failed"
    assert set(run["errors"]) == {"draft"} and "nosuch" in str(run["errors"]["draft"])
    results = client.get(f"/api/runs/{run_id}/results").json()
    assert results["nodes"] == {"draft": "failed"} and results["outputs"] == {}


def test_cancel_ends_the_run_cancelled_and_a_second_cancel_is_409(client):
    """in -> draft (sim/slow), cancelled right after the 202, before the executor may even hold it."""
    _create(client, "to-cancel", draft_spec(model="sim/slow"))
    run_id = _start(client, "to-cancel")["run_id"]
    cancelled = client.post(f"/api/runs/{run_id}/cancel")
    assert cancelled.status_code == 202, cancelled.text
    run = _wait_for(client, run_id, {"completed", "failed", "cancelled"})
    assert run["status"] == "cancelled"
    assert client.get(f"/api/runs/{run_id}/results").json()["status"] == "cancelled"
    again = client.post(f"/api/runs/{run_id}/cancel")
    assert again.status_code == 409 and again.json()["status"] == "cancelled"


def test_a_run_this_server_did_not_start_cannot_be_cancelled_here(client, store):
    """A row written by another process (say `opgraph flow run`): its owner holds the only handle."""
    pinned = store.resolve(_create(client, "elsewhere", draft_spec())["name"])
    provenance = fixed_workflow_provenance(ref=pinned.name, version=pinned.version,
                                              content_hash=pinned.content_hash).to_payload()
    store.create_run("run-from-another-process", session_id="another", provenance=provenance, inputs={},
                     workflow=pinned, status="running", capabilities=FIXED_WORKFLOW_CAPABILITIES.as_metadata())
    reply = client.post("/api/runs/run-from-another-process/cancel")
    assert reply.status_code == 409 and "not started by this server" in reply.json()["error"]
    assert store.get_run("run-from-another-process").status == "running"
    assert client.get("/api/runs/run-from-another-process/results").status_code == 409
    store.finish_run("run-from-another-process", "completed", outputs={})


def test_a_run_state_conflict_survives_pickling():
    error = RunStateConflictError("run r is still running", run_id="r", status="running")
    restored = pickle.loads(pickle.dumps(error))
    assert type(restored) is RunStateConflictError and isinstance(restored, OpGraphError)
    assert (restored.message, restored.run_id, restored.status) == (error.message, "r", "running")


def test_live_controls_are_rejected_and_the_run_keeps_its_pinned_version(client):
    """in -> draft on v1 (sim/slow): message/pause/resume are 409 and a PUT of v2 mid-run changes nothing."""
    v1 = _create(client, "pinned", draft_spec(prompt="First prompt", model="sim/slow"))
    run_id = _start(client, "pinned", version=1)["run_id"]
    for control, body in (("message", {"text": "hurry up"}), ("pause", None), ("resume", None)):
        reply = client.post(f"/api/runs/{run_id}/{control}", json=body)
        assert reply.status_code == 409, reply.text
        assert "not queued" in reply.json()["error"] and reply.json()["request_kind"] == control
        assert reply.json()["lane_capabilities"]["live_message"] is False
    v2 = client.put("/api/workflows/pinned", json={"spec": draft_spec(prompt="Second prompt", model="sim/fast")}).json()
    assert v2["version"] == 2 and v2["content_hash"] != v1["content_hash"]
    assert client.get(f"/api/runs/{run_id}").json()["status"] == "running"  # unaffected

    run = _wait_for(client, run_id, {"completed", "failed", "cancelled"})
    assert run["status"] == "completed"
    assert run["version"] == 1 and run["content_hash"] == v1["content_hash"]
    assert run["provenance"]["source"] == {"kind": "workflow_def", "ref": "pinned", "version": 1,
                                           "content_hash": v1["content_hash"]}
    text = run["outputs"]["draft"]["text"]
    assert "First prompt" in text and "hurry up" not in text and run["outputs"]["draft"]["model"] == "sim/slow"
    kinds = [(s["spec_node_id"], s["kind"]) for s in client.get(f"/api/runs/{run_id}/signals").json()["signals"]]
    assert kinds == [("draft", "queued"), ("draft", "started"), ("draft", "completed")]  # nothing paused
    latest = _start(client, "pinned")
    assert latest["version"] == 2 and latest["content_hash"] == v2["content_hash"]
    assert _wait_for(client, latest["run_id"], {"completed", "failed", "cancelled"})["status"] == "completed"


def test_unknown_workflows_runs_and_versions_are_404(client):
    for method, path in (("GET", "/api/workflows/ghost"), ("GET", "/api/workflows/ghost/versions"),
                         ("DELETE", "/api/workflows/ghost"), ("POST", "/api/workflows/ghost/runs"),
                         ("GET", "/api/runs/ghost"), ("GET", "/api/runs/ghost/signals"),
                         ("GET", "/api/runs/ghost/results"), ("POST", "/api/runs/ghost/cancel"),
                         ("POST", "/api/runs/ghost/message"), ("POST", "/api/runs/ghost/pause")):
        reply = client.request(method, path)
        assert reply.status_code == 404, (method, path, reply.text)
        assert "ghost" in reply.json()["error"]
    assert client.put("/api/workflows/ghost", json={"spec": draft_spec()}).status_code == 404
    _create(client, "one-version", draft_spec())
    # The workflow exists; the body pins a version it lacks: the body is what is wrong.
    reply = client.post("/api/workflows/one-version/runs", json={"version": 7})
    assert reply.status_code == 422 and "version 7" in reply.json()["error"]
    assert reply.json()["error"].startswith("body.version:")


def test_shutdown_cancels_in_flight_runs(session, tmp_path):
    """A second server: stopping it while a sim/slow run is in flight records ``cancelled``."""
    with open_store(tmp_path / "shutdown.db") as store:
        app = create_app(store, session_factory=lambda: session)
        served = serve(app)
        try:
            with served.client() as http:
                _create(http, "long", draft_spec(model="sim/slow"))
                run_id = _start(http, "long")["run_id"]
        finally:
            served.stop()
        assert store.get_run(run_id).status == "cancelled"
        assert app.state.runs.statistics()["in_flight"] == 0


def test_the_runtime_starts_with_the_server_so_the_first_admission_is_quick(session, tmp_path):
    """A runtime that takes 3 s to start (Ray's start measured 8-30 s here): the server pays it
    while starting, says so, and the first run is then admitted in well under a second."""
    calls = []

    def slow_start():
        calls.append(time.monotonic())
        time.sleep(SLOW_RUNTIME_START)  # stands in for Ray starting inside Session()
        return session

    with open_store(tmp_path / "eager.db") as store:
        served = serve(create_app(store, session_factory=slow_start))
        try:
            assert len(calls) == 1, "the runtime did not start with the server"
            with served.client() as http:
                _create(http, "twice", draft_spec())
                started = time.monotonic()
                first = _start(http, "twice")
                assert time.monotonic() - started < 1.0, "the first admission waited for the runtime"
                second = _start(http, "twice")
                for admitted in (first, second):
                    assert _wait_for(http, admitted["run_id"], {"completed", "failed", "cancelled"})["status"] \
                        == "completed"
        finally:
            served.stop()
    assert len(calls) == 1  # one Session for the server's life


def test_a_runtime_that_cannot_start_is_503_and_creates_no_run(tmp_path, capfd):
    """No Ray at all: the start with the server fails and says so, definitions are still
    served, each run request says why it cannot run, and each retries the start."""
    attempts = []

    def unreachable():
        attempts.append(1)
        raise ConnectionError("no Ray cluster at 10.0.0.1:6379")

    with open_store(tmp_path / "no-ray.db") as store:
        served = serve(create_app(store, session_factory=unreachable))
        try:
            assert "cannot start the runtime" in capfd.readouterr().err
            with served.client() as http:
                _create(http, "stranded", draft_spec())
                for _ in range(2):
                    reply = http.post("/api/workflows/stranded/runs", json={})
                    assert reply.status_code == 503 and "no Ray cluster" in reply.json()["error"]
        finally:
            served.stop()
        assert store.list_runs() == [] and len(attempts) == 3
