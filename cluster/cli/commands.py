"""The `opgraph` command line: the parser of every command, its exit-code table, and dispatch.

Each subcommand imports what it needs lazily, so `opgraph --version` stays fast and does not
start Ray; `opgraph bench` is handed over whole to opgraph.cluster.bench (which never imports
the CLI back)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from ..command_line import (
    CLUSTER_ADDRESS,
    NAMESPACE,
    RAY_ADDRESS,
    STORE,
    ExitCode,
    add_options,
    exit_codes_table,
)
from .client import RUN_EXIT_CODES
from .control import add_control_parsers
from .engine import add_engine_parser, add_run_show_parser
from .flow import FLOW_RUN_CODES, add_flow_parser, add_run_arguments, add_workflows_parser
from .map import EXPORT_COMMAND, add_map_parsers
from .models import add_models_parser
from .orchestrate import add_orchestrate_parser, add_play_parser
from .results import add_result_parsers
from .runs import add_runs_parser, add_store_parser
from .serve import add_serve_parser, add_token_parser
from .spine import command_group, subcommand
from .webhooks import add_webhook_parser

__all__ = ["main"]


def _installed_version() -> str:
    try:
        return version("opgraph")
    except PackageNotFoundError:
        # Running from a source tree that was never installed.
        return "unknown"


def _run_demo(arguments: argparse.Namespace) -> int:
    # Lazy: importing the runtime loads Ray, which --version must not pay for.
    from .demo import main as demo_main

    return demo_main(kernel_only=arguments.kernel, arguments=arguments)


def _serve_metrics(arguments: argparse.Namespace) -> int:
    # Lazy: the exporter imports Ray and the runtime.
    from ..metrics import serve

    return serve(arguments.address, arguments.port, arguments.host,
                 namespace=arguments.namespace, timeout=arguments.scrape_timeout)


def _submit_job(arguments: argparse.Namespace) -> int:
    from .client import submit_job

    entrypoint = list(arguments.entrypoint)
    if entrypoint[:1] == ["--"]:
        entrypoint = entrypoint[1:]
    try:
        runtime_env = json.loads(arguments.runtime_env_json) if arguments.runtime_env_json else None
    except json.JSONDecodeError as exc:
        print(f"opgraph job submit: --runtime-env-json is not JSON: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    return submit_job(entrypoint, address=arguments.address, working_dir=arguments.working_dir,
                      no_wait=arguments.no_wait, submission_id=arguments.submission_id, detach=arguments.detach,
                      runtime_env=runtime_env, ship=arguments.ship)


def _job_runtime_env(arguments: argparse.Namespace) -> int:
    from ..jobs.shipping import opgraph_runtime_env

    print(json.dumps(opgraph_runtime_env(), sort_keys=True))
    return ExitCode.OK


def _run_action(arguments: argparse.Namespace) -> int:
    # Lazy: attaching imports Ray and the runtime.
    from .client import run_action

    return run_action(arguments.action, arguments.run_id, address=arguments.address,
                      namespace=arguments.namespace, text=getattr(arguments, "text", None),
                      limit=getattr(arguments, "limit", None), store=arguments.store)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opgraph", description="Run LLM operation graphs on Ray.",
                                     epilog=exit_codes_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = subcommand(
        subcommands, "demo",
        "run the bundled support-triage workflow on the embedded local runtime (sim/ provider)", codes=FLOW_RUN_CODES,
        description="The main job: `opgraph flow run` on the bundled five-node workflow with a conditional "
                    "fork, on local Ray, the SQLite store and the built-in simulated provider. Pass "
                    "--input priority=low to take the other branch, --model to use a real provider.",
    )
    demo.add_argument("--kernel", action="store_true", help="drive the kernel state machine alone, without Ray")
    add_run_arguments(demo)
    demo.set_defaults(handler=_run_demo)
    add_flow_parser(subcommands)
    add_workflows_parser(subcommands)
    add_orchestrate_parser(subcommands)
    add_play_parser(subcommands)
    add_engine_parser(subcommands)
    add_map_parsers(subcommands)
    add_serve_parser(subcommands)
    add_token_parser(subcommands)
    add_models_parser(subcommands)
    # Parsed by opgraph.cluster.bench itself: main() hands `bench ...` over before argparse
    # (a REMAINDER positional would not take options such as --repeat).
    subcommands.add_parser("bench", add_help=False,
                           help="benchmark the standard shapes; `opgraph bench --help` for options")
    _add_metrics_parser(subcommands)
    _add_job_parser(subcommands)
    _add_run_parser(subcommands)
    add_runs_parser(subcommands)
    add_store_parser(subcommands)
    add_control_parsers(subcommands)
    add_webhook_parser(subcommands)
    return parser


def _add_metrics_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "metrics", "Prometheus metrics of a running runtime")
    serve = subcommand(actions, "serve", "serve /metrics for the executor, workers and branch stores until Ctrl-C",
                       codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.RUNTIME))
    serve.add_argument("--port", type=int, default=9464, help="port to listen on, 0 for any free one (9464)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1)")
    add_options(serve, RAY_ADDRESS, NAMESPACE)
    serve.add_argument("--scrape-timeout", type=float, default=2.0,
                       help="seconds a scrape waits for the actors' snapshots (2.0)")
    serve.set_defaults(handler=_serve_metrics)


def _add_job_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "job", "Ray jobs running opgraph")
    submit = subcommand(
        actions, "submit", "ray job submit --working-dir . -- python -m opgraph.cluster.job ARGS..., shipping opgraph",
        codes=(ExitCode.USAGE,),
        description="A thin wrapper: runs `ray job submit` with the job entrypoint, and opgraph in the job's "
                    "runtime environment (py_modules), and passes its exit status through (non-zero when the "
                    "job fails).",
        notes="Otherwise, `ray job submit`'s own exit status: non-zero when the job failed.")
    # The job server's URL, not a Ray (GCS) address: its own option.
    submit.add_argument("--address", default=None,
                        help="the cluster's job server, e.g. http://127.0.0.1:8265 "
                             "(default: Ray's own default, RAY_API_SERVER_ADDRESS or RAY_ADDRESS)")
    submit.add_argument("--working-dir", default=".", help="directory uploaded with the job (.)")
    submit.add_argument("--submission-id", default=None, help="job id to use instead of a generated one")
    submit.add_argument("--no-wait", action="store_true", help="return once submitted instead of tailing logs")
    submit.add_argument("--detach", action="store_true",
                        help="the job admits its run detached and ends: the run goes on on the cluster, and "
                             "`opgraph run result RUN_ID` reads its end (the job's own --detach)")
    submit.add_argument("--runtime-env-json", default=None, metavar="JSON",
                        help="Ray runtime environment of the job; opgraph is added to its py_modules")
    submit.add_argument("--ship", action=argparse.BooleanOptionalAction, default=True,
                        help="take this opgraph to the cluster in the job's runtime environment (py_modules), so "
                             "its nodes need only Ray and opgraph's dependencies (default: yes)")
    submit.add_argument("entrypoint", nargs=argparse.REMAINDER, metavar="-- ARGS",
                        help="arguments of python -m opgraph.cluster.job, e.g. -- fanout --nodes 1000")
    submit.set_defaults(handler=_submit_job)
    runtime_env = actions.add_parser(
        "runtime-env",
        help="print the runtime environment JSON that ships this opgraph (for ray job submit --runtime-env-json)",
        description="Stages this opgraph's code once (under ~/.cache/opgraph/runtime-env) and prints "
                    '{"py_modules": [FOLDER]}: `ray job submit --runtime-env-json "$(opgraph job runtime-env)" '
                    "--working-dir . -- python -m opgraph.cluster.job ...` then runs on nodes without opgraph.")
    runtime_env.set_defaults(handler=_job_runtime_env)


def _add_run_parser(subcommands: Any) -> None:
    run_commands = command_group(
        subcommands, "run", "find a live run by id on a running cluster and control it", dest="action",
        description="Attach to a run that a process on the cluster is running, by its id. A cluster with "
                    "token authentication (Ray's default) needs RAY_AUTH_MODE=token and its token.")
    for action, help_text in [
        ("status", "print the run's counters as JSON"),
        ("pause", "stop new dispatches; in-flight operations finish"),
        ("cancel", "cancel what has not settled; the owning client gets status 'cancelled'"),
        ("message", "send an operator message, rendered into the next dispatched instructions"),
        ("watch", "stream settled nodes as JSON lines until the run ends"),
    ]:
        command = subcommand(run_commands, action, help_text, codes=RUN_EXIT_CODES)
        command.add_argument("run_id", metavar="RUN_ID")
        if action == "message":
            command.add_argument("text", metavar="TEXT")
        if action == "watch":
            command.add_argument("--limit", type=int, default=None, metavar="N",
                                 help="stop after N settled nodes (default: watch to the end)")
        # The store holds the run's record (its lane's capabilities), which a control is held against.
        add_options(command, CLUSTER_ADDRESS, NAMESPACE, STORE)
        command.set_defaults(handler=_run_action)
    add_run_show_parser(run_commands)
    add_result_parsers(run_commands)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from ..bench.shapes import main as bench_main  # lazy: it starts Ray

        return bench_main(argv[1:])
    if argv[:2] == ["map", "export"]:  # `map` takes INPUT, so its export action is a command of its own
        argv = [EXPORT_COMMAND, *argv[2:]]
    parser = _build_parser()
    arguments = parser.parse_args(argv)
    handler = getattr(arguments, "handler", None)
    if handler is None:
        parser.print_help()
        return ExitCode.USAGE
    return handler(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
