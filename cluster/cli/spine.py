"""The CLI's spine: command groups and subcommands built one way, and how a command says why it stopped.

Owns what every command module shares beyond its own options: a command group that, run
without an action, shows its actions and exits as a usage error; a subcommand whose help
ends with the exit codes it can return (drawn from the one table, ``ExitCode``); and
``refused``, which prints why a command stops and gives the exit code that error means; and
leaving Ray as a command found it. The options themselves are declared once in
``opgraph.cluster.command_line``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from ..command_line import ExitCode, exit_codes_epilog
from ..connection import RuntimeStartError
from ..store import (
    EngineRunNotFoundError,
    RunNotFoundError,
    RunNotResumableError,
    WorkflowDefinitionError,
    WorkflowStoreError,
)

__all__ = ["command_group", "leaving_ray_as_found", "refused", "subcommand"]

# Store errors that refuse a run asked for by id (unknown, not resumable): the command was refused, not misused.
_RUN_REFUSALS = (RunNotFoundError, RunNotResumableError, EngineRunNotFoundError)


def command_group(subcommands: Any, name: str, help_text: str, *, dest: str | None = None, **settings: Any) -> Any:
    """A group of actions (``opgraph NAME ACTION``): run without one, it prints its help and exits 2.
    Returns the group's subparsers, to add the actions to."""
    group = subcommands.add_parser(name, help=help_text, **settings)
    group.set_defaults(handler=lambda _: _print_help_of(group))
    return group.add_subparsers(dest=dest or f"{name}_command", metavar="ACTION")


def _print_help_of(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return ExitCode.USAGE


def subcommand(actions: Any, name: str, help_text: str, *, codes: tuple[ExitCode, ...], description: str | None = None,
               notes: str = "", **settings: Any) -> argparse.ArgumentParser:
    """An action whose help ends with the exit codes it can return; ``notes`` follow them (capabilities...).
    Without a ``description``, the help sentence is it."""
    epilog = exit_codes_epilog(*codes) + (f" {notes}" if notes else "")
    return actions.add_parser(name, help=help_text, epilog=epilog,
                              description=description or help_text[0].upper() + help_text[1:] + ".", **settings)


def refused(prefix: str, exc: BaseException, otherwise: ExitCode = ExitCode.FAILED, *,
            typed: bool = False) -> ExitCode:
    """Say on stderr why the command stops, and return the exit code ``exc`` means.

    A runtime that could not be started or reached is ``RUNTIME``; a definition that fails
    its checks (with its problem list) or a store that cannot be used (or has no such
    workflow) is ``USAGE``; any other error, a run the store does not know or cannot resume
    included, is ``otherwise``: a usage error where nothing could have run, else a failure (its
    type named too when ``typed``).
    """
    if isinstance(exc, RuntimeStartError):
        print(f"{prefix}: {exc}", file=sys.stderr)
        return ExitCode.RUNTIME
    if isinstance(exc, WorkflowDefinitionError):
        kind = "compile" if type(exc).__name__ == "WorkflowCompileError" else "validation"
        print(f"{prefix}: the workflow definition failed {kind} ({len(exc.errors)} problem(s)):", file=sys.stderr)
        print(json.dumps({"errors": exc.errors}, indent=2), file=sys.stderr)
        return ExitCode.USAGE
    if isinstance(exc, WorkflowStoreError) and not isinstance(exc, _RUN_REFUSALS):
        print(f"{prefix}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(f"{prefix}: {type(exc).__name__ + ': ' if typed else ''}{exc}", file=sys.stderr)
    return otherwise


@contextlib.contextmanager
def leaving_ray_as_found() -> Iterator[None]:
    """Shut Ray down on leaving when this block was the first to join it: a caller's own Ray
    connection (a test's, a script's) is left as it was. Ray is imported only when it runs."""
    import ray

    joined_here = not ray.is_initialized()
    try:
        yield
    finally:
        if joined_here:
            ray.shutdown()
