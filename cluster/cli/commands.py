"""The `opgraph` command line: argument parsing and subcommand dispatch.
Each subcommand imports what it needs lazily, so `opgraph --version` stays fast
and does not start Ray."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from ..http.body import DEFAULT_MAX_BODY_BYTES
from .client import RUN_EXIT_CODES
from .engine import add_engine_parser, add_run_show_parser
from .flow import add_flow_parser, add_run_arguments, add_workflows_parser, positive_int
from .orchestrate import add_orchestrate_parser, add_play_parser
from .results import add_result_parsers

__all__ = ["main"]

_RUN_EPILOG = RUN_EXIT_CODES[0].upper() + RUN_EXIT_CODES[1:] + "."


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


def _serve_api(arguments: argparse.Namespace) -> int:
    # Lazy: FastAPI and uvicorn load only for the server.
    from opgraph.kernel import OpGraphError

    from ..http import serve

    try:
        serve(arguments.host, arguments.port, store_path=arguments.store, address=arguments.address,
              max_body_bytes=arguments.max_body_bytes)
    except OpGraphError as exc:  # the store cannot be opened: nothing was served
        print(f"opgraph serve: {exc}", file=sys.stderr)
        return 2
    return 0


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
        return 2
    return submit_job(entrypoint, address=arguments.address, working_dir=arguments.working_dir,
                      no_wait=arguments.no_wait, submission_id=arguments.submission_id, detach=arguments.detach,
                      runtime_env=runtime_env, ship=arguments.ship)


def _job_runtime_env(arguments: argparse.Namespace) -> int:
    from ..jobs.shipping import opgraph_runtime_env

    print(json.dumps(opgraph_runtime_env(), sort_keys=True))
    return 0


def _run_action(arguments: argparse.Namespace) -> int:
    # Lazy: attaching imports Ray and the runtime.
    from .client import run_action

    return run_action(arguments.action, arguments.run_id, address=arguments.address,
                      namespace=arguments.namespace, text=getattr(arguments, "text", None),
                      limit=getattr(arguments, "limit", None), store=arguments.store)


def _print_help_of(parser: argparse.ArgumentParser) -> int:
    """A command group run without an action: show its actions, exit as a usage error."""
    parser.print_help()
    return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opgraph",
        description="Run LLM operation graphs on Ray.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_installed_version()}",
    )
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = subcommands.add_parser(
        "demo",
        help="run the bundled support-triage workflow on the embedded local runtime (sim/ provider)",
        description="The main job: `opgraph flow run` on the bundled five-node workflow with a conditional "
                    "fork, on local Ray, the SQLite store and the built-in simulated provider. Pass "
                    "--input priority=low to take the other branch, --model to use a real provider.",
    )
    demo.add_argument("--kernel", action="store_true",
                      help="drive the kernel state machine alone, without Ray")
    add_run_arguments(demo)
    demo.set_defaults(handler=_run_demo)
    add_flow_parser(subcommands)
    add_workflows_parser(subcommands)
    add_orchestrate_parser(subcommands)
    add_play_parser(subcommands)
    add_engine_parser(subcommands)
    api = subcommands.add_parser(
        "serve", help="serve the workflow HTTP API (definitions CRUD, 202-admitted runs) until Ctrl-C",
        description="FastAPI server of the fixed-workflow lane: /api/workflows (CRUD, versions) and "
                    "/api/workflows/NAME/runs (202 admission), /api/runs/ID (status, signals, results, "
                    "cancel). Interactive docs at /docs.",
    )
    api.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1)")
    api.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    api.add_argument("--store", default=None,
                     help="store: a SQLite path or a postgresql:// URL "
                     "(default: OPGRAPH_DB, $OPGRAPH_HOME/opgraph.db or ~/.opgraph/opgraph.db)")
    api.add_argument("--address", default=None,
                     help="Ray address (default: an embedded local Ray); the runtime starts with the server, "
                          "before it takes requests")
    api.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                     help=f"largest request body taken; a larger one is refused with 413 before it is read "
                          f"whole ({DEFAULT_MAX_BODY_BYTES})")
    api.set_defaults(handler=_serve_api)

    # Parsed by opgraph.cluster.bench itself: main() hands `bench ...` over before argparse
    # (a REMAINDER positional would not take options such as --repeat).
    subcommands.add_parser("bench", add_help=False,
                           help="benchmark the standard shapes; `opgraph bench --help` for options")

    metrics = subcommands.add_parser("metrics", help="Prometheus metrics of a running runtime")
    metrics.set_defaults(handler=lambda _: _print_help_of(metrics))
    metrics_commands = metrics.add_subparsers(dest="metrics_command", metavar="ACTION")
    serve = metrics_commands.add_parser(
        "serve",
        help="serve /metrics for the executor, workers and branch stores until Ctrl-C",
    )
    serve.add_argument("--port", type=int, default=9464, help="port to listen on, 0 for any free one (9464)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1)")
    serve.add_argument("--address", default=None,
                       help='Ray address: "auto", "ray://host:port" or "host:port" (default: embedded local Ray)')
    serve.add_argument("--namespace", default="opgraph", help="Ray namespace of the runtime (opgraph)")
    serve.add_argument("--scrape-timeout", type=float, default=2.0,
                       help="seconds a scrape waits for the actors' snapshots (2.0)")
    serve.set_defaults(handler=_serve_metrics)

    job = subcommands.add_parser("job", help="Ray jobs running opgraph")
    job.set_defaults(handler=lambda _: _print_help_of(job))
    job_commands = job.add_subparsers(dest="job_command", metavar="ACTION")
    submit = job_commands.add_parser(
        "submit",
        help="ray job submit --working-dir . -- python -m opgraph.cluster.job ARGS..., shipping opgraph",
        description="A thin wrapper: runs `ray job submit` with the job entrypoint, and opgraph in the job's "
                    "runtime environment (py_modules), and passes its exit status through (non-zero when the "
                    "job fails).",
    )
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
    runtime_env = job_commands.add_parser(
        "runtime-env",
        help="print the runtime environment JSON that ships this opgraph (for ray job submit --runtime-env-json)",
        description="Stages this opgraph's code once (under ~/.cache/opgraph/runtime-env) and prints "
                    '{"py_modules": [FOLDER]}: `ray job submit --runtime-env-json "$(opgraph job runtime-env)" '
                    "--working-dir . -- python -m opgraph.cluster.job ...` then runs on nodes without opgraph.")
    runtime_env.set_defaults(handler=_job_runtime_env)

    run = subcommands.add_parser(
        "run", help="find a live run by id on a running cluster and control it",
        description="Attach to a run that a process on the cluster is running, by its id. A cluster with "
                    "token authentication (Ray's default) needs RAY_AUTH_MODE=token and its token.",
        epilog=_RUN_EPILOG)
    run.set_defaults(handler=lambda _: _print_help_of(run))
    run_commands = run.add_subparsers(dest="action", metavar="ACTION")
    for action, help_text in [
        ("status", "print the run's counters as JSON"),
        ("pause", "stop new dispatches; in-flight operations finish"),
        ("cancel", "cancel what has not settled; the owning client gets status 'cancelled'"),
        ("message", "send an operator message, rendered into the next dispatched instructions"),
        ("watch", "stream settled nodes as JSON lines until the run ends"),
    ]:
        command = run_commands.add_parser(action, help=help_text, epilog=_RUN_EPILOG,
                                          description=help_text[0].upper() + help_text[1:] + ".")
        command.add_argument("run_id", metavar="RUN_ID")
        if action == "message":
            command.add_argument("text", metavar="TEXT")
        if action == "watch":
            command.add_argument("--limit", type=int, default=None, metavar="N",
                                 help="stop after N settled nodes (default: watch to the end)")
        command.add_argument("--address", default=None,
                             help='Ray address ("auto", "ray://host:port", "host:port"; default: RAY_ADDRESS or auto)')
        command.add_argument("--namespace", default="opgraph", help="Ray namespace of the runtime (opgraph)")
        command.add_argument("--store", default=None,
                             help="run store whose record of the run (its lane's capabilities) a control is held "
                                  "against (default: OPGRAPH_DB or ~/.opgraph/opgraph.db, when it exists)")
        command.set_defaults(handler=_run_action)
    add_run_show_parser(run_commands)
    add_result_parsers(run_commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from ..bench.shapes import main as bench_main  # lazy: it starts Ray

        return bench_main(argv[1:])
    parser = _build_parser()
    arguments = parser.parse_args(argv)
    handler = getattr(arguments, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
