"""Fixed workflow runs end to end: runner, store, CLI and the bundled main job.

Runs go through the shared Session on real actors with the built-in `sim/` provider;
the CLI is driven in-process (same Ray) except where a fresh process is the point.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import sys

import pytest
from workflow_specs import draft_spec

from opgraph.cluster.cli import main as cli_main
from opgraph.cluster.cli.flow import example_workflow_path, parse_inputs
from opgraph.cluster.lanes import LaneCapabilityError, open_store
from opgraph.cluster.lanes.fixed import (
    WorkflowCompileError,
    WorkflowSource,
    file_source,
    registry_source,
    resolve_source,
    run_workflow,
)
from opgraph.cluster.processes import free_port, http_body, run_command, start_server
from opgraph.kernel import OpGraphError

EXAMPLE = json.loads(example_workflow_path().read_text())


@pytest.fixture
def store(database_target):
    """The run store, once on SQLite and once on PostgreSQL."""
    with open_store(database_target) as opened:
        yield opened


def _run(coro):
    return asyncio.run(coro)


def test_bundled_example_takes_the_urgent_branch_and_records_everything(session, store, tmp_path):
    source = file_source(example_workflow_path())
    result = _run(run_workflow(session, source, inputs={"ticket": "checkout is down", "priority": "high"},
                               store=store, model="sim/fast"))
    assert result.status == "completed"
    assert result.statuses == {"classify": "completed", "draft_reply": "skipped", "escalate": "completed",
                               "check": "completed"}
    assert set(result.outputs) == {"classify", "escalate", "check"}  # skipped outputs are absent
    assert result.outputs["check"]["model"] == "sim/fast"
    run = store.get_run(result.run_id)
    assert run.status == "completed"
    assert run.provenance["lane"] == "fixed_workflow"
    assert run.provenance["source"] == {"kind": "workflow_file", "ref": str(example_workflow_path()),
                                        "version": None, "content_hash": source.content_hash}
    assert run.content_hash == source.content_hash
    kinds = [(s["spec_node_id"], s["kind"]) for s in store.run_signals(result.run_id)]
    assert ("escalate", "completed") in kinds and ("draft_reply", "skipped") in kinds
    assert kinds.index(("classify", "completed")) < kinds.index(("escalate", "started"))
    branches = store.run_branches(result.run_id)
    assert any(branch["messages"] for branch in branches), "the chat turns are persisted"


def test_low_priority_takes_the_routine_branch(session, store):
    result = _run(run_workflow(session, file_source(example_workflow_path()),
                               inputs={"ticket": "how do I export invoices?", "priority": "low"}, store=store))
    assert result.status == "completed"
    assert result.statuses["draft_reply"] == "completed"
    assert result.statuses["escalate"] == "skipped"
    assert result.statuses["check"] == "completed"  # one open incoming path is enough


def test_file_mode_hashes_the_validated_bytes(tmp_path):
    path = tmp_path / "flow.json"
    raw = json.dumps(draft_spec(), indent=4).encode()
    path.write_bytes(raw)
    import hashlib

    source = file_source(path)
    assert source.content_hash == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert resolve_source(str(path), None).content_hash == source.content_hash


def test_a_bad_file_is_a_structured_validation_error(tmp_path):
    path = tmp_path / "bad.json"
    bad = draft_spec()
    bad["nodes"].append({"id": "g", "kind": "gate", "pos": {"x": 0, "y": 0}})
    path.write_text(json.dumps(bad))
    with pytest.raises(Exception) as caught:
        file_source(path)
    assert any(problem["node_id"] == "g" for problem in caught.value.errors)
    (tmp_path / "notjson.json").write_text("{nope")
    with pytest.raises(Exception, match="not JSON"):
        file_source(tmp_path / "notjson.json")


def test_version_is_pinned_before_the_run(session, store):
    store.create_workflow("pinned", draft_spec(prompt="first prompt"))
    source = registry_source(store, "pinned")
    store.add_version("pinned", draft_spec(prompt="second prompt"))  # edited after pinning, before running
    result = _run(run_workflow(session, source, inputs={"topic": "x"}, store=store))
    assert result.status == "completed"
    assert "first prompt" in result.outputs["draft"]["text"]
    run = store.get_run(result.run_id)
    assert run.provenance["source"]["version"] == 1
    assert run.content_hash == store.resolve("pinned", 1).content_hash != store.resolve("pinned").content_hash
    assert resolve_source("pinned@2", store).version == 2
    with pytest.raises(OpGraphError, match="positive integer"):
        resolve_source("pinned@zero", store)


def test_compile_error_creates_no_run(session, store):
    spec = draft_spec(extra_nodes=[{"id": "p", "kind": "parse", "pos": {"x": 2, "y": 0}}],
                 extra_edges=[{"id": "e2", "from": "draft", "to": "p"}])
    source = WorkflowSource(kind="workflow_file", ref="inline", content_hash="sha256:" + "0" * 64, spec=spec)
    with pytest.raises(WorkflowCompileError) as caught:
        _run(run_workflow(session, source, store=store))
    assert any(problem["node_id"] == "p" for problem in caught.value.errors)
    assert store.list_runs() == []
    empty = WorkflowSource(kind="workflow_file", ref="inline", content_hash="sha256:" + "0" * 64, spec=None)
    with pytest.raises(WorkflowCompileError, match="no spec_json"):
        _run(run_workflow(session, empty, store=store))


def test_a_failing_node_fails_the_run_and_downstream_still_settles(session, store):
    spec = draft_spec(model="nosuch/model",
                 extra_nodes=[{"id": "after", "kind": "chat", "pos": {"x": 2, "y": 0},
                               "config": {"prompt": "go on", "model": "sim/fast"}}],
                 extra_edges=[{"id": "e2", "from": "draft", "to": "after"}])
    store.create_workflow("failing", spec)
    result = _run(run_workflow(session, registry_source(store, "failing"), store=store))
    assert result.status == "failed"
    assert set(result.errors) == {"draft"}
    assert result.statuses == {"draft": "failed", "after": "completed"}  # unconditional edge still satisfied
    assert "nosuch" in json.dumps(result.errors["draft"])
    assert store.get_run(result.run_id).status == "failed"


def test_cancel_is_honoured_and_other_controls_are_rejected(session, store):
    spec = draft_spec(model="sim/slow")
    store.create_workflow("slow", spec)

    async def scenario():
        control: dict = {}
        task = asyncio.ensure_future(run_workflow(session, registry_source(store, "slow"), store=store,
                                                  control=control))
        for _ in range(500):
            if "control" in control:
                break
            await asyncio.sleep(0.01)
        handle = control["control"]
        with pytest.raises(LaneCapabilityError, match="not queued"):
            await handle.send_operator_message("hurry up")
        with pytest.raises(LaneCapabilityError):
            await handle.pause()
        assert (await handle.status())["paused"] is False
        assert await handle.cancel() is True
        return await task

    result = _run(scenario())
    assert result.status == "cancelled"
    assert store.get_run(result.run_id).status == "cancelled"


def test_parse_inputs():
    assert parse_inputs(["a=1", "b=high", "c=[1, 2]", "d=", "e=x=y"]) == {
        "a": 1, "b": "high", "c": [1, 2], "d": "", "e": "x=y"}
    with pytest.raises(OpGraphError, match="KEY=VALUE"):
        parse_inputs(["novalue"])


def test_cli_workflows_and_flow_run_in_process(session, tmp_path, capsys, database_target):
    db = str(database_target)  # --store takes a file or a postgresql:// URL
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(draft_spec()))
    assert cli_main(["workflows", "add", "drafts", str(path), "--store", db]) == 0
    assert "added drafts@1" in capsys.readouterr().out
    assert cli_main(["workflows", "add", "drafts", str(path), "--store", db]) == 0
    assert "unchanged: drafts@1" in capsys.readouterr().out
    path.write_text(json.dumps(draft_spec(prompt="Second")))
    assert cli_main(["workflows", "add", "drafts", str(path), "--store", db]) == 0
    assert "new version: drafts@2" in capsys.readouterr().out
    assert cli_main(["workflows", "versions", "drafts", "--store", db]) == 0
    assert capsys.readouterr().out.count("drafts@") == 2
    assert cli_main(["workflows", "show", "drafts@1", "--store", db]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["nodes"][1]["config"]["prompt"] == "Draft"
    assert cli_main(["workflows", "show", "drafts@zero", "--store", db]) == 2
    assert "positive integer" in capsys.readouterr().err
    assert cli_main(["workflows", "list", "--json", "--store", db]) == 0
    assert json.loads(capsys.readouterr().out)[0]["latest_version"] == 2

    code = cli_main(["flow", "run", "drafts@1", "--store", db, "--json", "--plain", "--input", "topic=actors"])
    out = capsys.readouterr()
    assert code == 0, out.err
    payload = json.loads(out.out)
    assert payload["status"] == "completed" and payload["source"] == "drafts@1"
    assert payload["lane_capabilities"]["live_message"] is False
    assert "completed draft" in " ".join(out.err.split())  # the plain progress lines

    assert cli_main(["workflows", "delete", "drafts", "--store", db]) == 0
    capsys.readouterr()
    assert cli_main(["flow", "run", "drafts", "--store", db]) == 2
    assert "drafts" in capsys.readouterr().err


def test_cli_failed_run_exits_one(session, tmp_path, capsys):
    path = tmp_path / "failing.json"
    path.write_text(json.dumps(draft_spec(model="nosuch/model")))
    assert cli_main(["flow", "run", str(path), "--store", str(tmp_path / "db"), "--plain"]) == 1
    assert "draft FAILED" in capsys.readouterr().out


def test_cli_compile_error_exits_two_with_structured_errors_before_ray(tmp_path):
    """A fresh process: the compile error is printed before any Ray or Session starts."""
    spec = copy.deepcopy(draft_spec())
    spec["nodes"].append({"id": "fan", "kind": "fanout", "pos": {"x": 3, "y": 0}})
    spec["edges"].append({"id": "e9", "from": "draft", "to": "fan"})
    path = tmp_path / "compile-error.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OPGRAPH_DB": str(tmp_path / "db")}
    done = run_command([sys.executable, "-m", "opgraph.cluster.cli", "flow", "run", str(path)],
                       timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    errors = json.loads(done.stderr[done.stderr.index("{"):])["errors"]
    assert any(problem["node_id"] == "fan" for problem in errors)
    assert "Started a local Ray instance" not in done.stderr


def test_main_job_runs_the_bundled_workflow_in_a_fresh_process(tmp_path):
    """The README's main job: `opgraph demo` on local Ray, SQLite and the sim/ provider."""
    env = {**os.environ, "OPGRAPH_DB": str(tmp_path / "demo.db")}
    env.pop("RAY_AUTH_MODE", None)  # as on a fresh machine: Ray's default token auth (conftest disables it)
    done = run_command([sys.executable, "-m", "opgraph.cluster.cli", "demo", "--json", "--plain"],
                       timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads(done.stdout[done.stdout.index("{"):])
    assert payload["status"] == "completed"
    assert payload["statuses"] == {"classify": "completed", "draft_reply": "skipped", "escalate": "completed",
                                   "check": "completed"}
    with open_store(tmp_path / "demo.db") as store:
        assert store.get_run(payload["run_id"]).status == "completed"
    # A new user's first command starts clean: Ray's token-auth notice is quieted.
    assert "Token authentication" not in done.stderr


def test_flow_run_help_publishes_the_capability_matrix(capsys):
    with pytest.raises(SystemExit):
        cli_main(["flow", "run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "live operator message: no" in text and "cancel: yes" in text


def test_opgraph_serve_answers_over_http_and_stops_on_sigterm(tmp_path):
    """`opgraph serve` in its own process: create a definition over HTTP, list it, stop cleanly. Its
    token is the one it generated in its opgraph home, which a client on the machine reads."""
    import signal

    from opgraph.cluster.http import ServerClient, client_token

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    home = tmp_path / "home"
    env = {**os.environ, "OPGRAPH_DB": str(tmp_path / "served.db"), "OPGRAPH_HOME": str(home)}
    for variable in ("OPGRAPH_TOKEN", "OPGRAPH_TOKEN_FILE"):
        env.pop(variable, None)
    log = tmp_path / "serve.log"
    with start_server([sys.executable, "-m", "opgraph.cluster.cli", "serve", "--port", str(port)],
                      ready=lambda: (home / "server-token").exists() and http_body(
                          f"{base}/api/workflows", headers={"authorization": f"Bearer {client_token(environ=env)}"}),
                      timeout=60, what="opgraph serve", log_path=log, env=env) as server:
        with ServerClient(base, token=client_token(environ=env), timeout=5) as api:
            created = api.create_workflow("served", draft_spec())
            assert created["content_hash"].startswith("sha256:")
            assert [row["name"] for row in api.workflows()] == ["served"]
        code = server.stop(signal.SIGTERM)
    output = log.read_text()
    # uvicorn shuts down gracefully, then re-raises the signal it caught.
    assert code in (0, -signal.SIGTERM), output
    assert "Finished server process" in output, output
    with open_store(tmp_path / "served.db") as store:
        assert store.resolve("served").version == 1


def test_progress_display_counts_and_renders_live_on_a_terminal():
    import io

    from rich.console import Console

    from opgraph.cluster.cli.flow import ProgressDisplay

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with ProgressDisplay(["a", "b", "c"], console=console) as display:
        assert display.live_enabled  # a terminal gets the live table
        display("a", "chat_and_record", "queued", 0.0)
        display("a", "chat_and_record", "started", 0.1)
        display("b", "chat_and_record", "skipped", 0.2)
        assert display.counts() == {"queued": 0, "running": 1, "done": 0, "failed": 0, "skipped": 1}
        display("a", "chat_and_record", "completed", 0.5)
        display("c", "chat_and_record", "failed", 0.6)
    assert display.counts() == {"queued": 0, "running": 0, "done": 1, "failed": 1, "skipped": 1}
    assert "3/3 settled" in screen.getvalue()

    plain = io.StringIO()
    with ProgressDisplay(["a"], console=Console(file=plain, force_terminal=False)) as display:
        assert not display.live_enabled
        display("a", "chat_and_record", "completed", 1.25)
    assert plain.getvalue().split() == ["1.25s", "completed", "a"]
