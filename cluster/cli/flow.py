"""`opgraph flow run` and `opgraph workflows ...`: the fixed workflow lane from a terminal or CI.

Owns argument handling, the live progress display (rich on a terminal, one plain line
per lifecycle signal otherwise), structured error printing and exit codes. It reaches
the lane through the lane registry and the definitions through the run store: it never
imports a lane's internals, nor compiles, stores or runs anything itself.

Exit codes: 0 completed, 1 failed run, 2 bad definition, arguments, store or unknown name
(nothing ran), 3 the runtime (Ray) could not be started or reached (nothing ran), 130
cancelled (Ctrl-C). Options are checked before anything starts.
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

from ..connection import EXIT_RUNTIME, RuntimeStartError
from ..lanes import FIXED_WORKFLOW, RunHooks, describe_capabilities, lane_adapter, lane_entry, open_store, parse_inputs
from ..store import WorkflowDefinitionError

__all__ = [
    "EXIT_CODES", "add_flow_parser", "add_workflows_parser", "example_workflow_path", "parse_inputs",
    "positive_int", "run_flow",
]

EXIT_FAILED, EXIT_INVALID, EXIT_CANCELLED = 1, 2, 130
EXIT_CODES = ("exit status: 0 completed; 1 the run failed; 2 bad definition, arguments, store or unknown "
              f"name (nothing ran); {EXIT_RUNTIME} the runtime (Ray) could not be started or reached "
              "(nothing ran); 130 cancelled")
_FINAL = {"completed": "done", "failed": "failed", "skipped": "skipped"}


def example_workflow_path() -> Path:
    """The bundled support-triage workflow: five nodes with a conditional fork (the fixed lane's example)."""
    return lane_entry(FIXED_WORKFLOW).examples["support-triage"]


def positive_int(text: str) -> int:
    """An argparse type: a whole number above 0 (argparse exits 2 before anything starts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _refused(exc: OpGraphError) -> int:
    """Print why nothing ran (a definition's problem list, or the typed error); exit 2 (3 for
    a runtime that could not be started or reached)."""
    if isinstance(exc, RuntimeStartError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    if isinstance(exc, WorkflowDefinitionError):
        kind = "compile" if type(exc).__name__ == "WorkflowCompileError" else "validation"
        print(f"error: the workflow definition failed {kind} ({len(exc.errors)} problem(s)):", file=sys.stderr)
        print(json.dumps({"errors": exc.errors}, indent=2), file=sys.stderr)
    else:
        print(f"error: {exc}", file=sys.stderr)
    return EXIT_INVALID


class ProgressDisplay:
    """Counts of queued/running/done nodes and each node's last state.

    On a terminal it is a rich live table; elsewhere (CI, job logs, pipes) each signal is
    one plain line, so logs stay greppable.
    """

    def __init__(self, node_ids: list[str], *, console: Any = None, live: bool | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.states: dict[str, tuple[str, float]] = {node_id: ("waiting", 0.0) for node_id in node_ids}
        self.live_enabled = self.console.is_terminal if live is None else live
        self._live = None

    def __enter__(self) -> ProgressDisplay:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self._render(), console=self.console, refresh_per_second=8, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc_info)
            self._live = None

    def counts(self) -> dict[str, int]:
        counts = {"queued": 0, "running": 0, "done": 0, "failed": 0, "skipped": 0}
        for state, _ in self.states.values():
            if state == "queued":
                counts["queued"] += 1
            elif state == "started":
                counts["running"] += 1
            elif state in _FINAL:
                counts[_FINAL[state]] += 1
        return counts

    def __call__(self, node_id: str, name: str, status: str, elapsed: float) -> None:
        self.states[node_id] = (status, elapsed)
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(f"{elapsed:8.2f}s  {status:<9} {node_id}", highlight=False)

    def _render(self) -> Any:
        from rich.table import Table

        counts = self.counts()
        total = len(self.states)
        settled = counts["done"] + counts["failed"] + counts["skipped"]
        table = Table(title=f"{settled}/{total} settled · queued {counts['queued']} · running "
                            f"{counts['running']} · failed {counts['failed']} · skipped {counts['skipped']}",
                      title_justify="left")
        table.add_column("node")
        table.add_column("state")
        table.add_column("elapsed", justify="right")
        styles = {"completed": "green", "failed": "red", "skipped": "dim", "started": "yellow"}
        for node_id, (state, elapsed) in self.states.items():
            table.add_row(node_id, f"[{styles.get(state, '')}]{state}[/]" if state in styles else state,
                          f"{elapsed:.2f}s" if state != "waiting" else "")
        return table


async def _run(arguments: argparse.Namespace, target: str) -> int:
    from ..connection import open_session

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
    if arguments.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(f"run {result.run_id} {result.status} in {result.elapsed:.2f} s ({result.source})")
        for node_id, output in result.outputs.items():
            text = output.get("text") if isinstance(output, Mapping) else output
            print(f"  {node_id}: {text}")
        for node_id, error in result.errors.items():
            print(f"  {node_id} FAILED: {json.dumps(error, default=str)}")
    return {"completed": 0, "cancelled": EXIT_CANCELLED}.get(result.status, EXIT_FAILED)


def run_flow(arguments: argparse.Namespace, target: str | None = None) -> int:
    """``opgraph flow run``; also the main job (``opgraph demo``) on the bundled example."""
    target = target or arguments.target
    try:
        return asyncio.run(_run(arguments, target))
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return EXIT_CANCELLED
    except OpGraphError as exc:
        return _refused(exc)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", action="append", metavar="KEY=VALUE",
                        help="a run input in the flow context (repeatable; JSON values are parsed)")
    parser.add_argument("--base-dir", default=None, help="containment root for coding-engine cwd")
    parser.add_argument("--model", default=None, help="provider/model for every chat node, e.g. openai/gpt-4.1-mini")
    parser.add_argument("--default-model", default=None,
                        help="provider/model for chat nodes that name none (default: OPGRAPH_DEFAULT_MODEL or "
                             "sim/default, the built-in simulated provider)")
    parser.add_argument("--max-concurrent", type=positive_int, default=5, help="operations in flight at once (5)")
    parser.add_argument("--store", default=None,
                        help="store: a SQLite path or a postgresql:// URL (default: OPGRAPH_DB, "
                             "$OPGRAPH_HOME/opgraph.db or ~/.opgraph/opgraph.db)")
    parser.add_argument("--address", default=None,
                        help="Ray address host:port, auto or ray://host:port (default: an embedded local Ray); "
                             "a cluster with token authentication needs RAY_AUTH_MODE=token")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")


def add_flow_parser(subcommands: Any) -> None:
    flow = subcommands.add_parser("flow", help="run fixed workflows (ADR-0073)")
    flow.set_defaults(handler=lambda _: (flow.print_help(), 2)[1])
    actions = flow.add_subparsers(dest="flow_command", metavar="ACTION")
    run = actions.add_parser(
        "run", help="run a workflow by name[@version] or from a JSON file",
        description="Compile and run a fixed workflow, pinned to one version and content hash, with live "
                    "progress. Options, the definition and the store are checked before Ray starts.",
        epilog=f"E{EXIT_CODES[1:]}. Lane {FIXED_WORKFLOW} capabilities: "
               f"{describe_capabilities(lane_entry(FIXED_WORKFLOW).capabilities)}. "
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
    return 0


def _list(store: Any, arguments: argparse.Namespace) -> int:
    rows = store.list_workflows()
    if arguments.json:
        print(json.dumps([_plain(row) for row in rows], indent=2, default=str))
        return 0
    if not rows:
        print("no workflows; add one with: opgraph workflows add NAME FILE")
    for row in rows:
        print(f"{row.name:<32} v{row.latest_version:<4} {row.content_hash}  {row.description or ''}".rstrip())
    return 0


def _show(store: Any, arguments: argparse.Namespace) -> int:
    from ..store import parse_ref

    pinned = store.resolve(*parse_ref(arguments.name))
    print(json.dumps({"name": pinned.name, "version": pinned.version, "content_hash": pinned.content_hash,
                      "description": pinned.description, "spec": pinned.spec}, indent=2, default=str))
    return 0


def _versions(store: Any, arguments: argparse.Namespace) -> int:
    for row in store.versions(arguments.name):
        print(f"{row.name}@{row.version}  {row.content_hash}  {row.description or ''}".rstrip())
    return 0


def _delete(store: Any, arguments: argparse.Namespace) -> int:
    store.delete_workflow(arguments.name)
    print(f"deleted {arguments.name} (its versions stay for the runs that used them)")
    return 0


def _plain(row: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(row)


_WORKFLOW_ACTIONS = {"add": _add, "list": _list, "show": _show, "versions": _versions, "delete": _delete}


def add_workflows_parser(subcommands: Any) -> None:
    workflows = subcommands.add_parser("workflows", help="the versioned workflow registry (SQLite)")
    workflows.set_defaults(handler=lambda _: (workflows.print_help(), 2)[1])
    actions = workflows.add_subparsers(dest="workflows_command", metavar="ACTION")
    specs = {
        "add": "add a workflow from a JSON file, or a new immutable version of an existing one",
        "list": "list workflows with their latest version and content hash",
        "show": "print one version's definition (NAME or NAME@VERSION)",
        "versions": "list a workflow's versions",
        "delete": "delete a workflow name; its versions stay for runs that pinned them",
    }
    for action, help_text in specs.items():
        command = actions.add_parser(action, help=help_text)
        if action != "list":
            command.add_argument("name", metavar="NAME")
        if action == "add":
            command.add_argument("file", metavar="FILE")
            command.add_argument("--description", default=None)
        if action == "list":
            command.add_argument("--json", action="store_true")
        command.add_argument("--store", default=None, help="store: a SQLite path or a postgresql:// URL "
                        "(default: OPGRAPH_DB or ~/.opgraph)")
        command.set_defaults(handler=_workflows)
