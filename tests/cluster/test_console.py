"""The run console in a real browser: Debian's Chromium driven by Playwright, against `opgraph serve`'s app.

    Chromium (Playwright, one per module) -> uvicorn (one per module) -> create_app -> the shared Session

One server and one SQLite store serve the module; its runs are real runs of the fixed lane on
the shared Session with the built-in ``sim/`` provider (``sim/slow``: 1 s per call, long enough
to watch a node run and to cancel a run). The 10,000-node fan-out and the run whose node
outputs ``<script>`` are recorded in the store as a run records them. Screenshots of the
support-triage run and of the fan-out go to ``$OPGRAPH_TEST_CACHE/artifacts/``.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_server import serve
from components import require
from workflow_specs import draft_spec

from opgraph.cluster.bench.console import CHROMIUM_ARGS, record_fanout
from opgraph.cluster.http import AccessPolicy, create_app
from opgraph.cluster.lanes import open_store

TOKEN = "console-token-" + "k" * 32
RUN_DEADLINE = 30.0
SCRIPT = "<script>alert(1)</script>"
EXAMPLES = Path(__file__).resolve().parents[2] / "cluster" / "lanes" / "fixed" / "examples"


def artifacts() -> Path:
    folder = Path(os.environ.get("OPGRAPH_TEST_CACHE") or "/tmp/opgraph-test-cache") / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def chromium_binary():
    return require("chromium")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("console") / "opgraph.db") as opened:
        yield opened


@pytest.fixture(scope="module")
def served(session, store, chromium_binary):
    app = create_app(store, session_factory=lambda: session, access=AccessPolicy(TOKEN))
    with serve(app) as running:
        yield running


@pytest.fixture(scope="module")
def api(served):
    with served.client() as http:
        yield http


@pytest.fixture(scope="module")
def chromium(chromium_binary):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium_binary, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


@pytest.fixture()
def console_page(chromium, served):
    """A page of a browser context signed in once with the sign-in URL (the cookie holds from then on)."""
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    signed_in = context.new_page()
    signed_in.set_default_timeout(15_000)
    signed_in.goto(f"{served.url}/?token={TOKEN}")
    yield signed_in
    context.close()


def _workflow(api: httpx.Client, name: str, spec: dict[str, Any]) -> None:
    reply = api.post("/api/workflows", json={"name": name, "spec": spec})
    assert reply.status_code == 201, reply.text


def _start(api: httpx.Client, name: str, **body: Any) -> str:
    reply = api.post(f"/api/workflows/{name}/runs", json=body)
    assert reply.status_code == 202, reply.text
    return reply.json()["run_id"]


def _wait(api: httpx.Client, run_id: str, done: Any) -> Any:
    deadline = time.monotonic() + RUN_DEADLINE
    while True:
        found = done()
        if found:
            return found
        assert time.monotonic() < deadline, api.get(f"/api/runs/{run_id}").text
        time.sleep(0.05)


def _status(api: httpx.Client, run_id: str) -> str:
    return api.get(f"/api/runs/{run_id}").json()["status"]


@pytest.fixture(scope="module")
def triage_run(api):
    """A finished run of the bundled support-triage workflow."""
    _workflow(api, "support-triage", json.loads((EXAMPLES / "support-triage.json").read_text()))
    run_id = _start(api, "support-triage", inputs={"ticket": "The export button crashes the app", "priority": "high"},
                    model="sim/fast")
    _wait(api, run_id, lambda: _status(api, run_id) in ("completed", "failed"))
    return run_id


# -- signing in ------------------------------------------------------------------------------------
def test_without_the_token_a_browser_gets_the_sign_in_page_and_signs_in_once(chromium, served):
    context = chromium.new_context()
    try:
        console_page = context.new_page()
        answer = console_page.goto(served.url + "/")
        assert answer.status == 401
        assert console_page.get_by_role("heading", name="Sign in to opgraph").is_visible()
        console_page.get_by_label("Token").fill(TOKEN)
        console_page.get_by_role("button", name="Sign in").click()
        console_page.get_by_role("heading", name="Runs").wait_for()
        assert console_page.url == served.url + "/"  # the token left the address bar
        (cookie,) = [c for c in context.cookies() if c["name"] == "opgraph_session"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and TOKEN not in cookie["value"]
        assert console_page.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    finally:
        context.close()


# -- the runs list and a run's page ---------------------------------------------------------------
def test_the_runs_list_shows_a_finished_support_triage_run(console_page, served, api, triage_run):
    console_page.goto(served.url + "/")
    row = console_page.locator(f'tr[data-run="{triage_run}"]')
    assert row.is_visible()
    assert "support-triage@1" in row.inner_text() and "fixed_workflow" in row.inner_text()
    assert re.search(r"✓\s*\d", row.locator(".counts").inner_text())
    # Keyboard: j selects the first run and focuses its link; Enter opens it.
    console_page.keyboard.press("j")
    console_page.keyboard.press("Enter")
    console_page.wait_for_url(re.compile(r"/runs/"))
    # Without a browser: the same page for `Accept: text/html`, the JSON API where it was.
    html = api.get("/", headers={"accept": "text/html"})
    assert html.status_code == 200 and triage_run in html.text
    assert api.get("/").json()["signed_in"] is True
    filtered = api.get("/", params={"status": "cancelled"}, headers={"accept": "text/html"}).text
    assert triage_run not in filtered
    # On a phone: the list fits the screen's width (less urgent columns fold away).
    console_page.set_viewport_size({"width": 390, "height": 800})
    console_page.goto(served.url + "/")
    assert console_page.evaluate("document.documentElement.scrollWidth") <= 390


def test_a_run_page_draws_its_graph_as_svg_naming_its_nodes(console_page, served, api, triage_run):
    served_html = api.get(f"/runs/{triage_run}").text  # server-rendered: there with JavaScript off
    svg = served_html[served_html.index("<svg"):served_html.index("</svg>")]
    for name in ("classify", "draft_reply", "escalate", "check"):  # the nodes that run (an input is context)
        assert f">{name}</text>" in svg
    console_page.goto(f"{served.url}/runs/{triage_run}")
    names = console_page.locator("svg.graph a.node text.name").all_text_contents()
    assert {"classify", "draft_reply", "escalate", "check"} <= set(names)
    assert "s-completed" in console_page.locator("svg.graph a.node", has_text="classify").get_attribute("class")
    console_page.screenshot(path=str(artifacts() / "console-support-triage.png"), full_page=True)


def test_a_nodes_panel_shows_its_conversation_result_and_signals(console_page, served, triage_run):
    console_page.goto(f"{served.url}/runs/{triage_run}")
    console_page.locator("svg.graph a.node", has_text="classify").click()
    panel = console_page.locator("#panel")
    panel.locator(".node-panel").wait_for()
    assert "classify" in panel.locator("h2").inner_text()
    conversation = panel.locator("ol.conversation li.message")
    roles = conversation.locator(".role").all_inner_texts()
    assert "USER" in [role.upper() for role in roles] and "ASSISTANT" in [role.upper() for role in roles]
    own = panel.locator("ol.conversation li.message.own")  # the node's own answer, marked
    assert own.count() == 1 and own.locator(".role").inner_text().upper() == "ASSISTANT"
    assert "tokens" in panel.inner_text() and "started" in panel.locator("table.signals").inner_text()
    console_page.keyboard.press("Escape")
    assert panel.is_hidden()


# -- live ------------------------------------------------------------------------------------------
def test_a_live_nodes_state_turns_from_running_to_completed_without_a_reload(console_page, served, api, store):
    # A chain of three 1 s nodes: whichever runs when the page is drawn is watched until it completes.
    _workflow(api, "console-live", _chain_spec())
    run_id = _start(api, "console-live", inputs={"topic": "live"})
    _wait(api, run_id, lambda: any(s["kind"] == "started" for s in store.run_signals(run_id)))
    console_page.goto(f"{served.url}/runs/{run_id}")
    console_page.evaluate("window.notReloaded = true")
    running = console_page.locator("svg.graph a.node.s-running")
    assert running.count() == 1, console_page.content()
    node_id = running.get_attribute("data-node")
    console_page.locator(f'svg.graph a.node.s-completed[data-node="{node_id}"]').wait_for(
        timeout=RUN_DEADLINE * 1000)
    console_page.locator("#run-status", has_text="completed").wait_for(timeout=RUN_DEADLINE * 1000)
    assert console_page.evaluate("window.notReloaded") is True
    assert node_id in [update[0] for update in console_page.evaluate("window.opgraphUpdates")]  # by the feed
    assert _status(api, run_id) == "completed"


def _chain_spec() -> dict[str, Any]:
    """in -> draft -> second -> third, each on sim/slow (1 s a call)."""
    return draft_spec(model="sim/slow", extra_nodes=[
        {"id": "second", "kind": "chat", "pos": {"x": 2, "y": 0}, "config": {"prompt": "Again", "model": "sim/slow"}},
        {"id": "third", "kind": "chat", "pos": {"x": 3, "y": 0}, "config": {"prompt": "More", "model": "sim/slow"}}],
        extra_edges=[{"id": "e2", "from": "draft", "to": "second"}, {"id": "e3", "from": "second", "to": "third"}])


def test_cancelling_from_the_console_asks_first_and_the_store_agrees(console_page, served, api):
    _workflow(api, "console-cancel", _chain_spec())
    run_id = _start(api, "console-cancel", inputs={"topic": "cancel me"})
    console_page.goto(f"{served.url}/runs/{run_id}")
    asked = []
    console_page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    console_page.get_by_role("button", name="cancel").click()
    assert asked and "Cancel this run" in asked[0]
    assert _status(api, run_id) == "running"  # dismissed: nothing was sent
    console_page.once("dialog", lambda dialog: dialog.accept())
    console_page.get_by_role("button", name="cancel").click()
    console_page.locator("#control-outcome", has_text="cancel: cancelled").wait_for()
    assert _status(api, run_id) == "cancelled"
    console_page.locator("#run-status", has_text="cancelled").wait_for()


# -- escaping and size -----------------------------------------------------------------------------
def test_a_nodes_script_output_and_name_show_as_text(console_page, served, store):
    run_id = "console-script-run"
    provenance = {"lane": "fixed_workflow", "source": {"kind": "workflow_file", "ref": SCRIPT,
                                                       "content_hash": "sha256:" + "c" * 64}}
    store.create_run(run_id, session_id="s", provenance=provenance, inputs={"topic": SCRIPT})
    store.record_outline(run_id, {"nodes": [["n1", SCRIPT, "chat"]], "edges": []})
    store.record_progress(run_id, signals=[{"node_id": "n1", "spec_node_id": SCRIPT, "kind": "completed"}],
                          nodes=[{"node_id": "n1", "spec_node_id": SCRIPT, "status": "completed", "result": SCRIPT}])
    store.record_branch(run_id, "b1", node_id=SCRIPT, messages=[{"role": "assistant", "content": SCRIPT}])
    store.finish_run(run_id, "failed", error={SCRIPT: {"error": SCRIPT, "type": "<b>Boom</b>"}})
    dialogs = []
    console_page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    console_page.goto(f"{served.url}/runs/{run_id}")
    console_page.locator("svg.graph a.node").click()
    panel = console_page.locator("#panel .node-panel")
    panel.wait_for()
    assert SCRIPT in console_page.locator("h1").inner_text()
    assert SCRIPT in panel.locator("h2").inner_text()
    assert panel.locator("pre", has_text=SCRIPT).count() >= 2  # the result and the message, as text
    assert panel.locator(".error-type").inner_text() == "<b>Boom</b>"
    console_page.goto(f"{served.url}/")
    assert console_page.locator("script").count() == 1  # the console's own script only
    assert dialogs == []


def test_a_10000_node_fan_out_is_a_few_shapes_with_counts_and_expands(console_page, served, store):
    record_fanout(store, "console-fanout", 10_000, failed=2)
    started = time.perf_counter()
    console_page.goto(f"{served.url}/runs/console-fanout")
    assert time.perf_counter() - started < 10
    assert console_page.locator("svg.graph a.shape").count() == 3
    group = console_page.locator("svg.graph a.group")
    assert "×10,000" in group.text_content() and "✓9,998" in group.text_content() and "✗2" in group.text_content()
    console_page.screenshot(path=str(artifacts() / "console-fanout-10000.png"), full_page=True)
    group.click()
    members = console_page.locator("#panel a.member")
    members.first.wait_for()
    assert members.count() == 200  # a page of members; the rest are a "next" away
    members.nth(1).click()
    console_page.locator("#panel h2", has_text="row-1").wait_for()


# -- pause, message, resume; resume from the run log ----------------------------------------------
def _signals(api: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    return api.get(f"/api/runs/{run_id}/signals").json()["signals"]


def _confirm(console_page: Any, asked: list[str], answer: str | None = None) -> None:
    """Accept the next dialog (a prompt with ``answer``), noting what it asked."""
    console_page.once("dialog", lambda dialog: (asked.append(dialog.message),
                                                dialog.accept(answer) if answer is not None else dialog.accept()))


def test_pausing_messaging_and_resuming_a_planned_run_from_the_console(console_page, served, api, session,
                                                                        tmp_path):
    """A planned flow (scripted planner: gather -> weigh -> draft SLOW -> review SLOW) is paused, sent a
    message while paused and resumed through the console's buttons, and completes without a reload."""
    import planned_scripts
    from planned_scripts import PlannedScript
    from ray import cloudpickle

    from opgraph.actors.providers import ScriptedProvider

    cloudpickle.register_pickle_by_value(planned_scripts)
    try:
        session.register_provider("scripted", ScriptedProvider(PlannedScript(tmp_path / "calls.log")))
        started = api.post("/api/flows/runs", json={"prompt": "crash-plan", "model": "scripted/planner",
                                                    "synthesis": False})
        assert started.status_code == 202, started.text
        run_id = started.json()["run_id"]
        console_page.goto(f"{served.url}/runs/{run_id}")
        console_page.evaluate("window.notReloaded = true")
        asked: list[str] = []
        _confirm(console_page, asked)
        console_page.get_by_role("button", name="pause", exact=True).click()
        console_page.locator("#control-outcome", has_text="pause: accepted").wait_for()
        assert asked and "Pause this run" in asked[-1]
        # The run holds: no node starts while it is paused (the running ones may finish), and it does not end.
        time.sleep(0.5)
        started = [s for s in _signals(api, run_id) if s["kind"] == "started"]
        time.sleep(3.0)  # longer than a SLOW node
        assert [s for s in _signals(api, run_id) if s["kind"] == "started"] == started
        assert _status(api, run_id) == "running"

        _confirm(console_page, asked, "keep it short")
        console_page.get_by_role("button", name="send a message").click()
        console_page.locator("#control-outcome", has_text="message: accepted").wait_for()
        assert asked[-1] == "Message to send into the run:"
        assert _status(api, run_id) == "running"

        _confirm(console_page, asked)
        console_page.get_by_role("button", name="resume", exact=True).click()
        console_page.locator("#control-outcome", has_text="resume: accepted").wait_for()
        console_page.locator("#run-status", has_text="completed").wait_for(timeout=RUN_DEADLINE * 1000)
        assert console_page.evaluate("window.notReloaded") is True
        assert _status(api, run_id) == "completed"
    finally:
        cloudpickle.unregister_pickle_by_value(planned_scripts)


