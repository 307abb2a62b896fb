"""`opgraph map INPUT ...` and `opgraph map export JOB`: a prompt or a stored workflow over every row of a file.

Owns registering the two commands with the spine; their options, progress view and summary
are the dataset jobs' own (opgraph.cluster.jobs.command), shared with the job entrypoint's
``map`` mode, so `opgraph map` and `ray job submit -- python -m opgraph.cluster.job map`
take the same arguments.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..command_line import ExitCode
from .spine import subcommand

__all__ = ["EXPORT_COMMAND", "add_map_parsers"]

# `opgraph map export JOB` is parsed as this command (commands.main renames it): `map` itself takes INPUT.
EXPORT_COMMAND = "map-export"


def _run_map(arguments: argparse.Namespace) -> int:
    from ..jobs.command import run_map  # lazy: the jobs load the runtime's modules

    return run_map(arguments)


def _run_export(arguments: argparse.Namespace) -> int:
    from ..jobs.command import run_export

    return run_export(arguments)


def add_map_parsers(subcommands: Any) -> None:
    from ..jobs.command import MAP_CODES, add_export_arguments, add_map_arguments

    command = subcommand(
        subcommands, "map", "run a prompt (or a stored workflow) over every row of a JSONL, CSV or Parquet file",
        codes=MAP_CODES,
        description="A dataset job: every row's answer is recorded in the run store once (keyed by --id-column), "
                    "before it counts as done, and exported to --output. The same command again skips what is "
                    "recorded and pays for none of it again; a changed input is refused. Rows stream into one live "
                    "run a window at a time. `opgraph map export JOB --output FILE` writes the output again.",
        notes="Bad input (a line that is not JSON, a row without its id, a repeated id, a template field the "
              "file lacks, a schema that is not JSON Schema, an output folder that does not exist) is refused "
              "before any model call.")
    add_map_arguments(command)
    command.set_defaults(handler=_run_map)
    export = subcommand(subcommands, EXPORT_COMMAND, "write a dataset job's output file again from the run store",
                        codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE))
    export.prog = "opgraph map export"
    add_export_arguments(export)
    export.set_defaults(handler=_run_export)
