"""Fixtures for the cluster tests: one shared Ray and Session, a live metrics endpoint, a real head.

Ray starts once (``session``); the metrics endpoint (``metrics_server``) is served on a
free loopback port for the whole session; each test module is pickled by value so that
operations defined in it can run inside the worker processes. ``ray_head`` is a separate
`ray start --head` cluster that only subprocesses talk to; it is stopped by process id,
never with `ray stop` (which would also stop the embedded Ray of this pytest process).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

# First: sets the test clusters' Ray options before Ray is imported anywhere.
from ray_session import _pickle_test_module_by_value, _restore_registrations, session  # noqa: F401

from opgraph.cluster.metrics import serve_metrics


@pytest.fixture(scope="session")
def metrics_server(session):  # noqa: F811 - the fixture imported above, requested by name
    """``/metrics`` for the shared runtime on 127.0.0.1, any free port."""
    server = serve_metrics(session, port=0, host="127.0.0.1")
    yield server
    server.stop()


# -- a real local head, for jobs and for clients in other processes ----------------------

HEAD_START_DEADLINE = 90.0  # seconds for `ray start --head` and its job server to answer
HEAD_STOP_DEADLINE = 10.0  # seconds for `ray start` to shut its node down after SIGTERM
_RAYLET_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # children the raylet stops itself


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _processes() -> dict[int, tuple[int, int, str, str]]:
    """Live processes from /proc: pid -> (parent pid, session id, state, command line)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(name)] = (int(fields[1]), int(fields[3]), fields[0], command)
    return table


def _descendants(table: dict[int, tuple[int, int, str, str]], roots: set[int]) -> set[int]:
    found = set(roots)
    grew = True
    while grew:
        children = {pid for pid, (parent, _, state, _) in table.items()
                    if parent in found and pid not in found and state != "Z"}
        found |= children
        grew = bool(children)
    return found


