"""Gates: a command (a project's tests) run as a subprocess in its own process group, on a worker.

Owns how a gate runs: in a given folder (a workspace copy), with a scrubbed environment
(an allow-list; provider keys, tokens and cloud credentials never pass), output kept as
a bounded tail, and a timeout that ends the whole process group (SIGTERM, a short grace,
then SIGKILL), children that ignore SIGTERM included. Whatever the command leaves
running in its group when it exits is ended too. The exit status is the gate's verdict.

Limits, stated: the command runs with the worker's user and file permissions. A process
that leaves its group (``setsid``) escapes the group kill; its open output is abandoned
after a short wait and the result says so.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import GateError

__all__ = [
    "DEFAULT_KILL_GRACE_S",
    "DEFAULT_MAX_OUTPUT_BYTES",
    "GateResult",
    "gate_environment",
    "is_secret_name",
    "run_gate",
]

DEFAULT_KILL_GRACE_S = 2.0
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024
_OUTPUT_DRAIN_S = 1.0  # how long output may stay open once the group has ended
_POLL_S = 0.05

# Kept from the worker's environment (plus LC_*). Everything else is dropped unless asked for.
_KEPT = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "USER", "LOGNAME", "SHELL")
# Never passed, even when asked for: provider keys, tokens, passwords, cloud credentials.
_SECRET = re.compile(
    r"(API_?KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|PRIVATE_KEY|AUTH)"
    r"|^(AWS_|AZURE_|GOOGLE_APPLICATION_CREDENTIALS|GCP_|OPGRAPH_|RAY_)",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    """True for an environment variable a gate never receives (``OPENAI_API_KEY``, ``AWS_*``...)."""
    return bool(_SECRET.search(name))


def gate_environment(*, home: str, tmp: str | None = None, keep: Iterable[str] = (),
                     source: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a gate runs with: an allow-list of ``source`` (``os.environ``).

    PATH, LANG, LC_*, TZ, TERM and the user's names are kept; ``keep`` adds names the
    caller chose; any name that looks like a secret is dropped, asked for or not. HOME
    (and TMPDIR, when given) point into the sandbox.
    """
    source = os.environ if source is None else source
    wanted = set(_KEPT) | {name for name in source if name.startswith("LC_")} | set(keep)
    environment = {name: source[name] for name in sorted(wanted)
                   if name in source and not is_secret_name(name)}
    environment.setdefault("PATH", os.defpath)
    environment["HOME"] = home
    if tmp is not None:
        environment["TMPDIR"] = tmp
    return environment


@dataclass(frozen=True, slots=True)
class GateResult:
    """What one gate did: exit status (None when it never exited by itself), whether the
    timeout ended it, the tail of its output, and how much output there was."""

    command: str
    returncode: int | None
    timed_out: bool
    duration_s: float
    output_tail: str
    output_bytes: int
    truncated: bool
    killed: bool = False  # the group was signalled (timeout, cancellation, or stragglers)
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        """Exit status 0 within the timeout: the ground truth of a gate."""
        return self.returncode == 0 and not self.timed_out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes), "passed": self.passed}


def _live_members(group: int) -> bool | None:
    """Whether a running (not zombie) process is in ``group``, from /proc; None without /proc.

    A zombie still counts for ``killpg(group, 0)``, and where nobody reaps orphans (a
    container whose first process does not) one stays forever, so /proc is asked first.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or unreadable
        if len(fields) > 2 and int(fields[2]) == group and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member exists that we may not signal (it changed user): still alive
    members = _live_members(group)
    return True if members is None else members


def _signal_group(group: int, sign: int) -> bool:
    try:
        os.killpg(group, sign)
    except ProcessLookupError:
        return False
    return True


async def _end_group(process: asyncio.subprocess.Process, grace_s: float) -> bool:
    """SIGTERM the group, wait up to ``grace_s`` for it to empty, then SIGKILL what is left.

    Returns True when any signal was sent. The leader is reaped before returning.
    """
    group = process.pid
    if not _group_alive(group):
        return False
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), _POLL_S)
            except TimeoutError:
                pass
        else:
            await asyncio.sleep(_POLL_S)
        if process.returncode is not None and not _group_alive(group):
            return True
    _signal_group(group, signal.SIGKILL)
    try:
        await asyncio.wait_for(process.wait(), max(grace_s, 1.0))
    except TimeoutError:
        pass  # a leader stuck in the kernel: SIGKILL lands when it returns; do not hang here
    return True


class _Tail(asyncio.Protocol):
    """Reads a pipe: keeps the last ``limit`` bytes, counts them all, notes the end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.total = 0
        self.ended = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.total += len(data)
        self.data += data
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def text(self) -> str:
        return bytes(self.data).decode("utf-8", errors="replace")


