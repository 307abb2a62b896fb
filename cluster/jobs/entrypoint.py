"""The job entrypoint: parse a job's mode and options, run it, report Ray that could not be reached.

Owns the command line of ``python -m opgraph.cluster.job`` (and ``opgraph.cluster.jobs``):
its modes (``fanout``, ``workflow``, ``map``: `opgraph map`'s own options), their options and
the exit statuses. Each mode is
its own module; this one only dispatches.

    ray job submit --working-dir . -- python -m opgraph.cluster.job fanout --nodes 10000 --latency 0.05
    python -m opgraph.cluster.job fanout --nodes 200 --latency 0.01     # embedded local Ray
    ray job submit --working-dir . -- python -m opgraph.cluster.job workflow flow.json --input topic=x
    opgraph job submit -- map /data/in.jsonl --prompt "Classify: {text}" --id-column id --output /data/out.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..command_line import NAMESPACE, RAY_ADDRESS, STORE, ExitCode, add_options, exit_codes_epilog
from ..connection import RuntimeStartError
from .command import add_map_arguments, run_map
from .fanout import run_fanout_job
from .workflow import run_workflow_job

__all__ = ["build_parser", "main"]


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m opgraph.cluster.job",
        description="Run one opgraph run as a Ray job: progress in the logs, the summary as the last line.",
        epilog=exit_codes_epilog(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME)
        + " A run that failed or was cancelled ends the job with 1: Ray marks it FAILED.",
    )
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    fanout = modes.add_parser("fanout", help="N independent nodes of the built-in 'sleep' operation")
    fanout.add_argument("--nodes", type=_positive(int), default=1000, help="number of nodes (1000)")
    fanout.add_argument("--latency", type=float, default=0.05, help="seconds each node sleeps (0.05)")
    fanout.add_argument("--max-concurrent", type=_positive(int), default=100,
                        help="operations in flight at once (100)")
    fanout.add_argument("--fail-every", type=int, default=0, metavar="K",
                        help="make every K-th node fail, to see a failed run (0: none)")
    fanout.add_argument("--results", default=None, metavar="PATH",
                        help="write the full result envelope as JSON to PATH")
    fanout.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus /metrics on PORT during the run (0: any free port)")
    fanout.add_argument("--metrics-host", default="127.0.0.1", help="interface for --metrics-port (127.0.0.1)")
    fanout.add_argument("--metrics-linger", type=float, default=None, metavar="SECONDS",
                        help="after the run, keep --metrics-port open until one more scrape has read the final "
                             "values, at most SECONDS (30; 0: close at once). Nothing scraped: it closes at once")
    fanout.add_argument("--progress-from", choices=("status", "signals"), default="status",
                        help="where progress lines come from: the run's status, polled (status, the default: one "
                             "message whatever the size), or a lifecycle signal per node (signals)")
    _add_runtime_arguments(fanout, run_id_default="fanout-<uuid>")
    fanout.set_defaults(handler=run_fanout_job)
    workflow = modes.add_parser("workflow", help="run a fixed-workflow JSON file (ADR-0073), recorded in SQLite")
    workflow.add_argument("file", metavar="FILE")
    workflow.add_argument("--input", action="append", metavar="KEY=VALUE",
                          help="a run input in the flow context (repeatable; JSON values are parsed)")
    workflow.add_argument("--model", default=None, help="provider/model for every chat node")
    workflow.add_argument("--base-dir", default=None, help="containment root for coding-engine cwd")
    workflow.add_argument("--max-concurrent", type=_positive(int), default=5, help="operations in flight (5)")
    add_options(workflow, STORE)
    workflow.add_argument("--results", default=None, metavar="PATH",
                          help="write the full run result (outputs, errors, provenance) as JSON to PATH")
    _add_runtime_arguments(workflow, run_id_default="workflow-<uuid>")
    workflow.set_defaults(handler=run_workflow_job)
    rows = modes.add_parser("map", help="a dataset job: a prompt or a stored workflow over every row of a file "
                                        "(the options of `opgraph map`)")
    add_map_arguments(rows)
    rows.set_defaults(handler=run_map)
    return parser


def _add_runtime_arguments(mode: argparse.ArgumentParser, *, run_id_default: str) -> None:
    add_options(mode, RAY_ADDRESS, NAMESPACE)  # RAY_ADDRESS is set for a driver under `ray job submit`
    mode.add_argument("--detached", action=argparse.BooleanOptionalAction, default=None,
                      help="keep the opgraph actors alive after this job, shared by later jobs and "
                           "clients (default: yes with --address or RAY_ADDRESS, else no)")
    mode.add_argument("--detach", action="store_true",
                      help="admit the run detached and end the job once it is admitted and durable: the run goes "
                           "on on the cluster, and `opgraph run result RUN_ID` reads its end (needs --address or "
                           "RAY_ADDRESS)")
    mode.add_argument("--run-id", default=None,
                      help="name of the run, for `opgraph run ... RUN_ID` from another client "
                           f"(default: {run_id_default}, printed at start)")
    mode.add_argument("--progress-interval", type=float, default=1.0,
                      help="seconds between progress lines at most (1.0); also one line per 5%% settled")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        return arguments.handler(arguments)
    except RuntimeStartError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return ExitCode.RUNTIME


if __name__ == "__main__":
    raise SystemExit(main())
