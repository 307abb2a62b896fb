"""`opgraph o flow` and `opgraph play`: the planned reactive flow and play lanes from a terminal or CI.

Owns the arguments of both commands (a playbook's args become flags of ``play``), the run id
printed as soon as the run exists, the live progress display, the result printed (or its
JSON), ``play list`` and ``play check``, and the exit codes. Lanes are reached through the
registry only: nothing here plans, resolves a playbook or runs a graph itself.

Exit codes: 0 completed; 1 the run failed or was cancelled, the planner gave no usable plan,
or a resume was refused (nothing ran); 2 bad arguments, spec or playbook, unknown playbook
or store (nothing ran); 3 the runtime (Ray) could not be started or reached; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opgraph.kernel import OpGraphError

from ..connection import EXIT_RUNTIME, RuntimeStartError
from ..lanes import (
    PLANNED_REACTIVE_FLOW,
    REACTIVE_PLAY,
    LaneCapabilityError,
    RunHooks,
    describe_capabilities,
    lane_adapter,
    lane_entry,
    open_store,
)
from ..store import WorkflowStoreError
from .flow import ProgressDisplay, positive_int

__all__ = ["EXIT_CODES", "add_orchestrate_parser", "add_play_parser", "main_flow", "main_play", "run_planned"]

EXIT_FAILED, EXIT_INVALID, EXIT_CANCELLED = 1, 2, 130
EXIT_CODES = ("exit status: 0 completed; 1 the run failed or was cancelled, no usable plan, or a resume refused "
              "(nothing ran); 2 bad arguments, spec or playbook, unknown playbook or store (nothing ran); "
              f"{EXIT_RUNTIME} the runtime (Ray) could not be started or reached; 130 Ctrl-C")


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _roles(text: str) -> dict[str, str]:
    """``--roles researcher,writer=drafts the text``: a role's duty after ``=`` (default: its name)."""
    roles = {}
    for part in (item.strip() for item in text.split(",")):
        if part:
            name, _, duty = part.partition("=")
            roles[name.strip()] = duty.strip() or f"works as the {name.strip()}"
    if not roles:
        raise argparse.ArgumentTypeError("--roles takes NAME[=DUTY],...")
    return roles


def add_flow_options(parser: argparse.ArgumentParser, *, play: bool = False) -> None:
    parser.add_argument("--reactive", default=None, metavar="all|off|ROLE,ROLE",
                        help="which ops may spawn follow-ups: all (default), off (fixed topology, still this lane), "
                             "or the roles listed")
    parser.add_argument("--max-ops", type=_nonnegative, default=None, metavar="N",
                        help="ops in all, spawned included: spawns are capped at N minus the planned ops "
                             "(0, the default: no shared ceiling, at most 20 spawns)")
    parser.add_argument("--max-concurrent", type=positive_int, default=None, metavar="N",
                        help="operations in flight at once (5, or the playbook's workers)")
    parser.add_argument("--model", default=None, help="provider/model of the planner and every op (default: "
                                                      "--default-model)")
    parser.add_argument("--default-model", default=None,
                        help="provider/model for what names none (default: OPGRAPH_DEFAULT_MODEL or sim/default)")
    parser.add_argument("--no-synthesis", action="store_true", help="skip the exempt synthesis after the run")
    parser.add_argument("--store", default=None,
                        help="SQLite store path (default: OPGRAPH_DB, $OPGRAPH_HOME/opgraph.db or "
                             "~/.opgraph/opgraph.db)")
    parser.add_argument("--address", default=None,
                        help="Ray address (default: an embedded local Ray); `opgraph run pause|message|cancel RUN_ID` "
                             "reach a run on a cluster")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    parser.add_argument("--resume", default=None, metavar="RUN_ID",
                        help="replay a recorded run (or a unique id prefix) from its checkpoint, with no planner call")
    parser.add_argument("--retry-failed", action="store_true", help="with --resume: run failed ops again, "
                                                                     "dropping the children they spawned")
    parser.add_argument("--allow-degraded-context", action="store_true",
                        help="with --resume: go on when a role's conversation history is missing (recorded)")


