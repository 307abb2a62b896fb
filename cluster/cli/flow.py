"""`opgraph flow run` and `opgraph workflows ...`: the fixed workflow lane from a terminal or CI.

Owns argument handling, the live progress display (rich on a terminal, one plain line
per lifecycle signal otherwise), structured error printing and exit codes. It reaches
the lane through the lane registry and the definitions through the run store: it never
imports a lane's internals, nor compiles, stores or runs anything itself.

Its exit codes are ``ExitCode``'s (``opgraph.cluster.command_line``); options are checked
before anything starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ..command_line import JSON, RUN_OPTIONS, STORE, ExitCode, add_options, positive_int
from ..lanes import FIXED_WORKFLOW, RunHooks, describe_capabilities, lane_adapter, lane_entry, open_store, parse_inputs
from .progress import ProgressDisplay
from .spine import command_group, refused, subcommand

__all__ = [
    "FLOW_RUN_CODES", "ProgressDisplay", "add_flow_parser", "add_run_arguments", "add_workflows_parser",
    "example_workflow_path", "parse_inputs", "run_flow",
]

# What running a run can end with: the codes of `opgraph flow run`, `o flow`, `play` and `demo`.
FLOW_RUN_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME, ExitCode.CANCELLED)


def example_workflow_path() -> Path:
    """The bundled support-triage workflow: five nodes with a conditional fork (the fixed lane's example)."""
    return lane_entry(FIXED_WORKFLOW).examples["support-triage"]


def _refused(exc: OpGraphError) -> int:
    """Print why nothing ran (a definition's problem list, or the typed error): a usage error, or
    ``RUNTIME`` for a runtime that could not be started or reached."""
    return refused("error", exc, ExitCode.USAGE)


def run_exit_code(status: str) -> ExitCode:
    """The exit code of a run this command waited on, by the status it ended with."""
    return {"completed": ExitCode.OK, "cancelled": ExitCode.CANCELLED}.get(status, ExitCode.FAILED)


async def _run(arguments: argparse.Namespace, target: str, report: Any = None) -> int:
    from opgraph.actors.providers.local import check_local_models

    from ..connection import open_session

    # A local model that is not installed, or whose file is not GGUF, is refused before Ray starts.
    check_local_models([arguments.model, arguments.default_model])
    store = open_store(arguments.store)
    try:
        lane = lane_adapter(FIXED_WORKFLOW, store)
        invocation = lane.invocation(target, inputs=parse_inputs(arguments.input), base_dir=arguments.base_dir,
                                     model=arguments.model, max_concurrent=arguments.max_concurrent)
        prepared = await lane.prepare(invocation)  # pinned and compiled before Ray starts
        session = open_session(arguments.address, default_model=arguments.default_model)
        content_hash = prepared.invocation.source_content_hash or "no hash"
        print(f"running {prepared.label} ({content_hash[:19]}…) on lane {prepared.provenance.lane}", file=sys.stderr)
        with ProgressDisplay(list(prepared.labels.values()), live=None if not arguments.plain else False) as display:
            result = await lane.execute(prepared, session=session, hooks=RunHooks(on_progress=display))
    finally:
        store.close()
    payload = result.to_dict()
    if report is not None:
        report(result)
    elif arguments.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(f"run {result.run_id} {result.status} in {result.elapsed:.2f} s ({result.source})")
        for node_id, output in result.outputs.items():
            text = output.get("text") if isinstance(output, Mapping) else output
            print(f"  {node_id}: {text}")
        for node_id, error in result.errors.items():
            print(f"  {node_id} FAILED: {json.dumps(error, default=str)}")
    return run_exit_code(result.status)


def run_flow(arguments: argparse.Namespace, target: str | None = None, report: Any = None) -> int:
    """``opgraph flow run``; also the main job (``opgraph demo``) on the bundled example, which
    prints its result with ``report`` (called with the run's result) instead."""
    target = target or arguments.target
    try:
        return asyncio.run(_run(arguments, target, report))
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return ExitCode.CANCELLED
    except OpGraphError as exc:
        return _refused(exc)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", action="append", metavar="KEY=VALUE",
                        help="a run input in the flow context (repeatable; JSON values are parsed)")
    parser.add_argument("--base-dir", default=None, help="containment root for coding-engine cwd")
    parser.add_argument("--model", default=None, help="provider/model for every chat node, e.g. openai/gpt-4.1-mini")
    parser.add_argument("--max-concurrent", type=positive_int, default=5, help="operations in flight at once (5)")
    add_options(parser, *RUN_OPTIONS)


