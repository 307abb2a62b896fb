"""The ADR-0034 contract, written once, that every domain engine must pass (D1 to D6).

Each engine is one ``EngineCase`` in ``CASES``; every test below runs for every case:

    reused Engine ──> run A, run B        isolated: session used as given, own events, keys,
                                          counters, agents, deadline (D1)
    hard bounds ────> agents, deadline,   hold whatever the model does; turns in flight
                      tokens, cost        never exceed max_concurrent (D2)
    prose emission ─> observable, at most 1 + repair turns, nothing fabricated (D3)
    judge ──────────> fails open on an infrastructure error, closed without budget (D3)
    terminal turn ──> exempt from the agent bound; partial export after a spent budget (D5)
    cancellation, a non-budget failure ──> propagate, the run recorded as such (D5)
    bounded vs broken ──> degradation and skipped emissions on the result (D5)
    budget ─────────> tokens_used - estimated_tokens == what the provider itself counted

A case names the engine's roles by the agent names its runs give them, scripts a clean run
(``replies``: agent name or name prefix -> reply, as ``ByAgent`` takes them), and says
what the contract looks like for it: ``make`` (the engine from settings: model,
max_agents, deadline_s, max_tokens, max_cost_usd, prices, max_concurrent, judge_model),
``subject`` (its run arguments, made under a temporary folder), ``terminal`` (its exempt
final agent's name and the text its reply puts in the result), ``min_agents``, the
``prose`` agent and what its missing emission becomes, and how its result reads:
``diagnostics`` (degraded, degrade_reason, skipped) and ``text``.

The coding engine returns a structured record (``CodeResultRecorded``), not an
EngineResult: its entry reads the diagnostics and the report off that record, and its
subject is a fresh throw-away project whose one test fails until the implementer's change
is written into the workspace copy (the gate is a real subprocess, a quick interpreter).
It is a chain, so one turn is in flight at a time (``in_flight``): the concurrency test
checks for it that the bound is never passed, not that it is reached. Only research
consults the judge in its topology; for the others the judge test checks the one they
inherit.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import ray
from coding_fixtures import FIXED, PLAN, VERIFIED, change, edit, make_project
from engine_scripts import HANG, ByAgent, js, last_user
from running import run_engine as run

from opgraph.actors import RuntimeLostError
from opgraph.actors.models import ProviderUnavailable
from opgraph.engines import (
    ChangeProposed,
    CodeResultRecorded,
    CodingEngine,
    CodingSpec,
    Engine,
    EngineEvent,
    EngineResult,
    HypothesisEngine,
    PlanError,
    PlanningEngine,
    PlanProposed,
    ResearchEngine,
    ReviewEngine,
    SessionPort,
)

pytestmark = pytest.mark.ray

DEADLINE_S = 1.0


def engine_result_diagnostics(result: Any) -> dict[str, Any]:
    assert isinstance(result, EngineResult), f"a string-producing engine returns an EngineResult, got {result!r}"
    return {"degraded": result.degraded, "degrade_reason": result.degrade_reason, "skipped": list(result.skipped)}


def coding_record_diagnostics(result: Any) -> dict[str, Any]:
    """The same diagnostics off coding's structured record, which also says ``stopped`` exactly
    when a budget or the deadline ended the chain."""
    assert isinstance(result, CodeResultRecorded), f"the coding engine returns its record, got {result!r}"
    assert result.run is not None and result.run_id == result.run.run_id
    assert (result.verdict == "stopped") == (result.degrade_reason in ("budget", "deadline"))
    return {"degraded": result.degraded, "degrade_reason": result.degrade_reason, "skipped": list(result.skipped)}


@dataclass(frozen=True)
class EngineCase:
    """One engine under the contract (see the module docstring for what each field means)."""

    name: str
    make: Callable[..., Engine]
    subject: Callable[[Path], tuple]
    replies: dict[str, Any]
    terminal: tuple[str, str]  # (exempt final agent, a text its reply leaves in the result)
    min_agents: int  # non-exempt agents a clean run makes
    prose: str  # an agent whose typed emission the topology needs
    prose_outcome: type[BaseException] | None = None  # None: the miss is a skipped diagnostic; else this raises
    prose_event: type | None = None  # the event the prose agent owed: after its miss no agent has one
    miss_notification: str = "emission_missing"
    diagnostics: Callable[[Any], dict[str, Any]] = engine_result_diagnostics
    text: Callable[[Any], str] = str  # the result as a reader gets it
    partial_evidence: str = ""  # a text of the first turn's reply that a partial export must carry
    in_flight: int | None = None  # the most turns its topology ever has at once (None: as many as allowed)
    settings: dict[str, Any] = field(default_factory=dict)  # fixed settings of this engine's clean run

    def __str__(self) -> str:
        return self.name


# -- the engines ---------------------------------------------------------------------------

def _planned(*roles: str) -> str:
    return js({"assignments": [{"task": f"task for the {role}", "assignee": role} for role in roles]})


def _task_reply(request: Any) -> str:
    return js({"text": f"did: {last_user(request).splitlines()[0][:40]}", "spawn": []})


PLANNING = EngineCase(
    name="planning",
    make=PlanningEngine,
    subject=lambda folder: ("plan a picnic",),
    replies={"orchestrator": _planned("researcher", "analyst", "writer"), "researcher": _task_reply,
             "analyst": _task_reply, "writer": _task_reply, "critic": _task_reply, "synthesizer": "PLANNING-DONE"},
    terminal=("synthesizer", "PLANNING-DONE"),
    min_agents=1 + 4,  # the orchestrator and one agent per roster role
    prose="orchestrator",
    prose_outcome=PlanError,  # an empty plan is retried once, then the run fails: nothing to run
    prose_event=PlanProposed,
    miss_notification="plan_empty",
)

_CLEAN_REVIEW = js({"issue_found": [], "dimension_reviewed": [{"dimension": "x", "summary": "nothing found"}]})
REVIEW = EngineCase(
    name="review",
    make=ReviewEngine,
    subject=lambda folder: ("def load(path):\n    return eval(open(path).read())\n",),
    replies={"reviewer": _CLEAN_REVIEW, "verdict": js({"review_verdict": [{"verdict": "approve",
                                                                          "rationale": "REVIEW-DONE"}]})},
    terminal=("verdict", "REVIEW-DONE"),
    min_agents=4,  # one reviewer per dimension
    prose="reviewer-security",
)


def _finding(text: str) -> dict[str, Any]:
    return {"description": text, "novelty": 0.1, "confidence": 0.6, "severity": "minor", "aspect": "evidence",
            "sources": ["doi:1"]}


def _analyst(request: Any) -> str:
    root = "This is a deeper look within" not in last_user(request)
    asks = [{"question": "how do dendrites grow", "aspect": "risks"},
            {"question": "what do cells cost", "aspect": "costs"}] if root else []
    return js({"finding_emitted": [_finding(f"implication {len(last_user(request))}")], "depth_requested": asks})


RESEARCH = EngineCase(
    name="research",
    make=ResearchEngine,
    subject=lambda folder: ("solid-state batteries",),
    replies={"researcher": lambda request: js({"finding_emitted": [_finding(f"fact {len(last_user(request))}")]}),
             "analyst": _analyst,
             "critic": js({"contradiction_found": [], "finding_emitted": [_finding("the evidence is thin")],
                           "depth_requested": []}),
             "synthesizer": "RESEARCH-DONE"},
    terminal=("synthesizer", "RESEARCH-DONE"),
    min_agents=3 * 3,  # the root and two deeper nodes, a team of three each
    prose="researcher-n1",
    settings={"max_depth": 1},
)


def _investigator(request: Any) -> str:
    text = last_user(request)
    if "Collect the evidence" in text:
        return js({"evidence_collected": [{"summary": "it is so", "sources": ["doi:2"], "strength": 0.6}]})
    if "Form testable hypotheses" in text:
        return js({"hypothesis_formed": [{"statement": "s", "metric": "m", "threshold": "t", "falsifier": "f"}]})
    return js({"experiment_designed": [{"method": "simulation", "procedure": "p", "acceptance": "a"}]})


def _hypothesis_analyst(request: Any) -> str:
    if "conclusion_drawn" in last_user(request):
        return js({"conclusion_drawn": [{"basis": "b", "confidence": 0.7}]})
    return js({"application_mapped": [{"effect": "e"}], "question_raised": []})


HYPOTHESIS = EngineCase(
    name="hypothesis",
    make=HypothesisEngine,
    subject=lambda folder: (["seed one", "seed two", "seed three"],),
    replies={"questioner": js({"question_raised": [{"area": "a", "what_is_unknown": "w"}]}),
             "investigator": _investigator,
             "runner": js({"result_recorded": [{"measurements": ["x = 1"], "passed": True}]}),
             "analyst": _hypothesis_analyst, "synthesizer": "HYPOTHESIS-DONE"},
    terminal=("synthesizer", "HYPOTHESIS-DONE"),
    min_agents=3 * 4,  # per seed: questioner, investigator, runner, analyst
    prose="questioner-F1",
)

# The gate: the project's one test, as a quick interpreter rather than pytest (it runs in every coding run).
_ADDS = (sys.executable, "-B", "-c", "from calc import add; raise SystemExit(add(2, 3) != 5)")


def _coding_subject(folder: Path) -> tuple[CodingSpec]:
    """A fresh throw-away project under ``folder`` whose test fails until ``add`` adds."""
    project, _ = make_project(Path(tempfile.mkdtemp(prefix="coding-", dir=folder)))
    return (CodingSpec.build("make add() add its arguments", workspace=str(project), test_cmd=_ADDS),)


CODING = EngineCase(
    name="coding",
    make=CodingEngine,
    subject=_coding_subject,
    replies={"planner": PLAN, "implementer": change(edit("calc.py", FIXED), summary="add adds"),
             "verifier": VERIFIED},
    terminal=("verifier", "Coding verdict: passed"),  # only a verification that the criteria are met says so
    min_agents=2,  # the planner and the implementer; the verifier is exempt
    prose="implementer",
    prose_event=ChangeProposed,  # TestsRan ("gate") and the record ("engine") are the engine's own measurements
    diagnostics=coding_record_diagnostics,
    text=CodeResultRecorded.report,
    partial_evidence="make add add",  # the planner's approach: the plan is what exists when the budget stops it
    in_flight=1,  # a chain: plan, implement, test, verify, each waiting for the one before
    # No fix round: a clean run's change passes in round 0, and a missed change stays one stage's
    # miss (each fix round is a further implementer stage with its own repair bound).
    settings={"max_fix_rounds": 0, "test_timeout_s": 30.0, "turn_timeout_s": 60.0, "kill_grace_s": 0.5},
)

CASES = [PLANNING, REVIEW, RESEARCH, HYPOTHESIS, CODING]

every_engine = pytest.mark.parametrize("case", CASES, ids=str)


# -- helpers ---------------------------------------------------------------------------------

def build(case: EngineCase, model: Callable[..., str], replies: dict[str, Any] | None = None,
          usage: dict[str, int] | None = None, **settings: Any) -> Engine:
    """The case's engine on a scripted model answering ``replies`` (the clean run's by default)."""
    script = ByAgent({**case.replies, **(replies or {})})
    return case.make(model=model(script, **(usage or {})), **{**case.settings, **settings})


async def execute(engine: Engine, case: EngineCase, folder: Path, session: Any, **options: Any) -> tuple[Any, Any]:
    """(result, run): the run is made first, so it is at hand whatever the result type."""
    fresh = engine.new_run(session=session, **options)
    return await engine.execute(fresh, *case.subject(folder)), fresh


def turns_of(run_: Any, agent: str) -> int:
    return sum(1 for record in run_.events.notifications()
               if record.type in ("turn_completed", "agent_error") and record.agent == agent)


def provider_tokens(session: Any, model_id: str) -> int:
    """What the scripted provider itself counted (every worker's provider totals, by provider name)."""
    name = model_id.split("/", 1)[0]
    totals = ray.get([worker.statistics.remote() for worker in session.runtime.workers], timeout=30)
    return sum(t["providers"].get(name, {}).get("prompt_tokens", 0)
               + t["providers"].get(name, {}).get("completion_tokens", 0) for t in totals)


def most_in_flight(run_: Any) -> int:
    """The most agent turns (or DAG nodes) in flight at once, from the run's own record."""
    edges: list[tuple[float, int]] = []
    for record in run_.events.notifications():
        if record.type == "turn_completed":
            edges += [(record.at - record.data["elapsed"], 1), (record.at, -1)]
    nodes = 0
    peak = 0
    for record in run_.events.notifications("dag_progress"):  # in the executor's order
        nodes += {"started": 1, "completed": -1, "failed": -1, "cancelled": -1}.get(record.data["status"], 0)
        peak = max(peak, nodes)
    level = 0
    for _, step in sorted(edges, key=lambda edge: (edge[0], edge[1])):
        level += step
        peak = max(peak, level)
    return peak


# -- D1: a reused Engine gives isolated runs -------------------------------------------------

@every_engine
def test_a_reused_engine_gives_isolated_runs(case, session, model, tmp_path):
    engine = build(case, model, deadline_s=60.0)
    first, first_run = run(execute(engine, case, tmp_path, session))
    snapshot = (first_run.agents_made, first_run.budget.tokens_used, len(first_run.by_type(EngineEvent)),
                dict(first_run.agents), set(first_run._seen), first_run.log.seq)
    second, second_run = run(execute(engine, case, tmp_path, session))
    assert first_run is not second_run and first_run.run_id != second_run.run_id
    assert first_run.session is session and second_run.session is session  # used as given, never cloned
    # nothing of the first run moved, and the second started from nothing
    assert snapshot == (first_run.agents_made, first_run.budget.tokens_used, len(first_run.by_type(EngineEvent)),
                        dict(first_run.agents), set(first_run._seen), first_run.log.seq)
    assert second_run.agents_made == first_run.agents_made and second_run.budget.tokens_used == \
        first_run.budget.tokens_used  # per-run counters: equal runs count equally, never cumulatively
    assert len(second_run.by_type(EngineEvent)) == len(first_run.by_type(EngineEvent))
    assert {a.id for a in first_run.agents.values()}.isdisjoint(a.id for a in second_run.agents.values())
    assert second_run._seen is not first_run._seen and second_run.tasks is not first_run.tasks
    assert all(r.run_id == second_run.run_id for r in second_run.events.events())
    assert second_run._deadline == pytest.approx(second_run._t0 + 60.0) and second_run._deadline > first_run._deadline
    assert case.diagnostics(second) == {"degraded": False, "degrade_reason": "", "skipped": []}


# -- D2: hard bounds ------------------------------------------------------------------------

@every_engine
def test_the_agent_bound_holds(case, session, model, tmp_path):
    bound = min(2, case.min_agents - 1)  # below what a clean run makes
    engine = build(case, model, max_agents=bound)
    result, bounded = run(execute(engine, case, tmp_path, session))
    working = [agent for agent in bounded.agents.values() if not agent.exempt]
    assert len(working) <= bound and bounded.agents_made <= bound + sum(a.exempt for a in bounded.agents.values())
    assert case.diagnostics(result)["degrade_reason"] == "budget" and bounded.status == "degraded"


@every_engine
def test_the_deadline_holds(case, session, model, tmp_path):
    engine = build(case, model, replies={name: HANG for name in case.replies}, deadline_s=DEADLINE_S)
    started = time.monotonic()
    result, bounded = run(execute(engine, case, tmp_path, session))
    assert time.monotonic() - started < DEADLINE_S + 10  # cleanup is bounded too
    assert case.diagnostics(result)["degrade_reason"] == "deadline" and bounded.deadline_hit
    assert not bounded._active


@every_engine
def test_the_token_bound_holds(case, session, model, tmp_path):
    """100 tokens a call, max_tokens 50: the first turns spend it; what else runs is the
    turns already in flight (at most max_concurrent; one cut off is counted at an estimate)
    and the exempt terminal turn."""
    engine = build(case, model, usage={"prompt_tokens": 60, "completion_tokens": 40}, max_tokens=50,
                   max_concurrent=2)
    result, bounded = run(execute(engine, case, tmp_path, session))
    budget = bounded.budget
    assert bounded.exhausted_reason == "tokens" and case.diagnostics(result)["degrade_reason"] == "budget"
    assert budget.tokens_used - budget.estimated_tokens <= 50 + 2 * 100 + 100 and budget.estimated_calls <= 2


@every_engine
def test_the_cost_bound_holds(case, session, model, tmp_path):
    script_model = model(ByAgent(case.replies), prompt_tokens=1000, completion_tokens=0)
    engine = case.make(model=script_model, max_cost_usd=0.005, max_concurrent=2,
                       prices={script_model: (10.0, 30.0)}, **case.settings)  # $0.01 a call
    result, bounded = run(execute(engine, case, tmp_path, session))
    budget = bounded.budget
    assert bounded.exhausted_reason == "cost" and case.diagnostics(result)["degrade_reason"] == "budget"
    reported_calls = budget.calls - budget.estimated_calls  # each reported call cost $0.01
    assert reported_calls * 0.01 <= 0.005 + 2 * 0.01 + 0.01 + 1e-9 and budget.estimated_calls <= 2


@pytest.mark.parametrize("case", [
    case if case.in_flight is None else
    pytest.param(case, id=f"{case.name}-a-chain-has-{case.in_flight}-turn-in-flight-so-2-is-never-reached")
    for case in CASES], ids=str)
def test_turns_in_flight_never_exceed_max_concurrent(case, session, model, tmp_path):
    async def slow(reply: Any) -> Any:
        await asyncio.sleep(0.3)
        return reply

    def delayed(reply: Any) -> Any:
        return lambda request: slow(reply(request) if callable(reply) else reply)

    engine = build(case, model, replies={name: delayed(reply) for name, reply in case.replies.items()},
                   max_concurrent=2)
    result, bounded = run(execute(engine, case, tmp_path, session))
    assert not case.diagnostics(result)["degraded"]
    assert most_in_flight(bounded) == min(2, case.in_flight or 2)  # reached (as far as the topology goes), never passed


# -- D3: emissions and the judge --------------------------------------------------------------

@pytest.mark.parametrize("reply", ["I looked; it all seems fine.", '{"unfinished": ['], ids=["prose", "malformed"])
@every_engine
def test_a_missing_emission_is_observable_bounded_and_never_fabricated(case, reply, session, model, tmp_path):
    engine = build(case, model, replies={case.prose: reply})
    fresh = engine.new_run(session=session)
    if case.prose_outcome is None:
        result = run(engine.execute(fresh, *case.subject(tmp_path)))
        assert case.diagnostics(result)["skipped"] == [f"{case.prose} x2"]
        assert case.diagnostics(result)["degrade_reason"] == "emission_failure"
    else:
        with pytest.raises(case.prose_outcome):
            run(engine.execute(fresh, *case.subject(tmp_path)))
    assert turns_of(fresh, case.prose) == 2  # the turn and the one configured repair
    assert fresh.events.notifications(case.miss_notification)
    assert fresh.by_type(EngineEvent, agent=case.prose) == []
    if case.prose_event is not None:
        assert fresh.by_type(case.prose_event) == []


@every_engine
def test_the_judge_fails_open_on_an_infrastructure_error_and_closed_without_budget(case, session, model):
    down = model(ByAgent(default=ProviderUnavailable("judge service down", provider="x", status=503)))

    async def judged(max_agents: int, spend: int) -> tuple[bool, Any]:
        engine = case.make(judge_model=down, max_agents=max_agents, **case.settings)
        fresh = engine.new_run(session=session)
        for index in range(spend):
            await fresh.make_agent("worker", name=f"spender-{index}")
        return await engine.judge(fresh, "X1", "a deeper look"), fresh

    allowed, open_run = run(judged(5, 0))
    assert allowed is True and open_run.events.notifications("judge_error")[0].data["eid"] == "X1"
    refused, closed_run = run(judged(1, 1))
    assert refused is False and closed_run.events.notifications("judged")[0].data["outcome"] == "budget"


# -- D5: terminal turns, propagation, degradation ------------------------------------------------

@every_engine
def test_the_terminal_turn_is_exempt_from_the_agent_bound(case, session, model, tmp_path):
    engine = build(case, model, max_agents=case.min_agents)
    result, bounded = run(execute(engine, case, tmp_path, session))
    terminal, text = case.terminal
    assert bounded.agents[terminal].exempt and bounded.agents_made == case.min_agents + 1
    assert text in case.text(result)


@every_engine
def test_a_partial_export_follows_a_spent_budget(case, session, model, tmp_path):
    engine = build(case, model, usage={"prompt_tokens": 60, "completion_tokens": 40}, max_tokens=50,
                   max_concurrent=2)
    result, bounded = run(execute(engine, case, tmp_path, session))
    assert case.diagnostics(result)["degraded"] and bounded.exhausted_reason == "tokens"
    assert case.text(result).strip(), "evidence was collected, so the result reports it"
    assert case.partial_evidence in case.text(result)


@every_engine
def test_external_cancellation_propagates_after_cleanup(case, session, model, tmp_path):
    engine = build(case, model, replies={name: HANG for name in case.replies})

    async def cancel_mid_turn() -> Any:
        working = asyncio.Event()

        def watch(event: dict[str, Any]) -> None:
            if event["type"] == "agent_created":
                working.set()  # its turn comes next, and never answers

        fresh = engine.new_run(session=session, on_event=watch)
        task = asyncio.ensure_future(engine.execute(fresh, *case.subject(tmp_path)))
        await asyncio.wait_for(working.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return fresh

    cancelled = run(cancel_mid_turn())
    assert cancelled.status == "cancelled" and not cancelled._active


class LosingPort(SessionPort):
    """The session's port, whose store is lost at the ``lose_at``-th branch: a non-budget failure."""

    def __init__(self, session: Any, lose_at: int) -> None:
        super().__init__(session)
        self.lose_at = lose_at
        self.made = 0

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str:
        self.made += 1
        if self.made == self.lose_at:
            raise RuntimeLostError("the branch store died", actor="branches-0")
        return await super().new_branch(name, messages)


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


@every_engine
def test_a_non_budget_failure_propagates(case, session, model, tmp_path):
    engine = build(case, model)
    fresh = engine.new_run(session=session, port=LosingPort(session, lose_at=2))
    with pytest.raises((RuntimeLostError, BaseExceptionGroup)) as raised:
        run(engine.execute(fresh, *case.subject(tmp_path)))
    assert any(isinstance(leaf, RuntimeLostError) for leaf in _leaves(raised.value))
    assert fresh.status == "failed"


@every_engine
def test_bounded_completion_is_distinguishable_from_a_clean_or_broken_run(case, session, model, tmp_path):
    clean, clean_run = run(execute(build(case, model), case, tmp_path, session))
    bounded, bounded_run = run(execute(build(case, model, max_agents=1), case, tmp_path, session))
    assert case.diagnostics(clean) == {"degraded": False, "degrade_reason": "", "skipped": []}
    assert clean_run.status == "completed" and clean_run.statistics()["degrade_reason"] == ""
    assert case.diagnostics(bounded)["degraded"] and case.diagnostics(bounded)["degrade_reason"] == "budget"
    assert bounded_run.status == "degraded" and bounded_run.statistics()["budget"]["exhausted"] == "agents"


# -- budgets against the provider's own count ---------------------------------------------------

@every_engine
def test_the_budget_counts_every_token_the_provider_counted(case, session, model, tmp_path):
    """A clean run, then one whose typed agent replies unparseably (its calls are paid
    for): the budget holds exactly what the provider counted, nothing estimated."""
    for replies in ({}, {case.prose: '{"unfinished": ['}):
        engine = build(case, model, replies=replies, usage={"prompt_tokens": 7, "completion_tokens": 3})
        fresh = engine.new_run(session=session)
        try:
            run(engine.execute(fresh, *case.subject(tmp_path)))
        except PlanError:
            pass  # planning fails without a plan; its paid turns still count
        assert fresh.budget.estimated_tokens == 0
        assert fresh.budget.tokens_used == provider_tokens(session, engine.model) > 0


@every_engine
def test_a_cut_off_turn_is_estimated_on_top_of_the_providers_count(case, session, model, tmp_path):
    engine = build(case, model, replies={case.prose: HANG},
                   usage={"prompt_tokens": 7, "completion_tokens": 3}, deadline_s=DEADLINE_S)
    fresh = engine.new_run(session=session)
    run(engine.execute(fresh, *case.subject(tmp_path)))
    budget = fresh.budget
    assert budget.estimated_tokens > 0
    assert budget.tokens_used - budget.estimated_tokens == provider_tokens(session, engine.model)
