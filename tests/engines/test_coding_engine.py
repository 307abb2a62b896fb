"""CodingEngine against something real: a throw-away repository, a real pytest, real escapes.

The sandbox pieces first, in this process (confined writes, the gate's process group, its
environment); then whole runs on the shared test runtime, whose gates run on its workers:
a scripted coder fixes a failing test in the copy while the original stays untouched
until ``apply``; escape attempts are refused and a sibling folder stays byte-identical;
a test command that outlives its timeout, or ignores SIGTERM, is killed with its group.
Timeouts here are short (1-3 s) so the module stays quick.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from coding_fixtures import (
    BROKEN,
    FIXED,
    PYTEST,
    CodingScript,
    change,
    coding_case,
    edit,
    make_project,
    snapshot,
)

from opgraph.actors.verbs import (
    PathEscapeError,
    gate_environment,
    read_confined,
    run_gate,
    write_confined,
)
from opgraph.engines import (
    ChangeProposed,
    CodeResultRecorded,
    CodingEngine,
    EngineInputError,
    TestsRan,
    WorkspaceConflictError,
    engine_for,
)
from opgraph.engines.workspace import Sandbox, workspace_gate

MARK = "31.4159"  # a sleep only these tests start, to find stray processes by


def _running(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line holds ``marker``: their pids."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in command and state not in (b"Z", b"X") and "pytest" not in command:
            found.append(int(entry))
    return found


def _wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def run_the_fix(session, model, tmp_path, test_cmd: str, **settings) -> CodeResultRecorded:
    """The engine asked to "make add() add" in a fresh project, its model proposing the fix."""
    project, _ = make_project(tmp_path)
    coder = engine(model(CodingScript([change(edit("calc.py", FIXED))])), **settings)
    return asyncio.run(coder.run("make add() add", session=session, workspace=str(project), test_cmd=test_cmd))


def engine(model: str, **settings) -> CodingEngine:
    options = {"model": model, "test_timeout_s": 60.0, "turn_timeout_s": 60.0, "kill_grace_s": 0.5,
               "max_fix_rounds": 1, **settings}
    return CodingEngine(**options)


# -- the sandbox pieces, in this process ------------------------------------------------------


def test_confined_writes_refuse_every_way_out_and_change_nothing_outside(tmp_path):
    project, outside = make_project(tmp_path)
    (project / "link_out").symlink_to(outside)
    (project / "file_link").symlink_to(outside / "keep.txt")
    before = snapshot(outside)
    for path in ("../outside/pwned.txt", str(outside / "pwned.txt"), "link_out/pwned.txt", "file_link",
                 "sub/../../outside/pwned.txt", ""):
        with pytest.raises(PathEscapeError) as refused:
            write_confined(str(project), path, b"pwned")
        assert refused.value.path == path
    with pytest.raises(PathEscapeError):
        read_confined(str(project), "link_out/keep.txt")
    # A hard link into the folder is replaced, never written through.
    os.link(outside / "keep.txt", project / "hard.txt")
    write_confined(str(project), "hard.txt", b"new")
    assert (project / "hard.txt").read_bytes() == b"new"
    assert snapshot(outside) == before
    assert write_confined(str(project), "pkg/deep/new.py", b"x = 1\n") == 6
    assert (project / "pkg/deep/new.py").read_text() == "x = 1\n"


def test_a_gate_past_its_timeout_is_killed_with_children_that_ignore_sigterm(tmp_path):
    command = f"sh -c 'trap \"\" TERM; sleep {MARK}' & sleep {MARK}"
    started = time.monotonic()
    result = asyncio.run(run_gate(command, str(tmp_path), timeout_s=1.0, kill_grace_s=0.5))
    assert result.timed_out and result.killed and not result.passed and result.returncode is None
    assert time.monotonic() - started < 10
    assert _running(MARK) == []


def test_a_gate_scrubs_the_environment_and_keeps_a_bounded_tail(tmp_path, monkeypatch):
    for name in ("OPENAI_API_KEY", "OPGRAPH_TOKEN", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "MY_PASSWORD"):
        monkeypatch.setenv(name, "sentinel-secret")
    monkeypatch.setenv("HARMLESS_SETTING", "kept-when-asked")
    home = tmp_path / "home"
    home.mkdir()
    environment = gate_environment(home=str(home), keep=["HARMLESS_SETTING", "OPGRAPH_TOKEN"])
    result = asyncio.run(run_gate("env > env.txt; yes | head -c 300000; exit 3", str(tmp_path), timeout_s=5.0,
                                  env=environment, max_output_bytes=1000))
    seen = (tmp_path / "env.txt").read_text()
    assert "sentinel-secret" not in seen  # asked for or not, a secret never passes
    assert f"HOME={home}" in seen and "HARMLESS_SETTING=kept-when-asked" in seen
    assert result.returncode == 3 and not result.passed
    assert result.output_bytes == 300000 and result.truncated and len(result.output_tail) == 1000


def test_a_process_that_leaves_the_group_cannot_hold_the_gate_open(tmp_path):
    # The command waits until its child has left the group (written its pid after setsid), then exits.
    command = (f"setsid sh -c 'echo $$ > escaped.pid; exec sleep {MARK}' & "
               "while [ ! -s escaped.pid ]; do sleep 0.01; done; echo started")
    started = time.monotonic()
    try:
        result = asyncio.run(run_gate(command, str(tmp_path), timeout_s=5.0, kill_grace_s=0.5))
        assert result.passed and "started" in result.output_tail
        assert any("left the group" in note for note in result.notes)
        assert time.monotonic() - started < 20  # not held until the escapee's sleep ends (31 s)
    finally:
        for pid in _running(MARK):  # the escapee is this test's to end, by its pid: the gate says it cannot
            os.kill(pid, signal.SIGKILL)


def test_leftover_processes_of_a_passing_gate_are_ended(tmp_path):
    result = asyncio.run(run_gate(f"sleep {MARK} & exit 0", str(tmp_path), timeout_s=5.0, kill_grace_s=0.5))
    assert result.passed and result.killed and result.notes
    assert _running(MARK) == []


@pytest.mark.parametrize("inputs, message", [
    ({"workspace": None, "test_cmd": "true"}, "workspace"),
    ({"workspace": "/no/such/folder", "test_cmd": "true"}, "not an existing folder"),
    ({"test_cmd": "   "}, "non-empty test command"),
    ({"test_cmd": []}, "non-empty test command"),
    ({"test_cmd": "true", "keep_env": ["OPENAI_API_KEY"]}, "secrets"),
])
def test_a_bad_spec_is_refused_before_any_run_state(inputs, message, tmp_path):
    class NoRuntime:
        async def new_branch(self, *args, **kwargs):
            raise AssertionError("an agent was made for bad input")

        async def turn(self, *args, **kwargs):
            raise AssertionError("a turn ran for bad input")

        async def flow(self, *args, **kwargs):
            raise AssertionError("a graph ran for bad input")

    inputs = {"workspace": str(tmp_path), **inputs}
    coder = CodingEngine(model="sim/instant")
    with pytest.raises(EngineInputError, match=message):
        asyncio.run(coder.run("fix it", port=NoRuntime(), **inputs))
    with pytest.raises(EngineInputError, match="task"):
        asyncio.run(coder.run("  ", port=NoRuntime(), workspace=str(tmp_path), test_cmd="true"))


def test_the_bounds_have_the_records_defaults_and_are_overridable():
    coder = CodingEngine()
    assert (coder.max_fix_rounds, coder.test_timeout_s, coder.turn_timeout_s, coder.heartbeat_s) == (3, 600, 600, 30)
    tuned = engine_for("coding", max_fix_rounds=0, test_timeout_s=2, turn_timeout_s=3, heartbeat_s=0.5)
    assert (tuned.max_fix_rounds, tuned.test_timeout_s, tuned.turn_timeout_s, tuned.heartbeat_s) == (0, 2, 3, 0.5)
    with pytest.raises(EngineInputError):
        CodingEngine(test_timeout_s=0)


# -- whole runs, gates on the workers ----------------------------------------------------------


@pytest.mark.ray
def test_a_scripted_fix_turns_a_real_pytest_green_in_the_copy_and_apply_writes_it(session, model, sink, tmp_path):
    project, outside = make_project(tmp_path)
    original, beside = snapshot(project), snapshot(outside)
    script = CodingScript([change(edit("calc.py", BROKEN + "# looked at it\n"), summary="not yet"),
                           change(edit("calc.py", FIXED), summary="add adds")])
    result = asyncio.run(engine(model(script)).run("make add() add", session=session, event_sink=sink,
                                                   workspace=str(project), test_cmd=PYTEST))
    assert isinstance(result, CodeResultRecorded)
    assert (result.passed, result.verdict, result.rounds_used) == (True, "passed", 1)
    assert [(test.round, test.returncode, test.passed) for test in result.test_runs] == [(0, 1, False), (1, 0, True)]
    assert "assert -1 == 5" in result.test_runs[0].output_tail and "1 passed" in result.test_runs[1].output_tail
    assert [(change_.path, change_.status) for change_ in result.files_changed] == [("calc.py", "modified")]
    assert "-    return a - b\n+    return a + b\n" in result.patch
    assert result.patch.startswith("diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n")
    assert result.run.by_type(TestsRan) == result.test_runs  # stated by the gate, in the event log
    types = sink.types(result.run_id)
    for kind in ("WorkPlanned", "ChangeProposed", "TestsRan", "VerifyResult", "CodeResultRecorded"):
        assert kind in types
    assert sink.runs[result.run_id]["status"] == "completed"
    assert "Coding verdict: passed" in sink.runs[result.run_id]["result"]
    assert snapshot(project) == original  # offered, not applied
    if shutil.which("git"):  # the patch is what `git apply` takes, as well as what apply() writes
        checked = tmp_path / "git-applied"
        shutil.copytree(project, checked)
        subprocess.run(["git", "apply", "-"], input=result.patch, text=True, cwd=checked, check=True)
        assert (checked / "calc.py").read_text() == FIXED
    assert not Path(result.run.sandbox.path).exists()  # the copy is gone with the run
    assert result.apply() == ["calc.py"]
    assert (project / "calc.py").read_text() == FIXED and snapshot(outside) == beside
    with pytest.raises(WorkspaceConflictError):
        result.apply()  # the workspace is no longer what the patch was made against


@pytest.mark.ray
def test_escape_attempts_are_refused_by_path_and_nothing_outside_changes(session, model, tmp_path):
    project, outside = make_project(tmp_path)
    (project / "link_out").symlink_to(outside)
    before, original = snapshot(outside), snapshot(project)
    attempts = ["../outside/pwned.txt", str(outside / "pwned.txt"), "link_out/pwned.txt", "made_by_tests/pwned.txt"]
    script = CodingScript([change(edit("calc.py", FIXED), edit(path, "pwned")) for path in attempts])
    # The test command itself leaves a link out of the copy behind; a later write through it is refused too.
    test_cmd = f"ln -sfn {outside} made_by_tests; {PYTEST}"
    result = asyncio.run(engine(model(script), max_fix_rounds=3).run(
        "make add() add", session=session, workspace=str(project), test_cmd=test_cmd))
    assert [refusal["path"] for refusal in result.refusals] == attempts
    assert all(refusal["reason"] for refusal in result.refusals)
    assert (result.passed, result.verdict, result.rounds_used, result.files_changed) == (False, "failed", 3, [])
    assert [notice.data["path"] for notice in result.run.log.notifications("write_refused")] == attempts
    assert snapshot(outside) == before and snapshot(project) == original


@pytest.mark.ray
def test_a_test_command_past_its_timeout_is_killed_and_reported_timed_out(session, model, tmp_path):
    started = time.monotonic()
    result = run_the_fix(session, model, tmp_path, f"sh -c 'trap \"\" TERM; sleep {MARK}' & sleep {MARK}",
                         max_fix_rounds=0, test_timeout_s=1.0, heartbeat_s=0.3)
    [tested] = result.test_runs
    assert (tested.timed_out, tested.passed, tested.killed, tested.returncode) == (True, False, True, None)
    assert (result.verdict, result.passed) == ("failed", False)
    assert time.monotonic() - started < 45
    assert _running(MARK) == []  # the child that ignored SIGTERM died with its group
    assert any(notice.data["stage"] == "test 0" for notice in result.run.log.notifications("heartbeat"))


@pytest.mark.ray
def test_the_gate_on_a_worker_never_sees_the_workers_secrets(session, tmp_path):
    """A worker holding provider keys and an opgraph token runs the real gate operation: the
    test command's environment (written to a file in the copy) holds none of them."""

    async def gate_beside_secrets(branch, **parameters):
        secrets = {"OPENAI_API_KEY": "sentinel-key", "OPGRAPH_TOKEN": "sentinel-token",
                   "AWS_SECRET_ACCESS_KEY": "sentinel-aws"}
        saved = {name: os.environ.get(name) for name in secrets}
        os.environ.update(secrets)
        try:
            return {"gate": await workspace_gate(branch, **parameters), "worker_env": sorted(os.environ)}
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    session.register_operation("gate_beside_secrets", gate_beside_secrets, record_turn=False)
    project, _ = make_project(tmp_path)

    async def scenario():
        from opgraph.engines.port import SessionPort

        port = SessionPort(session)
        sandbox = await Sandbox.open(port, None, str(project), timeout_s=60, max_bytes=2**20, snapshot_chars=1000)
        try:
            await sandbox.write([edit("env.txt", "")])  # touched, so the changes carry what the test wrote
            outcome = await port.turn(None, "gate_beside_secrets", timeout=60, sandbox=sandbox.path,
                                      command="env > env.txt", timeout_s=5.0)
            [written] = await sandbox.changes(["env.txt"])
            return outcome.response, written.content, sandbox.path
        finally:
            await sandbox.close()

    outcome, seen, sandbox_path = asyncio.run(scenario())
    assert outcome["gate"]["passed"]
    assert {"OPENAI_API_KEY", "OPGRAPH_TOKEN", "AWS_SECRET_ACCESS_KEY"} <= set(outcome["worker_env"])
    assert "sentinel" not in seen
    names = {line.split("=", 1)[0] for line in seen.splitlines() if "=" in line}
    assert not {name for name in names if name.startswith(("RAY_", "OPGRAPH_", "AWS_"))}
    assert f"HOME={sandbox_path}/home" in seen
    assert not Path(sandbox_path).exists()


