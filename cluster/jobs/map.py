"""Dataset jobs: a prompt, or a stored workflow, over every row of a file, durable per row (``opgraph map``).

Owns a job's life: what names it (its input's location and content, and the options that shape
an answer, so the same command finds its job again and a changed input is refused), the checks
before anything is sent, the one live run its rows are fed into (adopted again after a crash),
recording and exporting its rows, and the summary it ends with. ``MapJob.prepare`` does
everything that needs no runtime; ``MapJob.execute`` runs it on a Session; ``dry_run`` only
reads and estimates; ``map`` is the same for a notebook, as an async iterator of row outcomes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opgraph.engines import PriceTable
from opgraph.kernel import OpGraphError, RetryPolicy

from ..command_line import ExitCode
from ..store import MapJobRecord, MapJobStore, RowOutcome, RunNotFoundError, digest
from .answers import ROW_OPERATION, ROWS_OPERATION, RowTask, answer_row, answer_rows, check_schema
from .feeding import (
    BatchSizer,
    Budget,
    MapProgress,
    PromptFeeder,
    RowPlan,
    RowRecorder,
    WorkflowRows,
    batch_size,
    recorded_bitmap,
)
from .output import OutputFile, check_output
from .rows import (
    BAD_ROW_POLICIES,
    InputCheck,
    MapInputChangedError,
    MapInputError,
    PromptTemplate,
    RowSource,
    check_input,
)

__all__ = ["MAP_LANE", "MapJob", "MapSettings", "MapSpec", "MapSummary", "dry_run", "map_rows"]

MAP_LANE = "map"  # the lane a job's runs are recorded under in the run store
ROW_ATTEMPTS = 3  # a row whose worker died is attempted again, up to this many times in all
SKIPPED_KEPT = 100_000  # refused rows' places a job remembers, so a rerun need not check its input again
ESTIMATED_COMPLETION_TOKENS = 64  # a dry run's guess of the tokens one answer takes (it cannot know)


@dataclass(frozen=True)
class MapSpec:
    """What shapes every answer of a job, and so names it (with its input): the id column, then a
    ``prompt`` template (with ``system``, ``model`` and an answer ``schema``) or a ``workflow``."""

    id_column: str
    prompt: str | None = None
    system: str | None = None
    model: str | None = None
    schema: dict[str, Any] | None = None
    workflow: str | None = None

    def identity(self) -> dict[str, Any]:
        return {"id_column": self.id_column, "prompt": self.prompt, "system": self.system, "model": self.model,
                "schema": self.schema, "workflow": self.workflow}


@dataclass
class MapSettings:
    """How one run of a job goes (none of it names the job): concurrency and the window of rows held
    in the run, budgets and prices, ``limit`` rows of the input, what a bad row does, whether failed
    rows run again, whether a changed input starts a new job, and the output file."""

    concurrency: int = 64
    window: int | None = None
    batch: int | None = None  # rows one operation carries (None: as many as suit the concurrency, batch_size)
    max_tokens: int | None = None
    max_cost_usd: float | None = None
    prices: Mapping[str, Any] | None = None
    limit: int | None = None
    on_bad_row: str = "fail"
    retry_failed: bool = False
    new_job: bool = False
    output: str | os.PathLike[str] | None = None

    @property
    def rows_held(self) -> int:
        """The window: rows admitted into the run and not yet released, at most."""
        return self.window or max(4 * self.concurrency, 512)


@dataclass
class MapSummary:
    """How a run of a job ended: its ids, status, counts (``progress``), the model calls this run made
    (counted by the workers' providers) and where the output is."""

    job_id: str
    run_id: str | None
    status: str  # completed | stopped | incomplete | cancelled | failed
    progress: MapProgress
    model_calls: int | None = None
    output: str | None = None
    output_lines: int | None = None
    input_changed: bool = False
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> ExitCode:
        """OK when every row has its answer; FAILED when a row failed, the job did, or its run ended with
        rows unanswered (``incomplete``); DEGRADED when a budget stopped it with rows left; CANCELLED
        when it was cancelled."""
        if self.status == "cancelled":
            return ExitCode.CANCELLED
        if self.status in ("failed", "incomplete") or self.progress.failed:
            return ExitCode.FAILED
        if self.status == "stopped":
            return ExitCode.DEGRADED
        return ExitCode.OK

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "run_id": self.run_id, "status": self.status, **self.progress.as_dict(),
                "model_calls": self.model_calls, "output": self.output, "output_lines": self.output_lines,
                "error": self.error, **self.extra}


