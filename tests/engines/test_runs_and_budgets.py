"""ADR-0034 D1 and D2 through real actors: fresh run state, hard bounds, spawn, quiescence, cleanup.

Each test drives a ``ScriptEngine`` whose body is the topology under test; agent turns
run on the shared session's OperationWorkers against scripted models.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import ray
from engine_scripts import HANG, ByAgent, Note, ScriptEngine, hang, js, kinds, last_user
from running import run_engine as run

from opgraph.actors import TurnError, UnknownBranchError
from opgraph.engines import EngineBudgetError, EngineInputError, EngineResult

pytestmark = pytest.mark.ray


async def one_agent(run_, name="a"):
    agent = await run_.make_agent("worker", name=name)
    return (await run_.turn(agent, "hello")).response


# -- D1 ----------------------------------------------------------------------------------


def test_each_run_owns_fresh_state_and_reuses_the_supplied_session(session, model):
    """Two runs of one Engine: separate ids, agents, seen-keys and budgets; one untouched Session."""
    engine = ScriptEngine(one_agent, model=model(ByAgent(default="hi")))
    default_branch = session.default_branch
    first = run(engine.run(session=session))
    first.run.seen("Topic")
    second = run(engine.run(session=session))
    assert first.run.run_id != second.run.run_id
    assert first.run.session is session and second.run.session is session
    assert session.default_branch == default_branch  # used as it is, never reset
    assert first.run.agents_made == second.run.agents_made == 1
    assert first.run.agents["a"].id != second.run.agents["a"].id
    assert second.run.seen("topic") is False  # the first run's keys did not leak


def test_models_are_copied_and_model_for_falls_back_to_the_base_model():
    stages = {"critic": "sim/critic"}
    engine = ScriptEngine(one_agent, model="sim/base", models=stages)
    stages["critic"] = "sim/changed"
    assert engine.model_for("critic") == "sim/critic"
    assert engine.model_for("writer") == "sim/base"


def test_seen_strips_and_lowercases_keys(session):
    engine = ScriptEngine(one_agent)
    fresh = engine.new_run(session=session)
    assert fresh.seen("  Rate Limits ") is False
    assert fresh.seen("rate limits") is True
    assert fresh.seen("RATE LIMITS\n") is True


def test_on_event_receives_plain_dicts_with_a_type(session, model):
    seen = []
    engine = ScriptEngine(one_agent, model=model(ByAgent(default="hi")))
    run(engine.run(session=session, on_event=seen.append))
    types = [event["type"] for event in seen]
    assert types[0] == "run_started" and types[-1] == "run_finished"
    created = next(event for event in seen if event["type"] == "agent_created")
    assert created["agent"] == "a" and created["role"] == "worker"


def executor_totals(session):
    snapshot = ray.get(session.runtime.executor.statistics.remote(), timeout=30)
    return snapshot["turns"], snapshot["runs_started"]


def test_agent_turns_run_on_a_worker_process_not_the_driver(session, model):
    """One agent turn is one Session.turn on a worker: the model answers from another
    process, the executor counts one turn, and no graph run is started for it."""
    engine = ScriptEngine(one_agent, model=model(lambda request: f"pid {os.getpid()}"))
    turns, runs = executor_totals(session)
    result = run(engine.run(session=session))
    assert result.startswith("pid ") and int(result.split()[1]) != os.getpid()
    assert executor_totals(session) == (turns + 1, runs)


def test_a_run_without_a_session_makes_its_own_and_closes_it(session):
    """engine.run() with no session: the run's own Session, closed at the end with its
    agents' branches; a supplied Session (as everywhere else here) stays open."""
    result = run(ScriptEngine(one_agent, model="sim/default").run())
    own = result.run.session
    assert own is not session and own.closed and not session.closed
    assert result.run.events.notifications("session_closed")[0].data["branches_dropped"] >= 2
    with pytest.raises(UnknownBranchError):
        run(session.messages(result.run.agents["a"].id))  # the agent's branch is gone from the store


