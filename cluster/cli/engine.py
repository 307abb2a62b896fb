"""`opgraph engine run KIND ...` and `opgraph run show RUN_ID`: engines from a terminal or CI.

Owns argument handling, reading a review target, the live progress display (rich on a
terminal, one plain line per event elsewhere), printing a recorded run, and exit codes.
It must not implement engine semantics: opgraph.engines does. Exit codes: ``ENGINE_CODES``
(a degraded run is ``ExitCode.DEGRADED``, its partial result printed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ..budget_options import add_budget_options
from ..command_line import JSON, PLAIN, RAY_ADDRESS, STORE, ExitCode, add_options
from ..connection import RuntimeStartError
from .coding import add_coding_arguments, coding_inputs, coding_settings, finish_coding
from .progress import LiveDisplay
from .spine import command_group, refused, subcommand

__all__ = [
    "ENGINE_CODES", "EngineProgress", "add_engine_parser", "add_run_show_parser", "read_review_target", "run_engine",
    "show_run",
]

ENGINE_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME, ExitCode.DEGRADED, ExitCode.UNMET,
                ExitCode.CANCELLED)
MAX_REVIEW_CHARS = 200_000


def read_review_target(path: str, max_chars: int = MAX_REVIEW_CHARS) -> str:
    """The text to review: one file, or every non-hidden UTF-8 file under a folder, each with its name."""
    from opgraph.engines import EngineInputError

    target = Path(path).expanduser()
    if not target.exists():
        raise EngineInputError(f"the review path {path!r} does not exist")
    if target.is_file():
        files = [target]
    else:
        files = sorted(f for f in target.rglob("*")
                       if f.is_file() and not any(part.startswith(".") for part in f.relative_to(target).parts))
    chunks, total = [], 0
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not reviewable text
        name = file.name if target.is_file() else str(file.relative_to(target))
        chunk = f"--- {name} ---\n{text}"
        total += len(chunk)
        if total > max_chars:
            raise EngineInputError(f"the review path {path!r} holds more than {max_chars} characters of text; "
                                   "review a smaller file or folder")
        chunks.append(chunk)
    if not chunks or not any(chunk.split("\n", 1)[1].strip() for chunk in chunks):
        raise EngineInputError(f"the review path {path!r} holds no text to review")
    return "\n\n".join(chunks)


def _short(data: dict[str, Any], limit: int = 160) -> str:
    text = json.dumps({k: v for k, v in data.items() if k not in ("type", "agent")}, default=str,
                      separators=(",", ":"))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def agents_line(budget: dict[str, Any]) -> str:
    """``agents 8/8 + synthesizer``: the agents the bound counts, then the exempt (terminal) ones.

    Exempt agents run after the bound is spent, so ``agents_made`` may exceed ``max_agents``;
    they are named beside it rather than shown as an overrun. A budget recorded before
    ``exempt_agents`` existed shows ``agents_made`` as it was.
    """
    exempt = list(budget.get("exempt_agents") or [])
    bounded = (budget.get("agents_made") or 0) - len(exempt)
    line = f"agents {bounded}/{budget.get('max_agents')}"
    return line + (f" + {', '.join(exempt)}" if exempt else "")


class EngineProgress(LiveDisplay):
    """Live progress of one engine run: agents, events, budget left, the latest events.

    On a terminal it is a rich live panel; elsewhere each event is one plain line.
    """

    def __init__(self, *, console: Any = None, live: bool | None = None) -> None:
        super().__init__(console=console, live=live)
        self.run: Any = None
        self.count = 0
        self.latest: deque[str] = deque(maxlen=8)
        self.started = time.monotonic()

    def attach(self, run: Any) -> EngineProgress:
        self.run = run
        return self

    def budget_line(self) -> str:
        if self.run is None:
            return ""
        budget = self.run.budget.snapshot()
        tokens = f"{budget['tokens_used']}" + (f"/{budget['max_tokens']}" if budget["max_tokens"] else "")
        line = f"{agents_line(budget)} · tokens {tokens}"
        if budget["max_cost_usd"]:
            line += f" · cost ${budget['cost_usd']:.4f}/${budget['max_cost_usd']}"
        if budget["seconds_left"] is not None:
            line += f" · {budget['seconds_left']:.1f} s left"
        return line

    def __call__(self, event: dict[str, Any]) -> None:
        self.count += 1
        elapsed = time.monotonic() - self.started
        line = f"{elapsed:8.2f}s  {event.get('type', ''):<18} {event.get('agent') or '-':<22} {_short(event)}"
        self.latest.append(line)
        if self.showing_live:
            self.refresh()
        elif event.get("type") in ("agent_created", "budget_exhausted", "run_finished"):
            self.console.print(f"{line}  [{self.budget_line()}]", highlight=False, markup=False, soft_wrap=True)
        else:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        title = Text(f"events {self.count} · {self.budget_line()} · {time.monotonic() - self.started:.1f} s",
                     style="bold")
        return Group(title, *(Text(line) for line in self.latest))


def _settings(arguments: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {"max_agents": arguments.max_agents, "deadline_s": arguments.deadline,
                                "max_tokens": arguments.max_tokens, "max_cost_usd": arguments.max_cost_usd,
                                "max_concurrent": arguments.max_concurrent}
    if arguments.model:
        settings["model"] = arguments.model
    if arguments.price:
        settings["prices"] = dict(arguments.price)
    if arguments.kind == "review" and arguments.dimensions:
        settings["dimensions"] = tuple(d.strip() for d in arguments.dimensions.split(",") if d.strip())
    if arguments.kind == "coding":
        settings.update(coding_settings(arguments))
    if arguments.max_depth is not None:
        settings["max_depth"] = arguments.max_depth
    for flag, name, kind in (("--novelty-threshold", "novelty_threshold", "research"),
                             ("--max-questions", "max_questions", "hypothesis")):
        value = getattr(arguments, name)
        if value is None:
            continue
        if arguments.kind != kind:
            from opgraph.engines import EngineInputError

            raise EngineInputError(f"{flag} applies to {kind} runs only")
        settings[name] = value
    return settings


def _subject(engine: Any, target: list[str]) -> Any:
    """What the engine runs on: a review's files, a hypothesis run's seeds, else the words as one text."""
    from opgraph.engines import EngineInputError

    if engine.kind == "review":
        if len(target) != 1:
            raise EngineInputError(f"review takes one file or folder, got {len(target)} paths")
        return read_review_target(target[0])
    if engine.kind == "hypothesis":
        return list(target)
    return " ".join(target)


def _payload(result: Any, run: Any) -> dict[str, Any]:
    degraded = bool(getattr(result, "degraded", False))
    return {"run_id": run.run_id, "engine": run.engine.kind, "status": "degraded" if degraded else "completed",
            "degraded": degraded, "degrade_reason": getattr(result, "degrade_reason", ""),
            "skipped": list(getattr(result, "skipped", [])), "statistics": run.statistics(), "text": str(result)}


async def _execute(arguments: argparse.Namespace, engine: Any, subject: str,
                   inputs: dict[str, Any] | None = None) -> int:
    from opgraph.actors.providers import SimulatedProvider

    from ..connection import open_session
    from ..store import EngineRunStore

    store = EngineRunStore(arguments.store)
    session = None
    try:
        # The CLI's own Session (the address probed, the environment's providers registered, as
        # for every command): the engine uses it as it is, and this run closes it below.
        session = open_session(arguments.address)
        if arguments.sim_items is not None or arguments.sim_malformed_rate is not None:
            session.register_provider("sim", SimulatedProvider(
                list_items=1 if arguments.sim_items is None else arguments.sim_items,
                malformed_rate=arguments.sim_malformed_rate or 0.0, seed=arguments.sim_seed))
        progress = EngineProgress(live=False if arguments.plain else None)
        run = engine.new_run(session=session, on_event=progress, event_sink=store)
        progress.attach(run)
        print(f"engine run {run.run_id} ({engine.kind}); inspect it with: opgraph run show {run.run_id}",
              file=sys.stderr, flush=True)
        try:
            with progress:
                result = await engine.execute(run, subject, **(inputs or {}))
        except OpGraphError as exc:
            print(f"engine run {run.run_id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            if arguments.json:
                print(json.dumps({"run_id": run.run_id, "engine": engine.kind, "status": "failed",
                                  "error": str(exc), "error_type": type(exc).__name__}, indent=2))
            return ExitCode.FAILED
    finally:
        try:
            if session is not None:
                await session.aclose()  # drops the run's agent branches from the stores
        except OpGraphError as exc:  # the run is recorded; say what was left behind, keep its outcome
            print(f"warning: the session could not be closed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            store.close()
    if engine.kind == "coding":
        return finish_coding(arguments, result, run, progress.budget_line())
    payload = _payload(result, run)
    if arguments.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        reason = f" ({payload['degrade_reason']})" if payload["degraded"] else ""
        skipped = f"; missing emissions: {', '.join(payload['skipped'])}" if payload["skipped"] else ""
        print(f"engine run {run.run_id} {payload['status']}{reason} · {progress.budget_line()}{skipped}",
              file=sys.stderr, flush=True)
        print(str(result))
    return ExitCode.DEGRADED if payload["degraded"] else ExitCode.OK


def run_engine(arguments: argparse.Namespace) -> int:
    """``opgraph engine run KIND TARGET``: refuse bad input before anything starts, then run."""
    from opgraph.engines import EngineInputError, engine_for

    try:
        engine = engine_for(arguments.kind, **_settings(arguments))
        subject = _subject(engine, arguments.target)
        inputs = coding_inputs(arguments) if engine.kind == "coding" else {}
        engine.validate(subject, **inputs)
        if arguments.sim_items is not None and arguments.sim_items < 0:
            raise EngineInputError(f"--sim-items must be >= 0, got {arguments.sim_items}")
        if arguments.sim_malformed_rate is not None and not 0.0 <= arguments.sim_malformed_rate <= 1.0:
            raise EngineInputError(f"--sim-malformed-rate must be within [0, 1], got {arguments.sim_malformed_rate}")
    except EngineInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if arguments.json:  # a script reading stdout gets an answer for bad input too
            print(json.dumps({"engine": arguments.kind, "status": "invalid", "error": exc.message,
                              "error_type": type(exc).__name__}, indent=2))
        return ExitCode.USAGE
    try:
        from opgraph.actors.providers.local import check_local_models

        # A local model that is not installed, or whose file is not GGUF, is refused before Ray starts.
        check_local_models([arguments.model, os.environ.get("OPGRAPH_DEFAULT_MODEL")])
        return asyncio.run(_execute(arguments, engine, subject, inputs))
    except KeyboardInterrupt:
        print("cancelled", file=sys.stderr)
        return ExitCode.CANCELLED
    except OpGraphError as exc:  # nothing ran (no runtime), or before the run began (the store, say)
        code = refused("error", exc, typed=not isinstance(exc, RuntimeStartError))
        if arguments.json:  # a script reading stdout gets an answer too
            print(json.dumps({"engine": engine.kind, "status": "not_started" if code == ExitCode.RUNTIME else "failed",
                              "error": exc.message, "error_type": type(exc).__name__}, indent=2))
        return code


def add_engine_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "engine", "run a domain engine (planning, review, research, hypothesis, "
                                                   "coding) on the actor runtime")
    run = subcommand(
        actions, "run",
        "run an engine: `planning PROMPT`, `review PATH`, `research TOPIC`, `hypothesis SEED...` or "
        "`coding TASK --workspace DIR --test-cmd CMD`",
        codes=ENGINE_CODES,
        description="Run a domain engine (ADR-0034) with hard budgets: agents, deadline, tokens, cost. Agent "
                    "turns run on the operation workers; every event is recorded in the store under the printed "
                    "run id (`opgraph run show RUN_ID`). Live progress on a terminal, plain lines elsewhere; the "
                    "result text is printed last.")
    run.add_argument("kind", metavar="KIND", help="planning, review, research, hypothesis or coding")
    run.add_argument("target", metavar="TARGET", nargs="+",
                     help="the planning prompt, the file or folder to review, the research topic (its words are "
                          "joined), the hypothesis run's seed findings (one per argument), or the coding task")
    run.add_argument("--model", default=None,
                     help="provider/model for every agent (default: OPGRAPH_DEFAULT_MODEL or sim/default)")
    run.add_argument("--max-agents", type=int, default=50, help="hard bound on agents made (50)")
    run.add_argument("--deadline", type=float, default=None, help="hard wall-clock bound in seconds (none)")
    add_budget_options(run, tokens_type=int, tokens_help="hard bound on provider tokens (none)",
                       cost_help="hard bound on dollars, priced by --price (sim/ and scripted/ are free)")
    run.add_argument("--max-concurrent", type=int, default=5, help="agent turns in flight at once (5)")
    run.add_argument("--max-depth", type=int, default=None,
                     help="research: deepest node; hypothesis: last question generation (3)")
    run.add_argument("--novelty-threshold", type=float, default=None,
                     help="research only: a finding more novel than this opens a deeper node (0.7)")
    run.add_argument("--max-questions", type=int, default=None,
                     help="hypothesis only: questions of generation 0; generation g gets max(1, N >> g) (8)")
    run.add_argument("--dimensions", default=None,
                     help="review only: comma-separated dimensions (correctness,security,performance,maintainability)")
    run.add_argument("--sim-items", type=int, default=None,
                     help="sim/ provider: items per list in structured replies (1)")
    run.add_argument("--sim-malformed-rate", type=float, default=None,
                     help="sim/ provider: share of structured replies that come back malformed (0)")
    run.add_argument("--sim-seed", type=int, default=None, help="sim/ provider: seed for malformed replies")
    add_options(run, STORE, RAY_ADDRESS, JSON, PLAIN)
    add_coding_arguments(run)
    run.set_defaults(handler=run_engine)
    _add_show(actions, "print a recorded engine run: its events and result (as `opgraph run show`)")


# -- opgraph run show ----------------------------------------------------------------------
def _print_engine_run(record: Any, events: list[dict[str, Any]]) -> None:
    reason = f" ({record.degrade_reason})" if record.degrade_reason else ""
    print(f"engine run {record.run_id}  {record.engine}  {record.status}{reason}")
    stats = record.statistics or {}
    budget = stats.get("budget") or {}
    if budget:
        print(f"{agents_line(budget)} · tokens {budget.get('tokens_used')}"
              f" · cost ${budget.get('cost_usd', 0):.6f} · {budget.get('elapsed_s')} s")
    if record.error:
        print(f"error: {record.error}")
    for event in events:
        offset = event["at"] - record.created_at
        print(f"{event['seq']:>6} {offset:9.3f}s {event['kind'][:5]:<5} {event['type']:<20} "
              f"{event['agent'] or '-':<22} {_short(event['data'], 200)}")
    if record.result:
        print("result:")
        print(record.result)


def show_run(arguments: argparse.Namespace) -> int:
    """``opgraph run show RUN_ID``: an engine run's events, or a workflow run's record and signals."""
    from ..store import EngineRunStore, RunNotFoundError, RunStore, WorkflowStoreError

    try:
        with EngineRunStore(arguments.store) as store:
            if store.has_run(arguments.run_id):
                record = store.get_run(arguments.run_id)
                events = store.events(arguments.run_id, limit=arguments.limit)
                if arguments.json:
                    from dataclasses import asdict

                    print(json.dumps({**asdict(record), "events": events}, indent=2, default=str))
                else:
                    _print_engine_run(record, events)
                return ExitCode.OK
        with RunStore(arguments.store) as workflows:
            run = workflows.get_run(arguments.run_id)
            signals = workflows.run_signals(arguments.run_id)
    except RunNotFoundError:
        print(f"opgraph run show: no engine or workflow run with id {arguments.run_id!r} in the store",
              file=sys.stderr)
        return ExitCode.FAILED
    except WorkflowStoreError as exc:
        return refused("opgraph run show", exc)
    from dataclasses import asdict

    print(json.dumps({**asdict(run), "signals": signals[: arguments.limit] if arguments.limit else signals},
                     indent=2, default=str))
    return ExitCode.OK


def add_run_show_parser(run_commands: Any) -> None:
    _add_show(run_commands, "print a recorded run from the store: an engine run's events, or a workflow run's "
                            "record and signals")


def _add_show(actions: Any, help_text: str) -> None:
    """`show RUN_ID` under `opgraph run` and `opgraph engine`: one command, two doors."""
    show = subcommand(actions, "show", help_text, codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE))
    show.add_argument("run_id", metavar="RUN_ID")
    show.add_argument("--limit", type=int, default=None, metavar="N", help="print at most N events")
    add_options(show, STORE, JSON)
    show.set_defaults(handler=show_run)
