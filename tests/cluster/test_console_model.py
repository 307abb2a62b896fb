"""What the console reads and draws, without a browser: the store's outline and node summaries on both
backends, the folding of a fan-out into groups, the layout's direction and the SVG's escaping.

No Ray and no browser: the store is written as a run writes it (test_console.py drives the pages).
"""

from __future__ import annotations

import time

import httpx
import pytest
from api_server import serve

from opgraph.cluster.bench.console import record_fanout
from opgraph.cluster.control import ControlDatabase, TaskQueue
from opgraph.cluster.control.schedules import Scheduler
from opgraph.cluster.http import AccessPolicy, create_app
from opgraph.cluster.http.console import build_model, render_svg
from opgraph.cluster.lanes import open_store
from opgraph.cluster.store import EngineRunStore, RunStore
from opgraph.engines import EventRecord

SCRIPT = "<script>alert(1)</script>"


def test_the_store_keeps_a_runs_outline_and_sums_its_nodes_by_state(database_target):
    with RunStore(database_target) as store:
        record_fanout(store, "fan", 50, failed=2)
        outline = store.run_outline("fan")
        assert len(outline["nodes"]) == 52 and ["split", "w0"] in outline["edges"]
        summary = store.node_summary(["fan", "unknown-run"])
        assert summary == {"fan": {"counts": {"completed": 50, "failed": 2}, "tokens": 52 * 30, "cost_usd": 0.0}}
        states = store.node_states("fan")
        assert states["w0"] == "failed" and states["w5"] == "completed" and len(states) == 52
        assert store.run_node("fan", "w5")["result"]["text"] == "answer 6"
        assert [signal["kind"] for signal in store.node_signals("fan", "w5")] == ["queued", "started", "completed"]
        assert store.list_runs(limit=1, offset=1) == []


def test_a_fan_out_is_one_group_between_its_neighbours_laid_out_left_to_right():
    width = 10_000
    outline = {"nodes": [["s", "split", "split"]] + [[f"w{i}", f"row-{i}", "work"] for i in range(width)]
               + [["j", "join", "join"], ["x", "draft", "chat"], ["y", "check", "chat"]],
               "edges": [["s", f"w{i}"] for i in range(width)] + [[f"w{i}", "j"] for i in range(width)]
               + [["j", "x"], ["x", "y"]]}
    started = time.perf_counter()
    model = build_model(outline)
    svg = render_svg(model, {f"w{i}": "completed" for i in range(9_000)} | {"w9999": "failed"}, run_id="r")
    assert time.perf_counter() - started < 5
    assert len(model.shapes) == 5  # split, the group of 10,000, join, draft, check
    (group,) = [shape for shape in model.shapes.values() if shape.group]
    assert len(group.members) == width and group.label == "work"
    xs = {shape.label: shape.x for shape in model.shapes.values()}
    assert xs["split"] < xs["work"] < xs["join"] < xs["draft"] < xs["check"]  # layered by dependency
    assert "work ×10,000" in svg and "✓9,000" in svg and "✗1" in svg and "○999" in svg
    assert svg.count("<a ") == 5


def test_siblings_below_the_group_size_stay_nodes_and_every_name_is_escaped():
    outline = {"nodes": [["a", "classify", "chat"], ["b", SCRIPT, "chat"], ["c", "escalate", "chat"]],
               "edges": [["a", "b"], ["a", "c"]]}
    model = build_model(outline)
    assert not any(shape.group for shape in model.shapes.values())
    svg = render_svg(model, {"a": "completed", "b": "running"}, run_id='run"<x>')
    assert SCRIPT not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg
    assert 'run"<x>' not in svg
    assert model.shapes[model.shape_of["a"]].x < model.shapes[model.shape_of["b"]].x


# -- the pages over HTTP, without a browser or Ray ----------------------------------------------------
TOKEN = "console-model-token-" + "m" * 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("console-model") / "opgraph.db") as store:
        record_fanout(store, "fan", 20)
        app = create_app(store, session_factory=lambda: None, start_runtime=False, access=AccessPolicy(TOKEN))
        with serve(app) as running:
            yield running, store, app.state.access


def test_the_cookie_signs_a_browser_in_and_a_post_by_it_needs_the_csrf_token(served):
    running, _, access = served
    with httpx.Client(base_url=running.url, timeout=30, follow_redirects=True) as browser:
        assert browser.get("/runs/fan").status_code == 401
        signed_in = browser.get("/", params={"token": TOKEN}, headers={"accept": "text/html"})
        assert signed_in.history[0].status_code == 303 and signed_in.url.path == "/"
        assert "fan" in signed_in.text and "<svg" not in signed_in.text
        page = browser.get("/runs/fan").text
        assert f'<meta name="csrf-token" content="{access.csrf_token}">' in page
        refused = browser.post("/api/runs/fan/cancel", json={})
        assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
        with_token = browser.post("/api/runs/fan/cancel", json={}, headers={"x-csrf-token": access.csrf_token})
        assert with_token.status_code == 409  # past the guard: the run already ended
        assert browser.post("/api/runs/fan/cancel", json={},
                            headers={"x-csrf-token": access.csrf_token, "origin": "https://attacker.example"}
                            ).status_code == 403


def test_an_engine_runs_page_shows_its_timeline_and_its_tree(served):
    running, store, _ = served
    engines = EngineRunStore(store.path)
    engines.open_run("eng-1", engine="research", inputs={"question": SCRIPT}, config={})
    events = [EventRecord("eng-1", 1, "event", "NodeOpened", {"id": "root", "label": "batteries", "parent": None}),
              EventRecord("eng-1", 2, "event", "NodeOpened", {"id": "a", "label": "solid-state", "parent": "root"}),
              EventRecord("eng-1", 3, "event", "NodeOpened", {"id": "b", "label": SCRIPT, "parent": "a"}),
              EventRecord("eng-1", 4, "notification", "progress", {"done": 3})]
    engines.record_events("eng-1", events)
    engines.close_run("eng-1", "completed", result="done", degrade_reason="", error=None, statistics={"events": 4})
    engines.close()
    with running.client() as client:
        listing = client.get("/engine-runs").text
        assert "eng-1" in listing and "research" in listing
        page = client.get("/engine-runs/eng-1").text
        assert page.count("<tr><td>") == 4 and "NodeOpened" in page and "progress" in page
        tree = page[page.index('<ul class="tree">'):page.index("Event timeline")]
        assert tree.index("batteries") < tree.index("solid-state") < tree.index("&lt;script&gt;")
        assert SCRIPT not in page
        assert client.get("/engine-runs/nope").status_code == 404


def test_the_control_plane_has_a_page_each_for_schedules_tasks_and_webhook_deliveries(served):
    running, store, _ = served
    control = ControlDatabase(store.path)
    try:
        task, _ = TaskQueue(control).submit("workflow", SCRIPT, queue="console")
        Scheduler(control, name="test").add("nightly", action_kind="workflow", target="triage", cron="0 3 * * *")
    finally:
        control.close()
    with running.client() as client:
        tasks = client.get("/control/tasks").text
        assert task.task_id in tasks and "&lt;script&gt;" in tasks and SCRIPT not in tasks
        assert "nightly" in client.get("/control/schedules").text and "0 3 * * *" in client.get(
            "/control/schedules").text
        assert "Webhook deliveries" in client.get("/control/webhooks").text
        assert client.get("/control/nothing").status_code == 404