@dataclass
class LocalHead:
    """A `ray start --head --block` cluster in its own temp dir and process session.

    Its processes are: everything in the session of the `ray start` process (started
    with ``start_new_session``), their descendants (job drivers start their own
    sessions), and anything naming the head's temp dir. ``stop`` signals exactly those.
    """

    process: subprocess.Popen
    temp_dir: str
    gcs_port: int
    dashboard_port: int
    log_path: str
    token: str  # the head uses token authentication, Ray 2.60's default

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self, *, authenticated: bool = True) -> dict[str, str]:
        """An environment for client subprocesses: no inherited RAY_ADDRESS, the head's token
        (``authenticated=False``: no token, as a shell that forgot to export one)."""
        env = _interpreter_first({k: v for k, v in os.environ.items()
                                  if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN",
                                               "RAY_AUTH_TOKEN_PATH")})
        env["RAY_AUTH_MODE"] = "token" if authenticated else "disabled"
        if authenticated:
            env["RAY_AUTH_TOKEN"] = self.token
        return env

    def pids(self) -> set[int]:
        table = _processes()
        own = os.getpid()
        found = {pid for pid, (_, sid, state, command) in table.items()
                 if state != "Z" and pid != own and (sid == self.process.pid or self.temp_dir in command)}
        found.add(self.process.pid)
        found = _descendants(table, found) - {own}
        return {pid for pid in found if pid in table and table[pid][2] != "Z"}

    def stop(self) -> set[int]:
        """Stop this head's processes and only them; return survivors (there should be none).

        Order matters. With detached actors alive, `ray start --block` does not finish
        its own shutdown on SIGTERM (measured: still up after 30 s), so the raylet's
        workers (actors, job supervisors and their drivers) go first; then `ray start`
        shuts its node down (about 2 s); then whatever remains gets SIGTERM, then SIGKILL.
        """
        table = _processes()
        mine = self.pids()
        command = {pid: table[pid][3] for pid in mine if pid in table}
        raylets = {pid for pid, line in command.items() if "/raylet/raylet" in line}
        workers = _descendants(table, raylets) - raylets
        workers = {pid for pid in workers if not any(agent in table[pid][3] for agent in _RAYLET_AGENTS)}
        self._signal(workers, signal.SIGTERM)
        self._wait_gone(workers, 5.0)
        self._signal({self.process.pid}, signal.SIGTERM)
        try:
            self.process.wait(timeout=HEAD_STOP_DEADLINE)
        except subprocess.TimeoutExpired:
            pass  # SIGKILL below
        targets = mine
        for sig in (signal.SIGTERM, signal.SIGKILL):
            targets = self._alive(targets | self.pids())
            self._signal(targets, sig)
            targets = self._wait_gone(targets, 5.0)
            if not targets:
                break
        self.process.wait(timeout=5)
        return targets

    def _wait_gone(self, pids: set[int], seconds: float) -> set[int]:
        end = time.monotonic() + seconds
        alive = self._alive(pids)
        while alive and time.monotonic() < end:
            self.process.poll()  # reap `ray start`, our own child
            time.sleep(0.1)
            alive = self._alive(alive)
        return alive

    @staticmethod
    def _alive(pids: set[int]) -> set[int]:
        table = _processes()
        return {pid for pid in pids if pid in table and table[pid][2] != "Z"}

    @staticmethod
    def _signal(pids: set[int], sig: signal.Signals) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _interpreter_first(env: dict[str, str], python: str = sys.executable) -> dict[str, str]:
    """``env`` with ``python``'s folder first on PATH: a job's entrypoint says `python`, which
    must be the interpreter under test (this one, with opgraph), not another one on the machine."""
    env["PATH"] = os.pathsep.join([os.path.dirname(python), env.get("PATH", "")])
    return env


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def start_local_head(python: str = sys.executable) -> LocalHead:
    """A head run by ``python`` (and its Ray), whose jobs' `python` is that interpreter too."""
    temp_dir = tempfile.mkdtemp(prefix="ogh-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs_port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    log_path = os.path.join(temp_dir, "ray-start.log")
    command = [
        # This interpreter's Ray CLI: a fresh machine may have no `ray` script on PATH.
        python, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
        "--num-cpus=2",
        "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        # Every port Ray would otherwise take at a fixed default, so the embedded Ray of
        # this process (or another test run) never collides with this head.
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={agent_port}",
        "--min-worker-port=0", "--max-worker-port=0", f"--temp-dir={temp_dir}",
    ]
    token = secrets.token_hex(32)
    env = _interpreter_first({k: v for k, v in os.environ.items()
                              if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH",
                                           "VIRTUAL_ENV", "PYTHONPATH")}, python)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)  # its own token, never ~/.ray/auth_token
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True, cwd=temp_dir)
    head = LocalHead(process, temp_dir, gcs_port, dashboard_port, log_path, token)
    deadline = time.monotonic() + HEAD_START_DEADLINE
    while True:
        if process.poll() is not None:
            head.stop()
            with open(log_path) as log:
                raise RuntimeError(f"`ray start --head` exited with {process.returncode}:\n{log.read()}")
        try:
            # The job server answers once the dashboard's job module is up; a submission
            # is then handed to the node's dashboard agent, which may still be starting
            # (a submission sent before it listens fails with "Server disconnected").
            request = urllib.request.Request(f"{head.dashboard_url}/api/jobs/",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=2) as reply:
                if reply.status == 200 and _listening("127.0.0.1", agent_port):
                    return head
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            survivors = head.stop()
            with open(log_path) as log:
                raise RuntimeError(f"the head's job server at {head.dashboard_url} did not answer within "
                                   f"{HEAD_START_DEADLINE} s (survivors: {survivors}):\n{log.read()}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def local_head_starter():
    """``start_local_head`` itself, for a test module that needs a head of its own (another Python)."""
    return start_local_head


@pytest.fixture(scope="session")
def ray_head():
    """A real `ray start --head` on 127.0.0.1 free ports, with token authentication (Ray's
    default), for subprocess clients only: ``ray_head.env()`` carries its token.

    Nothing in this pytest process calls ray.init against it: its ray_current_cluster
    file lives in its own temp dir, so the embedded Ray of ``session`` never finds it.
    """
    head = start_local_head()
    try:
        yield head
    finally:
        survivors = head.stop()
        shutil.rmtree(head.temp_dir)
        assert not survivors, f"processes of the local head survived SIGKILL: {sorted(survivors)}"