def _refused(prefix: str, exc: BaseException) -> int:
    if isinstance(exc, RuntimeStartError):
        print(f"{prefix}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    message = getattr(exc, "message", None) or str(exc)
    print(f"{prefix}: {message}", file=sys.stderr)
    return EXIT_INVALID


def _print_result(result: Any, arguments: argparse.Namespace, prepared: Any) -> None:
    payload = result.to_dict()
    envelope = result.envelope or {}
    extra = {"spawned_operations": envelope.get("spawned_operations", 0),
             "dropped_spawns": envelope.get("dropped_spawns", []),
             "resumed_from": (prepared.recovery.get("resumed_from") or {}).get("run_id"),
             "degraded_context": prepared.recovery.get("degraded_context", [])}
    if arguments.json:
        print(json.dumps({**payload, **extra}, indent=2, default=str))
        return
    print(f"run {result.run_id} {result.status} in {result.elapsed:.2f} s ({result.lane}, {result.source}); "
          f"{len(result.statuses)} ops, {extra['spawned_operations']} spawned, "
          f"{len(extra['dropped_spawns'])} spawns dropped")
    if extra["resumed_from"]:
        print(f"  resumed from {extra['resumed_from']}"
              + (f"; degraded context for {', '.join(extra['degraded_context'])}" if extra["degraded_context"] else ""))
    for label, output in result.outputs.items():
        text = output.get("text") if isinstance(output, Mapping) else output
        print(f"  {label}: {str(text)[:300]}")
    for label, error in result.errors.items():
        print(f"  {label} FAILED: {json.dumps(error, default=str)[:300]}")


async def _run(arguments: argparse.Namespace, kind: str, make_invocation: Callable[[Any], Any], prefix: str,
               providers: Mapping[str, Any] | None) -> int:
    from ..connection import open_session

    store = open_store(arguments.store)
    try:
        lane = lane_adapter(kind, store)
        try:
            invocation = make_invocation(lane)  # options, spec, playbook and a resume's run checked before Ray
        except (ValueError, OpGraphError) as exc:
            code = _refused(prefix, exc)
            # A resume refused (unknown, live, completed, already replayed, another lane's run): nothing ran.
            return EXIT_FAILED if getattr(arguments, "resume", None) and isinstance(exc, OpGraphError) else code
        session = open_session(arguments.address, default_model=arguments.default_model)
        for name, provider in (providers or {}).items():
            session.register_provider(name, provider)
        what = "replaying" if invocation.source_kind == "checkpoint" else "planning"
        print(f"{what} {invocation.source_ref[:80]!r} on lane {invocation.lane}", file=sys.stderr)
        try:
            prepared = await lane.prepare(invocation, session=session)
        except LaneCapabilityError as exc:
            print(f"{prefix}: {exc.message}", file=sys.stderr)
            return EXIT_FAILED
        print(f"run_id: {prepared.run_id}", file=sys.stderr, flush=True)
        print(f"{len(prepared.graph.nodes)} ops ({describe_capabilities(prepared.capabilities)})", file=sys.stderr)
        live = None if not arguments.plain else False
        known = set(prepared.labels.values())
        with ProgressDisplay(list(prepared.labels.values()), live=live) as display:

            def shown(label: str, name: str, status: str, elapsed: float) -> None:
                # A spawned op has no label until the run ends: shown as the result names it.
                display(label if label in known else f"spawned:{label[:8]}", name, status, elapsed)

            result = await lane.execute(prepared, session=session, hooks=RunHooks(on_progress=shown))
    finally:
        store.close()
    _print_result(result, arguments, prepared)
    return {"completed": 0, "cancelled": EXIT_CANCELLED}.get(result.status, EXIT_FAILED)


def run_planned(arguments: argparse.Namespace, kind: str, make_invocation: Callable[[Any], Any], prefix: str,
                providers: Mapping[str, Any] | None = None) -> int:
    try:
        return asyncio.run(_run(arguments, kind, make_invocation, prefix, providers))
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return EXIT_CANCELLED
    except (RuntimeStartError, WorkflowStoreError) as exc:
        return _refused(prefix, exc)
    except OpGraphError as exc:  # no usable plan, a refused replay, a failure before the run
        print(f"{prefix}: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED


# -- o flow ---------------------------------------------------------------------------------
def _flow(arguments: argparse.Namespace, providers: Mapping[str, Any] | None = None) -> int:
    words = list(arguments.words)
    if arguments.resume is None and not words and arguments.file is None:
        print("opgraph o flow: give a PROMPT (or -f SPEC, or --resume RUN_ID)", file=sys.stderr)
        return EXIT_INVALID
    model = arguments.model
    if arguments.resume is None and len(words) > 1 and "/" in words[0] and " " not in words[0] and model is None:
        model, words = words[0], words[1:]  # `o flow [MODEL] PROMPT`

    def invocation(lane: Any) -> Any:
        if arguments.resume is not None:
            return lane.invocation(arguments.resume, resume=True, retry_failed=arguments.retry_failed,
                                   allow_degraded_context=arguments.allow_degraded_context,
                                   max_concurrent=arguments.max_concurrent)
        return lane.invocation(" ".join(words), model=model, reactive=arguments.reactive or "",
                               max_ops=arguments.max_ops or 0, roles=arguments.roles,
                               max_assignments=arguments.max_assignments, synthesis=not arguments.no_synthesis,
                               max_concurrent=arguments.max_concurrent or 5, spec=arguments.file)

    return run_planned(arguments, PLANNED_REACTIVE_FLOW, invocation, "opgraph o flow", providers)


def add_orchestrate_parser(subcommands: Any) -> None:
    orchestrate = subcommands.add_parser("o", help="orchestrate: the planned reactive flow lane (o flow)")
    orchestrate.set_defaults(handler=lambda _: (orchestrate.print_help(), 2)[1])
    actions = orchestrate.add_subparsers(dest="o_command", metavar="ACTION")
    flow = actions.add_parser(
        "flow", help="plan a task with the planner and run the plan as a DAG that may grow",
        description="Plan PROMPT into assignments for the roster's roles, validate the plan and run it as an "
                    "operation DAG on the embedded runtime (or --address), with live progress. Ops may spawn "
                    "follow-ups as --reactive and --max-ops allow. --resume RUN_ID replays a recorded run with no "
                    "planner call.",
        epilog=f"E{EXIT_CODES[1:]}. Lane {PLANNED_REACTIVE_FLOW} capabilities: "
               f"{describe_capabilities(lane_entry(PLANNED_REACTIVE_FLOW).capabilities)} (reactive growth: no with "
               "--reactive off; checkpoint resume: no for a run not logged).")
    flow.add_argument("words", nargs="*", metavar="[MODEL] PROMPT", help="the task (a provider/model first word "
                                                                          "picks the model)")
    flow.add_argument("-f", "--file", default=None, metavar="SPEC", help="a YAML or JSON flow spec (prompt, roles, "
                                                                         "model, max_ops, reactive, ...)")
    flow.add_argument("--roles", type=_roles, default=None, metavar="NAME[=DUTY],...",
                      help="the roster (default: researcher, analyst, writer, critic)")
    flow.add_argument("--max-assignments", type=positive_int, default=None, metavar="N",
                      help="the cap on planned assignments (default: --max-ops, else 12); a plan over it fails")
    add_flow_options(flow)
    flow.set_defaults(handler=_flow)


def main_flow(argv: Sequence[str], providers: Mapping[str, Any] | None = None) -> int:
    """``opgraph o flow ARGV`` in this process, with extra model ``providers`` registered (tests, benches)."""
    parser = argparse.ArgumentParser(prog="opgraph o flow")
    parser.add_argument("words", nargs="*")
    parser.add_argument("-f", "--file", default=None)
    parser.add_argument("--roles", type=_roles, default=None)
    parser.add_argument("--max-assignments", type=positive_int, default=None)
    add_flow_options(parser)
    return _flow(parser.parse_args(list(argv)), providers)


# -- play -----------------------------------------------------------------------------------
def _play_parser(playbook: Any | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"opgraph play {playbook.name if playbook else 'NAME'}",
                                     description=(playbook.description if playbook else None),
                                     epilog=f"E{EXIT_CODES[1:]}.")
    parser.add_argument("input", nargs="*", metavar="INPUT", help="the positional text ({input} in the prompt)")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a playbook arg (repeatable)")
    for arg in (playbook.args if playbook else ()):
        default = "" if arg.default is None else f" (default {arg.default!r})"
        parser.add_argument(f"--{arg.name.replace('_', '-')}", dest=f"playbook_arg_{arg.name}", default=None,
                            metavar=arg.type.upper(), help=f"{arg.help or arg.name}: {arg.type}{default}")
    add_flow_options(parser, play=True)
    return parser


def _play(arguments: argparse.Namespace, providers: Mapping[str, Any] | None = None) -> int:
    rest = list(arguments.rest)
    if arguments.name == "list":
        return _play_list(rest)
    if arguments.name == "check":
        return _play_check(rest)
    return _play_run(arguments.name, rest, providers)


def _resolve(name: str) -> Any:
    # The playbook format is the play lane's; reached through its registry entry's module.
    from importlib import import_module

    return import_module(type(lane_adapter(REACTIVE_PLAY)).__module__.rsplit(".", 1)[0])


def _play_run(name: str, rest: list[str], providers: Mapping[str, Any] | None) -> int:
    play = _resolve(name)
    playbook = None
    try:
        playbook = play.resolve_playbook(name)
    except OpGraphError as exc:
        if "--resume" not in rest:
            return _refused("opgraph play", exc)
    arguments = _play_parser(playbook).parse_args(rest)
    values: dict[str, Any] = {}
    for pair in arguments.arg:
        key, separator, value = pair.partition("=")
        if not separator:
            print(f"opgraph play: --arg expects NAME=VALUE, got {pair!r}", file=sys.stderr)
            return EXIT_INVALID
        values[key.strip()] = value
    for arg in (playbook.args if playbook else ()):
        given = getattr(arguments, f"playbook_arg_{arg.name}")
        if given is not None:
            values[arg.name] = given

    def invocation(lane: Any) -> Any:
        if arguments.resume is not None:
            return lane.invocation(arguments.resume, resume=True, retry_failed=arguments.retry_failed,
                                   allow_degraded_context=arguments.allow_degraded_context,
                                   max_concurrent=arguments.max_concurrent)
        return lane.invocation(name, text=" ".join(arguments.input), args=values, model=arguments.model,
                               reactive=arguments.reactive, max_ops=arguments.max_ops,
                               max_concurrent=arguments.max_concurrent)

    return run_planned(arguments, REACTIVE_PLAY, invocation, "opgraph play", providers)


def _play_list(rest: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="opgraph play list")
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args(rest)
    play = _resolve("list")
    rows = []
    for item in play.list_playbooks():
        if isinstance(item, OpGraphError):
            rows.append({"name": None, "path": item.path, "error": item.message})
        else:
            rows.append({"name": item.name, "path": str(item.path), "description": item.description,
                         "content_hash": item.content_hash,
                         "args": {arg.name: {"type": arg.type, "default": arg.default, "help": arg.help}
                                  for arg in item.args}})
    if arguments.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    for row in rows:
        if row["name"] is None:
            print(f"{'(invalid)':<24} {row['path']}: {row['error']}")
        else:
            args = " ".join(f"--{name.replace('_', '-')}" for name in row["args"])
            print(f"{row['name']:<24} {row['description']}  [{args}]  {row['path']}".rstrip())
    return 0


def _play_check(rest: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="opgraph play check",
                                     description="Resolve and validate a playbook without planning.")
    parser.add_argument("name", metavar="NAME")
    parser.add_argument("input", nargs="*", metavar="INPUT")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE")
    arguments = parser.parse_args(rest)
    play = _resolve(arguments.name)
    try:
        playbook = play.resolve_playbook(arguments.name)
        values = playbook.convert(dict(pair.partition("=")[::2] for pair in arguments.arg))
        rendered = playbook.render(" ".join(arguments.input) or "<input>", values)
    except OpGraphError as exc:
        return _refused("opgraph play check", exc)
    print(json.dumps({"name": playbook.name, "path": str(playbook.path), "content_hash": playbook.content_hash,
                      "ok": True, "settings": dict(playbook.settings), "prompt": rendered}, indent=2, default=str))
    return 0


def add_play_parser(subcommands: Any) -> None:
    play = subcommands.add_parser(
        "play", help="run a playbook (NAME.playbook.yaml) as a planned flow; also: play list, play check NAME",
        description="Resolve NAME.playbook.yaml from ./.opgraph/playbooks, each parent's, ~/.opgraph/playbooks, then "
                    "the bundled examples; render its prompt with INPUT and its args (each also a --flag), and run "
                    "it in the play lane. `opgraph play NAME --help` lists a playbook's args.",
        epilog=f"E{EXIT_CODES[1:]}.", add_help=True)
    play.add_argument("name", metavar="NAME|list|check")
    play.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS")
    play.set_defaults(handler=_play)


def main_play(argv: Sequence[str], providers: Mapping[str, Any] | None = None) -> int:
    """``opgraph play ARGV`` in this process, with extra model ``providers`` registered (tests, benches)."""
    argv = list(argv)
    return _play(argparse.Namespace(name=argv[0], rest=argv[1:]), providers)