@pytest.mark.ray
def test_a_spent_budget_returns_the_structured_record_degraded_and_removes_the_copy(session, model, tmp_path):
    result = run_the_fix(session, model, tmp_path, PYTEST, max_agents=1)
    assert isinstance(result, CodeResultRecorded)
    assert (result.degraded, result.degrade_reason, result.verdict) == (True, "budget", "stopped")
    assert result.test_runs == [] and "the tests never ran" in result.caveats
    assert result.run.status == "degraded"
    assert not Path(result.run.sandbox.path).exists()


def reads_then_fixes(request):
    """The implementer reads the copy with its tools (one read leads out), then proposes the fix."""
    if any(message.get("role") == "tool" for message in request.messages):
        return change(edit("calc.py", FIXED))
    return {"tool_calls": [{"id": "r1", "name": "read_file", "arguments": {"path": "calc.py"}},
                           {"id": "r2", "name": "read_file", "arguments": {"path": "../outside/keep.txt"}},
                           {"id": "r3", "name": "list_files", "arguments": {"folder": "."}}]}


@pytest.mark.ray
def test_agents_read_the_copy_with_their_tools_and_no_further(session, model, tmp_path):
    project, _ = make_project(tmp_path)
    script = CodingScript([reads_then_fixes])
    result = asyncio.run(engine(model(script), max_fix_rounds=0).run(
        "make add() add", session=session, workspace=str(project), test_cmd=PYTEST))
    assert result.verdict == "passed"
    messages = asyncio.run(session.messages(result.run.agents["implementer"].id))
    answers = {message["tool_call_id"]: message["content"] for message in messages if message.get("role") == "tool"}
    assert answers["r1"] == BROKEN
    assert '"error_type":"ToolPermissionError"' in answers["r2"] and "untouched" not in answers["r2"]
    assert "calc.py" in answers["r3"] and "test_calc.py" in answers["r3"]


