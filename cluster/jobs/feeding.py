"""Feeding a dataset job's rows to the runtime: a window at a time into one live run, or a workflow run per row.

Owns the loop between the input and the runtime. ``PromptFeeder`` admits rows into one
``FedRun`` so that at most a window of them is held there at once, records each settled
row's outcome in the run store (its answer, usage and cost) and appends it to the output,
and only then lets the run release it; a budget stops the admissions and lets what is in
flight finish. After the run's executor was replaced, or when it takes over a run its last
client left, it reconciles with what the run still holds. ``WorkflowRows`` runs a stored
fixed workflow per row through the lane registry, as many at once as the concurrency allows.
It reads rows from ``RowSource`` and never makes a model call itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from opgraph.actors.protocol import AdmittedRow
from opgraph.kernel import FlowEvent, OpGraphError

from ..store import MapJobStore, RowOutcome
from .answers import ROWS_OPERATION, decode_answers
from .output import OutputFile
from .rows import PromptTemplate, RowSource, row_key

__all__ = ["ADMIT_BATCH", "BatchSizer", "Budget", "MapProgress", "PromptFeeder", "RowPlan", "WorkflowRows",
           "batch_size", "node_id_of"]

ADMIT_BATCH = 1024  # rows one admission carries at most
ROWS_AN_OPERATION = (8, 32)  # the rows one operation carries, at least and at most, at a large concurrency
OPERATIONS_IN_FLIGHT = 32  # a batch shrinks to keep this many operations in flight (one row below 64 rows)
POLL_SECONDS = 1.0  # how long one poll of the run waits for settled rows
# The shortest round of the drain (poll, record, release): what settles meanwhile waits for the
# next one, so each round's costs (a call each way, a transaction, an fsync, and the executor's
# log commit of the release) go to many rows, not to each operation as it settles.
DRAIN_ROUND_SECONDS = 0.05
ADMIT_PART = 8  # with more than enough rows in the run, admit once an eighth of the window is free


def batch_size(concurrency: int) -> int:
    """Rows one operation carries at ``concurrency`` rows in flight: one up to ``OPERATIONS_IN_FLIGHT``
    rows, then more, at most ``ROWS_AN_OPERATION[1]``; from ``ROWS_AN_OPERATION[0]`` on, the largest size
    whose whole operations leave at most 1% of the ``concurrency`` rows unused (else the least unused).

    Per operation, not per row, go the executor's scheduling and logging, Ray's calls and the
    worker's dispatch: a batch divides them by its size. A batch's rows are called at once, so
    ``concurrency // size`` operations in flight keep (nearly) ``concurrency`` rows in flight."""
    least, most = ROWS_AN_OPERATION
    fitting = max(1, min(most, concurrency // OPERATIONS_IN_FLIGHT))
    if fitting < least:
        return fitting
    return min(range(least, fitting + 1), key=lambda size: (max(concurrency % size, concurrency // 100), -size))


class BatchSizer:
    """The rows the next operations carry: ``largest`` when the rows' model calls take about the
    same time, fewer when they spread.

    A batch's rows are called at once and its slots in the capacity are held until its slowest
    row ends, so batching pays only where rows are short and even (a simulated 50 ms call: the
    executor's and Ray's costs divided by the batch), and costs throughput where they spread (a real
    model's log-normal latencies: 16 rows held for their slowest, a third of the calls a second).
    From the rows' own call times (``observe``), at most once a ``RECONSIDER_SECONDS``, it picks
    the largest size whose expected slowest row is within ``EFFICIENCY`` of a row's mean time,
    estimated by drawing groups of that size from the times seen. Until ``FIRST_LOOK`` rows have
    been timed, rows go one an operation. ``fixed`` (``--batch N``) never changes."""

    FIRST_LOOK = 256
    RECONSIDER_SECONDS = 1.0
    EFFICIENCY = 0.85
    DRAWS = 200

    def __init__(self, largest: int, *, fixed: bool = False) -> None:
        self.largest = max(1, largest)
        self.fixed = fixed
        self.size = self.largest if fixed else 1
        self.times: deque[float] = deque(maxlen=4096)
        self.seen = 0
        self.considered_at: float | None = None
        self._draw = random.Random(0).choices

    def observe(self, seconds: list[float], now: float) -> int:
        """Note rows' call times; return the size for the next operations."""
        if self.fixed or not seconds:
            return self.size
        self.times.extend(seconds)
        self.seen += len(seconds)
        if self.seen >= self.FIRST_LOOK and (self.considered_at is None
                                             or now - self.considered_at >= self.RECONSIDER_SECONDS):
            self.considered_at = now
            self.size = self._best()
        return self.size

    def _best(self) -> int:
        times = list(self.times)
        mean = sum(times) / len(times)
        if mean <= 0:  # calls that take no time: nothing is held for a slowest one
            return self.largest
        size = self.largest
        while size > 1:
            slowest = sum(max(self._draw(times, k=size)) for _ in range(self.DRAWS)) / self.DRAWS
            if mean / slowest >= self.EFFICIENCY:
                return size
            size //= 2
        return 1


def node_id_of(job_id: str, key: str) -> str:
    """A row's node id: the same for the same job and row key, in any process (a reinjection is a
    duplicate); 32 hex digits of a keyed hash (a uuid5 cost three times as much, once a row)."""
    return hashlib.blake2b(key.encode(), digest_size=16, key=job_id.encode()[:64]).hexdigest()


@dataclass
class Budget:
    """The job's spending bounds and what it has spent (recorded rows, earlier runs included)."""

    max_tokens: int | None = None
    max_cost_usd: float | None = None
    tokens: int = 0
    cost_usd: float = 0.0
    rows: int = 0  # rows whose spending is counted above (for the mean a row in flight is expected to cost)

    def add(self, outcome: RowOutcome) -> None:
        self.tokens += outcome.tokens
        self.cost_usd += outcome.cost_usd
        self.rows += 1

    @property
    def bounded(self) -> bool:
        return self.max_tokens is not None or self.max_cost_usd is not None

    def rows_left(self) -> int | None:
        """How many more rows the bounds allow at the mean cost of a row so far (None: no bound, or no
        row recorded yet to take a mean from)."""
        if not self.bounded or not self.rows:
            return None
        left = []
        if self.max_tokens is not None and self.tokens:
            left.append(int((self.max_tokens - self.tokens) / (self.tokens / self.rows)))
        if self.max_cost_usd is not None and self.cost_usd:
            left.append(int((self.max_cost_usd - self.cost_usd) / (self.cost_usd / self.rows)))
        return max(0, min(left)) if left else None

    def spent(self, in_flight: int = 0) -> str | None:
        """Which bound leaves no room for one more row (``tokens``, ``cost``): spent already, or spent
        once the ``in_flight`` rows and one more cost the mean so far."""
        mean_tokens = self.tokens / self.rows if self.rows else 0.0
        mean_cost = self.cost_usd / self.rows if self.rows else 0.0
        if self.max_tokens is not None and (self.tokens >= self.max_tokens
                                            or self.tokens + (in_flight + 1) * mean_tokens > self.max_tokens):
            return "tokens"
        if self.max_cost_usd is not None and (self.cost_usd >= self.max_cost_usd
                                              or self.cost_usd + (in_flight + 1) * mean_cost > self.max_cost_usd):
            return "cost"
        return None


@dataclass
class MapProgress:
    """A job's counts as it goes: what a progress bar and the final summary show."""

    total: int = 0  # rows the job runs (the input's, less those refused)
    recorded_before: int = 0  # rows recorded by earlier runs of the job, not run again
    refused: int = 0  # rows skipped as bad input (``--on-bad-row skip``)
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    calls: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    started: float = field(default_factory=time.monotonic)
    stopped: str | None = None  # why admissions stopped early: a budget (``tokens``, ``cost``) or ``limit``
    refused_by_run: str | None = None  # why the live run refused a row (it ended under the feeder), if it did

    @property
    def finished(self) -> int:
        return self.done + self.failed

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.recorded_before - self.finished)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def rows_per_second(self) -> float:
        return self.finished / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        rate = self.rows_per_second
        return self.remaining / rate if rate > 0 and not self.stopped else None

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "recorded_before": self.recorded_before, "refused": self.refused,
                "done": self.done, "failed": self.failed, "remaining": self.remaining, "calls": self.calls,
                "tokens": self.tokens, "cost_usd": round(self.cost_usd, 6),
                "rows_per_second": round(self.rows_per_second, 1), "elapsed": round(self.elapsed, 3),
                "stopped": self.stopped}


@dataclass
class RowPlan:
    """Which rows of the input this run of the job takes: not refused, not recorded (``recorded``,
    a bitmap of input places), not already open in the run (``open_places``), at most ``limit``
    (counted over the input's good rows, recorded ones included)."""

    source: RowSource
    id_column: str
    refused: set[int]
    recorded: bytearray
    limit: int | None = None
    open_places: set[int] = field(default_factory=set)

    def mark(self, ordinal: int) -> None:
        _set_bit(self.recorded, ordinal)

    def pending(self) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """(ordinal, key, values) of every row to run, in input order."""
        good, limit, refused, open_places = 0, self.limit, self.refused, self.open_places
        recorded, id_column = self.recorded, self.id_column  # marked as rows settle: read it as it grows
        for ordinal, _, values, _ in self.source.rows():
            if values is None or ordinal in refused:
                continue
            if limit is not None and good >= limit:
                return
            good += 1
            index = ordinal >> 3
            if (index < len(recorded) and recorded[index] >> (ordinal & 7) & 1) or ordinal in open_places:
                continue
            yield ordinal, row_key(values.get(id_column)), values


def recorded_bitmap(ordinals: Iterator[int]) -> bytearray:
    bitmap = bytearray()
    for ordinal in ordinals:
        _set_bit(bitmap, ordinal)
    return bitmap


def _set_bit(bitmap: bytearray, ordinal: int) -> None:
    index = ordinal >> 3
    if index >= len(bitmap):
        bitmap.extend(bytes(index + 1 - len(bitmap) + 4096))
    bitmap[index] |= 1 << (ordinal & 7)


class RowRecorder:
    """Turns settled rows into outcomes, records them (store, then output) and counts them."""

    def __init__(self, job_id: str, run_id: str, store: MapJobStore, output: OutputFile | None, prices: Any,
                 progress: MapProgress, budget: Budget, *, replace_failed: bool,
                 on_recorded: Callable[[list[RowOutcome]], Any] | None = None) -> None:
        self.job_id, self.run_id = job_id, run_id
        self.store, self.output, self.prices = store, output, prices
        self.progress, self.budget = progress, budget
        self.replace_failed = replace_failed
        self.call_seconds: list[float] = []  # the rows' model call times since the feeder last took them
        self.on_recorded = on_recorded
        self._prices: dict[str, Any] = {}  # model -> its ModelPrice (or None), looked up once

    def outcomes(self, event: FlowEvent, places: list[tuple[int, str]]) -> list[RowOutcome] | None:
        """The outcomes of a settled operation's rows, ``places`` ((ordinal, key) each, in the order the
        operation carried them); None for an operation that was cancelled (its rows not answered).
        An operation that failed as a whole (its worker died at every attempt, say) fails each row."""
        result = event.result
        if event.status == "completed" and type(result) is str and not result.startswith("{"):
            try:
                return self._answered(places, result)
            except (ValueError, TypeError):
                pass
            return [RowOutcome(key, ordinal, "failed", error=f"the answers of the batch of {len(places)} rows "
                               f"could not be read: {result[:200]!r}", run_id=self.run_id) for ordinal, key in places]
        if len(places) == 1:  # a row an operation, as runs fed before batches were did
            made = self.outcome(event, *places[0])
            return None if made is None else [made]
        if event.status != "failed":
            return None
        failure = self.outcome(event, *places[0])
        return [failure._replace(row_key=key, ordinal=ordinal) for ordinal, key in places]

    def _answered(self, places: list[tuple[int, str]], text: str) -> list[RowOutcome]:
        """The rows of a batch's answers (``answers.encode_answers``' text), each answer's JSON kept
        as it is (stored and exported so, never decoded here)."""
        answers = decode_answers(text, self.call_seconds)
        if len(answers) != len(places):
            raise ValueError(f"{len(answers)} answers for {len(places)} rows")
        made, run_id, price_of, model_price = [], self.run_id, self._price, (None, None)
        for (ordinal, key), (ok, text, calls, prompt, completion, model) in zip(places, answers, strict=True):
            cost = 0.0
            if model and (prompt or completion):
                if model_price[0] != model:
                    model_price = (model, price_of(model))
                price = model_price[1]
                cost = price.cost(prompt, completion) if price is not None else 0.0
            if ok:
                made.append(RowOutcome(key, ordinal, "done", None, None, calls, prompt, completion, cost, model,
                                       run_id, text))
            else:
                made.append(RowOutcome(key, ordinal, "failed", None, text, calls, prompt, completion, cost, model,
                                       run_id))
        return made

    def outcome(self, event: FlowEvent, ordinal: int, key: str | None = None) -> RowOutcome | None:
        """One row's outcome from its settled node, which answered that row alone (as JSON text, or a
        failure); None for a row that was cancelled (not answered)."""
        result = event.result
        key = event.name if key is None else key
        if type(result) is str:  # a row's answer comes as JSON text (answers.answer_row)
            try:
                result = json.loads(result)
            except json.JSONDecodeError:
                result = {"answer": result}
        if not isinstance(result, dict):
            result = {}
        usage = result.get("usage") or (0, 0, 0)
        model = result.get("model")
        calls, prompt, completion = int(usage[0] or 0), int(usage[1] or 0), int(usage[2] or 0)
        cost = 0.0
        if model and (prompt or completion):
            price = self._price(model)
            cost = price.cost(prompt, completion) if price is not None else 0.0
        if event.status == "completed" and "answer" in result:
            answer = result["answer"]
            return RowOutcome(key, ordinal, "done", answer, None, calls, prompt, completion, cost, model,
                              self.run_id, json.dumps(answer, ensure_ascii=False, separators=(",", ":")))
        if event.status == "completed" and "failed" in result:
            error = str(result["failed"])
        elif event.status == "failed":
            error = result.get("error") or "the row's operation failed"
            kind = result.get("error_type")
            error = f"{kind}: {error}" if kind else str(error)
        else:
            return None
        return RowOutcome(key, ordinal, "failed", None, error, calls, prompt, completion, cost, model,
                          self.run_id)

    def _price(self, model: str) -> Any:
        prices = self._prices
        if model not in prices:
            prices[model] = self.prices.price_for(model)
        return prices[model]

    async def record(self, outcomes: list[RowOutcome]) -> list[RowOutcome]:
        """Record in the store, then append to the output; returns the outcomes new to the job."""
        written = await asyncio.to_thread(self.store.record_rows, self.job_id, outcomes,
                                          replace_failed=self.replace_failed)
        if self.output is not None and written:
            await asyncio.to_thread(self.output.append, written)
        if written:
            progress, budget = self.progress, self.budget
            done = sum(1 for outcome in written if outcome.status == "done")
            tokens = sum(outcome.prompt_tokens + outcome.completion_tokens for outcome in written)
            cost = sum(outcome.cost_usd for outcome in written)
            progress.done += done
            progress.failed += len(written) - done
            progress.calls += sum(outcome.calls for outcome in written)
            progress.tokens += tokens
            progress.cost_usd += cost
            budget.tokens += tokens
            budget.cost_usd += cost
            budget.rows += len(written)
        if written and self.on_recorded is not None:
            await _maybe_await(self.on_recorded(written))
        return written


class PromptFeeder:
    """Feeds the rows of ``plan`` into ``fed`` (a ``FedRun``), a window at a time, and records them.

    ``window`` bounds the rows admitted and not yet released, so the run holds at most that
    many rows whatever the input's size; admissions stop once ``budget`` is spent. Rows go in
    operations of ``batch`` rows each (a size, or a ``BatchSizer`` that picks it as rows settle;
    each operation weighs its rows in the run's capacity, so ``max_concurrent`` counts rows), each
    row recorded on its own once its operation settled.
    """

    def __init__(self, fed: Any, job_id: str, plan: RowPlan, template: PromptTemplate, recorder: RowRecorder,
                 *, window: int, concurrency: int, batch: int | BatchSizer = 1,
                 on_progress: Callable[[MapProgress], Any] | None = None) -> None:
        self.fed, self.job_id, self.plan, self.template = fed, job_id, plan, template
        self.recorder = recorder
        self.window = max(1, window)
        self.concurrency = max(1, concurrency)
        self.sizer = batch if isinstance(batch, BatchSizer) else BatchSizer(batch, fixed=True)
        self.on_progress = on_progress
        # node id -> its rows' (ordinal, key)s: admitted, not yet released; ``rows_in_run`` counts the rows
        self.in_run: dict[str, list[tuple[int, str]]] = {}
        self.rows_in_run = 0
        self.room = asyncio.Event()
        self.room.set()
        self.recoveries = fed.recoveries
        self.reading_done = False
        self.cancelled = 0  # rows the run cancelled: not answered, left for the next run

    async def run(self) -> dict[str, Any] | None:
        """Feed every pending row, drain, close the run; return its envelope."""
        await self._take_over()
        admitting = asyncio.ensure_future(self._admit_all())
        try:
            with _young_collections_rarer():
                await self._drain(admitting)
        except asyncio.CancelledError:
            # Stopped (Ctrl-C, a notebook's loop left): what settled is recorded before the caller
            # stops the run, so only the rows in flight are asked again next time.
            await asyncio.shield(self._settle_held())
            raise
        finally:
            if not admitting.done():
                admitting.cancel()
                await asyncio.gather(admitting, return_exceptions=True)
        return self.fed.envelope

    async def _settle_held(self) -> None:
        """Record what the run holds settled; a run that cannot be asked (its runtime going down)
        keeps it, in its log, for the next run of the job to adopt."""
        with contextlib.suppress(OpGraphError):
            held = await self.fed.held()
            await self._settle(held.settled, held.metadata)

    async def _take_over(self) -> None:
        """A run its last client left (or that a replaced executor rebuilt): record what it settled,
        and remember what is open in it, so those rows are not admitted twice."""
        held = await self.fed.held()
        for node_id, metadata in held.open:
            places = _places(metadata)
            if places:
                self._hold(node_id, places)
                self.plan.open_places.update(ordinal for ordinal, _ in places)
        await self._settle(held.settled, held.metadata)
        self.recoveries = self.fed.recoveries

    @property
    def batch(self) -> int:
        """The rows the next operation carries (the sizer's choice, within the window)."""
        return max(1, min(self.sizer.size, self.window))

    def _hold(self, node_id: str, places: list[tuple[int, str]]) -> None:
        if node_id not in self.in_run:
            self.in_run[node_id] = places
            self.rows_in_run += len(places)

    def _let_go(self, node_id: str) -> None:
        places = self.in_run.pop(node_id, None)
        if places is not None:
            self.rows_in_run -= len(places)

    def _room(self) -> int:
        """Rows that may be admitted now: the window's room; under a budget whose cost per row is not
        known yet (nothing recorded), no more than one wave (the concurrency), so that the first
        rows' spending is seen before the run holds many more."""
        budget = self.recorder.budget
        limit = self.concurrency if budget.bounded and budget.rows == 0 else self.window
        room = limit - self.rows_in_run
        allowed = budget.rows_left()
        return room if allowed is None else min(room, allowed - self.rows_in_run)

    def _least(self) -> int:
        """The room worth an admission: a whole operation's rows (a budget's last rows may be fewer);
        while the run holds twice the concurrency or more (the rows in flight, and as many waiting
        for a slot), an eighth of the window, so that admissions (each a call, and a commit of the
        executor's log) are few and large."""
        if self.recorder.budget.bounded:
            return 1
        if self.rows_in_run >= 2 * self.concurrency:
            return max(self.batch, min(ADMIT_BATCH, self.window // ADMIT_PART))
        return self.batch

    async def _admit_all(self) -> None:
        rows = self.plan.pending()
        budget, progress = self.recorder.budget, self.recorder.progress
        try:
            while True:
                while self._room() < self._least() and (self.rows_in_run or self._room() <= 0):
                    reason = budget.spent(self.rows_in_run)
                    if reason is not None:  # spent, counting what is in flight: no row will be admitted
                        progress.stopped = reason
                        return
                    self.room.clear()
                    await self.room.wait()
                reason = budget.spent(self.rows_in_run)
                if reason is not None:
                    progress.stopped = reason
                    return
                count = min(ADMIT_BATCH, self._room())
                if count >= self.batch:  # whole operations: a part of one only at the input's end
                    count -= count % self.batch
                batch = self._operations(rows, count)
                if not batch:
                    return
                for node_id, _, _, metadata in batch:
                    self._hold(node_id, _places(metadata))
                progress.in_flight = self.rows_in_run
                decided = await self.fed.admit(batch)
                for (node_id, *_), (accepted, reason) in zip(batch, decided, strict=True):
                    if not accepted and reason != "duplicate":  # refused: the run ended under us
                        self._let_go(node_id)
                        progress.refused_by_run = progress.refused_by_run or str(reason)
                if progress.refused_by_run is not None:
                    return  # the rows not admitted stay pending: the same command again runs them
                await asyncio.sleep(0)  # let the drain take what settled meanwhile
        finally:
            self.reading_done = True
            self.room.set()

    def _operations(self, rows: Iterator[tuple[int, str, dict[str, Any]]], count: int) -> list[AdmittedRow]:
        """Up to ``count`` rows as the operations they are admitted as, ``batch`` rows each: (node id,
        operation, parameters, metadata), the rows' keys and places in its metadata. A node id is
        the keyed hash of its rows' keys: the same rows make the same node in any process."""
        made, job_id, render, size = [], self.job_id, self.template.render, self.batch
        ordinals: list[int] = []
        keys: list[str] = []
        prompts: list[str] = []
        taken = 0
        for ordinal, key, values in rows:
            ordinals.append(ordinal)
            keys.append(key)
            prompts.append(render(values))
            taken += 1
            if len(keys) >= size or taken >= count:
                made.append(_operation(job_id, ordinals, keys, prompts))
                ordinals, keys, prompts = [], [], []
                if taken >= count:
                    break
        if keys:
            made.append(_operation(job_id, ordinals, keys, prompts))
        return made

    async def _drain(self, admitting: asyncio.Future) -> None:
        fed = self.fed
        closing = False
        loop = asyncio.get_running_loop()
        began = loop.time()
        while not fed.done:
            pause = DRAIN_ROUND_SECONDS - (loop.time() - began)
            if pause > 0 and not closing:
                await asyncio.sleep(pause)
            began = loop.time()
            if admitting.done() and admitting.exception() is not None:
                raise admitting.exception()
            if not closing and self.reading_done and not self.in_run:
                closing = True
                await fed.close()
            events = await fed.outcomes(timeout=POLL_SECONDS if not closing else 0.2)
            if fed.recoveries != self.recoveries:  # the executor was replaced: what it had not delivered
                self.recoveries = fed.recoveries
                held = await fed.held()
                events = [*events, *held.settled]
            await self._settle(events)

    async def _settle(self, events: list[FlowEvent], metadata: dict[str, dict[str, Any]] | None = None) -> None:
        if not events:
            return
        outcomes, seen, recorder, plan = [], [], self.recorder, self.plan
        for event in events:
            places = self.in_run.get(event.operation_id)
            if places is None and metadata is not None:
                places = _places(metadata.get(event.operation_id, {}))
            seen.append(event.operation_id)
            if not places:  # recorded before (a repeat after a recovery): only its release is left
                continue
            settled = recorder.outcomes(event, places)
            if settled is None:
                self.cancelled += len(places)
                continue
            outcomes.extend(settled)
            for ordinal, _ in places:
                plan.mark(ordinal)
        await recorder.record(outcomes)
        if recorder.call_seconds:
            self.sizer.observe(recorder.call_seconds, time.monotonic())
            recorder.call_seconds = []
        await self.fed.release(seen)
        for node_id in seen:
            self._let_go(node_id)
        recorder.progress.in_flight = self.rows_in_run
        self.room.set()
        if self.on_progress is not None:
            await _maybe_await(self.on_progress(recorder.progress))


@contextlib.contextmanager
def _young_collections_rarer() -> Iterator[None]:
    """The collector's youngest generation collected every 50,000 allocations, not 700, while rows
    are fed (then as it was): a window of rows in flight keeps thousands of young objects alive
    (rows read ahead, their operations, outcomes), and with the default every collection of the
    older generations scanned them again, about a quarter of the feeding's time (as in the
    executor and the workers, actors.settings.tune_garbage_collector)."""
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], 50_000), *threshold[1:])
    try:
        yield
    finally:
        if gc.get_threshold()[0] == max(threshold[0], 50_000):
            gc.set_threshold(*threshold)


def _operation(job_id: str, ordinals: list[int], keys: list[str], prompts: list[str]) -> AdmittedRow:
    node_id = node_id_of(job_id, keys[0] if len(keys) == 1 else "\x1f".join(keys))
    metadata = {"stateless": True, "reference_id": keys[0], "rows": ordinals, "keys": keys}
    if len(keys) > 1:  # its rows' calls in the run's capacity (kernel ``node_weight``), not one
        metadata["weight"] = len(keys)
    return node_id, ROWS_OPERATION, {"prompts": prompts}, metadata


def _places(metadata: dict[str, Any]) -> list[tuple[int, str]]:
    """An admitted operation's rows, (ordinal, key) each, from its metadata (``rows`` and ``keys``; a
    run fed before batches were has ``row`` and ``reference_id``, one row)."""
    ordinals, keys = metadata.get("rows"), metadata.get("keys")
    if isinstance(ordinals, list) and isinstance(keys, list) and len(ordinals) == len(keys):
        return [(ordinal, str(key)) for ordinal, key in zip(ordinals, keys, strict=True) if isinstance(ordinal, int)]
    ordinal = metadata.get("row")
    return [(ordinal, str(metadata.get("reference_id") or ""))] if isinstance(ordinal, int) else []


class WorkflowRows:
    """Runs a stored fixed workflow once per row (the row's columns as its inputs), through the lane
    registry, ``concurrency`` rows at a time; each row's run is recorded by its lane like any other."""

    def __init__(self, lane: Any, workflow: str, model: str | None, session: Any, job_id: str, plan: RowPlan,
                 recorder: RowRecorder, *, concurrency: int,
                 on_progress: Callable[[MapProgress], Any] | None = None) -> None:
        self.lane, self.workflow, self.model, self.session = lane, workflow, model, session
        self.job_id, self.plan, self.recorder = job_id, plan, recorder
        self.concurrency = max(1, concurrency)
        self.on_progress = on_progress

    async def run(self) -> None:
        progress, budget = self.recorder.progress, self.recorder.budget
        running: set[asyncio.Task] = set()
        for ordinal, key, values in self.plan.pending():
            while len(running) >= self.concurrency:
                finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    task.result()
            reason = budget.spent(len(running))
            if reason is not None:
                progress.stopped = reason
                break
            running.add(asyncio.ensure_future(self._row(ordinal, key, values)))
            progress.in_flight = len(running)
        if running:
            for task in asyncio.as_completed(running):
                await task

    async def _row(self, ordinal: int, key: str, values: dict[str, Any]) -> None:
        invocation = self.lane.invocation(self.workflow, inputs=dict(values), model=self.model,
                                          run_id=f"map-{self.job_id}-{node_id_of(self.job_id, key)[:8]}-"
                                                 f"{uuid.uuid4().hex[:8]}")
        try:
            prepared = await self.lane.prepare(invocation)
            result = await self.lane.execute(prepared, session=self.session)
        except Exception as exc:  # noqa: BLE001 - the row's workflow could not run: the row failed, with why
            outcome = RowOutcome(key, ordinal, "failed", error=f"{type(exc).__name__}: {exc}")
        else:
            outcome = self._outcome(key, ordinal, result)
        await self.recorder.record([outcome])
        self.plan.mark(ordinal)
        progress = self.recorder.progress
        progress.in_flight = max(0, progress.in_flight - 1)
        if self.on_progress is not None:
            await _maybe_await(self.on_progress(progress))

    def _outcome(self, key: str, ordinal: int, result: Any) -> RowOutcome:
        calls = prompt = completion = 0
        cost, model = 0.0, None
        for output in result.outputs.values():
            usage = output.get("usage") if isinstance(output, dict) else None
            if isinstance(usage, dict):
                calls += int(usage.get("calls") or 0)
                prompt += int(usage.get("prompt_tokens") or 0)
                completion += int(usage.get("completion_tokens") or 0)
                model = output.get("model") or model
                if output.get("model"):
                    cost += self.recorder.prices.cost({output["model"]: usage})[0]
        common = {"calls": calls, "prompt_tokens": prompt, "completion_tokens": completion, "cost_usd": cost,
                  "model": model, "run_id": result.run_id}
        if result.status == "completed":
            answer = {name: (output.get("text") if isinstance(output, dict) and "text" in output else output)
                      for name, output in result.outputs.items()}
            return RowOutcome(key, ordinal, "done", answer=answer, **common)
        return RowOutcome(key, ordinal, "failed", error=f"the workflow run {result.run_id} ended {result.status}: "
                                                        f"{result.errors}", **common)


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value):
        return await value
    return value