def _prices(settings: MapSettings) -> PriceTable:
    try:
        return PriceTable(settings.prices)
    except OpGraphError as exc:
        raise MapInputError(str(exc.message)) from None


def _check_spec(spec: MapSpec, settings: MapSettings) -> PromptTemplate | None:
    """Refuse, before anything is read, options that cannot make a job."""
    if not isinstance(spec.id_column, str) or not spec.id_column:
        raise MapInputError("--id-column names the column that keys each row")
    if (spec.prompt is None) == (spec.workflow is None):
        raise MapInputError("give a prompt template (--prompt) or a stored workflow (--workflow), one of the two")
    if spec.workflow is not None and (spec.schema is not None or spec.system is not None):
        raise MapInputError("--schema and --system shape a prompt's answer; a workflow's nodes have their own")
    if spec.schema is not None:
        check_schema(spec.schema)
    if settings.on_bad_row not in BAD_ROW_POLICIES:
        raise MapInputError(f"--on-bad-row is {' or '.join(BAD_ROW_POLICIES)}, not {settings.on_bad_row!r}")
    if settings.concurrency < 1 or (settings.window is not None and settings.window < 1):
        raise MapInputError("--concurrency (and the window) must be at least 1")
    if settings.batch is not None and not 1 <= settings.batch <= settings.concurrency:
        raise MapInputError(f"the rows an operation carries (batch) must be from 1 to the concurrency "
                            f"({settings.concurrency}), not {settings.batch}")
    return PromptTemplate(spec.prompt) if spec.prompt is not None else None


def _check_budget_prices(spec: MapSpec, settings: MapSettings, prices: PriceTable, default_model: str) -> None:
    model = spec.model or default_model
    if settings.max_cost_usd is not None and spec.workflow is None and prices.price_for(model) is None:
        raise MapInputError(f"--max-cost-usd needs a price for {model}: give --price {model}=PROMPT,COMPLETION "
                            "($ per million tokens)")


def default_model() -> str:
    return os.environ.get("OPGRAPH_DEFAULT_MODEL", "sim/default")


