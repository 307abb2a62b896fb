"""`opgraph engine run coding`: the coding engine's flags, its structured result, and ``--apply``.

Owns what only coding needs on the command line: the workspace, test command and bounds
flags, the printed result (verdict, test runs, the patch), applying the patch to the
workspace on ``--apply`` (only when the tests passed), and coding's exit status. The
engine's semantics stay in opgraph.engines.coding.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..command_line import ExitCode

__all__ = ["add_coding_arguments", "coding_inputs", "coding_settings", "finish_coding"]


def add_coding_arguments(run: argparse.ArgumentParser) -> None:
    coding = run.add_argument_group("coding", "for `engine run coding TASK`")
    coding.add_argument("--workspace", default=None, metavar="DIR",
                        help="the folder to change; the run works on a copy of it, on a worker")
    coding.add_argument("--test-cmd", default=None, metavar="CMD",
                        help="the test command (run by /bin/sh in the copy); exit status 0 means the change passes")
    coding.add_argument("--max-fix-rounds", type=int, default=None, help="fix rounds after the first test run (3)")
    coding.add_argument("--test-timeout", type=float, default=None,
                        help="seconds one test run may take before its process group is killed (600)")
    coding.add_argument("--turn-timeout", type=float, default=None, help="seconds one agent turn may take (600)")
    coding.add_argument("--kill-grace", type=float, default=None,
                        help="seconds between SIGTERM and SIGKILL of a timed-out test run's group (5)")
    coding.add_argument("--keep-env", action="append", default=None, metavar="NAME",
                        help="pass this environment variable to the tests (never keys, tokens or credentials)")
    coding.add_argument("--apply", action="store_true",
                        help="write the change into the workspace when the final tests pass (default: only print it)")


def coding_settings(arguments: argparse.Namespace) -> dict[str, Any]:
    """The CodingEngine settings the flags give (unset flags keep the engine's defaults)."""
    flags = {"max_fix_rounds": arguments.max_fix_rounds, "test_timeout_s": arguments.test_timeout,
             "turn_timeout_s": arguments.turn_timeout, "kill_grace_s": arguments.kill_grace}
    return {name: value for name, value in flags.items() if value is not None}


def coding_inputs(arguments: argparse.Namespace) -> dict[str, Any]:
    """The run's keyword inputs besides the task: workspace, test command, kept variables."""
    return {"workspace": arguments.workspace, "test_cmd": arguments.test_cmd,
            "keep_env": tuple(arguments.keep_env or ())}


def coding_payload(result: Any, run: Any) -> dict[str, Any]:
    record = result.model_dump(mode="json")
    for change in record.get("files_changed", []):
        change.pop("content", None)  # the diff says it; the full text stays out of the JSON
    return {"run_id": run.run_id, "engine": "coding", "status": "degraded" if result.degraded else "completed",
            "degraded": result.degraded, "degrade_reason": result.degrade_reason, "skipped": list(result.skipped),
            "statistics": run.statistics(), "result": record}


def finish_coding(arguments: argparse.Namespace, result: Any, run: Any, budget_line: str) -> int:
    """Print the coding result (and apply it on ``--apply``); coding's exit status."""
    from opgraph.engines import WorkspaceConflictError


    payload = coding_payload(result, run)
    applied: list[str] = []
    apply_error = ""
    if arguments.apply:
        if not result.passed:
            apply_error = "not applied: the final tests did not pass"
        else:
            try:
                applied = result.apply()
            except WorkspaceConflictError as exc:
                apply_error = f"not applied: {exc.message}"
    payload["applied"] = applied
    if apply_error:
        payload["apply_error"] = apply_error
    if arguments.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        reason = f" ({result.degrade_reason})" if result.degraded else ""
        print(f"engine run {run.run_id} {payload['status']}{reason} · verdict {result.verdict} · {budget_line}",
              file=sys.stderr, flush=True)
        print(result.report())
        if arguments.apply:
            print(apply_error or f"applied to {result.workspace}: {', '.join(applied) or 'nothing to apply'}",
                  file=sys.stderr)
        elif result.files_changed:
            print("the workspace is unchanged; rerun with --apply to write the change, or apply the patch above "
                  "(`git apply`)", file=sys.stderr)
    if apply_error and result.passed:
        return ExitCode.FAILED
    if result.degraded:
        return ExitCode.DEGRADED
    return ExitCode.OK if result.verdict in ("passed", "unverified") else ExitCode.UNMET