def _argv(command: str | Sequence[str]) -> tuple[list[str], str]:
    if isinstance(command, str):
        if not command.strip():
            raise GateError("the gate command is empty")
        return ["/bin/sh", "-c", command], command
    argv = [str(part) for part in command]
    if not argv or not argv[0]:
        raise GateError("the gate command is empty")
    return argv, " ".join(argv)


async def run_gate(command: str | Sequence[str], cwd: str, *, timeout_s: float,
                   env: Mapping[str, str] | None = None, kill_grace_s: float = DEFAULT_KILL_GRACE_S,
                   max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES) -> GateResult:
    """Run ``command`` in ``cwd`` in a new process group; end the group at ``timeout_s``.

    A string runs through ``/bin/sh -c``; a list runs as it is. stdout and stderr are
    merged and the last ``max_output_bytes`` kept. ``env`` is used as given (build it
    with ``gate_environment``); None means an allow-listed copy of this process's, with
    HOME at ``cwd``. Cancelling the call kills the group at once. GateError when the
    command cannot be started at all.
    """
    if timeout_s <= 0 or kill_grace_s < 0 or max_output_bytes < 1:
        raise GateError(f"a gate needs timeout_s > 0, kill_grace_s >= 0 and max_output_bytes >= 1, got "
                        f"{timeout_s}, {kill_grace_s}, {max_output_bytes}")
    argv, shown = _argv(command)
    environment = dict(env) if env is not None else gate_environment(home=cwd)
    started = time.monotonic()
    # Output goes to a pipe this function owns (not asyncio's): a process that keeps it open
    # after the command exited can neither hold up the exit status nor outlive the reading.
    read_end, write_end = os.pipe()
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=environment, stdin=asyncio.subprocess.DEVNULL, stdout=write_end, stderr=write_end,
            start_new_session=True)
    except OSError as exc:
        os.close(read_end)
        raise GateError(f"the gate command {shown!r} could not be started: {exc.strerror or exc}") from None
    finally:
        os.close(write_end)
    tail = _Tail(max_output_bytes)
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: tail, os.fdopen(read_end, "rb", buffering=0))
    except BaseException:
        _signal_group(process.pid, signal.SIGKILL)  # nothing may run unwatched
        raise
    timed_out = killed = False
    notes: list[str] = []
    try:
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
        returncode = None if timed_out else process.returncode
        # Ends the group on a timeout, and whatever the command left running in it otherwise.
        killed = await _end_group(process, kill_grace_s)
        if killed and not timed_out:
            notes.append("processes the command left running in its group were ended")
        try:
            await asyncio.wait_for(asyncio.shield(tail.ended), _OUTPUT_DRAIN_S)
        except TimeoutError:
            notes.append("output stayed open after the group ended (a process left the group); "
                         "the rest was not read")
    finally:
        if process.returncode is None or _group_alive(process.pid):
            _signal_group(process.pid, signal.SIGKILL)  # cancelled: no grace, nothing left behind
        transport.close()
    return GateResult(command=shown, returncode=returncode, timed_out=timed_out,
                      duration_s=round(time.monotonic() - started, 3), output_tail=tail.text(),
                      output_bytes=tail.total, truncated=tail.total > len(tail.data), killed=killed,
                      notes=tuple(notes))