def add_flow_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "flow", "run fixed workflows (ADR-0073)")
    run = subcommand(
        actions, "run", "run a workflow by name[@version] or from a JSON file", codes=FLOW_RUN_CODES,
        description="Compile and run a fixed workflow, pinned to one version and content hash, with live "
                    "progress. Options, the definition and the store are checked before Ray starts.",
        notes=f"Lane {FIXED_WORKFLOW} capabilities: {describe_capabilities(lane_entry(FIXED_WORKFLOW).capabilities)}. "
              "Controls the lane cannot honour are rejected, never queued.",
    )
    run.add_argument("target", metavar="NAME-OR-FILE", help="registry name, name@VERSION, or a .json file")
    add_run_arguments(run)
    run.set_defaults(handler=run_flow)


# -- workflows ---------------------------------------------------------------------------
def _workflows(arguments: argparse.Namespace) -> int:
    try:
        store = open_store(arguments.store)
    except OpGraphError as exc:  # a directory, a file that is no SQLite store, no permission
        return _refused(exc)
    try:
        return _WORKFLOW_ACTIONS[arguments.workflows_command](store, arguments)
    except OpGraphError as exc:
        return _refused(exc)
    finally:
        store.close()


def _add(store: Any, arguments: argparse.Namespace) -> int:
    from ..store import WorkflowNotFoundError, read_definition_file

    spec, _, _ = read_definition_file(arguments.file)  # the store checks it under the lane's rules
    try:
        existing = store.resolve(arguments.name)
    except WorkflowNotFoundError:
        existing = None
    if existing is None:
        added = store.create_workflow(arguments.name, spec, description=arguments.description)
        print(f"added {added.name}@{added.version} {added.content_hash}")
    else:
        added = store.add_version(arguments.name, spec, description=arguments.description)
        verb = "unchanged" if added.version == existing.version else "new version"
        print(f"{verb}: {added.name}@{added.version} {added.content_hash}")
    return ExitCode.OK


def _list(store: Any, arguments: argparse.Namespace) -> int:
    rows = store.list_workflows()
    if arguments.json:
        print(json.dumps([_plain(row) for row in rows], indent=2, default=str))
        return ExitCode.OK
    if not rows:
        print("no workflows; add one with: opgraph workflows add NAME FILE")
    for row in rows:
        print(f"{row.name:<32} v{row.latest_version:<4} {row.content_hash}  {row.description or ''}".rstrip())
    return ExitCode.OK


def _show(store: Any, arguments: argparse.Namespace) -> int:
    from ..store import parse_ref

    pinned = store.resolve(*parse_ref(arguments.name))
    print(json.dumps({"name": pinned.name, "version": pinned.version, "content_hash": pinned.content_hash,
                      "description": pinned.description, "spec": pinned.spec}, indent=2, default=str))
    return ExitCode.OK


def _versions(store: Any, arguments: argparse.Namespace) -> int:
    for row in store.versions(arguments.name):
        print(f"{row.name}@{row.version}  {row.content_hash}  {row.description or ''}".rstrip())
    return ExitCode.OK


def _delete(store: Any, arguments: argparse.Namespace) -> int:
    store.delete_workflow(arguments.name)
    print(f"deleted {arguments.name} (its versions stay for the runs that used them)")
    return ExitCode.OK


def _plain(row: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(row)


_WORKFLOW_ACTIONS = {"add": _add, "list": _list, "show": _show, "versions": _versions, "delete": _delete}


def add_workflows_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "workflows", "the versioned workflow registry (SQLite)")
    specs = {
        "add": "add a workflow from a JSON file, or a new immutable version of an existing one",
        "list": "list workflows with their latest version and content hash",
        "show": "print one version's definition (NAME or NAME@VERSION)",
        "versions": "list a workflow's versions",
        "delete": "delete a workflow name; its versions stay for runs that pinned them",
    }
    for action, help_text in specs.items():
        command = subcommand(actions, action, help_text, codes=(ExitCode.OK, ExitCode.USAGE))
        if action != "list":
            command.add_argument("name", metavar="NAME")
        if action == "add":
            command.add_argument("file", metavar="FILE")
            command.add_argument("--description", default=None)
        if action == "list":
            add_options(command, JSON)
        add_options(command, STORE)
        command.set_defaults(handler=_workflows)
