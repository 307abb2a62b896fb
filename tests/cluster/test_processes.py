"""The process helpers every command, benchmark and test uses: each waits with a deadline and cleans up.

Plain Python children only (no Ray): a server that becomes ready by a port, an HTTP answer or a
line; one that dies or never gets ready (ended, and the error says what it printed); a command
past its timeout (its whole group killed); an owner killed with everything of its session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from opgraph.cluster.processes import (
    ProcessEndedError,
    ServerStartError,
    accepts_connections,
    end_process_group,
    free_port,
    http_body,
    read_line,
    run_command,
    run_until,
    running,
    start_server,
    wait_for_line,
)

# A child that starts a grandchild in its own process group, prints the grandchild's pid, then sleeps.
PARENT_OF_SLEEPER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def _gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_server_is_ready_when_its_port_answers_and_stops_with_its_group(tmp_path):
    port = free_port()
    with start_server(_http_server(port), ready=lambda: http_body(f"http://127.0.0.1:{port}/"), timeout=30,
                      what="http.server", log_path=tmp_path / "server.log", cwd=tmp_path) as server:
        assert server.ready is not None and accepts_connections(port)
        assert os.getpgid(server.pid) == server.pid != os.getpgrp()  # a group of its own, never ours
        code = server.stop(signal.SIGINT, grace=10)
    assert code is not None and not accepts_connections(port)


def test_a_server_that_exits_while_starting_is_an_error_with_its_output(tmp_path):
    command = [sys.executable, "-c", "import sys; print('no config here', flush=True); sys.exit(4)"]
    with pytest.raises(ServerStartError, match="exited with 4") as raised:
        start_server(command, ready=lambda: False, timeout=30, what="the broken server", log_path=tmp_path / "log")
    assert "no config here" in str(raised.value)


def test_a_server_not_ready_in_time_is_ended(tmp_path):
    started = time.monotonic()
    with pytest.raises(ServerStartError, match="not ready within 0.5 s") as raised:
        start_server([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                     ready=lambda: False, timeout=0.5, what="the slow server", log_path=tmp_path / "log")
    assert time.monotonic() - started < 30
    assert "up" in str(raised.value)  # what it printed


def test_a_server_can_be_ready_on_a_line_of_its_output():
    command = [sys.executable, "-c", "import time; print('noise'); print('listening on http://x:1', flush=True); "
                                     "time.sleep(600)"]
    with start_server(command, ready=r"listening on (\S+)", timeout=30, what="the talker",
                      stdout=subprocess.PIPE, text=True) as server:
        assert server.ready.group(1) == "http://x:1"
    assert server.process.returncode is not None  # leaving the block ended it


def test_wait_for_line_reports_an_early_end_and_leaves_the_rest_to_communicate():
    process = subprocess.Popen([sys.executable, "-c", "print('a'); print('b'); print('c')"], stdout=subprocess.PIPE,
                               text=True)
    assert wait_for_line(process, "^b", timeout=30).group(0) == "b"
    rest, _ = process.communicate(timeout=30)
    assert rest == "c\n"  # nothing was held back in a buffer
    process = subprocess.Popen([sys.executable, "-c", "print('only this')"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(ProcessEndedError) as raised:
        wait_for_line(process, "never", timeout=30)
    assert raised.value.lines == ["only this\n"]
    process.communicate()


def test_read_line_times_out_on_a_silent_child():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE)
    try:
        with pytest.raises(TimeoutError):
            read_line(process.stdout, 0.2)
    finally:
        end_process_group(process, signal.SIGKILL)


def test_a_command_past_its_timeout_is_killed_with_its_whole_group():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.5)
    assert time.monotonic() - started < 30
    done = run_command([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")


def test_ending_a_group_ends_what_its_leader_left_behind():
    process = subprocess.Popen([sys.executable, "-c", PARENT_OF_SLEEPER], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    grandchild = int(read_line(process.stdout, 30))
    end_process_group(process, signal.SIGTERM, grace=5)
    assert _gone(grandchild), "the leader's child outlived its group's end"


def test_run_until_kills_the_whole_session_at_the_awaited_line():
    killed = run_until([sys.executable, "-c", PARENT_OF_SLEEPER], lambda seen: len(seen) == 1, timeout=30)
    assert killed.returncode == -signal.SIGKILL
    assert _gone(int(killed.lines[0]))
    with pytest.raises(ProcessEndedError):
        run_until([sys.executable, "-c", "print('too soon')"], lambda seen: "never" in seen, timeout=30)