@pytest.mark.ray
def test_a_prose_reply_is_a_missed_emission_never_a_fabricated_change(session, model, tmp_path):
    project, _ = make_project(tmp_path)
    script = CodingScript(["I would change calc.py, but here is only prose."])
    result = asyncio.run(engine(model(script), max_fix_rounds=0).run(
        "make add() add", session=session, workspace=str(project), test_cmd=PYTEST))
    assert result.run.by_type(ChangeProposed) == [] and result.skipped == ["implementer x2"]  # one repair turn
    assert (result.degraded, result.degrade_reason, result.verdict) == (True, "emission_failure", "failed")
    assert [test.change for test in result.test_runs] == [""]  # the gate still measured the untouched copy


@pytest.mark.ray
def test_the_deadline_stops_a_long_test_and_still_returns_the_record(session, model, tmp_path):
    started = time.monotonic()
    result = run_the_fix(session, model, tmp_path, f"sleep {MARK}", max_fix_rounds=0, test_timeout_s=60.0,
                         deadline_s=3.0)
    assert (result.degraded, result.degrade_reason, result.verdict) == (True, "deadline", "stopped")
    assert [(change_.path, change_.status) for change_ in result.files_changed] == [("calc.py", "modified")]
    assert time.monotonic() - started < 30
    assert _wait_until(lambda: not _running(MARK), 10)  # the gate's group died with the cancelled turn
    assert not Path(result.run.sandbox.path).exists()


