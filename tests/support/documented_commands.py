"""What README.md and docs/*.md show, read back as runnable items, and the means to run them.

Owns the documentation's conventions as the tests hold them: which fenced blocks exist
(``console``/``sh`` hold commands, one per ``$ `` line, ``\\`` continuing a line;
``python`` holds complete programs; ``py`` holds fragments; ``yaml`` parses; ``text``
is a picture), the kinds of check a documented item can get, and running a shell command
in its own process group under a deadline. It must not decide how any one item is
checked: tests/cluster/test_documented_commands.py does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

__all__ = [
    "BLOCK_KINDS",
    "help_of",
    "AfterInstall",
    "COMMAND_BLOCKS",
    "REPOSITORY",
    "Block",
    "DocumentedCommand",
    "Environment",
    "HeadFixture",
    "NotRun",
    "Outcome",
    "ParsedOnly",
    "Run",
    "Serve",
    "Service",
    "documents",
    "free_port",
    "read_blocks",
    "read_commands",
    "run_shell",
]

REPOSITORY = Path(__file__).resolve().parents[2]  # tests/support -> the repository
COMMAND_BLOCKS = ("console", "sh")
# Every fence in the documentation names one of these; an untagged or unknown block fails
# the meta-test, so nothing runnable can hide in a block the tests do not read.
BLOCK_KINDS = (*COMMAND_BLOCKS, "python", "py", "yaml", "text")
_FENCE = re.compile(r"^```(?P<tag>[A-Za-z0-9_+-]*)\s*$")


def documents() -> list[Path]:
    """README.md, then every docs/*.md by name: the order the commands run in."""
    return [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced block: its document, the line of its opening fence, its tag and body lines."""

    document: str
    line: int
    tag: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass(frozen=True)
class DocumentedCommand:
    """One shell command as shown (continuations joined), where it is shown."""

    document: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file; an unclosed fence is an error."""
    name = str(path.relative_to(REPOSITORY))
    blocks: list[Block] = []
    opened: tuple[int, str] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence["tag"]), []
        elif line.rstrip() == "```":
            blocks.append(Block(name, opened[0], opened[1], tuple(body)))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        raise ValueError(f"{name}:{opened[0]}: a fenced block is never closed")
    return blocks


def read_commands(block: Block) -> list[DocumentedCommand]:
    """The commands of a ``console``/``sh`` block: ``$ `` starts one, a trailing ``\\`` continues it.

    Any other non-blank line (shown output, a comment) is an error: a block holds commands
    only, so every line of it is something the tests run.
    """
    commands: list[DocumentedCommand] = []
    current: list[str] = []
    start = 0
    for offset, line in enumerate(block.lines, start=1):
        number = block.line + offset
        if current:
            current.append(line.strip())
        elif line.startswith("$ "):
            current, start = [line[2:].strip()], number
        elif line.strip():
            raise ValueError(f"{block.document}:{number}: a line of a {block.tag} block that is not a "
                             f"`$ ` command: {line!r}")
        else:
            continue
        if current[-1].endswith("\\"):
            current[-1] = current[-1][:-1].rstrip()
        else:
            commands.append(DocumentedCommand(block.document, start, " ".join(current)))
            current = []
    if current:
        raise ValueError(f"{block.document}:{start}: the last command ends in a continuation")
    return commands


# -- how a documented item is checked ----------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Run it for real; it must exit ``exit`` and print something matching ``expect``.

    ``name`` and ``after`` order it: it starts once every item named in ``after`` is done
    (items without ``after`` may run side by side). ``capture`` (a regex with one group)
    takes the ``RUN_ID`` the docs tell the reader to set, for the items that name this one
    in ``after``. ``poll`` runs it again until it matches (what a reader polling a live run
    does). ``embedded`` runs it as written on a fresh embedded Ray, not joined to the test's
    head through ``RAY_ADDRESS``. ``early`` starts it before other items that wait on nothing:
    it spends long waiting on other processes (a Ray start, a job server), best overlapped.
    """

    expect: str
    exit: int = 0
    capture: str | None = None
    poll: bool = False
    embedded: bool = False
    timeout: float = 240.0
    name: str | None = None
    after: tuple[str, ...] = ()
    early: bool = False

    label = "run"


@dataclass(frozen=True)
class AfterInstall:
    """``INSTALL && COMMAND``: the install is not run (the tests run in the installed tree, and
    the module checks CI installs the same way); ``then`` checks COMMAND, which runs for real."""

    install: str
    then: Run

    @property
    def label(self) -> str:
        return f"install not run, then {self.then.label}"


@dataclass(frozen=True)
class Serve:
    """It runs until stopped: start it in its own process group, wait until ``ready`` (a URL,
    after port mapping) answers, and stop it by process group once every document has run.
    ``name`` and ``after`` order it as they order a ``Run``."""

    ready: str
    timeout: float = 180.0
    name: str | None = None
    after: tuple[str, ...] = ()

    label = "serve"


@dataclass(frozen=True)
class Export:
    """``export NAME=$(COMMAND)``: COMMAND runs for real (after ``after``) and must print a value
    matching ``expect``; every command after it (naming it in ``after``) runs with NAME so."""

    expect: str
    name: str | None = None
    after: tuple[str, ...] = ()

    label = "export"


@dataclass(frozen=True)
class Environment:
    """``export NAME=VALUE``: every command that joins the test's head runs with it set so."""

    label = "environment"


@dataclass(frozen=True)
class HeadFixture:
    """``ray start --head ...``: the test session starts this head itself (with free ports
    and a temp dir of its own); every option shown must be on the started head's command line."""

    label = "the module's Ray head"


@dataclass(frozen=True)
class _NotRunFor:
    """Not run, for the ``reason`` given; labelled with the kind's ``how`` and the reason."""

    reason: str

    how: ClassVar[str]

    @property
    def label(self) -> str:
        return f"{self.how}: {self.reason}"


class ParsedOnly(_NotRunFor):
    """Not run, for the ``reason`` given: the command with ``--help`` appended must parse and
    exit 0, and every option it shows must be in that help."""

    how = "parsed only"


class NotRun(_NotRunFor):
    """Not run at all, for the ``reason`` given (installing packages; the test command itself)."""

    how = "not run"


# -- running ------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one item did: exit status, output (stdout and stderr together), seconds, and any
    failure of the harness itself (a deadline, a service that never answered)."""

    status: int | None
    output: str
    seconds: float
    problem: str | None = None
    notes: list[str] = field(default_factory=list)
    captured: str | None = None


def _stop_group(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGINT the process group (Ctrl-C, as a reader stops a server), then SIGKILL what is left."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break  # the group is gone; the leader may still need reaping
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait(timeout=grace)


def run_shell(command: str, env: dict[str, str], timeout: float) -> Outcome:
    """``bash -c command`` with pipefail, in its own process group, ended as a group at ``timeout``."""
    started = time.monotonic()
    process = subprocess.Popen(["bash", "-o", "pipefail", "-c", command], cwd=REPOSITORY, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        output, _ = process.communicate()
        return Outcome(None, output, time.monotonic() - started, f"still running after {timeout:g} s")
    return Outcome(process.returncode, output, time.monotonic() - started)


class Service:
    """A documented command that runs until stopped, started in a process group of its own."""

    def __init__(self, command: str, env: dict[str, str], log: Path) -> None:
        self.command = command
        self._log = log
        with open(log, "w") as handle:
            self.process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=REPOSITORY, env=env,
                                            stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)

    def wait_until_answering(self, url: str, timeout: float) -> str | None:
        """None once ``url`` answers (any HTTP status); else what went wrong."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"exited with {self.process.returncode} before {url} answered"
            try:
                with urllib.request.urlopen(url, timeout=2):
                    return None
            except urllib.error.HTTPError:
                return None  # it answered, with an error status: it is up
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        return f"{url} did not answer within {timeout:g} s"

    def output(self) -> str:
        return self._log.read_text(errors="replace")

    def stop(self) -> None:
        _stop_group(self.process)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Prints each command's --help in one interpreter: `opgraph ARGS` is `python -m
# opgraph.cluster.cli ARGS`, and `python -m MODULE ARGS` is MODULE run as __main__.
_HELP_SCRIPT = r"""
import contextlib, io, json, runpy, sys, warnings
results = []
for module, arguments in json.loads(sys.stdin.read()):
    sys.argv = [module, *arguments, "--help"]
    out = io.StringIO()
    status = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module may be imported already
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    results.append([status, out.getvalue()])
print(json.dumps(results))
"""


def help_of(commands: list[str], env: dict[str, str], timeout: float = 120.0) -> list[tuple[int | None, str]]:
    """``(exit status, output)`` of each command with ``--help`` appended, all in one interpreter.

    Only ``opgraph ...`` and ``python -m MODULE ...`` commands; ``--help`` makes argparse parse
    every value before it, then print the help and exit, so nothing the command does runs.
    """
    calls = []
    for command in commands:
        words = shlex.split(command)
        if words[0] == "opgraph":
            calls.append(["opgraph.cluster.cli", words[1:]])
        elif words[:2] == ["python", "-m"]:
            calls.append([words[2], words[3:]])
        else:
            raise ValueError(f"not an opgraph or python -m command: {command!r}")
    done = subprocess.run([sys.executable, "-c", _HELP_SCRIPT], input=json.dumps(calls), capture_output=True,
                          text=True, env=env, cwd=REPOSITORY, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the --help pass failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [(status, output) for status, output in json.loads(done.stdout.splitlines()[-1])]
