"""Engine: reusable configuration, the run lifecycle, judging and degradation (ADR-0034 D1, D3, D5).

Owns ``Engine`` (stateless, reusable settings; ``new_run``/``run``/``execute``), the
advisory ``judge``, and how a run ends: a clean or degraded ``EngineResult``, a
shielded and bounded partial export, or a propagated failure or cancellation after
run-owned cleanup. Domain engines subclass it and implement ``_run``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from opgraph.actors.models import ModelIdentityError, parse_model_id
from opgraph.actors.verbs import json_candidates
from opgraph.kernel import OpGraphError

from .agents import emission_bundle
from .budget import BudgetLimits, PriceTable
from .errors import EngineBudgetError, EngineError, EngineInputError, EventSinkError
from .events import DEFAULT_MAX_RETAINED_EVENTS, DEFAULT_MAX_RETAINED_NOTIFICATIONS, EventSink, JudgeVerdict
from .result import EngineResult
from .run import EngineRun, EventCallback
from .statistics import EngineCounters, counters_for

__all__ = ["PARTIAL_EXPORT_TIMEOUT_S", "Engine"]

log = logging.getLogger(__name__)

PARTIAL_EXPORT_TIMEOUT_S = 120.0  # a hung synthesis cannot extend a stopped run without bound


def _check_model(name: str, model: Any) -> None:
    if model is None:
        return
    try:
        parse_model_id(model)
    except ModelIdentityError as exc:
        raise EngineInputError(f"{name}: {exc.message}") from None


def _positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise EngineInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _only_budget(group: BaseExceptionGroup) -> bool:
    """True when every leaf of ``group`` is an EngineBudgetError (cancellations aside)."""
    leaves = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        else:
            leaves.append(error)

    walk(group)
    budget = [leaf for leaf in leaves if isinstance(leaf, EngineBudgetError)]
    others = [leaf for leaf in leaves if not isinstance(leaf, (EngineBudgetError, asyncio.CancelledError))]
    return bool(budget) and not others


def _caller_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Engine:
    """Reusable engine configuration; every invocation gets a fresh ``EngineRun`` (D1).

    The record's settings, plus hard ``max_tokens`` and ``max_cost_usd`` budgets priced
    by ``prices`` (dollars per million tokens per ``provider/model``; ``sim/*`` and
    ``scripted/*`` are free). With ``max_cost_usd`` set, a turn on a model without a
    price spends the cost budget at once (fail closed: its cost is unknown).
    ``event_sink`` receives every record of every run (cluster/ supplies SQLite).
    """

    run_context_cls: type[EngineRun] = EngineRun
    kind = "engine"
    partial_export_timeout_s = PARTIAL_EXPORT_TIMEOUT_S

    def __init__(
        self,
        *,
        model: str | None = None,
        models: dict[str, str] | None = None,
        max_depth: int = 3,
        max_concurrent: int = 5,
        max_agents: int = 50,
        deadline_s: float | None = None,
        judge_model: str | None = None,
        judge_role: str = "critic",
        cancel_timeout_s: float = 30.0,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
        prices: Mapping[str, Any] | None = None,
        turn_timeout_s: float | None = None,
        event_sink: EventSink | None = None,
        max_retained_events: int = DEFAULT_MAX_RETAINED_EVENTS,
        max_retained_notifications: int = DEFAULT_MAX_RETAINED_NOTIFICATIONS,
    ) -> None:
        if models is not None and not isinstance(models, Mapping):
            raise EngineInputError(f"models must map stage names to 'provider/model', got {type(models).__name__}")
        _check_model("model", model)
        _check_model("judge_model", judge_model)
        for stage, stage_model in (models or {}).items():
            _check_model(f"models[{stage!r}]", stage_model)
        self.model = model
        self.models = dict(models or {})  # copied: a caller's later edit changes nothing here
        self.max_depth = _positive_int("max_depth", max_depth, minimum=0)
        self.max_concurrent = _positive_int("max_concurrent", max_concurrent)
        self.limits = BudgetLimits(max_agents=max_agents, deadline_s=deadline_s, max_tokens=max_tokens,
                                   max_cost_usd=max_cost_usd)
        self.prices = PriceTable(prices)
        if max_cost_usd is not None:
            named = [model, judge_model, *self.models.values()]
            unpriced = sorted({m for m in named if m is not None and self.prices.price_for(m) is None})
            if unpriced:
                raise EngineInputError(f"max_cost_usd needs a price for {', '.join(unpriced)}; "
                                       "give prices={'provider/model': (prompt, completion)} in $ per million tokens")
        self.judge_model = judge_model
        self.judge_role = judge_role
        for name, value in (("cancel_timeout_s", cancel_timeout_s), ("turn_timeout_s", turn_timeout_s)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise EngineInputError(f"{name} must be a positive number of seconds, got {value!r}")
        self.cancel_timeout_s = cancel_timeout_s
        self.turn_timeout_s = turn_timeout_s
        self.event_sink = event_sink
        self.max_retained_events = _positive_int("max_retained_events", max_retained_events)
        self.max_retained_notifications = _positive_int("max_retained_notifications", max_retained_notifications)

    # -- the record's small helpers --------------------------------------------------------
    @property
    def max_agents(self) -> int:
        return self.limits.max_agents

    @property
    def deadline_s(self) -> float | None:
        return self.limits.deadline_s

    @property
    def statistics_counters(self) -> EngineCounters:
        return counters_for(self.kind)

    def statistics(self) -> dict[str, Any]:
        """This engine kind's counters in this process (agents made, exhaustions, judge outcomes...)."""
        return self.statistics_counters.snapshot()

    def model_for(self, stage: str) -> str | None:
        """The stage's model when one is mapped, else the base model."""
        return self.models.get(stage) or self.model

    def config(self) -> dict[str, Any]:
        """The settings a run records with itself (what the store shows for it)."""
        return {
            "kind": self.kind, "model": self.model, "models": dict(self.models), "max_depth": self.max_depth,
            "max_concurrent": self.max_concurrent, "max_agents": self.limits.max_agents,
            "deadline_s": self.limits.deadline_s, "max_tokens": self.limits.max_tokens,
            "max_cost_usd": self.limits.max_cost_usd, "judge_model": self.judge_model,
            "cancel_timeout_s": self.cancel_timeout_s,
        }

    # -- hooks for domain engines ---------------------------------------------------------
    def validate(self, *args: Any, **kwargs: Any) -> None:
        """Refuse bad input with EngineInputError before any run state or agent exists."""

    def describe_input(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The invocation's input as plain data, for the run store."""
        return {"args": [str(arg)[:4000] for arg in args], "kwargs": {k: str(v)[:4000] for k, v in kwargs.items()}}

    def describe_result(self, result: Any) -> str | None:
        """The result as the run store keeps it: the text of a string result, else its repr."""
        return str(result) if isinstance(result, str) else (None if result is None else repr(result))

    async def _run(self, run: EngineRun, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement _run(run, ...)")

    async def _partial_export(self, run: EngineRun) -> str | None:
        """Text from evidence already collected, after budget or deadline stopped the run.

        The default exports nothing. Exempt agents may be used: the export is shielded
        from the run's cancellation and bounded by ``partial_export_timeout_s``.
        """
        return None

    # -- D1 ------------------------------------------------------------------------------
    def new_run(self, *, session: Any = None, on_event: EventCallback | None = None,
                on_branch_created: Callable[[Any], None] | None = None, port: Any = None,
                event_sink: EventSink | None = None, run_id: str | None = None) -> EngineRun:
        return self.run_context_cls(self, session=session, on_event=on_event, on_branch_created=on_branch_created,
                                    port=port, event_sink=event_sink, run_id=run_id)

    async def run(self, *args: Any, session: Any = None, on_event: EventCallback | None = None,
                  on_branch_created: Callable[[Any], None] | None = None, port: Any = None,
                  event_sink: EventSink | None = None, **kwargs: Any) -> Any:
        """Validate, make a fresh run, execute it (D5). See ``execute``."""
        self.validate(*args, **kwargs)
        run = self.new_run(session=session, on_event=on_event, on_branch_created=on_branch_created, port=port,
                           event_sink=event_sink)
        return await self.execute(run, *args, **kwargs)

    # -- D5 ------------------------------------------------------------------------------
    async def execute(self, run: EngineRun, *args: Any, **kwargs: Any) -> Any:
        """Run ``_run`` as the root task under the deadline watchdog; return its result.

        - A plain string becomes an EngineResult; other values pass through unchanged.
        - Root budget exhaustion (or a group of only budget errors) or the internal deadline:
          cancel spawned work, export partial evidence, return a degraded result.
        - Any other error, or a group with any non-budget leaf, propagates after cleanup;
          so does the caller's cancellation.
        """
        self.validate(*args, **kwargs)
        if run.status != "created":
            raise EngineError(f"run {run.run_id} was already executed; make a new run", run_id=run.run_id)
        run.status = "running"
        self.statistics_counters.add("runs_started")
        await self._open(run, args, kwargs)
        root = asyncio.ensure_future(self._run(run, *args, **kwargs))
        run._run_task = root
        watchdog = asyncio.ensure_future(run._watch_deadline()) if run.budget.deadline is not None else None
        try:
            try:
                value = await root
            except asyncio.CancelledError:
                if _caller_cancelled() or not run.deadline_hit:
                    raise
                result = await self._degrade(run, "deadline")
            except EngineBudgetError:
                result = await self._degrade(run, "budget")
            except BaseExceptionGroup as group:
                if not _only_budget(group):
                    raise
                result = await self._degrade(run, "budget")
            else:
                result = self._wrap_result(run, value)
        except BaseException as error:
            status = "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"
            try:
                await self._close(run, watchdog, status, None, error)
            except EventSinkError as sink_error:
                error.add_note(f"also, the run's events could not all be recorded: {sink_error}")
            raise
        # An EngineResult, or a structured domain result (coding's) that states its own degradation.
        status = "degraded" if getattr(result, "degraded", False) is True else "completed"
        await self._close(run, watchdog, status, result, None)
        return result

    async def _open(self, run: EngineRun, args: tuple, kwargs: dict) -> None:
        sink = run.log.sink
        if sink is not None:
            try:
                await asyncio.to_thread(sink.open_run, run.run_id, engine=self.kind,
                                        inputs=self.describe_input(*args, **kwargs), config=self.config())
            except Exception as exc:  # any sink failure is translated at this boundary, and raised
                run.status = "failed"
                raise EventSinkError(f"the run could not be recorded: {type(exc).__name__}: {exc}",
                                     run_id=run.run_id) from exc
        run.notify("run_started", engine=self.kind, **{k: v for k, v in self.config().items() if k != "kind"})

    def _wrap_result(self, run: EngineRun, value: Any) -> Any:
        """Wrap a plain string; an EngineResult or a non-string domain result passes through."""
        if isinstance(value, EngineResult) or not isinstance(value, str):
            return value
        reason = ""
        if run.budget_hit:
            reason = "deadline" if run.exhausted_reason == "deadline" else "budget"
        elif run._emission_failures:
            reason = "emission_failure"
        run.degrade_reason = reason
        return EngineResult(value, events_by_type=run.by_type, skipped=list(run._emission_failures),
                            degraded=bool(reason), run=run, degrade_reason=reason)

    async def _degrade(self, run: EngineRun, reason: str) -> EngineResult:
        run.degrade_reason = reason
        await run.cancel_active()
        text = await self._export_partial(run)
        return EngineResult(text or "", events_by_type=run.by_type, skipped=list(run._emission_failures),
                            degraded=True, run=run, degrade_reason=reason)

    async def _export_partial(self, run: EngineRun) -> str | None:
        """``_partial_export`` shielded from the run and bounded; a failure yields no text.

        The caller's cancellation during the export cancels the export and propagates.
        """
        export = asyncio.ensure_future(self._partial_export(run))
        try:
            return await asyncio.wait_for(asyncio.shield(export), self.partial_export_timeout_s)
        except asyncio.CancelledError:
            export.cancel()
            raise
        except TimeoutError:
            export.cancel()
            log.warning("engine run %s: partial export timed out after %s s", run.run_id,
                        self.partial_export_timeout_s)
            run.notify("partial_export_failed", reason="timeout", timeout_s=self.partial_export_timeout_s)
            return None
        except Exception as exc:  # noqa: BLE001 - D5: a failed export yields no partial result, recorded
            log.warning("engine run %s: partial export failed: %s: %s", run.run_id, type(exc).__name__, exc)
            run.notify("partial_export_failed", reason="error", error=str(exc), error_type=type(exc).__name__)
            return None

    async def _close(self, run: EngineRun, watchdog: asyncio.Task | None, status: str, result: Any,
                     error: BaseException | None) -> None:
        """Run-owned cleanup: stop the watchdog, cancel spawned work, close a Session the run
        made for itself (never a supplied one), record the end durably."""
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
        await run.cancel_active()
        await self._release_session(run)
        run.status = status
        self.statistics_counters.finished(status)
        error_data = None if error is None else {"error": str(error), "error_type": type(error).__name__}
        run.notify("run_finished", status=status, degrade_reason=run.degrade_reason,
                   skipped=list(run._emission_failures), **({"error": error_data} if error_data else {}))
        await run.log.drain()
        sink = run.log.sink
        if sink is None:
            return
        text = self.describe_result(result)
        try:
            await asyncio.shield(asyncio.to_thread(
                sink.close_run, run.run_id, status, result=text, degrade_reason=run.degrade_reason,
                error=error_data, statistics=run.statistics()))
        except Exception as exc:  # any sink failure is translated at this boundary, and raised
            raise EventSinkError(f"the run's end could not be recorded: {type(exc).__name__}: {exc}",
                                 run_id=run.run_id) from exc

    @staticmethod
    async def _release_session(run: EngineRun) -> None:
        """Close the run's own Session; a failure to close is recorded, and the result stands."""
        try:
            dropped = await run.release()
        except OpGraphError as exc:
            run.notify("session_close_failed", error=str(exc), error_type=type(exc).__name__)
            return
        if dropped is not None:
            run.notify("session_closed", branches_dropped=dropped)

    # -- D3: the advisory judge ----------------------------------------------------------
    async def judge(self, run: EngineRun, eid: str, subject: str) -> bool:
        """Advisory gate for expansion: True lets ``eid`` proceed.

        No ``judge_model``: True. A typed JudgeVerdict for ``eid`` in the reply is
        authoritative; otherwise a reply containing "reject" fails the gate. Budget
        exhaustion fails closed (False); any other error fails open (``judge_error``, True).
        """
        counters = self.statistics_counters

        def judged(outcome: str, allowed: bool, **data: Any) -> bool:
            counters.judged(outcome)
            run.notify("judged", eid=eid, outcome=outcome, allowed=allowed, **data)
            return allowed

        if not self.judge_model:
            return judged("skipped", True)
        try:
            async with run.judge_lock:  # concurrent judgements share one judge agent
                agent = run.agents.get("judge") or await run.make_agent(
                    self.judge_role, name="judge", model=self.judge_model, emits=(JudgeVerdict,))
            schema = emission_bundle((JudgeVerdict,)).model_json_schema()
            instruction = (f"Decide whether this work should go ahead.\nid: {eid}\nsubject: {subject}\n\n"
                           f"Reply with a JSON object matching this schema, with subject set to {eid!r}: {schema}")
            result = await run.turn(agent, instruction, operation="chat")
        except EngineBudgetError:
            return judged("budget", False)
        except Exception as exc:  # noqa: BLE001 - D3: infrastructure failure fails open, recorded
            run.notify("judge_error", eid=eid, error=str(exc), error_type=type(exc).__name__)
            return judged("error", True)
        text = result.response if isinstance(result.response, str) else str(result.response)
        for verdict in self._verdicts(run, agent, text):
            if verdict.subject == eid:
                return judged("allow" if verdict.allow else "reject", verdict.allow, typed=True)
        allowed = "reject" not in text.lower()
        return judged("allow" if allowed else "reject", allowed, typed=False)

    @staticmethod
    def _verdicts(run: EngineRun, agent: Any, text: str) -> list[JudgeVerdict]:
        """Typed verdicts in the judge's reply (bare, or in an emission bundle), recorded as its emissions."""
        bundle = emission_bundle((JudgeVerdict,))
        for candidate in json_candidates(text):
            for kind in (bundle, JudgeVerdict):
                try:
                    parsed = kind.model_validate_json(candidate)
                except ValidationError:
                    continue
                if isinstance(parsed, JudgeVerdict) or any(getattr(parsed, name) for name in type(parsed).model_fields):
                    return run._observe(agent, parsed)
        return []
