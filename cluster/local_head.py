"""A `ray start --head` of its own, for a benchmark or a test: its own temp dir, free ports, a token.

Owns starting a head that nothing else on the machine shares (every port Ray would take at a
fixed default is chosen free, so another Ray on the machine never collides with it), waiting
for its job server, the environment its clients need (its token, this interpreter first on
PATH), and stopping exactly its processes, by pid: never `ray stop`, which would stop every
Ray of the machine. Linux only (it reads /proc); it starts programs through ``processes``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from .processes import (
    ProcessEndedError,
    ServerStartError,
    accepts_connections,
    descendants,
    free_port,
    http_body,
    process_table,
    running,
    send_signal,
    start_server,
    wait_gone,
    wait_until,
)

__all__ = ["HEAD_START_SECONDS", "LocalHead", "start_local_head"]

HEAD_START_SECONDS = 90.0  # for `ray start --head` and its job server to answer
HEAD_STOP_SECONDS = 10.0  # for `ray start` to shut its node down after SIGTERM
_RAYLET_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # children the raylet stops itself
# Never inherited: the head and its clients must find this head, with its own token.
_NOT_INHERITED = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


@dataclass
class LocalHead:
    """A `ray start --head --block` cluster in its own temp dir and process session.

    Its processes are everything in the session of the `ray start` process, their
    descendants (job drivers start sessions of their own), and anything naming its temp
    dir; ``stop`` signals exactly those.
    """

    process: subprocess.Popen
    temp_dir: str
    gcs_port: int
    dashboard_port: int
    agent_port: int
    log_path: str
    token: str  # the head uses token authentication, Ray's default
    database: str | None = None  # OPGRAPH_DB of its jobs and clients (None: inherited)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def env(self, *, authenticated: bool = True) -> dict[str, str]:
        """An environment for client processes: no inherited Ray address, this head's token
        (``authenticated=False``: none, as a shell that forgot to export one), its database."""
        env = _interpreter_first({key: value for key, value in os.environ.items() if key not in _NOT_INHERITED})
        env["RAY_AUTH_MODE"] = "token" if authenticated else "disabled"
        if authenticated:
            env["RAY_AUTH_TOKEN"] = self.token
        if self.database is not None:
            env["OPGRAPH_DB"] = self.database
        return env

    def job_server_ready(self) -> bool:
        """The job server answers, and the node's dashboard agent listens: a submission sent before
        the agent listens fails with "Server disconnected"."""
        answered = http_body(f"{self.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {self.token}"})
        return answered is not None and accepts_connections(self.agent_port)

    def pids(self) -> set[int]:
        """Every live process of this head (this process excepted)."""
        table = process_table()
        own = os.getpid()
        found = {pid for pid, info in table.items()
                 if info.state != "Z" and pid != own and (info.session == self.process.pid or self.temp_dir in
                                                          info.command)}
        found.add(self.process.pid)
        return {pid for pid in descendants(table, found) - {own} if pid in table and table[pid].state != "Z"}

    def stop(self) -> set[int]:
        """Stop this head's processes and only them; return the survivors (there should be none).

        Order matters. With detached actors alive, `ray start --block` does not finish its own
        shutdown on SIGTERM (measured: still up after 30 s), so the raylet's workers (actors, job
        supervisors and their drivers) go first; then `ray start` shuts its node down (about
        2 s); then whatever remains gets SIGTERM, then SIGKILL.
        """
        table = process_table()
        mine = self.pids()
        raylets = {pid for pid in mine if pid in table and "/raylet/raylet" in table[pid].command}
        workers = {pid for pid in descendants(table, raylets) - raylets
                   if not any(agent in table[pid].command for agent in _RAYLET_AGENTS)}
        send_signal(workers, signal.SIGTERM)
        wait_gone(workers, 5.0, reap=self.process)
        send_signal({self.process.pid}, signal.SIGTERM)
        try:
            self.process.wait(timeout=HEAD_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass  # SIGKILL below
        left = mine
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = {pid for pid in left | self.pids() if running(pid)}
            send_signal(left, sig)
            left = wait_gone(left, 5.0, reap=self.process)
            if not left:
                break
        self.process.wait(timeout=5)
        return left


def _interpreter_first(env: dict[str, str], python: str = sys.executable) -> dict[str, str]:
    """``env`` with ``python``'s folder first on PATH: a job's entrypoint says `python`, which must
    be the interpreter meant (this one, with opgraph), not another one on the machine."""
    env["PATH"] = os.pathsep.join([os.path.dirname(python), env.get("PATH", "")])
    return env


def start_local_head(python: str = sys.executable, *, cpus: int = 2, own_database: bool = False,
                     timeout: float = HEAD_START_SECONDS) -> LocalHead:
    """A head run by ``python`` (and its Ray), whose jobs' `python` is that interpreter too, once its
    job server answers. ``own_database``: its jobs and clients keep their runs in ``OPGRAPH_DB``
    inside its temp dir. A head that does not come up is stopped, and ``ServerStartError`` says
    what it printed and which of its processes survived."""
    temp_dir = tempfile.mkdtemp(prefix="ogh-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    gcs_port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    log_path = os.path.join(temp_dir, "ray-start.log")
    command = [
        # This interpreter's Ray CLI: a fresh machine may have no `ray` script on PATH.
        python, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--disable-usage-stats",
        f"--num-cpus={cpus}", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
        # Every port Ray would otherwise take at a fixed default, so the embedded Ray of
        # another process (or another test run) never collides with this head.
        f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={agent_port}",
        "--min-worker-port=0", "--max-worker-port=0", f"--temp-dir={temp_dir}",
    ]
    token = secrets.token_hex(32)
    env = _interpreter_first({key: value for key, value in os.environ.items()
                              if key not in (*_NOT_INHERITED, "VIRTUAL_ENV", "PYTHONPATH")}, python)
    database = os.path.join(temp_dir, "opgraph.db") if own_database else None
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)  # its own token, never ~/.ray/auth_token
    if database is not None:
        env["OPGRAPH_DB"] = database
    server = start_server(command, ready=None, timeout=timeout, what="`ray start --head`", log_path=log_path,
                          env=env, cwd=temp_dir)
    head = LocalHead(server.process, temp_dir, gcs_port, dashboard_port, agent_port, log_path, token, database)
    try:
        wait_until(head.job_server_ready, timeout=timeout, what=f"the head's job server at {head.dashboard_url}",
                   process=head.process, output=server.output, interval=0.25)
    except BaseException as exc:
        survivors = head.stop()
        if isinstance(exc, ProcessEndedError | TimeoutError):
            raise ServerStartError(f"{exc}\n(survivors: {sorted(survivors)})") from exc
        raise
    return head