def test_an_agent_is_a_branch_holding_its_role_profile(session, model):
    engine = ScriptEngine(one_agent, model=model(ByAgent(default="hi")))
    result = run(engine.run(session=session))
    messages = run(session.messages(result.run.agents["a"].id))
    assert messages[0]["role"] == "system" and "acting as the worker" in messages[0]["content"]
    assert [m["role"] for m in messages[1:]] == ["user", "assistant"]


# -- D2: hard bounds -----------------------------------------------------------------------


async def make_many(run_, count=5):
    for index in range(count):
        await run_.make_agent("worker", name=f"w{index}")
    return "made them all"


def test_agent_budget_refuses_the_next_agent_and_degrades(session, sink):
    engine = ScriptEngine(make_many, max_agents=3, event_sink=sink)
    result = run(engine.run(session=session))
    assert isinstance(result, EngineResult) and result.degraded and result.degrade_reason == "budget"
    assert result.run.agents_made == 3
    notices = kinds(sink, result.run, "budget_exhausted")
    assert len(notices) == 1 and notices[0].data["reason"] == "agents"


def test_the_last_agent_the_bound_allows_still_takes_its_turns(session, model):
    """max_agents bounds making agents, not working: with max_agents=1 the one agent's
    turns run (they used to be refused the moment it was made)."""
    async def body(run_):
        agent = await run_.make_agent("worker", name="only")
        first = (await run_.turn(agent, "one")).response
        second = (await run_.turn(agent, "two")).response
        with pytest.raises(EngineBudgetError):
            await run_.make_agent("worker")
        return f"{first} {second}"

    result = run(ScriptEngine(body, model=model(ByAgent(default="ok")), max_agents=1).run(session=session))
    assert result == "ok ok" and result.degrade_reason == "budget"


def test_budget_exhausted_is_notified_once_per_run(session, sink):
    async def body(run_):
        await run_.make_agent("worker")
        for _ in range(3):
            with pytest.raises(EngineBudgetError):
                await run_.make_agent("worker")
            assert run_.spawn(asyncio.sleep(0)) is None
        return "done"

    result = run(ScriptEngine(body, max_agents=1, event_sink=sink).run(session=session))
    assert len(kinds(sink, result.run, "budget_exhausted")) == 1


def test_exempt_agent_bypasses_the_budget_but_is_counted(session):
    async def body(run_):
        await run_.make_agent("worker")
        with pytest.raises(EngineBudgetError):
            await run_.make_agent("worker")
        await run_.make_agent("synthesizer", exempt=True)
        return "reported"

    result = run(ScriptEngine(body, max_agents=1).run(session=session))
    assert result.run.agents_made == 2  # beyond max_agents, by design
    assert result == "reported" and result.degrade_reason == "budget"


def test_deadline_cancels_the_root_and_degrades(session, model):
    engine = ScriptEngine(one_agent, model=model(ByAgent(default=HANG)), deadline_s=1.0)
    result = run(engine.run(session=session))
    assert result.degraded and result.degrade_reason == "deadline" and result.text == ""
    assert result.run.deadline_hit and result.run.exhausted_reason == "deadline"
    assert result.run.budget.snapshot()["elapsed_s"] < 30


async def ten_turns(run_):
    """One agent asked for ten turns: a budget ends it first."""
    agent = await run_.make_agent("worker")
    for index in range(10):
        await run_.turn(agent, f"turn {index}")
    return "never"


def test_token_budget_refuses_turns_once_spent(session, model):
    engine = ScriptEngine(ten_turns, model=model(ByAgent(default="x"), prompt_tokens=60, completion_tokens=40),
                          max_tokens=250)
    result = run(engine.run(session=session))
    assert result.degrade_reason == "budget" and result.run.exhausted_reason == "tokens"
    assert result.run.budget.tokens_used == 300  # three turns of 100; the fourth was refused


def test_cost_budget_refuses_turns_once_spent(session, model):
    name = model(ByAgent(default="x"), prompt_tokens=1000, completion_tokens=0)
    engine = ScriptEngine(ten_turns, model=name, max_cost_usd=0.025, prices={name: (10.0, 30.0)})
    result = run(engine.run(session=session))
    assert result.run.exhausted_reason == "cost"
    assert result.run.budget.cost_usd == pytest.approx(0.03)  # three turns at $0.01