def test_a_failed_durable_run_resumes_from_the_run_log_through_the_console(console_page, served, api, store, session,
                                                                           tmp_path):
    """in -> draft -> second -> third (sim/slow) run by `opgraph flow run` on the session's Ray; its owner is
    SIGKILLed once draft settled, so the run is recorded failed (OwnerProcessLost). The console's button
    continues it from the run log, and draft does not run again."""
    import subprocess
    import sys

    import ray

    from opgraph.cluster.processes import run_until

    definition = tmp_path / "chain.json"
    definition.write_text(json.dumps(_chain_spec()))
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    run_until([sys.executable, "-m", "opgraph.cluster.cli", "flow", "run", str(definition), "--store", store.path,
               "--plain", "--input", "topic=recover"],
              lambda lines: any("completed" in line and line.rstrip().endswith(" draft") for line in lines),
              stream="stderr", timeout=60, env=env, stdout=subprocess.DEVNULL)
    (record,) = [run for run in store.list_runs(limit=1000) if run.source_ref == str(definition)]
    assert record.orphaned, record
    console_page.goto(f"{served.url}/runs/{record.run_id}")
    assert console_page.locator("button.control").all_inner_texts() == ["resume from the run log"]
    asked: list[str] = []
    console_page.once("dialog", lambda dialog: (asked.append(dialog.message), dialog.dismiss()))
    console_page.get_by_role("button", name="resume from the run log").click()
    assert asked and "Continue this failed durable run" in asked[0]
    assert api.get(f"/api/runs/{record.run_id}").json()["status"] == "failed"  # dismissed: nothing was sent
    _confirm(console_page, asked)
    console_page.get_by_role("button", name="resume from the run log").click()
    console_page.locator("#control-outcome", has_text="recover: running").wait_for()
    _wait(api, record.run_id, lambda: _status(api, record.run_id) == "completed")
    started = [s["spec_node_id"] for s in store.run_signals(record.run_id) if s["kind"] == "started"]
    assert started.count("draft") == 1, started
    console_page.reload()
    console_page.locator("#run-status", has_text="completed").wait_for()