class MapJob:
    """One dataset job, checked and claimed, ready to ``execute`` (``MapJob.prepare`` makes it)."""

    def __init__(self, source: RowSource, spec: MapSpec, settings: MapSettings, store: MapJobStore,
                 record: MapJobRecord, check: InputCheck, template: PromptTemplate | None,
                 output: OutputFile | None, prices: PriceTable, lane: Any = None) -> None:
        self.source, self.spec, self.settings, self.store = source, spec, settings, store
        self.record, self.check, self.template = record, check, template
        self.output, self.prices, self.lane = output, prices, lane

    @property
    def job_id(self) -> str:
        return self.record.job_id

    # -- before any runtime ---------------------------------------------------------------------
    @classmethod
    async def prepare(cls, location: str, spec: MapSpec, settings: MapSettings, *,
                      store: str | os.PathLike[str] | None = None, reference: str | None = None) -> MapJob:
        """Check everything, find or make the job, and claim it; ``MapInputError`` (or a store error)
        before anything is sent. ``reference`` names the input instead of its location (rows a
        notebook gave, spooled to a file)."""
        template = _check_spec(spec, settings)
        prices = _prices(settings)
        _check_budget_prices(spec, settings, prices, default_model())
        output = OutputFile(check_output(settings.output)) if settings.output is not None else None
        source = RowSource(location)
        input_hash = await asyncio.to_thread(source.content_hash)
        input_ref = reference or source.reference
        command_key = digest({"input": input_ref, "spec": spec.identity()})
        job_store = await asyncio.to_thread(MapJobStore, store)
        try:
            lane = await cls._workflow_lane(spec, store)
            latest = await asyncio.to_thread(job_store.latest_job, command_key)
            if latest is not None and latest.input_hash != input_hash and not settings.new_job:
                raise MapInputChangedError(
                    f"the input {input_ref} changed since job {latest.job_id} ran on it (its content hash was "
                    f"{latest.input_hash[:19]}…, it is {input_hash[:19]}… now): its recorded answers belong to the "
                    "old content. Restore the file, or pass --new-job to start a job for the new content",
                    location=input_ref)
            job_id = hashlib.sha256(f"{input_hash}\0{command_key}".encode()).hexdigest()[:16]
            known = await asyncio.to_thread(job_store.find_job, job_id)
            check = await asyncio.to_thread(cls._checked, source, spec, settings, template, known)
            if lane is not None:
                await cls._check_workflow(lane, spec, source, check)
            record = known or await asyncio.to_thread(job_store.create_job, job_id, command_key=command_key,
                                                      input_ref=input_ref, input_hash=input_hash,
                                                      spec=spec.identity())
            record = await asyncio.to_thread(job_store.claim_job, job_id)
            record = await asyncio.to_thread(job_store.update_job, job_id, rows_total=check.rows,
                                             summary={**(record.summary or {}), "check": _check_summary(
                                                 check, spec, settings)})
        except BaseException:
            job_store.close()
            raise
        return cls(source, spec, settings, job_store, record, check, template, output, prices, lane)

    @staticmethod
    def _checked(source: RowSource, spec: MapSpec, settings: MapSettings, template: PromptTemplate | None,
                 known: MapJobRecord | None) -> InputCheck:
        """The input's check: remembered from an earlier run of the job (same bytes, same rules), or made now."""
        remembered = (known.summary or {}).get("check") if known is not None else None
        if remembered and remembered.get("rules") == _check_rules(spec, settings) and "skipped" in remembered:
            return InputCheck(rows=remembered["rows"], skipped=list(remembered["skipped"]),
                              problems=list(remembered["problems"]), problem_count=remembered["problem_count"])
        return check_input(source, id_column=spec.id_column, on_bad_row=settings.on_bad_row, limit=settings.limit,
                           template=template)

    @staticmethod
    async def _workflow_lane(spec: MapSpec, store: Any) -> Any:
        if spec.workflow is None:
            return None
        from ..lanes import FIXED_WORKFLOW, lane_adapter, open_store

        return lane_adapter(FIXED_WORKFLOW, await asyncio.to_thread(open_store, store))

    @staticmethod
    async def _check_workflow(lane: Any, spec: MapSpec, source: RowSource, check: InputCheck) -> None:
        """The workflow resolves and compiles with the first row's columns as its inputs (no model call)."""
        first = next((row for row in source.rows() if row.values is not None and row.ordinal not in
                      set(check.skipped)), None)
        if first is None:
            return
        await lane.prepare(lane.invocation(spec.workflow, inputs=dict(first.values), model=spec.model))

    def needs_runtime(self) -> bool:
        """Whether a run is needed: rows of the input not yet recorded (failed ones too with
        ``retry_failed``), or a run of the job still live in the run log, holding answers."""
        from opgraph.actors.persistence import RunLog, database_exists, database_path

        statuses = ("done",) if self.settings.retry_failed else ("done", "failed")
        totals = self.store.totals(self.job_id)
        if sum(totals[status] for status in statuses) < self.check.rows:
            return True
        if self.record.run_id is None or not database_exists(database_path()):
            return False
        entry = RunLog(database_path()).entry(self.record.run_id)
        return entry is not None and entry.status == "live"

    # -- on a runtime ----------------------------------------------------------------------------
    async def execute(self, session: Any, *, on_progress: Callable[[MapProgress], Any] | None = None,
                      on_recorded: Callable[[list[RowOutcome]], Any] | None = None) -> MapSummary:
        """Run the job's pending rows on ``session`` and return the summary; the job is left ended
        (completed, stopped by a budget, cancelled or failed), its runner let go. ``session`` may be
        None when nothing needs a runtime (``needs_runtime``): the output is written, nothing runs."""
        settings, store, job_id = self.settings, self.store, self.job_id
        statuses = ("done",) if settings.retry_failed else ("done", "failed")
        progress = MapProgress(total=self.check.rows, refused=len(self.check.skipped))
        totals = await asyncio.to_thread(store.totals, job_id)
        progress.recorded_before = sum(totals[status] for status in statuses)
        budget = Budget(settings.max_tokens, settings.max_cost_usd, totals["prompt_tokens"]
                        + totals["completion_tokens"], totals["cost_usd"], totals["done"] + totals["failed"])
        bitmap = await asyncio.to_thread(recorded_bitmap, store.recorded_ordinals(job_id, statuses=statuses))
        plan = RowPlan(self.source, self.spec.id_column, set(self.check.skipped), bitmap, settings.limit)
        if self.output is not None:
            await asyncio.to_thread(self.output.rewrite, store.rows(job_id, statuses=statuses))
        calls_before = 0 if session is None else await asyncio.to_thread(provider_calls, session)
        summary = MapSummary(job_id, None, "failed", progress,
                             output=None if self.output is None else str(self.output.path))
        try:
            # Without a session every row is recorded and no run holds any: nothing runs.
            if session is not None and self.lane is not None:
                await self._run_workflow(session, plan, progress, budget, on_progress, on_recorded, summary)
            elif session is not None:
                await self._run_prompt(session, plan, progress, budget, on_progress, on_recorded, summary)
            summary.status = "stopped" if progress.stopped and progress.remaining else "completed"
            if progress.refused_by_run is not None and progress.remaining:
                summary.status = "incomplete"
                # the run ended under the feeder with rows unanswered: say so, never "completed"
                summary.error = (f"{progress.remaining} rows were not answered (the run refused them: "
                                 f"{progress.refused_by_run or 'it ended'}); run the same command again to finish")
        except asyncio.CancelledError:
            summary.status = "cancelled"
            raise
        except BaseException as exc:
            summary.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            calls_after = 0 if session is None else await asyncio.shield(asyncio.to_thread(provider_calls, session))
            if calls_before is not None and calls_after is not None:
                summary.model_calls = max(0, calls_after - calls_before)
            if self.output is not None:
                summary.output_lines = self.output.lines
            await asyncio.shield(asyncio.to_thread(self._finish, summary))
        return summary

    async def _run_prompt(self, session: Any, plan: RowPlan, progress: MapProgress, budget: Budget,
                          on_progress: Any, on_recorded: Any, summary: MapSummary) -> None:
        from opgraph.actors import FedRun

        task = RowTask(model=self.spec.model, system=self.spec.system, schema=self.spec.schema)
        session.register_operation(ROWS_OPERATION, functools.partial(answer_rows, task=task), record_turn=False,
                                   retry=RetryPolicy.of(ROW_ATTEMPTS))
        # a run fed one row an operation (before batches), adopted: its rows still open finish as they were
        session.register_operation(ROW_OPERATION, functools.partial(answer_row, task=task), record_turn=False,
                                   retry=RetryPolicy.of(ROW_ATTEMPTS))
        # --batch N: that many rows an operation; else as many as suit the concurrency while the
        # rows' call times stay even (BatchSizer), one an operation until they have been seen
        sizer = (BatchSizer(self.settings.batch, fixed=True) if self.settings.batch
                 else BatchSizer(batch_size(self.settings.concurrency)))
        fed = None
        if self.record.run_id is not None:
            fed = await FedRun.adopt(session, self.record.run_id)
        if fed is None:
            run_id = f"map-{self.job_id}-{self.record.runs + 1}"
            # the capacity counts rows: each operation weighs the rows it carries (kernel node_weight)
            fed = await FedRun.start(session, run_id=run_id, max_concurrent=self.settings.concurrency,
                                     buffer=2 * self.settings.rows_held)
            self.record = await asyncio.to_thread(self.store.update_job, self.job_id, run_id=run_id, new_run=True)
            await asyncio.to_thread(self._record_run, run_id, session, False)
        else:
            await asyncio.to_thread(self._record_run, fed.run_id, session, True)
        summary.run_id = fed.run_id
        recorder = RowRecorder(self.job_id, fed.run_id, self.store, self.output, self.prices, progress, budget,
                               replace_failed=self.settings.retry_failed, on_recorded=on_recorded)
        feeder = PromptFeeder(fed, self.job_id, plan, self.template, recorder, window=self.settings.rows_held,
                              concurrency=self.settings.concurrency, batch=sizer, on_progress=on_progress)
        try:
            envelope = await feeder.run()
        except asyncio.CancelledError:
            with contextlib.suppress(OpGraphError):
                await asyncio.shield(fed.cancel())
            raise
        finally:
            await asyncio.shield(fed.forget())
        summary.extra["run_status"] = (envelope or {}).get("status")
        summary.extra["recoveries"] = fed.recoveries

    async def _run_workflow(self, session: Any, plan: RowPlan, progress: MapProgress, budget: Budget,
                            on_progress: Any, on_recorded: Any, summary: MapSummary) -> None:
        recorder = RowRecorder(self.job_id, None, self.store, self.output, self.prices, progress, budget,
                               replace_failed=self.settings.retry_failed, on_recorded=on_recorded)
        rows = WorkflowRows(self.lane, self.spec.workflow, self.spec.model, session, self.job_id, plan, recorder,
                            concurrency=self.settings.concurrency, on_progress=on_progress)
        await rows.run()

    def _record_run(self, run_id: str, session: Any, adopted: bool) -> None:
        """The run in the run store's runs, as any lane's: `opgraph run show RUN_ID` reads it."""
        if adopted:
            try:
                record = self.store.get_run(run_id)  # an orphan is settled as such by the read
            except RunNotFoundError:
                record = None
            if record is not None:
                if record.orphaned:
                    self.store.reopen_run(run_id, session_id=session.id)
                return
        provenance = {"lane": MAP_LANE, "source": {"kind": "dataset", "ref": self.record.input_ref,
                                                   "content_hash": self.record.input_hash}}
        self.store.create_run(run_id, session_id=session.id, provenance=provenance,
                              inputs={"job_id": self.job_id, **self.spec.identity()}, status="running",
                              recovery={"job_id": self.job_id})

    def _finish(self, summary: MapSummary) -> None:
        """End the job (and its run's row) with the summary; the job's runner is let go."""
        status = summary.status if summary.status != "cancelled" else "cancelled"
        self.store.update_job(self.job_id, status=status, summary={**(self.record.summary or {}),
                                                                   "last": summary.as_dict()})
        if summary.run_id is not None:
            run_status = {"completed": "completed", "stopped": "completed", "cancelled": "cancelled"}.get(
                summary.status, "failed")
            error = None if summary.error is None else {"error": summary.error}
            with contextlib.suppress(OpGraphError):  # a run row another process settled keeps its end
                self.store.finish_run(summary.run_id, run_status, outputs=summary.as_dict(), error=error)

    def close(self) -> None:
        self.store.close()


