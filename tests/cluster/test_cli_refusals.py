"""The command line refuses what it cannot do plainly: an exit status per cause, a message, no traceback.

Each test runs `opgraph` (or the job entrypoint) in a fresh process, as a user would:
bad options and stores are exit 2 before anything starts; a runtime that cannot start,
an address that does not answer and a token the cluster refuses are exit 3, each saying
what was tried; a run the executor does not know is "unknown or already finished".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from opgraph.cluster.connection import EXIT_RUNTIME
from opgraph.cluster.lanes import open_store
from opgraph.cluster.processes import free_port, run_command

COMMAND_TIMEOUT = 120.0  # seconds any one command may take
PROMPT_FAILURE = 20.0  # seconds a command may take to say an address does not answer
SIDE_BY_SIDE = 3  # commands run at once: each is mostly an interpreter's start, or a wait on a silent port
SPEC = {"version": 1, "nodes": [{"id": "a", "kind": "chat", "pos": {"x": 0, "y": 0},
                                 "config": {"prompt": "hello", "model": "sim/fast"}}], "edges": []}


def opgraph(*arguments: str, env: dict[str, str] | None = None, module: str = "opgraph.cluster.cli",
            **options: Any) -> subprocess.CompletedProcess:
    return run_command([sys.executable, "-m", module, *arguments], timeout=COMMAND_TIMEOUT, env=env, **options)


def opgraph_each(*commands: tuple[str, ...], **options: Any) -> list[subprocess.CompletedProcess]:
    """Each command (the arguments of ``opgraph``) in a fresh process of its own, side by side; in order."""
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        return list(pool.map(lambda arguments: opgraph(*arguments, **options), commands))


def assert_refused(done: subprocess.CompletedProcess, status: int, *phrases: str) -> None:
    assert done.returncode == status, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for phrase in phrases:
        assert phrase in done.stderr, done.stderr


@pytest.fixture
def definition(tmp_path) -> Path:
    path = tmp_path / "flow.json"
    path.write_text(json.dumps(SPEC))
    return path


@pytest.mark.parametrize("value", ["0", "-3"])
def test_flow_run_refuses_a_bad_max_concurrent_before_anything_starts(definition, tmp_path, value):
    database = tmp_path / "runs.db"
    started = time.monotonic()
    done = opgraph("flow", "run", str(definition), "--store", str(database), f"--max-concurrent={value}")
    assert_refused(done, 2, "--max-concurrent", "at least 1")
    assert time.monotonic() - started < 15, "it started something before refusing"
    assert not database.exists()  # no store opened, no run row written, no Ray


@pytest.mark.parametrize("kind", ["directory", "not a database", "postgresql nobody serves"])
def test_a_store_that_is_no_store_is_exit_2_with_a_message_everywhere(definition, tmp_path, kind):
    if kind == "directory":
        store = tmp_path / "a-folder"
        store.mkdir()
    elif kind == "postgresql nobody serves":
        store = "postgresql://someone@127.0.0.1:1/nothing"  # port 1: refused at once
    else:
        store = tmp_path / "notes.txt"
        store.write_text("these are notes, not SQLite\n" * 100)
    named = [("workflows", "list"), ("workflows", "add", "flow", str(definition)), ("workflows", "show", "flow"),
             ("flow", "run", str(definition))]
    with ThreadPoolExecutor(1) as job:  # the job entrypoint beside the `opgraph` commands
        entrypoint = job.submit(opgraph, "workflow", str(definition), "--store", str(store),
                                module="opgraph.cluster.job")
        *refusals, served = opgraph_each(*[(*arguments, "--store", str(store)) for arguments in named],
                                         ("serve", "--port", "0", "--store", str(store)))
        for done in refusals:
            assert_refused(done, 2, "run store", str(store))
        assert_refused(served, 2, "run store")
        assert_refused(entrypoint.result(), 2, "run store")


def test_a_workflow_file_nested_10000_deep_is_a_problem_not_a_traceback(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"version": 1, "nodes": ' + "[" * 10_000 + "]" * 10_000 + "}")
    for done in opgraph_each(("flow", "run", str(deep), "--store", str(tmp_path / "runs.db")),
                             ("workflows", "add", "deep", str(deep), "--store", str(tmp_path / "runs.db"))):
        assert_refused(done, 2, "nests deeper")
        assert '"errors"' in done.stderr


@pytest.mark.parametrize(("content", "kind"), [("null", "null"), ("[1, 2]", "list"), ("3", "int")])
def test_a_workflow_file_that_holds_no_object_is_refused_and_nothing_is_stored(tmp_path, content, kind):
    """A file holding ``null`` was added as a workflow with no spec (issue #32); like any other
    value that is not a JSON object, it is the one invalid-spec refusal, exit 2, nothing written."""
    path = tmp_path / "not-a-definition.json"
    path.write_text(content)
    database = tmp_path / "runs.db"
    for done in opgraph_each(("workflows", "add", "flow", str(path), "--store", str(database)),
                             ("flow", "run", str(path), "--store", str(database))):
        assert_refused(done, 2, "failed validation", f"a workflow definition must be a JSON object, got {kind}")
    listed = opgraph("workflows", "list", "--json", "--store", str(database))
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout + listed.stderr


def test_ray_that_cannot_start_is_its_own_exit_status_and_no_run(definition, tmp_path):
    """RAY_TMPDIR below a regular file: Ray cannot make its session folder, so it cannot start."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    database = tmp_path / "runs.db"
    env = {**os.environ, "RAY_TMPDIR": str(blocker / "ray")}
    done = opgraph("flow", "run", str(definition), "--store", str(database), "--plain", env=env)
    assert_refused(done, EXIT_RUNTIME, "could not start or join the embedded local Ray")
    with open_store(database) as store:
        assert store.list_runs() == []  # exit 1 would say "the run failed": there is no run
    documented = " ".join(opgraph("flow", "run", "--help").stdout.split())  # argparse wraps lines
    assert f"{EXIT_RUNTIME} the runtime (Ray) could not be started or reached" in documented


class SilentListener:
    """A loopback port that accepts connections and never says a word (a blackholed GCS)."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(64)
        self.port = self.socket.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return
            self.accepted.append(connection)

    def close(self) -> None:
        self.closed.set()
        self.socket.close()
        for connection in self.accepted:
            connection.close()
        self.thread.join(timeout=5)


def test_run_commands_fail_fast_and_say_what_was_tried_when_nothing_answers(tmp_path):
    silent = SilentListener()
    refused_port = free_port()  # closed again: connections to it are refused
    def timed(address: str, action: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.monotonic()
        done = opgraph("run", action, "some-run", "--address", address)
        return done, time.monotonic() - started

    cases = [(f"127.0.0.1:{port}", answer, action) for port, answer in ((silent.port, "DEADLINE_EXCEEDED"),
                                                                      (refused_port, "UNAVAILABLE"))
             for action in ("status", "watch")]
    try:
        with ThreadPoolExecutor(len(cases)) as pool:  # each mostly waits on its GCS deadline: all at once
            outcomes = list(pool.map(lambda case: timed(case[0], case[2]), cases))
        for (address, answer, action), (done, took) in zip(cases, outcomes, strict=True):
            assert_refused(done, EXIT_RUNTIME, f"cannot reach a Ray cluster at {address}",
                           "asked the Ray GCS", answer)
            assert took < PROMPT_FAILURE, f"`opgraph run {action}` took {took:.1f} s to give up"
        done = opgraph("flow", "run", str(tmp_path / "missing.json"), "--address", f"127.0.0.1:{refused_port}")
        assert_refused(done, 2, "cannot read workflow file")  # the definition is checked before Ray
    finally:
        silent.close()


def test_a_cluster_that_wants_a_token_says_so_and_an_unknown_run_is_unknown(ray_head):
    """The head uses token authentication; a shell without RAY_AUTH_MODE=token is told so."""
    started = time.monotonic()
    done = opgraph("run", "status", "some-run", "--address", ray_head.address, env=ray_head.env(authenticated=False))
    assert_refused(done, EXIT_RUNTIME, "authentication failed", "RAY_AUTH_MODE=token", "UNAUTHENTICATED")
    assert time.monotonic() - started < PROMPT_FAILURE
    wrong = {**ray_head.env(), "RAY_AUTH_TOKEN": "0" * 64}
    assert_refused(opgraph("run", "status", "some-run", "--address", ray_head.address, env=wrong), EXIT_RUNTIME,
                   "authentication failed", "does not accept")

    done = opgraph("run", "status", "never-started", "--address", ray_head.address, env=ray_head.env())
    assert_refused(done, 1, "run never-started is unknown or already finished")
    assert "not owned by this executor" not in done.stderr
