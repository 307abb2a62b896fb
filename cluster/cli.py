"""The `opgraph` command line: argument parsing and subcommand dispatch.
Each subcommand imports what it needs lazily, so `opgraph --version` stays fast
and does not start Ray."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

__all__ = ["main"]


def _installed_version() -> str:
    try:
        return version("opgraph")
    except PackageNotFoundError:
        # Running from a source tree that was never installed.
        return "unknown"


def _run_demo(arguments: argparse.Namespace) -> int:
    # Lazy: importing the runtime loads Ray, which --version must not pay for.
    from opgraph.cluster.demo import main as demo_main

    return demo_main(kernel_only=arguments.kernel)


def _serve_metrics(arguments: argparse.Namespace) -> int:
    # Lazy: the exporter imports Ray and the runtime.
    from opgraph.cluster.metrics import serve

    return serve(arguments.address, arguments.port, arguments.host,
                 namespace=arguments.namespace, timeout=arguments.scrape_timeout)


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
        help="run plan -> two drafts -> merge on the embedded local runtime",
    )
    demo.add_argument("--kernel", action="store_true",
                      help="drive the kernel state machine alone, without Ray")
    demo.set_defaults(handler=_run_demo)

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    arguments = parser.parse_args(argv)
    handler = getattr(arguments, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return handler(arguments)


if __name__ == "__main__":
    raise SystemExit(main())