def _check_rules(spec: MapSpec, settings: MapSettings) -> dict[str, Any]:
    return {"id_column": spec.id_column, "prompt": spec.prompt, "on_bad_row": settings.on_bad_row,
            "limit": settings.limit}


def _check_summary(check: InputCheck, spec: MapSpec, settings: MapSettings) -> dict[str, Any]:
    summary = {"rules": _check_rules(spec, settings), **check.as_dict()}
    if len(check.skipped) <= SKIPPED_KEPT:
        summary["skipped"] = list(check.skipped)
    return summary


def provider_calls(session: Any) -> int | None:
    """Model calls the runtime's workers have made, answered or failed, retries included (their
    providers' counters), or None when a worker cannot be asked."""
    from opgraph.actors.calls import WorkerStub, answers

    try:
        session.runtime.refresh()
    except OpGraphError:
        return None
    stubs = [WorkerStub(handle) for handle in session.runtime.workers]
    total = 0
    for answer in answers(stubs, WorkerStub.statistics, timeout=10.0):
        if answer.error is not None:
            return None
        total += sum(int(counts.get("calls", 0)) + int(counts.get("failures", 0)) + int(counts.get("retries", 0))
                     for counts in answer.value.get("providers", {}).values())
    return total


# -- a dry run --------------------------------------------------------------------------------------
def dry_run(location: str, spec: MapSpec, settings: MapSettings) -> dict[str, Any]:
    """Read and check every row, fill the template for each, and estimate tokens and cost; nothing is
    sent and nothing is stored. Tokens are counted by a tokenizer when one is available offline
    (tiktoken's cl100k_base), else estimated at four characters a token; the output says which."""
    template = _check_spec(spec, settings)
    prices = _prices(settings)
    model = spec.model or default_model()
    if settings.output is not None:
        check_output(settings.output)
    source = RowSource(location)
    check = check_input(source, id_column=spec.id_column, on_bad_row=settings.on_bad_row, limit=settings.limit,
                        template=template, render=template is not None)
    counted, prompt_tokens = _count_tokens(check, spec)
    completion_tokens = ESTIMATED_COMPLETION_TOKENS * check.rows
    price = prices.price_for(model)
    estimate = {"input": source.reference, "format": source.format, "rows": check.rows,
                "refused": len(check.skipped), "problems": check.problems, "problem_count": check.problem_count,
                "model": model if spec.workflow is None else None, "workflow": spec.workflow,
                "prompt_chars": check.prompt_chars, "largest_prompt_chars": check.largest_prompt,
                "prompt_tokens": prompt_tokens, "tokens_counted_by": counted,
                "completion_tokens": completion_tokens,
                "completion_tokens_counted_by": f"an assumed {ESTIMATED_COMPLETION_TOKENS} tokens an answer",
                "cost_usd": None if price is None else round(price.cost(prompt_tokens, completion_tokens), 6),
                "priced": price is not None, "sample_prompts": check.sample_prompts,
                "schema": "valid JSON Schema" if spec.schema is not None else None, "model_calls": 0}
    if settings.max_cost_usd is not None and estimate["cost_usd"] is not None:
        estimate["within_budget"] = estimate["cost_usd"] <= settings.max_cost_usd
    return estimate