def test_failed_turns_count_against_the_token_budget(session, model, sink):
    """Each turn's reply fails to parse (TurnError), after a model call of 100 tokens:
    the failed turns are paid for, so the fourth turn is refused."""
    async def body(run_):
        agent = await run_.make_agent("worker")
        for index in range(10):
            with pytest.raises(TurnError):
                await run_.turn(agent, f"turn {index}", response_format=Note, parse_retries=0)
        return "never"

    engine = ScriptEngine(body, model=model(ByAgent(default="not json"), prompt_tokens=60, completion_tokens=40),
                          max_tokens=250, event_sink=sink)
    result = run(engine.run(session=session))
    assert result.degrade_reason == "budget" and result.run.exhausted_reason == "tokens"
    assert result.run.budget.tokens_used == 300
    errors = kinds(sink, result.run, "agent_error")
    assert [e.data["error_type"] for e in errors] == ["ParseError"] * 3
    assert [e.data["tokens"] for e in errors] == [100, 100, 100]


def paid_then_hang(request):
    """The first call of a turn is paid for and fails to parse; the parse retry never answers."""
    if "could not be parsed" in last_user(request):
        return hang()
    return {"content": "not json", "usage": {"prompt_tokens": 60, "completion_tokens": 40}}


def test_a_timed_out_turn_counts_the_calls_it_paid_for_and_an_estimate_for_the_cut_off_one(session, model, sink):
    """turn: call 1 (100 tokens, malformed) -> parse retry (never answers) -> turn timeout.

    The provider reported 100 tokens for the first call: they reach the budget with the
    timeout. The cut-off call reported nothing, so the run estimates it (at least its
    prompt), recorded apart as ``estimated_tokens``.
    """
    async def body(run_):
        agent = await run_.make_agent("worker", name="slow")
        with pytest.raises(TurnError) as failed:
            await run_.turn(agent, "answer in JSON", response_format=Note, parse_retries=1, timeout=1.5)
        assert failed.value.error_type == "OperationTimeout"
        return "timed out"

    engine = ScriptEngine(body, model=model(ByAgent(default=paid_then_hang)), event_sink=sink)
    result = run(engine.run(session=session))
    budget = result.run.budget
    assert budget.tokens_used > 100  # the paid call, and more for the cut-off one
    assert budget.estimated_tokens > 0 and budget.tokens_used == 100 + budget.estimated_tokens
    (error,) = kinds(sink, result.run, "agent_error")
    assert error.data["tokens"] == 100 and error.data["estimated_tokens"] == budget.estimated_tokens


def test_a_turn_cut_off_by_the_deadline_is_estimated_not_free(session, model, sink):
    """turn -> model hangs -> the deadline cancels the root: the cut-off turn costs an estimate."""
    engine = ScriptEngine(one_agent, model=model(ByAgent(default=HANG)), deadline_s=1.0, event_sink=sink)
    result = run(engine.run(session=session))
    assert result.degrade_reason == "deadline"
    budget = result.run.budget
    assert budget.tokens_used > 0
    assert budget.estimated_tokens > 0 and budget.tokens_used == budget.estimated_tokens
    (cut,) = kinds(sink, result.run, "turn_cut_off")
    assert cut.agent == "a" and cut.data["estimated_tokens"] == budget.estimated_tokens


def test_cost_budget_refuses_an_unpriced_model_before_any_agent():
    with pytest.raises(EngineInputError, match="needs a price"):
        ScriptEngine(one_agent, model="openai/gpt-4.1-mini", max_cost_usd=1.0)


@pytest.mark.parametrize("setting", [{"max_agents": 0}, {"deadline_s": -1}, {"max_tokens": 0},
                                     {"max_cost_usd": 0.0}, {"max_concurrent": 0}])
def test_non_positive_budgets_are_refused_at_construction(setting):
    with pytest.raises(EngineInputError):
        ScriptEngine(one_agent, **setting)


# -- D2: spawn, quiescence, cleanup ----------------------------------------------------------


def test_spawn_without_budget_closes_the_coroutine_and_returns_none(session):
    async def body(run_):
        await run_.make_agent("worker")

        async def work():
            return "ran"

        coro = work()
        assert run_.spawn(coro) is None
        assert coro.cr_frame is None  # closed, never to run
        return "done"

    result = run(ScriptEngine(body, max_agents=1).run(session=session))
    assert result.degrade_reason == "budget" and result.run.tasks.refused == 1


