"""The `opgraph map` command line, shared by the CLI and the job entrypoint: options, progress, summary.

Owns turning arguments into a ``MapSpec`` and ``MapSettings`` (reading ``--schema`` and
``--price``), the progress view (a rich bar on a terminal: rows done, failed and skipped,
rows a second, tokens, cost, time left; a plain line every few seconds elsewhere), the
summary and the exit code (``ExitCode``), and `opgraph map export JOB`. It refuses bad
input before Ray starts, and never runs a row itself: ``MapJob`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from opgraph.kernel import OpGraphError

from ..budget_options import add_budget_options
from ..command_line import JSON, NAMESPACE, PLAIN, RAY_ADDRESS, STORE, ExitCode, add_options, positive_int
from .feeding import MapProgress
from .map import MapJob, MapSettings, MapSpec, MapSummary, dry_run
from .rows import BAD_ROW_POLICIES, MapInputError

__all__ = ["MAP_CODES", "MapProgressView", "add_export_arguments", "add_map_arguments", "run_export", "run_map"]

MAP_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME, ExitCode.DEGRADED, ExitCode.CANCELLED)
PLAIN_EVERY_SECONDS = 2.0


def add_map_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", metavar="INPUT",
                        help="the rows: a JSONL, CSV or Parquet file (by its ending), a path or a URL pyarrow opens")
    parser.add_argument("--prompt", metavar="TEMPLATE", default=None,
                        help='the prompt, with {column} filled from each row ("Classify: {text}"; {{ }} for braces)')
    parser.add_argument("--workflow", metavar="NAME[@VERSION]", default=None,
                        help="instead of a prompt: run this stored fixed workflow per row (its inputs: the row's "
                             "columns)")
    parser.add_argument("--id-column", required=True, metavar="COL",
                        help="the column that keys each row: its idempotency key (unique, never empty)")
    parser.add_argument("--output", metavar="OUTPUT", default=None,
                        help="JSON Lines file that gets one line per finished row (exported from the run store)")
    parser.add_argument("--model", default=None,
                        help="provider/model of every row (default: OPGRAPH_DEFAULT_MODEL, else sim/default)")
    parser.add_argument("--system", default=None, help="a system prompt every row's call starts with")
    parser.add_argument("--schema", metavar="FILE", default=None,
                        help="a JSON Schema file: each answer is parsed and validated (one repair turn, then the "
                             "row fails with the reason)")
    parser.add_argument("--concurrency", type=positive_int, default=64, help="model calls in flight at once (64)")
    parser.add_argument("--window", type=positive_int, default=None,
                        help="rows held in the live run at once (default: 4 x --concurrency, at least 512)")
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="rows one operation carries, their model calls made at once (default: chosen "
                             "from the rows' call times, up to --concurrency/32 and 32, batching only calls "
                             "that take about the same time)")
    add_budget_options(parser, tokens_type=positive_int,
                       tokens_help="token budget of the job (recorded rows counted): no new row once it is spent",
                       cost_help="dollar budget of the job, priced by --price (sim/ and scripted/ are free)")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the input's first N rows")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every row, count them, estimate tokens and cost; call no model")
    parser.add_argument("--on-bad-row", choices=BAD_ROW_POLICIES, default="fail",
                        help="a bad row (not JSON, no id, a repeated id, a missing field) fails the job before "
                             "anything is sent (fail, the default), or is skipped and counted (skip)")
    parser.add_argument("--retry-failed", action="store_true", help="run the rows recorded as failed again")
    parser.add_argument("--new-job", action="store_true",
                        help="the input changed since its job ran: start a new job for the new content")
    add_options(parser, RAY_ADDRESS, NAMESPACE, STORE, JSON, PLAIN)


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_id", metavar="JOB", help="the job's id (or its first characters)")
    parser.add_argument("--output", metavar="OUTPUT", required=True, help="the JSON Lines file to write")
    parser.add_argument("--failed", action=argparse.BooleanOptionalAction, default=True,
                        help="include the rows recorded as failed (default: yes)")
    add_options(parser, STORE)


def _spec_and_settings(arguments: argparse.Namespace) -> tuple[MapSpec, MapSettings]:
    schema = None
    if arguments.schema is not None:
        try:
            with open(arguments.schema, encoding="utf-8") as handle:
                schema = json.load(handle)
        except OSError as exc:
            raise MapInputError(f"cannot read the schema {arguments.schema}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise MapInputError(f"the schema {arguments.schema} is not JSON: {exc.msg} (line {exc.lineno}, column "
                                f"{exc.colno})", line=exc.lineno) from None
    spec = MapSpec(arguments.id_column, arguments.prompt, arguments.system, arguments.model, schema,
                   arguments.workflow)
    settings = MapSettings(concurrency=arguments.concurrency, window=arguments.window, batch=arguments.batch,
                           max_tokens=arguments.max_tokens, max_cost_usd=arguments.max_cost_usd,
                           prices=dict(arguments.price or []), limit=arguments.limit, on_bad_row=arguments.on_bad_row,
                           retry_failed=arguments.retry_failed, new_job=arguments.new_job, output=arguments.output)
    return spec, settings


class MapProgressView:
    """A job's progress: a rich bar on a terminal (``live=None``: when stderr is one), else a plain
    line every few seconds; called with each ``MapProgress`` the job reports."""

    def __init__(self, *, live: bool | None = None) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal if live is None else live
        self._bar: Any = None
        self._task: Any = None
        self._last_line = 0.0

    def __enter__(self) -> MapProgressView:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("map"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[line]}"), TimeRemainingColumn(), console=self.console,
                                 refresh_per_second=4)
            self._bar.__enter__()
            self._task = self._bar.add_task("rows", total=None, line="")
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc_info)
            self._bar = None

    def __call__(self, progress: MapProgress) -> None:
        line = (f"done {progress.done} · failed {progress.failed} · skipped "
                f"{progress.recorded_before + progress.refused} · {progress.rows_per_second:,.0f} rows/s · "
                f"{progress.tokens:,} tokens · ${progress.cost_usd:,.4f}")
        if self._bar is not None:
            total = max(1, progress.total - progress.recorded_before)
            self._bar.update(self._task, total=total, completed=progress.finished, line=line)
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_EVERY_SECONDS:
            self._last_line = now
            left = progress.seconds_left
            print(f"progress: {line} · in flight {progress.in_flight} · "
                  f"{'time left ' + format(left, '.0f') + ' s' if left is not None else ''}".rstrip(" ·"),
                  file=sys.stderr, flush=True)


def _print_summary(summary: MapSummary, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary.as_dict(), sort_keys=True, default=str), flush=True)
        return
    progress = summary.progress
    print(f"job {summary.job_id} {summary.status}: {progress.done} done, {progress.failed} failed, "
          f"{progress.recorded_before} recorded before, {progress.refused} refused, {progress.remaining} remaining; "
          f"{progress.calls} calls, {progress.tokens:,} tokens, ${progress.cost_usd:,.4f} in {progress.elapsed:.1f} s "
          f"({progress.rows_per_second:,.0f} rows/s)", flush=True)
    if summary.model_calls is not None:
        print(f"model calls this run: {summary.model_calls}", flush=True)
    if progress.stopped:
        print(f"stopped: the {progress.stopped} budget is spent; {progress.remaining} rows remain (raise the budget "
              "and run the same command again to finish)", flush=True)
    if summary.status == "incomplete":
        print(f"incomplete: {summary.error}", flush=True)
    if summary.output is not None:
        print(f"output: {summary.output} ({summary.output_lines} rows)", flush=True)
    if summary.run_id is not None:
        print(f"run: {summary.run_id} (opgraph run show {summary.run_id})", flush=True)


def _print_estimate(estimate: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(estimate, sort_keys=True, default=str), flush=True)
        return
    print(f"dry run: {estimate['rows']} rows to run in {estimate['input']} ({estimate['format']}), "
          f"{estimate['refused']} refused; no model was called", flush=True)
    for problem in estimate["problems"]:
        print(f"  refused: {problem}", flush=True)
    if estimate["workflow"] is None:
        cost = "unpriced (give --price)" if estimate["cost_usd"] is None else f"${estimate['cost_usd']:,.4f}"
        print(f"  prompts: {estimate['prompt_chars']:,} characters (largest {estimate['largest_prompt_chars']:,}); "
              f"{estimate['prompt_tokens']:,} prompt tokens by {estimate['tokens_counted_by']}", flush=True)
        print(f"  answers: {estimate['completion_tokens']:,} tokens, by {estimate['completion_tokens_counted_by']}",
              flush=True)
        print(f"  cost on {estimate['model']}: {cost}", flush=True)
        if "within_budget" in estimate:
            print(f"  within --max-cost-usd: {'yes' if estimate['within_budget'] else 'no'}", flush=True)
        for prompt in estimate["sample_prompts"][:1]:
            print(f"  first prompt: {prompt[:200]!r}", flush=True)


def _run(arguments: argparse.Namespace, spec: MapSpec, settings: MapSettings) -> MapSummary:
    """Prepare the job (no runtime), then run it: on a Session opened here, on the main thread (Ray's
    signal handlers want it), only when rows are left or a run of the job still holds some."""
    from ..connection import open_session

    job = asyncio.run(MapJob.prepare(arguments.input, spec, settings, store=arguments.store))
    try:
        print(f"job {job.job_id}: {job.check.rows} rows in {job.record.input_ref} "
              f"({job.record.input_hash[:19]}…); store {job.store.path}", file=sys.stderr, flush=True)
        session = open_session(arguments.address, namespace=arguments.namespace) if job.needs_runtime() else None
        with MapProgressView(live=False if arguments.plain else None) as view:
            return asyncio.run(job.execute(session, on_progress=view))
    finally:
        job.close()


def run_map(arguments: argparse.Namespace) -> int:
    """`opgraph map INPUT ...`: the job's summary on stdout, its exit code returned."""
    from ..cli.spine import leaving_ray_as_found, refused

    try:
        spec, settings = _spec_and_settings(arguments)
        if arguments.dry_run:
            _print_estimate(dry_run(arguments.input, spec, settings), arguments.json)
            return ExitCode.OK
        with leaving_ray_as_found():
            summary = _run(arguments, spec, settings)
    except KeyboardInterrupt:
        print("cancelled: the rows recorded so far stay recorded; the same command goes on", file=sys.stderr)
        return ExitCode.CANCELLED
    except MapInputError as exc:
        print(f"opgraph map: {exc.message}", file=sys.stderr)
        return ExitCode.USAGE
    except OpGraphError as exc:
        return refused("opgraph map", exc, ExitCode.FAILED, typed=True)
    _print_summary(summary, arguments.json)
    return summary.exit_code


def run_export(arguments: argparse.Namespace) -> int:
    """`opgraph map export JOB --output FILE`: the job's recorded rows, written again from the store."""
    from ..cli.spine import refused
    from ..store import MapJobStore
    from .output import OutputFile, check_output

    try:
        path = check_output(arguments.output)
        with MapJobStore(arguments.store) as store:
            job = store.get_job(arguments.job_id)
            statuses = ("done", "failed") if arguments.failed else ("done",)
            lines = OutputFile(path).rewrite(store.rows(job.job_id, statuses=statuses))
    except MapInputError as exc:
        print(f"opgraph map export: {exc.message}", file=sys.stderr)
        return ExitCode.USAGE
    except OpGraphError as exc:
        return refused("opgraph map export", exc, ExitCode.FAILED)
    print(f"exported {lines} rows of job {job.job_id} to {path}", flush=True)
    return ExitCode.OK
