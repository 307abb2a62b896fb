"""The planned reactive flow lane: planning rules, --reactive modes, the spawn cap, controls, replay, provenance.

    plan -> 1 -> 2 -> ...       a scripted planner (tests/support/planned_scripts.py) returns each plan;
                                task nodes spawn on SPAWN2, sleep on SLOW, fail on FAILONCE
    checkpoint replay           a failed run replayed with --retry-failed: completed ops short-circuit,
                                the failed op's old children are dropped, no planner call

Runs share the test session's Ray and run log (``OPGRAPH_DB``); each test's run store is its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import planned_scripts
import pytest
from planned_scripts import PlannedScript, calls
from ray import cloudpickle

from opgraph.actors.providers import ScriptedProvider
from opgraph.cluster.lanes import (
    FIXED_WORKFLOW,
    PLANNED_REACTIVE_FLOW,
    LaneCapabilityError,
    lane_adapter,
    validate_provenance,
)
from opgraph.cluster.processes import run_command, run_until
from opgraph.engines import PlanError

MODEL = "scripted/planner"
DEADLINE = 120.0  # seconds for a subprocess run


@pytest.fixture(autouse=True, scope="module")
def _scripts_by_value():
    cloudpickle.register_pickle_by_value(planned_scripts)
    yield
    cloudpickle.unregister_pickle_by_value(planned_scripts)


@pytest.fixture
def store(tmp_path):
    from opgraph.cluster.lanes import open_store

    with open_store(tmp_path / "runs.db") as opened:
        yield opened


def _run(session, store, log: Path, prompt: str, **options):
    session.register_provider("scripted", ScriptedProvider(PlannedScript(log)))
    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    invocation = lane.invocation(prompt, model=MODEL, **options)
    prepared = asyncio.run(lane.prepare(invocation, session=session))
    return prepared, asyncio.run(lane.execute(prepared, session=session))


def test_bad_options_are_refused_before_anything_starts(store):
    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    with pytest.raises(ValueError, match="not on the roster: wizard"):
        lane.invocation("x", reactive="writer,wizard")
    with pytest.raises(ValueError, match="max-ops"):
        lane.invocation("x", max_ops=-1)
    with pytest.raises(ValueError, match="needs a prompt"):
        lane.invocation("  ")
    off = lane.invocation("x", reactive="off")
    assert lane.capabilities(off).reactive_growth is False and lane.capabilities(off).live_message is True
    assert lane.capabilities(lane.invocation("x")).as_metadata() == {
        "planner": True, "reactive_growth": True, "live_pause": True, "live_message": True,
        "checkpoint_resume": True, "leased_admission": False, "cancel": True}
    assert lane.capabilities(lane.invocation("x", durable=False)).checkpoint_resume is False


@pytest.mark.ray
def test_plan_validation_drops_unknown_roles_and_bad_ordinals(session, store, tmp_path):
    """messy-plan: 1 RESEARCHER; 2 wizard (dropped); 3 writer after 1 (3 self, 9 out of range, 2 dropped);
    4 analyst after 3 ("x" dropped): kept as 1, 2 after 1, 3 after 2."""
    log = tmp_path / "calls.log"
    prepared, result = _run(session, store, log, "messy-plan", synthesis=False)
    assert prepared.recovery["dropped_assignees"] == ["wizard"]
    plan = prepared.recovery["plan"]
    assert [(step["assignee"], step["depends_on"]) for step in plan] == [
        ("researcher", []), ("writer", [1]), ("analyst", [2])]
    assert result.status == "completed" and set(result.statuses) == {"1:researcher", "2:writer", "3:analyst"}
    assert calls(log).count("planner") == 1 and "synthesis" not in calls(log)
    record = store.get_run(result.run_id)
    provenance = validate_provenance(record.provenance)
    assert (provenance.lane, provenance.source.kind, provenance.planner.used) == (
        PLANNED_REACTIVE_FLOW, "prompt", True)
    assert provenance.source.content_hash.startswith("sha256:") and record.recovery["plan"] == plan


@pytest.mark.ray
def test_a_cycle_an_empty_plan_and_an_oversized_plan_fail_typed(session, store, tmp_path):
    log = tmp_path / "calls.log"
    with pytest.raises(PlanError, match="cycle"):
        _run(session, store, log, "cycle-plan")
    with pytest.raises(PlanError, match="even after one retry"):
        _run(session, store, log, "empty-plan")
    assert calls(log).count("planner") == 1 + 2  # the empty plan was asked for once more
    with pytest.raises(PlanError, match="cap is 10"):
        _run(session, store, log, "big-plan", max_ops=10)
    assert store.list_runs() == []  # no run was recorded for a plan that failed


@pytest.mark.ray
def test_reactive_modes_and_the_spawn_cap(session, store, tmp_path):
    """spawny-plan: three roots, each asking for two children."""
    log = tmp_path / "calls.log"
    _, every = _run(session, store, log, "spawny-plan", synthesis=False)
    assert every.envelope["spawned_operations"] == 6 and len(every.statuses) == 9
    prepared, off = _run(session, store, log, "spawny-plan", synthesis=False, reactive="off")
    assert off.envelope.get("spawned_operations", 0) == 0 and len(off.statuses) == 3
    assert prepared.capabilities.reactive_growth is False
    assert store.get_run(off.run_id).capabilities["reactive_growth"] is False
    assert validate_provenance(store.get_run(off.run_id).provenance).reactive.enabled is False
    _, critic = _run(session, store, log, "spawny-plan", synthesis=False, reactive="critic")
    assert critic.envelope["spawned_operations"] == 2  # only the critic's two
    _, capped = _run(session, store, log, "spawny-plan", synthesis=False, max_ops=4)
    assert capped.envelope["spawned_operations"] == 1  # 4 ops in all, 3 planned
    assert {drop["reason"] for drop in capped.envelope["dropped_spawns"]} == {"max_spawn_exceeded"}


@pytest.mark.ray
def test_live_controls_are_honoured_for_this_lane(session, store, tmp_path):
    """crash-plan with a pause: nothing new dispatches while paused; a message and a resume go through."""
    log = tmp_path / "calls.log"
    session.register_provider("scripted", ScriptedProvider(PlannedScript(log)))
    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    prepared = asyncio.run(lane.prepare(lane.invocation("crash-plan", model=MODEL, synthesis=False),
                                        session=session))
    from opgraph.cluster.lanes import RunHooks

    async def drive():
        control: dict = {}
        task = asyncio.ensure_future(lane.execute(prepared, session=session, hooks=RunHooks(control=control)))
        while "control" not in control:
            await asyncio.sleep(0.02)
        handle = control["control"]
        assert await handle.pause() is True
        assert await handle.send_operator_message("keep it short") is True
        await asyncio.sleep(0.3)
        paused = await handle.status()
        assert await handle.resume() is True
        return paused, await task

    paused, result = asyncio.run(drive())
    assert paused["paused"] is True if "paused" in paused else True
    assert result.status == "completed"
    fixed = lane_adapter(FIXED_WORKFLOW, store).capabilities()
    assert fixed.live_pause is False and fixed.live_message is False  # the fixed lane still refuses them


@pytest.mark.ray
def test_a_failed_run_is_replayed_without_the_planner(session, store, tmp_path):
    """failing-plan: 1 (SPAWN2) ok; 2 (FAILONCE SPAWN2) fails; 3 after 2 settles as the kernel decides. Replay
    with --retry-failed: only 2 (and what did not complete) runs again."""
    log = tmp_path / "calls.log"
    Path(str(log) + ".fail").write_text("fail")
    prepared, failed = _run(session, store, log, "failing-plan", synthesis=False)
    assert failed.status == "failed" and failed.statuses["2:writer"] == "failed"
    assert failed.envelope["spawned_operations"] == 2  # 1's children; 2 failed before asking for any
    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    with pytest.raises(Exception, match="--retry-failed"):
        asyncio.run(lane.prepare(lane.invocation(failed.run_id, resume=True), session=session))
    Path(str(log) + ".fail").unlink()
    before = calls(log)
    invocation = lane.invocation(failed.run_id[:10], resume=True, retry_failed=True)
    replay = asyncio.run(lane.prepare(invocation, session=session))
    resumed = asyncio.run(lane.execute(replay, session=session))
    after = calls(log)[len(before):]
    assert "planner" not in after
    assert resumed.status == "completed"
    assert [line for line in after if line.startswith("task ")].count("task fine SPAWN2") == 0  # short-circuited
    assert after.count("task broken FAILONCE SPAWN2") == 1
    assert after.count("task after") == (0 if failed.statuses["3:critic"] == "completed" else 1)
    assert resumed.statuses["1:researcher"] == "completed" and resumed.statuses["2:writer"] == "completed"
    assert resumed.envelope["spawned_operations"] == 2  # the retried op's new children
    record = store.get_run(resumed.run_id)
    provenance = validate_provenance(record.provenance)
    assert (provenance.source.kind, provenance.planner.used, provenance.source.resumed_from) == (
        "checkpoint", False, failed.run_id)
    assert record.recovery["resumed_from"]["run_id"] == failed.run_id
    with pytest.raises(Exception, match="nothing to resume"):
        lane.invocation(resumed.run_id, resume=True)
    with pytest.raises(Exception, match=f"already replayed as run {resumed.run_id}"):
        lane.invocation(failed.run_id, resume=True, retry_failed=True)
    assert resumed.capabilities.planner is False  # a replay never calls the planner


def test_a_fixed_run_or_a_live_run_is_refused_with_the_capability_error(store):
    from opgraph.cluster.lanes.planned import refuse_replay as refuse_replay_of

    fixed = store.create_run("fixed-1", session_id="s", provenance={
        "lane": FIXED_WORKFLOW, "source": {"kind": "workflow_file", "ref": "/x.json",
                                           "content_hash": "sha256:" + "0" * 64}},
        inputs={}, capabilities={"cancel": True, "checkpoint_resume": True})
    with pytest.raises(LaneCapabilityError, match="replays planned checkpoints only") as refused:
        refuse_replay_of(fixed)
    assert refused.value.request_kind == "checkpoint_resume"
    live = store.create_run("planned-1", session_id="s", provenance={
        "lane": PLANNED_REACTIVE_FLOW, "source": {"kind": "prompt", "ref": "x", "content_hash": None},
        "planner": {"used": True}}, inputs={}, capabilities={"checkpoint_resume": True}, status="running")
    with pytest.raises(LaneCapabilityError, match="is live"):
        refuse_replay_of(live)


def _owner(log: Path, store_path: str, *arguments: str) -> list[str]:
    support = Path(planned_scripts.__file__).parent
    return [sys.executable, str(support / "planned_owner.py"), str(log), *arguments, "--store", store_path,
            "--plain", "--json"]


@pytest.mark.ray
def test_a_killed_planned_run_is_resumed_from_its_checkpoint(store, tmp_path):
    """crash-plan: 1 (SPAWN2) -> 2 -> 3 (SLOW) -> 4 (SLOW), 1's two children beside 2.

    The process running `opgraph o flow` (and its Ray) is SIGKILLed once 1, 2 and both children
    settled; `opgraph o flow --resume PREFIX` in another process finishes it with no planner
    call, no completed op run again, the children present once and the roles' histories intact.
    """
    from opgraph.cluster.lanes.planned import branch_history

    log = tmp_path / "calls.log"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(planned_scripts.__file__).parent), os.environ.get("PYTHONPATH", "")])}

    def far_enough(seen: list[str]) -> bool:
        settled = [entry.split()[-1] for entry in seen if " completed " in f" {entry} "]
        return {"1:researcher", "2:analyst"} <= set(settled) and len(settled) >= 4

    # The owner and the Ray it started, every process of it, are killed once far enough.
    seen = run_until(_owner(log, store.path, "crash-plan", "--model", MODEL, "--no-synthesis"), far_enough,
                     stream="stderr", timeout=DEADLINE, env=environment).lines
    run_id = next((line.split()[1] for line in seen if line.startswith("run_id: ")), None)
    assert run_id is not None
    record = store.get_run(run_id)
    assert record.orphaned
    before = calls(log)
    assert before.count("planner") == 1 and before.count("task gather SPAWN2") == 1
    histories = {role: branch_history(branch, {}) for role, branch in record.recovery["branches"].items()}
    assert len(histories["researcher"]) >= 3 and len(histories["analyst"]) >= 3  # a profile, then a turn

    resumed_by = run_command(_owner(log, store.path, "--resume", run_id[:12]), timeout=DEADLINE, env=environment)
    assert resumed_by.returncode == 0, resumed_by.stderr[-3000:]
    after = calls(log)[len(before):]
    assert "planner" not in after
    for done in ("task gather SPAWN2", "task weigh", "task child 1 of gather", "task child 2 of gather"):
        assert done not in after, f"{done!r} settled before the kill and ran again"
    assert after.count("task review SLOW") == 1
    printed = json.loads(resumed_by.stdout[resumed_by.stdout.index("{"):])
    assert printed["status"] == "completed" and printed["resumed_from"] == run_id
    spawned = sorted(label for label in printed["statuses"] if ">" in label)
    assert spawned == ["1:researcher>spawn-1", "1:researcher>spawn-2"]  # present once, under their parent
    assert len(printed["statuses"]) == 6
    branches = {row["node_id"]: row["messages"] for row in store.run_branches(printed["run_id"])}
    for role, history in histories.items():
        assert branches[f"role:{role}"][:len(history)] == history, f"{role}'s history was not restored"
    replay = store.get_run(printed["run_id"])
    assert replay.provenance["source"]["resumed_from"] == run_id and replay.provenance["planner"]["used"] is False


# -- playbooks ------------------------------------------------------------------------------
def _playbook(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.playbook.yaml"
    path.write_text(text)
    return path


def test_playbooks_resolve_nearest_first_and_render_typed_args(tmp_path):
    from opgraph.cluster.lanes import REACTIVE_PLAY
    from opgraph.cluster.lanes.play import resolve_playbook

    project, home = tmp_path / "repo" / "sub", tmp_path / "home"
    project.mkdir(parents=True)
    (tmp_path / "repo" / ".git").mkdir()  # repo is the project root: the search climbs to it
    _playbook(home / ".opgraph" / "playbooks", "brief", "prompt: home {input}\n")
    _playbook(tmp_path / "repo" / ".opgraph" / "playbooks", "brief",
              'prompt: "parent {input} in {words} words"\nargs: {words: {type: int, default: 100, help: length}}\n')
    found = resolve_playbook("brief", start=project, home=home)
    assert found.path.parent == (tmp_path / "repo" / ".opgraph" / "playbooks").resolve()
    _playbook(project / ".opgraph" / "playbooks", "brief", '{"prompt": "project", "max_ops": 5}')  # JSON too
    nearest = resolve_playbook("brief", start=project, home=home)
    assert nearest.prompt == "project" and nearest.settings["max_ops"] == 5
    assert nearest.render("topic", {}) == "project\n\ntopic"  # no placeholder: the input is appended
    assert found.render("tea", found.convert({"words": "40"})) == "parent tea in 40 words"
    lane = lane_adapter(REACTIVE_PLAY)
    invocation = lane.invocation("research-brief", text="tea", args={"words": "50"}, start=project, home=home)
    assert invocation.source_kind == "playbook" and invocation.inputs["playbook"]["args"] == {"words": 50}
    assert invocation.source_content_hash == invocation.inputs["playbook"]["content_hash"]
    assert invocation.max_ops == 12 and "tea" in invocation.inputs["task"]  # the bundled example's settings


def test_the_playbook_search_stops_at_the_project_root_and_the_config_folder(tmp_path, monkeypatch):
    """A playbook planted above the project (a shared parent such as /tmp) is never found (issue #32, finding
    6); the project's own folders and the user's config folder ($OPGRAPH_HOME/playbooks) are."""
    from opgraph.cluster.lanes.play import UnknownPlaybookError, resolve_playbook
    from opgraph.cluster.lanes.play.playbook import EXAMPLES_DIR, playbook_roots

    shared, project = tmp_path / "shared", tmp_path / "shared" / "project"
    start = project / "src" / "pkg"
    start.mkdir(parents=True)
    (project / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    config = tmp_path / "opgraph-home"
    monkeypatch.setenv("OPGRAPH_HOME", str(config))
    _playbook(shared / ".opgraph" / "playbooks", "planted", "prompt: stolen {input}\n")
    _playbook(project / ".opgraph" / "playbooks", "ours", "prompt: ours {input}\n")
    _playbook(config / "playbooks", "mine", "prompt: mine {input}\n")
    assert playbook_roots(start) == [start / ".opgraph" / "playbooks", project / "src" / ".opgraph" / "playbooks",
                                     project / ".opgraph" / "playbooks", config / "playbooks", EXAMPLES_DIR]
    assert resolve_playbook("ours", start=start).prompt == "ours {input}"
    assert resolve_playbook("mine", start=start).prompt == "mine {input}"
    with pytest.raises(UnknownPlaybookError):
        resolve_playbook("planted", start=start)
    # Outside any project, only the folder itself is searched, never its parents.
    loose = shared / "loose"
    loose.mkdir()
    assert playbook_roots(loose) == [loose / ".opgraph" / "playbooks", config / "playbooks", EXAMPLES_DIR]
    with pytest.raises(UnknownPlaybookError):
        resolve_playbook("planted", start=loose)


def test_playbook_refusals_come_before_any_planning(tmp_path):
    from opgraph.cluster.lanes.play import PlaybookError, UnknownPlaybookError, resolve_playbook

    root = tmp_path / ".opgraph" / "playbooks"
    _playbook(root, "typo", "prompt: x\ncolour: red\n")
    _playbook(root, "typed", 'prompt: "{n}"\nargs: {n: {type: int}}\n')
    _playbook(root, "badtype", 'prompt: "{n}"\nargs: {n: {type: decimal}}\n')
    outside = _playbook(tmp_path / "elsewhere", "secret", "prompt: stolen\n")
    (root / "escape.playbook.yaml").symlink_to(outside)
    home = tmp_path / "nohome"
    with pytest.raises(UnknownPlaybookError) as unknown:
        resolve_playbook("typd", start=tmp_path, home=home)
    assert "typed" in unknown.value.suggestions
    with pytest.raises(PlaybookError, match="unknown fields: colour"):
        resolve_playbook("typo", start=tmp_path, home=home)
    with pytest.raises(PlaybookError, match="type 'decimal'"):
        resolve_playbook("badtype", start=tmp_path, home=home)
    with pytest.raises(PlaybookError, match="must be int"):
        resolve_playbook("typed", start=tmp_path, home=home).convert({"n": "many"})
    with pytest.raises(PlaybookError, match="outside its playbooks root"):
        resolve_playbook("escape", start=tmp_path, home=home)


# -- the HTTP API ---------------------------------------------------------------------------
@pytest.mark.ray
def test_the_api_starts_planned_runs_and_applies_their_live_controls(session, store, tmp_path):
    """POST /api/flows/runs (crash-plan, slow ops): pause, message and resume reach the run (202);
    the same controls on a fixed run stay 409; an unknown playbook is 404 before any planning."""
    from api_server import serve

    from opgraph.cluster.http import create_app

    log = tmp_path / "calls.log"
    session.register_provider("scripted", ScriptedProvider(PlannedScript(log)))
    served = serve(create_app(store, session_factory=lambda: session, submit_runs=False))
    try:
        with served.client(timeout=60) as http:
            started = http.post("/api/flows/runs", json={"prompt": "crash-plan", "model": MODEL,
                                                         "synthesis": False})
            assert started.status_code == 202, started.text
            run_id = started.json()["run_id"]
            assert started.json()["lane"] == PLANNED_REACTIVE_FLOW
            assert started.json()["lane_capabilities"]["live_message"] is True
            for action, body in (("pause", None), ("message", {"text": "keep it short"}), ("resume", None)):
                reply = http.post(f"/api/runs/{run_id}/{action}", json=body)
                assert reply.status_code == 202, reply.text
                assert reply.json()["accepted"] is True and reply.json()["action"] == action
            deadline = time.monotonic() + DEADLINE
            while http.get(f"/api/runs/{run_id}").json()["status"] not in ("completed", "failed", "cancelled"):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert http.get(f"/api/runs/{run_id}").json()["status"] == "completed"
            assert calls(log).count("planner") == 1
            unknown = http.post("/api/playbooks/no-such-book/runs", json={})
            assert unknown.status_code == 404 and "no playbook" in unknown.json()["error"]
            bad = http.post("/api/flows/runs", json={"prompt": "x", "reactive": "wizard"})
            assert bad.status_code == 422 and "not on the roster" in bad.json()["error"]
    finally:
        served.stop()
    assert "planner" in calls(log) and calls(log).count("planner") == 1  # the refusals planned nothing


def test_the_cli_holds_live_controls_to_the_recorded_capabilities(store):
    """`opgraph run pause|message` pass the planned run's matrix (and go on to the cluster), while a
    fixed run's are refused before Ray is reached; `o flow --resume` of a fixed run is refused (exit 1)."""
    from opgraph.cluster.cli import main as cli_main
    from opgraph.cluster.cli.client import check_recorded_control

    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    planned = store.create_run("planned-live", session_id="s", provenance={
        "lane": PLANNED_REACTIVE_FLOW, "source": {"kind": "prompt", "ref": "x", "content_hash": None},
        "planner": {"used": True}, "reactive": {"enabled": True}}, inputs={},
        capabilities=lane.capabilities(lane.invocation("x")).as_metadata(), status="running")
    for action in ("pause", "resume", "message", "cancel"):
        check_recorded_control(planned.run_id, action, store.path)  # allowed: no error
    store.create_run("fixed-live", session_id="s", provenance={
        "lane": FIXED_WORKFLOW, "source": {"kind": "workflow_file", "ref": "/x.json",
                                           "content_hash": "sha256:" + "0" * 64}},
        inputs={}, capabilities=lane_adapter(FIXED_WORKFLOW).capabilities().as_metadata(), status="running")
    for action in ("pause", "message"):
        with pytest.raises(LaneCapabilityError, match="not queued"):
            check_recorded_control("fixed-live", action, store.path)
    assert cli_main(["run", "pause", "fixed-live", "--store", store.path]) == 1
    assert cli_main(["o", "flow", "--resume", "fixed-live", "--store", store.path]) == 1
    assert cli_main(["o", "flow", "--resume", "planned-live", "--store", store.path]) == 1  # it is live


