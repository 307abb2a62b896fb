"""`opgraph o flow` and `opgraph play`: the planned reactive flow and play lanes from a terminal or CI.

Owns the arguments of both commands (a playbook's args become flags of ``play``), the run id
printed as soon as the run exists, the live progress display, the result printed (or its
JSON), ``play list`` and ``play check``, and the exit codes. Lanes are reached through the
registry only: nothing here plans, resolves a playbook or runs a graph itself (the play lane's
adapter lists, checks and resolves playbooks). Exit codes: ``flow.FLOW_RUN_CODES``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opgraph.kernel import OpGraphError

from ..command_line import JSON, RUN_OPTIONS, ExitCode, add_options, exit_codes_epilog, nonnegative_int, positive_int
from ..connection import RuntimeStartError
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
from .flow import FLOW_RUN_CODES, run_exit_code
from .progress import ProgressDisplay
from .spine import command_group, refused, subcommand

__all__ = ["add_orchestrate_parser", "add_play_parser", "main_flow", "main_play", "run_planned"]


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
    parser.add_argument("--max-ops", type=nonnegative_int, default=None, metavar="N",
                        help="ops in all, spawned included: spawns are capped at N minus the planned ops "
                             "(0, the default: no shared ceiling, at most 20 spawns)")
    parser.add_argument("--max-concurrent", type=positive_int, default=None, metavar="N",
                        help="operations in flight at once (5, or the playbook's workers)")
    parser.add_argument("--model", default=None, help="provider/model of the planner and every op (default: "
                                                      "--default-model)")
    parser.add_argument("--no-synthesis", action="store_true", help="skip the exempt synthesis after the run")
    add_options(parser, *RUN_OPTIONS)
    parser.add_argument("--resume", default=None, metavar="RUN_ID",
                        help="replay a recorded run (or a unique id prefix) from its checkpoint, with no planner call")
    parser.add_argument("--retry-failed", action="store_true", help="with --resume: run failed ops again, "
                                                                     "dropping the children they spawned")
    parser.add_argument("--allow-degraded-context", action="store_true",
                        help="with --resume: go on when a role's conversation history is missing (recorded)")


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
            code = refused(prefix, exc, ExitCode.USAGE)
            # A resume refused (unknown, live, completed, already replayed, another lane's run): nothing ran.
            return ExitCode.FAILED if getattr(arguments, "resume", None) and isinstance(exc, OpGraphError) else code
        session = open_session(arguments.address, default_model=arguments.default_model)
        for name, provider in (providers or {}).items():
            session.register_provider(name, provider)
        what = "replaying" if invocation.source_kind == "checkpoint" else "planning"
        print(f"{what} {invocation.source_ref[:80]!r} on lane {invocation.lane}", file=sys.stderr)
        try:
            prepared = await lane.prepare(invocation, session=session)
        except LaneCapabilityError as exc:
            return refused(prefix, exc)
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
    return run_exit_code(result.status)


def run_planned(arguments: argparse.Namespace, kind: str, make_invocation: Callable[[Any], Any], prefix: str,
                providers: Mapping[str, Any] | None = None) -> int:
    try:
        return asyncio.run(_run(arguments, kind, make_invocation, prefix, providers))
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return ExitCode.CANCELLED
    except (RuntimeStartError, WorkflowStoreError) as exc:
        return refused(prefix, exc)
    except OpGraphError as exc:  # no usable plan, a refused replay, a failure before the run
        return refused(prefix, exc, typed=True)


# -- o flow ---------------------------------------------------------------------------------
def _flow(arguments: argparse.Namespace, providers: Mapping[str, Any] | None = None) -> int:
    words = list(arguments.words)
    if arguments.resume is None and not words and arguments.file is None:
        print("opgraph o flow: give a PROMPT (or -f SPEC, or --resume RUN_ID)", file=sys.stderr)
        return ExitCode.USAGE
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
    actions = command_group(subcommands, "o", "orchestrate: the planned reactive flow lane (o flow)")
    flow = subcommand(
        actions, "flow", "plan a task with the planner and run the plan as a DAG that may grow", codes=FLOW_RUN_CODES,
        description="Plan PROMPT into assignments for the roster's roles, validate the plan and run it as an "
                    "operation DAG on the embedded runtime (or --address), with live progress. Ops may spawn "
                    "follow-ups as --reactive and --max-ops allow. --resume RUN_ID replays a recorded run with no "
                    "planner call.",
        notes=f"Lane {PLANNED_REACTIVE_FLOW} capabilities: "
              f"{describe_capabilities(lane_entry(PLANNED_REACTIVE_FLOW).capabilities)} (reactive growth: no with "
              "--reactive off; checkpoint resume: no for a run not logged).")
    _add_o_flow_arguments(flow)
    flow.set_defaults(handler=_flow)


def _add_o_flow_arguments(flow: argparse.ArgumentParser) -> None:
    flow.add_argument("words", nargs="*", metavar="[MODEL] PROMPT", help="the task (a provider/model first word "
                                                                          "picks the model)")
    flow.add_argument("-f", "--file", default=None, metavar="SPEC", help="a YAML or JSON flow spec (prompt, roles, "
                                                                         "model, max_ops, reactive, ...)")
    flow.add_argument("--roles", type=_roles, default=None, metavar="NAME[=DUTY],...",
                      help="the roster (default: researcher, analyst, writer, critic)")
    flow.add_argument("--max-assignments", type=positive_int, default=None, metavar="N",
                      help="the cap on planned assignments (default: --max-ops, else 12); a plan over it fails")
    add_flow_options(flow)


def main_flow(argv: Sequence[str], providers: Mapping[str, Any] | None = None) -> int:
    """``opgraph o flow ARGV`` in this process, with extra model ``providers`` registered (tests, benches)."""
    parser = argparse.ArgumentParser(prog="opgraph o flow")
    _add_o_flow_arguments(parser)
    return _flow(parser.parse_args(list(argv)), providers)


# -- play -----------------------------------------------------------------------------------
def _play_parser(playbook: Any | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"opgraph play {playbook.name if playbook else 'NAME'}",
                                     description=(playbook.description if playbook else None),
                                     epilog=exit_codes_epilog(*FLOW_RUN_CODES))
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


def _play_run(name: str, rest: list[str], providers: Mapping[str, Any] | None) -> int:
    playbook = None
    try:
        playbook = lane_adapter(REACTIVE_PLAY).playbook(name)  # its args become flags of the command line
    except OpGraphError as exc:
        if "--resume" not in rest:
            return refused("opgraph play", exc, ExitCode.USAGE)
    arguments = _play_parser(playbook).parse_args(rest)
    values: dict[str, Any] = {}
    for pair in arguments.arg:
        key, separator, value = pair.partition("=")
        if not separator:
            print(f"opgraph play: --arg expects NAME=VALUE, got {pair!r}", file=sys.stderr)
            return ExitCode.USAGE
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
    add_options(parser, JSON)
    arguments = parser.parse_args(rest)
    rows = lane_adapter(REACTIVE_PLAY).catalogue()
    if arguments.json:
        print(json.dumps(rows, indent=2, default=str))
        return ExitCode.OK
    for row in rows:
        if row["name"] is None:
            print(f"{'(invalid)':<24} {row['path']}: {row['error']}")
        else:
            args = " ".join(f"--{name.replace('_', '-')}" for name in row["args"])
            print(f"{row['name']:<24} {row['description']}  [{args}]  {row['path']}".rstrip())
    return ExitCode.OK


def _play_check(rest: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="opgraph play check",
                                     description="Resolve and validate a playbook without planning.")
    parser.add_argument("name", metavar="NAME")
    parser.add_argument("input", nargs="*", metavar="INPUT")
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE")
    arguments = parser.parse_args(rest)
    try:
        report = lane_adapter(REACTIVE_PLAY).check(arguments.name, " ".join(arguments.input) or "<input>",
                                                  dict(pair.partition("=")[::2] for pair in arguments.arg))
    except OpGraphError as exc:
        return refused("opgraph play check", exc, ExitCode.USAGE)
    print(json.dumps(report, indent=2, default=str))
    return ExitCode.OK


def add_play_parser(subcommands: Any) -> None:
    play = subcommands.add_parser(
        "play", help="run a playbook (NAME.playbook.yaml) as a planned flow; also: play list, play check NAME",
        description="Resolve NAME.playbook.yaml from ./.opgraph/playbooks, each parent's, ~/.opgraph/playbooks, then "
                    "the bundled examples; render its prompt with INPUT and its args (each also a --flag), and run "
                    "it in the play lane. `opgraph play NAME --help` lists a playbook's args.",
        epilog=exit_codes_epilog(*FLOW_RUN_CODES), add_help=True)
    play.add_argument("name", metavar="NAME|list|check")
    play.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS")
    play.set_defaults(handler=_play)


def main_play(argv: Sequence[str], providers: Mapping[str, Any] | None = None) -> int:
    """``opgraph play ARGV`` in this process, with extra model ``providers`` registered (tests, benches)."""
    argv = list(argv)
    return _play(argparse.Namespace(name=argv[0], rest=argv[1:]), providers)
