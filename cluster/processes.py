"""Other programs started and ended: a server waited for, a command under a timeout, a crashed owner.

Owns how opgraph's commands, benchmarks and tests start a process and end it, so each waits
with a deadline and cleans up on failure the same way (a process group: polite signal, grace,
SIGKILL; a crashed owner: its whole session at once), and the /proc view (Linux) of what a
process left running. It runs programs and knows none of them: no Ray, no opgraph runtime.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

__all__ = [
    "GRACE_SECONDS",
    "LOOPBACK",
    "Killed",
    "ProcessEndedError",
    "ProcessInfo",
    "Server",
    "ServerStartError",
    "accepts_connections",
    "command_line",
    "descendants",
    "end_process_group",
    "free_port",
    "http_body",
    "kill_session",
    "process_table",
    "read_line",
    "run_command",
    "run_until",
    "running",
    "send_signal",
    "start_server",
    "wait_for_line",
    "wait_gone",
    "wait_until",
]

LOOPBACK = "127.0.0.1"
GRACE_SECONDS = 30.0  # how long a politely signalled process may take to end before SIGKILL
POLL_SECONDS = 0.2  # between two looks at a server that is not ready yet


class ServerStartError(RuntimeError):
    """A server exited, or was not ready, before its deadline; the message ends with what it printed."""


class ProcessEndedError(RuntimeError):
    """A process ended (its output closed) before it printed the line awaited; ``lines`` is what it printed."""

    def __init__(self, message: str, lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.lines = list(lines)


# -- ports and answers ---------------------------------------------------------------------------------
def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listened on a moment ago (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def accepts_connections(port: int, host: str = LOOPBACK, timeout: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_body(url: str, *, headers: Mapping[str, str] | None = None, timeout: float = 2.0) -> bytes | None:
    """The body of a GET that answered 200, else None (nothing listens yet, or another status)."""
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.read() if reply.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):  # URLError covers HTTP errors too
        return None


def wait_until(check: Callable[[], Any], *, timeout: float, what: str, process: subprocess.Popen | None = None,
               output: Callable[[], str] | None = None, interval: float = POLL_SECONDS) -> Any:
    """Call ``check`` until it returns something true, and return that.

    ``ProcessEndedError`` when ``process`` exits first, ``TimeoutError`` when ``timeout`` seconds
    pass; the message ends with ``output()`` (a log's text, say), so a failure says what the
    program printed.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and process.poll() is not None:
            raise ProcessEndedError(f"{what} exited with {process.returncode}{_tail(output)}")
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was not ready within {timeout:g} s{_tail(output)}")
        time.sleep(interval)


def _tail(output: Callable[[], str] | None, characters: int = 6000) -> str:
    return f":\n{output()[-characters:]}" if output is not None else ""


# -- lines of a child's output -------------------------------------------------------------------------
def read_line(stream: IO[Any], timeout: float) -> str:
    """One line of a child's output pipe ("" once it closed); ``TimeoutError`` when none came in time.

    Read a byte at a time from the descriptor, so nothing waits in a Python buffer where
    ``select`` cannot see it, and a later ``communicate()`` still gets the rest.
    """
    descriptor = stream.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while True:
        remaining = deadline - time.monotonic()
        readable, _, _ = select.select([descriptor], [], [], max(remaining, 0))
        if not readable:
            raise TimeoutError(f"no complete line within {timeout:g} s (so far: {line.decode(errors='replace')!r})")
        byte = os.read(descriptor, 1)
        line += byte
        if not byte or byte == b"\n":
            return line.decode(errors="replace")


def wait_for_line(process: subprocess.Popen, pattern: str | re.Pattern[str], *, timeout: float,
                  stream: IO[Any] | None = None, what: str = "the process") -> re.Match[str]:
    """The first line of ``stream`` (default: its stdout) that ``pattern`` is found in, within ``timeout``.

    ``ProcessEndedError`` when the output closes first, ``TimeoutError`` when time runs out.
    """
    stream = process.stdout if stream is None else stream
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        line = read_line(stream, deadline - time.monotonic())
        if not line:
            raise ProcessEndedError(f"{what} ended without printing {getattr(pattern, 'pattern', pattern)!r}", seen)
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found


# -- servers -------------------------------------------------------------------------------------------
def _default_interrupt() -> None:
    # Ctrl-C as a terminal sends it: a parent started in the background by a shell without job
    # control ignores SIGINT, and that disposition would otherwise pass to the server.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Server:
    """A program started by ``start_server``, in a process group (and session) of its own."""

    process: subprocess.Popen
    what: str
    log_path: Path | None = None
    ready: Any = None  # what the readiness check returned (a body, a match)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        """What it printed so far, when its output goes to a log file ("" otherwise)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self, first: signal.Signals = signal.SIGTERM, *, grace: float = GRACE_SECONDS) -> int:
        """End it (``end_process_group``); its exit status."""
        return end_process_group(self.process, first, grace=grace)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process.returncode is None:
            self.stop()


def start_server(command: Sequence[str], *, ready: Callable[[], Any] | str | re.Pattern[str] | None, timeout: float,
                 what: str, log_path: str | os.PathLike[str] | None = None, **popen: Any) -> Server:
    """Start ``command`` in a session of its own and return once it is ready.

    ``ready`` is a check called until it returns something true (``http_body`` of a URL,
    ``accepts_connections`` of a port), or a pattern awaited on a line of its stdout (give
    ``stdout=subprocess.PIPE``), or None (started is ready). Its output goes to ``log_path``
    when given. A server that exits or is not ready within ``timeout`` seconds is ended, and
    ``ServerStartError`` says what it printed (from its log).
    """
    log = open(log_path, "w") if log_path is not None else None
    if log is not None:
        popen.update(stdout=log, stderr=subprocess.STDOUT)
    try:
        process = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_default_interrupt, **popen)
    finally:
        if log is not None:
            log.close()  # the server writes through its own descriptor
    server = Server(process, what, Path(log_path) if log_path is not None else None)
    output = server.output if log_path is not None else None
    try:
        if isinstance(ready, str | re.Pattern):
            server.ready = wait_for_line(process, ready, timeout=timeout, what=what)
        elif ready is not None:
            server.ready = wait_until(ready, timeout=timeout, what=what, process=process, output=output)
    except (ProcessEndedError, TimeoutError) as exc:
        server.stop(signal.SIGKILL)
        raise ServerStartError(str(exc)) from exc
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


