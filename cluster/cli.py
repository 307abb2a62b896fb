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
