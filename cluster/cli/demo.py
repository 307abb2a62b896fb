"""`opgraph demo`: the main job on the embedded default — the bundled support-triage workflow.

Owns the demo's defaults: the bundled five-node workflow with a conditional fork, run
through `opgraph flow run` on local Ray and the SQLite store, answered by the local model
(`local/smollm2`, llama.cpp in the workers) when the `local` extra is installed, else by the
built-in `sim/` provider, which it says in one line (a real provider when
`--model`/`--default-model`/`OPGRAPH_DEFAULT_MODEL` names one). It prints each node's answer,
the category chosen, tokens and time. `--kernel` drives the pure state machine alone, without Ray.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["DEMO_INPUTS", "LOCAL_DEMO_MODEL", "main"]

DEMO_INPUTS = [
    "ticket=Checkout fails with error 502 for every customer paying by card since 09:00 UTC.",
    "priority=high",
]
LOCAL_DEMO_MODEL = "local/smollm2"


def _choose_model(arguments: argparse.Namespace) -> str | None:
    """The local model when nothing else is named and the extra is installed; says which in one line."""
    if arguments.model or arguments.default_model or os.environ.get("OPGRAPH_DEFAULT_MODEL"):
        return None
    from opgraph.actors.models import ProviderConfigError
    from opgraph.actors.providers.local import INSTALL_HINT, PACKAGED_MODELS, check_local_models

    try:
        check_local_models([LOCAL_DEMO_MODEL])
    except ProviderConfigError:
        print(f"opgraph demo: answering on the simulator (sim/), not a model; for a real one on this CPU: "
              f"{INSTALL_HINT}", file=sys.stderr)
        return None
    about = PACKAGED_MODELS[LOCAL_DEMO_MODEL.split("/", 1)[1]].about
    print(f"opgraph demo: answering with {LOCAL_DEMO_MODEL} ({about}), llama.cpp in the workers", file=sys.stderr)
    return LOCAL_DEMO_MODEL


def _reporter(started: float, chosen: str | None) -> Any:
    def report(result: Any) -> None:
        wall = time.perf_counter() - started
        print(f"run {result.run_id} {result.status} in {result.elapsed:.2f} s ({result.source}); "
              f"{wall:.1f} s with the runtime's start")
        prompt = completion = calls = 0
        models = set()
        for node_id, output in result.outputs.items():
            if not isinstance(output, Mapping):
                print(f"  {node_id}: {output}")
                continue
            usage = output.get("usage") or {}
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
            calls += usage.get("calls", 0)
            models.add(output.get("model") or "?")
            data = output.get("data")
            answer = (" ".join(f"{key}={value}" for key, value in data.items()) if isinstance(data, Mapping)
                      else " ".join(str(output.get("text") or "").split()))
            cut = " [cut at max_tokens]" if output.get("finish_reason") == "length" else ""
            print(f"  {node_id}: {answer}{cut}  ({usage.get('prompt_tokens', 0)}+"
                  f"{usage.get('completion_tokens', 0)} tokens)")
        for node_id, error in result.errors.items():
            print(f"  {node_id} FAILED: {error}")
        named = ", ".join(sorted(models)) or chosen or "?"
        print(f"model {named}: {calls} calls, {prompt} prompt + {completion} completion tokens, "
              f"{completion / result.elapsed if result.elapsed else 0:.0f} completion tokens/s over the run")

    return report


def main(kernel_only: bool = False, arguments: argparse.Namespace | None = None) -> int:
    if kernel_only:
        from opgraph.kernel.example import main as kernel_main

        return kernel_main()
    started = time.perf_counter()
    import ray

    from .flow import add_run_arguments, example_workflow_path, run_flow

    if arguments is None:
        parser = argparse.ArgumentParser()
        add_run_arguments(parser)
        arguments = parser.parse_args([])
    if not arguments.input:
        arguments.input = list(DEMO_INPUTS)
    chosen = _choose_model(arguments)
    if chosen is not None:
        arguments.model = chosen
    path = example_workflow_path()
    print(f"opgraph demo: the same as `opgraph flow run {path}` with "
          + " ".join(f"--input {value.split('=')[0]}=..." for value in arguments.input)
          + (f" --model {chosen}" if chosen else ""), file=sys.stderr)
    try:
        return run_flow(arguments, str(path), report=None if arguments.json else _reporter(started, chosen))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
