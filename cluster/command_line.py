"""What every opgraph command line shares: the exit-code table and the options declared once.

Owns ``ExitCode`` (each number a shell sees from `opgraph` or from the job entrypoint
`python -m opgraph.cluster.job`, with the one sentence that says what it means, shown in
`opgraph --help`) and the options several commands take (``--store``, ``--json``, the Ray
``--address`` and ``--namespace``, ``--token``...): each one's flag, default, environment
variable and help text are decided here, and a command adds them by name. It parses and
runs nothing itself, and imports no command, lane or runtime.
"""

from __future__ import annotations

import argparse
import os
import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

__all__ = [
    "CLUSTER_ADDRESS",
    "DEFAULT_MODEL",
    "JSON",
    "NAMESPACE",
    "PLAIN",
    "RAY_ADDRESS",
    "RUN_OPTIONS",
    "STORE",
    "TOKEN",
    "ExitCode",
    "SharedOption",
    "add_options",
    "duration_seconds",
    "exit_codes_epilog",
    "exit_codes_table",
    "model_price",
    "nonnegative_int",
    "positive_float",
    "positive_int",
]


class ExitCode(IntEnum):
    """The exit status of every opgraph command; ``meaning`` is its one sentence."""

    OK = 0
    FAILED = 1
    USAGE = 2
    RUNTIME = 3
    DEGRADED = 4
    UNMET = 5
    CANCELLED = 130

    @property
    def meaning(self) -> str:
        return _MEANINGS[self]


_MEANINGS = {
    ExitCode.OK: "done: the run completed, or the command did what was asked",
    ExitCode.FAILED: "the run failed, or (read from another process) ended other than completed; or the "
                     "command was refused or could not do its work: an unknown or finished run, a control the "
                     "run's lane excludes (nothing is sent), a resume that may not go on, no usable plan, a port "
                     "in use",
    ExitCode.USAGE: "bad arguments, input, definition, playbook or store (nothing ran)",
    ExitCode.RUNTIME: "the runtime (Ray) could not be started or reached (nothing ran)",
    ExitCode.DEGRADED: "an engine run ended degraded (budget, deadline or missing emissions): its partial result "
                       "is printed; or a dataset job's budget stopped it with rows left (the same command goes on)",
    ExitCode.UNMET: "an engine run completed, but its result does not meet its own check (coding: the final "
                    "tests do not pass; nothing is applied)",
    ExitCode.CANCELLED: "cancelled: Ctrl-C, or the run this command waited on was cancelled",
}


def exit_codes_epilog(*codes: ExitCode) -> str:
    """One paragraph for a command's help: the codes it can return (default: all), each with its sentence."""
    return "Exit status: " + "; ".join(f"{code.value} {code.meaning}" for code in codes or ExitCode) + "."


def exit_codes_table(width: int = 100) -> str:
    """The whole table, a code a paragraph (wrapped to ``width``), for `opgraph --help`."""
    rows = [textwrap.fill(code.meaning, width, initial_indent=f"  {code.value:>3}  {code.name:<9}  ",
                          subsequent_indent=" " * 18) for code in ExitCode]
    return "exit status (every command; each command's help names those it returns):\n" + "\n".join(rows)


# -- argument types ------------------------------------------------------------------------------------
def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (argparse exits 2 before anything starts)."""
    return _whole_number(text, 1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (seconds, say)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be above 0 and finite, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number, 0 or more."""
    return _whole_number(text, 0)


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def duration_seconds(text: str) -> float:
    """An argparse type: a duration such as ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or ``1h30m``, in seconds."""
    spec = text.strip().lower()
    if not spec or _DURATION.sub("", spec):
        raise argparse.ArgumentTypeError(f"must be a duration such as 30d, 12h, 90m, 45s or 1h30m, got {text!r}")
    return float(sum(float(number) * _DURATION_UNITS[unit] for number, unit in _DURATION.findall(spec)))


def model_price(text: str) -> tuple[str, tuple[float, float]]:
    """An argparse type: ``MODEL=PROMPT,COMPLETION`` ($ per million tokens) as (model, (prompt, completion))."""
    model, separator, pair = text.partition("=")
    prompt, comma, completion = pair.partition(",")
    try:
        if not separator or not comma or not model.strip():
            raise ValueError(text)
        return model.strip(), (float(prompt), float(completion))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects MODEL=PROMPT,COMPLETION ($ per million tokens), got {text!r}") \
            from None


# -- the shared options --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedOption:
    """One option several commands take: its flags, help, argparse settings and, where it has one, the
    environment variable its default is read from when a parser is built."""

    flags: tuple[str, ...]
    help: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    environment: str | None = None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        settings = dict(self.settings)
        if self.environment is not None:
            settings["default"] = os.environ.get(self.environment) or settings.get("default")
        parser.add_argument(*self.flags, help=self.help, **settings)


def add_options(parser: argparse.ArgumentParser, *options: SharedOption) -> None:
    """Add each shared option to ``parser``, in the order given."""
    for option in options:
        option.add_to(parser)


STORE = SharedOption(
    ("--store",), "the run store: a SQLite path or a postgresql:// URL (default: OPGRAPH_DB, else "
                  "$OPGRAPH_HOME/opgraph.db, else ~/.opgraph/opgraph.db)", {"default": None, "metavar": "STORE"})
JSON = SharedOption(("--json",), "print the result as JSON", {"action": "store_true"})
PLAIN = SharedOption(("--plain",), "plain progress lines even on a terminal", {"action": "store_true"})
# Where a command starts or joins a runtime: Ray's own resolution of an address that is not given.
RAY_ADDRESS = SharedOption(
    ("--address",), 'Ray address: "host:port", "auto" or "ray://host:port" (default: RAY_ADDRESS when set, else a '
                    "cluster `ray start` began on this machine, else an embedded local Ray); a cluster with token "
                    "authentication needs RAY_AUTH_MODE=token", {"default": None})
# Where a command reaches a run on a cluster that is already running.
CLUSTER_ADDRESS = SharedOption(
    ("--address",), 'Ray address of the running cluster: "host:port", "auto" or "ray://host:port" (default: '
                    'RAY_ADDRESS, else "auto"); a cluster with token authentication needs RAY_AUTH_MODE=token',
    {"default": None})
NAMESPACE = SharedOption(("--namespace",), "Ray namespace of the opgraph actors (opgraph)", {"default": "opgraph"})
DEFAULT_MODEL = SharedOption(
    ("--default-model",), "provider/model for what names none (default: OPGRAPH_DEFAULT_MODEL, else sim/default, "
                          "the built-in simulated provider)", {"default": None})
# What a command that runs a run takes (`flow run`, `demo`, `o flow`, `play`).
RUN_OPTIONS = (DEFAULT_MODEL, STORE, RAY_ADDRESS, JSON, PLAIN)
# The token of an `opgraph serve` server, for the commands that call one: sent as a bearer token.
# Without it, opgraph.cluster.http.auth.client_token looks further (OPGRAPH_TOKEN_FILE, then the
# token a server on this machine generated in the opgraph home).
TOKEN = SharedOption(("--token",), "the token of the opgraph server (default: OPGRAPH_TOKEN, else the file "
                                   "OPGRAPH_TOKEN_FILE names, else $OPGRAPH_HOME/server-token)",
                     {"default": None, "metavar": "TOKEN"}, environment="OPGRAPH_TOKEN")