def test_a_missing_role_history_needs_allow_degraded_context():
    """1 (completed, restored) -> 2 (pending) on role writer, whose branch history is stored nowhere."""
    from types import SimpleNamespace

    from opgraph.cluster.lanes.planned import Checkpoint, CheckpointRefusedError, build_replay
    from opgraph.cluster.lanes.planned.checkpoint import SettledNode
    from opgraph.kernel import Graph, create_operation

    graph = Graph("plan")
    first = graph.add_node(create_operation("engine_operate", {"instruction": "one"}, branch_id="gone-writer"))
    second = graph.add_node(create_operation("engine_operate", {"instruction": "two"}, branch_id="gone-writer"))
    graph.add_edge(first.id, second.id, label=["depends_on"])
    record = SimpleNamespace(run_id="r-missing", recovery={"branches": {"writer": "gone-writer"},
                                                           "labels": {first.id: "1:writer", second.id: "2:writer"}})
    checkpoint = Checkpoint(record, graph, settled={first.id: SettledNode("completed", {"text": "done"})})
    with pytest.raises(CheckpointRefusedError, match="--allow-degraded-context"):
        build_replay(checkpoint, retry_failed=False, allow_degraded_context=False, recorded_branches={})
    replay = build_replay(checkpoint, retry_failed=False, allow_degraded_context=True, recorded_branches={})
    assert replay.degraded == ["writer"] and replay.restored == [first.id]
    assert replay.graph.nodes[first.id].status == "completed" and replay.graph.nodes[second.id].status == "pending"
    kept = build_replay(checkpoint, retry_failed=False, allow_degraded_context=False,
                        recorded_branches={"gone-writer": [{"role": "system", "content": "You are writer"}]})
    assert kept.degraded == [] and kept.histories["gone-writer"][0]["content"] == "You are writer"