def end_process_group(process: subprocess.Popen, first: signal.Signals = signal.SIGTERM, *,
                      grace: float = GRACE_SECONDS) -> int:
    """Send ``first`` to ``process``, give it ``grace`` seconds to end, then SIGKILL its process group
    (what it left running too, when it leads a group of its own) and reap it; its exit status.

    The polite signal goes to the leader alone, so a server shuts its own children down in
    order; ``first=SIGKILL`` kills the group at once. The caller's own group is never signalled.
    """
    group = _own_group(process)
    if process.poll() is None and first != signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    if group is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    elif process.poll() is None:
        process.kill()
    process.communicate()  # reaps it and closes its pipes
    return process.returncode


def _own_group(process: subprocess.Popen) -> int | None:
    """``process``'s group when it leads one of its own (never the caller's), else None."""
    try:
        group = os.getpgid(process.pid)
    except ProcessLookupError:
        return None
    return group if group == process.pid and group != os.getpgrp() else None


# -- commands ------------------------------------------------------------------------------------------
def run_command(command: Sequence[str], *, timeout: float | None, input_text: str | None = None,
                own_session: bool = True, **popen: Any) -> subprocess.CompletedProcess:
    """``command`` run to its end, its output captured as text (unless ``stdout``/``stderr`` say
    otherwise), in a session of its own. When ``timeout`` passes (or this process is interrupted) it
    is killed, its whole process group with it, before ``subprocess.TimeoutExpired`` (or the
    interruption) goes on. ``own_session=False`` keeps it in the foreground, where a terminal's
    Ctrl-C reaches it too (a command a user asked for, such as `ray job submit`)."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    if input_text is not None:
        popen["stdin"] = subprocess.PIPE
    process = subprocess.Popen(list(command), start_new_session=own_session, **popen)
    try:
        stdout, stderr = process.communicate(input_text, timeout=timeout)
    except BaseException:
        end_process_group(process, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


class Killed(NamedTuple):
    """What ``run_until`` read before the kill (each line without its newline), and the exit status."""

    lines: list[str]
    returncode: int


def run_until(command: Sequence[str], until: Callable[[list[str]], bool], *, timeout: float, stream: str = "stdout",
              **popen: Any) -> Killed:
    """Start ``command`` in a session of its own, read its ``stream`` ("stdout" or "stderr") line by
    line until ``until(lines so far)``, then kill every process of that session at once (a power
    cut: the owner of a run and the Ray it started).

    ``ProcessEndedError`` when the output closes first, ``TimeoutError`` after ``timeout`` s:
    the session is killed either way.
    """
    popen[stream] = subprocess.PIPE
    popen.setdefault("stdout" if stream == "stderr" else "stderr", subprocess.DEVNULL)
    process = subprocess.Popen(list(command), start_new_session=True, text=True, **popen)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while not until(lines):
            line = read_line(getattr(process, stream), deadline - time.monotonic())
            if not line:
                raise ProcessEndedError(f"the process ended (exit {process.poll()}) before the awaited point; it "
                                        f"printed:\n" + "\n".join(lines[-40:]), lines)
            lines.append(line.rstrip("\n"))
    finally:
        kill_session(process)
        process.communicate(timeout=GRACE_SECONDS)
    return Killed(lines, process.returncode)


# -- the /proc view (Linux) ------------------------------------------------------------------------------
class ProcessInfo(NamedTuple):
    parent: int
    session: int
    state: str  # "Z": a zombie, which runs nothing
    command: str


def process_table() -> dict[int, ProcessInfo]:
    """Live processes: pid -> parent, session, state and command line."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        table[int(name)] = ProcessInfo(int(fields[1]), int(fields[3]), fields[0], command)
    return table


