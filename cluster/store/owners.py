"""Which process owns a run, and whether that process still lives.

A fixed-lane run executes inside the process that admitted it (``opgraph flow run``, a
job, or ``opgraph serve``). If that process dies, nothing else will ever settle the run,
so the store records its owner and settles an orphan as failed when it sees one. Only
an owner on this host can be checked; a run owned elsewhere is left as it is.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcessIdentity", "current_process", "owner_is_alive"]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """Host, pid and a start token; the token tells a reused pid from the original process."""

    host: str
    pid: int
    start: str | None  # "<boot id>:<start ticks>" on Linux, else None (liveness by pid alone)


def _start_token(pid: int) -> str | None:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (start time, in clock ticks since boot) follows the parenthesised command
    # name, which may itself hold spaces: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2:].split()
    return f"{boot}:{fields[19]}"


def current_process() -> ProcessIdentity:
    pid = os.getpid()
    return ProcessIdentity(socket.gethostname(), pid, _start_token(pid))


def owner_is_alive(owner: ProcessIdentity, here: ProcessIdentity | None = None) -> bool | None:
    """True or False for an owner on this host; None when it cannot be told (another host)."""
    here = here or current_process()
    if owner.host != here.host:
        return None
    if owner.pid == here.pid:
        return owner.start is None or here.start is None or owner.start == here.start
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, but another user's process
    except OSError:
        return None
    if owner.start is None:
        return True
    token = _start_token(owner.pid)
    return token is None or token == owner.start