def _count_tokens(check: InputCheck, spec: MapSpec) -> tuple[str, int]:
    """(how, prompt tokens of every row): a tokenizer's count of the sampled prompts scaled to all the
    characters, or four characters a token."""
    system = len(spec.system or "") * check.rows
    chars = check.prompt_chars + system
    try:
        import tiktoken

        encoding = tiktoken.get_encoding("cl100k_base")
    except Exception:  # noqa: BLE001 - no tokenizer here (not installed, or its encoding not cached offline)
        return "an estimate of four characters a token (no tokenizer is available offline)", (chars + 3) // 4
    sample = "".join(check.sample_prompts)
    if not sample:
        return "tiktoken cl100k_base", 0
    per_char = len(encoding.encode(sample)) / len(sample)
    return "tiktoken cl100k_base, on a sample of the prompts", round(chars * per_char)


# -- the Python form -----------------------------------------------------------------------------
async def map_rows(rows: str | os.PathLike[str] | Iterable[Mapping[str, Any]], *, session: Any,
                   id_column: str = "id", prompt: str | None = None, system: str | None = None,
                   model: str | None = None, schema: dict[str, Any] | None = None, workflow: str | None = None,
                   store: str | None = None, include_recorded: bool = True,
                   **settings: Any) -> AsyncIterator[RowOutcome]:
    """A prompt (or a stored workflow) over every row, as an async iterator of each row's recorded outcome.

    ``rows`` is a file (JSONL, CSV, Parquet; a path or URL) or an iterable of mappings (spooled to a
    temporary JSONL file, and named by its content, so the same rows find the same job again).
    ``settings`` are ``MapSettings``' fields (``concurrency``, ``max_cost_usd``, ``output``...).
    Rows recorded by an earlier run of the same job come first (``include_recorded``) and are not
    run again. Leaving the loop early cancels what is in flight; what was recorded stays recorded.
    """
    spec = MapSpec(id_column, prompt, system, model, schema, workflow)
    options = MapSettings(**settings)
    spooled, location, reference = None, rows, None
    if not isinstance(rows, (str, os.PathLike)):
        spooled, reference = await asyncio.to_thread(_spool, rows)
        location = spooled
    try:
        job = await MapJob.prepare(str(location), spec, options, store=store, reference=reference)
        try:
            if include_recorded:
                statuses = ("done",) if options.retry_failed else ("done", "failed")
                for outcome in await asyncio.to_thread(lambda: list(job.store.rows(job.job_id, statuses=statuses))):
                    yield outcome
            queue: asyncio.Queue = asyncio.Queue(maxsize=max(1, options.rows_held))

            async def recorded(outcomes: list[RowOutcome]) -> None:
                for outcome in outcomes:
                    if outcome.answer is None and outcome.answer_json is not None:  # as its worker sent it
                        outcome = outcome._replace(answer=json.loads(outcome.answer_json))
                    await queue.put(outcome)

            running = asyncio.ensure_future(job.execute(session, on_recorded=recorded))
            try:
                while not (running.done() and queue.empty()):
                    getting = asyncio.ensure_future(queue.get())
                    await asyncio.wait([getting, running], return_when=asyncio.FIRST_COMPLETED)
                    if getting.done():
                        yield getting.result()
                    else:
                        getting.cancel()
                running.result()
            finally:
                if not running.done():
                    running.cancel()
                    await asyncio.gather(running, return_exceptions=True)
        finally:
            job.close()
    finally:
        if spooled is not None:
            os.unlink(spooled)


def _spool(rows: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """Write ``rows`` to a temporary JSONL file; (its path, the reference naming it by content)."""
    digest_of = hashlib.sha256()
    handle = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8")
    with handle:
        for row in rows:
            line = json.dumps(dict(row), ensure_ascii=False, sort_keys=True, default=str) + "\n"
            digest_of.update(line.encode())
            handle.write(line)
    return handle.name, f"rows:sha256:{digest_of.hexdigest()}"
