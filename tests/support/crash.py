"""Crash a process and the Ray it started, all at once, as a power cut or the OOM killer would."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

__all__ = ["kill_session"]


def kill_session(owner: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL every process of ``owner``'s session (started with ``start_new_session=True``)
    and return once none of them is left running.

    Ray starts each actor in a process group of its own, so ``os.killpg(owner.pid)`` left the
    actors alive until they noticed their raylet was gone: a worker could still start an
    operation, and write its mark, after the test had read what happened before the crash.
    """
    deadline = time.monotonic() + timeout
    while members := _running_members(owner.pid):
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {members} of session {owner.pid} outlived SIGKILL for {timeout} s")
        time.sleep(0.05)


def _running_members(session: int) -> list[int]:
    """Processes of ``session`` that are not zombies (a zombie runs nothing and writes nothing)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != session:
                continue
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, PermissionError, FileNotFoundError):
            continue
        if state != "Z":
            members.append(pid)
    return members