@pytest.mark.ray
def test_a_callers_cancellation_propagates_after_killing_the_gate_and_removing_the_copy(session, model, tmp_path):
    project, _ = make_project(tmp_path)
    script = CodingScript([change(edit("calc.py", FIXED))])
    coder = engine(model(script), max_fix_rounds=0, test_timeout_s=60.0)
    copies = []

    def on_event(event):
        if event["type"] == "workspace_opened":
            copies.append(Path(event["copy"]))

    async def scenario():
        task = asyncio.ensure_future(coder.run("make add() add", session=session, workspace=str(project),
                                               test_cmd=f"sleep {MARK}", on_event=on_event))
        for _ in range(400):
            if _running(MARK):
                break
            await asyncio.sleep(0.05)
        assert _running(MARK), "the gate never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert _wait_until(lambda: not _running(MARK), 10)
    [copy] = copies
    assert not copy.parent.exists()  # the sandbox (the copy, its home and tmp) is gone
    assert (project / "calc.py").read_text() == BROKEN


@pytest.mark.ray
def test_on_sim_a_run_completes_and_says_honestly_the_tests_still_fail(session, tmp_path):
    project, _ = make_project(tmp_path)
    original = snapshot(project)
    result = asyncio.run(engine("sim/instant", max_fix_rounds=1).run(
        "make add() add", session=session, workspace=str(project), test_cmd=PYTEST))
    assert (result.passed, result.verdict, len(result.test_runs)) == (False, "failed", 2)
    assert all(test.returncode == 1 for test in result.test_runs)
    # the chain's turns record that each came after the one before (the bench's critical path reads it)
    turns = [(record.data["turn"], record.data["after"])
             for record in result.run.events.notifications("turn_completed")]
    assert turns == [(1, []), (2, [1]), (3, [2])]
    assert result.files_changed and all(item.status == "added" for item in result.files_changed)
    assert snapshot(project) == original