def command_line(pid: int) -> str:
    """The command line of ``pid`` ("" once it has gone); Ray sets an actor's to the method it runs."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(table: Mapping[int, ProcessInfo], roots: Iterable[int]) -> set[int]:
    """``roots`` and every live (not zombie) process below them in ``table``."""
    found = set(roots)
    while children := {pid for pid, info in table.items()
                       if info.parent in found and pid not in found and info.state != "Z"}:
        found |= children
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def send_signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_gone(pids: Iterable[int], seconds: float, *, reap: subprocess.Popen | None = None) -> set[int]:
    """Those of ``pids`` still running after up to ``seconds`` (``reap``: a child of ours, polled meanwhile)."""
    end = time.monotonic() + seconds
    alive = {pid for pid in pids if running(pid)}
    while alive and time.monotonic() < end:
        if reap is not None:
            reap.poll()
        time.sleep(0.1)
        alive = {pid for pid in alive if running(pid)}
    return alive


def kill_session(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL every process of ``process``'s session (started with ``start_new_session``) and return
    once none of them is left running.

    Ray starts each actor in a process group of its own, so killing the owner's group left
    the actors alive until they noticed their raylet was gone: a worker could still start an
    operation, and write its mark, after a test had read what happened before the crash.
    """
    deadline = time.monotonic() + timeout
    while members := [pid for pid, info in process_table().items()
                      if info.session == process.pid and info.state != "Z"]:
        send_signal(members, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {members} of session {process.pid} outlived SIGKILL for {timeout} s")
        time.sleep(0.05)