def test_spawn_without_a_loop_waits_in_pending_until_drained(session):
    fresh = ScriptEngine(one_agent).new_run(session=session)
    ran = []

    async def work():
        ran.append(True)

    assert fresh.spawn(work()) is None and len(fresh._pending) == 1

    async def later():
        tasks = fresh.drain_pending()
        await asyncio.gather(*tasks)

    run(later())
    assert ran == [True] and len(fresh._pending) == 0


def test_quiescence_treats_cancellation_and_budget_errors_as_stopping(session):
    async def body(run_):
        async def cancelled():
            raise asyncio.CancelledError

        async def refused():
            raise EngineBudgetError("spent", reason="agents")

        async def fine():
            return 1

        for coro in (cancelled(), refused(), fine()):
            run_.spawn(coro)
        await run_.wait_quiescence()
        return "quiet"

    result = run(ScriptEngine(body).run(session=session))
    assert result == "quiet" and result.degrade_reason == "budget"  # spawned work hit the budget


def test_quiescence_reraises_a_single_spawned_error(session):
    async def body(run_):
        async def broken():
            raise KeyError("lost")

        run_.spawn(broken())
        await run_.wait_quiescence()

    with pytest.raises(KeyError):
        run(ScriptEngine(body).run(session=session))


def test_quiescence_raises_several_spawned_errors_as_a_group(session):
    async def body(run_):
        async def broken(index):
            raise ValueError(index)

        for index in range(3):
            run_.spawn(broken(index))
        await run_.wait_quiescence()

    with pytest.raises(ExceptionGroup) as caught:
        run(ScriptEngine(body).run(session=session))
    assert sorted(e.args[0] for e in caught.value.exceptions) == [0, 1, 2]


def test_quiescence_waits_for_work_spawned_while_waiting(session):
    async def body(run_):
        order = []

        async def child():
            order.append("child")

        async def parent():
            order.append("parent")
            run_.spawn(child())

        run_.spawn(parent())
        await run_.wait_quiescence()
        return ",".join(order)

    assert run(ScriptEngine(body).run(session=session)) == "parent,child"


def test_cancel_active_is_bounded_by_cancel_timeout(session, sink):
    release = asyncio.Event()

    async def stubborn():
        while True:
            try:
                await release.wait()
                return
            except asyncio.CancelledError:
                continue  # resists cancellation

    async def body(run_):
        run_.spawn(stubborn())
        await asyncio.sleep(0)
        stragglers = await run_.cancel_active()
        release.set()
        await asyncio.gather(*stragglers)
        return f"{len(stragglers)} left"

    engine = ScriptEngine(body, cancel_timeout_s=0.2, event_sink=sink)
    result = run(engine.run(session=session))
    assert result == "1 left"
    assert len(kinds(sink, result.run, "cancel_timeout")) == 1


def test_run_ends_by_cancelling_spawned_work_the_root_left_behind(session, model, sink):
    async def body(run_):
        async def forever():
            agent = await run_.make_agent("worker", name="slow")
            await run_.turn(agent, "take your time")

        run_.spawn(forever())
        return "root done"

    engine = ScriptEngine(body, model=model(ByAgent(default=HANG)), event_sink=sink)
    result = run(engine.run(session=session))
    assert result == "root done"
    assert all(task.done() for task in result.run._active) and not result.run._active
    assert sink.runs[result.run.run_id]["status"] == "completed"


def test_turn_emissions_are_recorded_for_their_agent(session, model):
    async def body(run_):
        agent = await run_.make_agent("worker", name="noter", emits=(Note,))
        await run_.operate_with_repair(agent, "note it", arrived=lambda: bool(run_.by_type(Note)))
        return "ok"

    engine = ScriptEngine(body, model=model(ByAgent(default=js({"note": [{"text": "a"}, {"text": "b"}]}))))
    result = run(engine.run(session=session))
    assert [n.text for n in result.run.by_type(Note, agent="noter")] == ["a", "b"]