@pytest.mark.ray
def test_the_conformance_case_runs_a_complete_chain(session, model, tmp_path):
    coder, args, kwargs = coding_case(model, tmp_path)
    result = asyncio.run(coder.run(*args, session=session, **kwargs))
    assert (result.verdict, result.rounds_used, result.degraded, result.skipped) == ("passed", 0, False, [])
    assert result.measurements["agents"] == 3 and len(result.test_runs) == 1


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.ray
def test_cli_runs_coding_on_sim_and_shows_it(session, tmp_path, capsys):
    import json

    from opgraph.cluster.cli import main

    project, _ = make_project(tmp_path)
    store = str(tmp_path / "opgraph.db")
    argv = ["engine", "run", "coding", "make add() add", "--workspace", str(project), "--test-cmd", PYTEST,
            "--model", "sim/instant", "--max-fix-rounds", "0", "--test-timeout", "60", "--turn-timeout", "60",
            "--store", store, "--json", "--apply"]
    assert main(argv) == 5  # completed; the sim's change does not pass, so nothing is applied
    payload = json.loads(capsys.readouterr().out)
    assert payload["result"]["verdict"] == "failed" and payload["applied"] == []
    assert payload["apply_error"] == "not applied: the final tests did not pass"
    assert (project / "calc.py").read_text() == BROKEN
    assert main(["engine", "show", payload["run_id"], "--store", store]) == 0
    shown = capsys.readouterr().out
    assert "TestsRan" in shown and "Coding verdict: failed" in shown


def test_cli_refuses_a_coding_run_without_a_test_command(tmp_path, capsys):
    from opgraph.cluster.cli import main

    assert main(["engine", "run", "coding", "fix it", "--workspace", str(tmp_path),
                 "--store", str(tmp_path / "db")]) == 2
    assert "test command" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="/proc is read to find stray processes")
def test_the_marker_finder_sees_a_live_process(tmp_path):
    import subprocess

    child = subprocess.Popen(["sleep", MARK])
    try:
        assert _wait_until(lambda: child.pid in _running(MARK), 5), (child.poll(), _running(MARK))
    finally:
        child.kill()
        child.wait()
