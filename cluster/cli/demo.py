"""`opgraph demo`: the main job on the embedded default — the bundled support-triage workflow.

Owns the demo's defaults: the bundled five-node workflow with a conditional fork, run
through `opgraph flow run` on local Ray, the SQLite store and the built-in `sim/`
provider (or a real provider when `--model`/`OPGRAPH_DEFAULT_MODEL` names one).
`--kernel` drives the pure state machine alone, without Ray.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["DEMO_INPUTS", "main"]

DEMO_INPUTS = [
    "ticket=Checkout fails with error 502 for every customer paying by card since 09:00 UTC.",
    "priority=high",
]


def main(kernel_only: bool = False, arguments: argparse.Namespace | None = None) -> int:
    if kernel_only:
        from opgraph.kernel.example import main as kernel_main

        return kernel_main()
    import ray

    from .flow import add_run_arguments, example_workflow_path, run_flow

    if arguments is None:
        parser = argparse.ArgumentParser()
        add_run_arguments(parser)
        arguments = parser.parse_args([])
    if not arguments.input:
        arguments.input = list(DEMO_INPUTS)
    path = example_workflow_path()
    print(f"opgraph demo: the same as `opgraph flow run {path}` with "
          + " ".join(f"--input {value.split('=')[0]}=..." for value in arguments.input), file=sys.stderr)
    try:
        return run_flow(arguments, str(path))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
