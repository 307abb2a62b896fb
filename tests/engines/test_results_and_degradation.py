"""ADR-0034 D5 through real actors: EngineResult, degradation reasons, partial export, propagation.

    root ok --------------------------------------> EngineResult (clean, or "budget" if work was refused)
    root EngineBudgetError / group of only those --> cancel spawned, partial export -> degraded "budget"
    internal deadline ----------------------------> cancel spawned, partial export -> degraded "deadline"
    other error / group with another leaf / caller cancellation -> propagates after cleanup
"""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_scripts import HANG, ByAgent, ScriptEngine, kinds
from running import run_engine as run

from opgraph.actors import TurnError
from opgraph.engines import EngineBudgetError, EngineResult

pytestmark = pytest.mark.ray


async def say(run_, text="hello"):
    agent = await run_.make_agent("worker", name="speaker")
    return (await run_.turn(agent, text)).response


async def export_with_exempt_agent(run_):
    reporter = await run_.make_agent("synthesizer", name="reporter", exempt=True)
    return "partial: " + (await run_.turn(reporter, "summarise what you have")).response


def test_a_clean_string_result_is_an_engine_result(session, model):
    result = run(ScriptEngine(say, model=model(ByAgent(default="the answer"))).run(session=session))
    assert isinstance(result, EngineResult) and isinstance(result, str)
    assert str(result) == result.text == "the answer"
    assert (result.degraded, result.degrade_reason, result.skipped) == (False, "", [])
    assert result.run.status == "completed"


def test_a_non_string_result_passes_through_unchanged(session):
    async def body(run_):
        return {"passed": True}

    result = run(ScriptEngine(body).run(session=session))
    assert result == {"passed": True} and not isinstance(result, EngineResult)


def test_budget_hit_by_spawned_work_marks_a_completed_root_degraded(session):
    async def body(run_):
        await run_.make_agent("worker")

        async def more():
            await run_.make_agent("worker")

        run_.spawn(more())  # refused: the one agent is spent
        await run_.wait_quiescence()
        return "root finished"

    result = run(ScriptEngine(body, max_agents=1).run(session=session))
    assert result == "root finished" and result.degraded and result.degrade_reason == "budget"


def test_a_group_of_only_budget_errors_degrades(session):
    async def body(run_):
        async with asyncio.TaskGroup() as group:
            for _ in range(3):
                group.create_task(run_.make_agent("worker"))
        return "never"

    result = run(ScriptEngine(body, max_agents=1).run(session=session))
    assert result.degraded and result.degrade_reason == "budget"


def test_a_group_with_a_non_budget_error_propagates(session, model, sink):
    async def body(run_):
        async def broken():
            raise LookupError("not a budget problem")

        async with asyncio.TaskGroup() as group:
            group.create_task(run_.make_agent("worker"))
            group.create_task(run_.make_agent("worker"))
            group.create_task(broken())
        return "never"

    engine = ScriptEngine(body, max_agents=1, event_sink=sink)
    with pytest.raises(ExceptionGroup) as caught:
        run(engine.run(session=session))
    assert any(isinstance(e, LookupError) for e in caught.value.exceptions)
    (run_id,) = sink.runs
    assert sink.runs[run_id]["status"] == "failed"


def test_an_ordinary_failure_propagates_and_is_recorded(session, model, sink):
    from opgraph.actors.models import ProviderUnavailable

    engine = ScriptEngine(say, model=model(ByAgent(default=ProviderUnavailable("down", provider="x"))),
                          event_sink=sink)
    with pytest.raises(TurnError) as caught:
        run(engine.run(session=session))
    assert caught.value.error_type == "ProviderUnavailable"
    (state,) = sink.runs.values()
    assert state["status"] == "failed" and state["error"]["error_type"] == "TurnError"


def test_partial_export_runs_on_budget_exhaustion(session, model):
    async def body(run_):
        await run_.make_agent("worker")
        raise EngineBudgetError("spent", reason="agents")

    engine = ScriptEngine(body, export=export_with_exempt_agent, model=model(ByAgent(default="what we have")))
    result = run(engine.run(session=session))
    assert result.degrade_reason == "budget" and result == "partial: what we have"


def test_partial_export_runs_after_the_deadline(session, model):
    script = ByAgent({"speaker": HANG, "reporter": "collected so far"})
    engine = ScriptEngine(say, export=export_with_exempt_agent, model=model(script), deadline_s=1.0)
    result = run(engine.run(session=session))
    assert result.degrade_reason == "deadline" and result == "partial: collected so far"
    assert result.run.agents_made == 2  # the exempt reporter is counted


def test_partial_export_is_bounded_and_a_timeout_yields_no_text(session, model, sink):
    engine = ScriptEngine(say, export=export_with_exempt_agent, model=model(ByAgent(default=HANG)),
                          deadline_s=0.5, event_sink=sink)
    engine.partial_export_timeout_s = 1.0
    result = run(engine.run(session=session))
    assert result.degraded and result.degrade_reason == "deadline" and result == ""
    failed = kinds(sink, result.run, "partial_export_failed")
    assert len(failed) == 1 and failed[0].data["reason"] == "timeout"


def test_a_failing_partial_export_yields_no_text_and_is_recorded(session, sink):
    async def body(run_):
        raise EngineBudgetError("spent", reason="tokens")

    async def broken_export(run_):
        raise RuntimeError("export broke")

    result = run(ScriptEngine(body, export=broken_export, event_sink=sink).run(session=session))
    assert result.degraded and result == ""
    assert kinds(sink, result.run, "partial_export_failed")[0].data["error_type"] == "RuntimeError"


def test_caller_cancellation_propagates_after_cleanup(session, model, sink):
    """root: speaker turn (hangs) + spawned turn (hangs), both on workers; the caller
    cancels: CancelledError propagates, the run is recorded cancelled, and both model
    calls on the workers end (Session.turn carries the cancellation to them)."""
    async def body(run_):
        async def worker_turn():
            agent = await run_.make_agent("worker", name="spawned")
            await run_.turn(agent, "slow")

        spawned = run_.spawn(worker_turn())
        await say(run_)
        await spawned

    async def scenario():
        engine = ScriptEngine(body, model=model(ByAgent(default=HANG)), event_sink=sink)
        task = asyncio.ensure_future(engine.run(session=session))
        await until(lambda count: count == 2, session)  # both turns hang in a worker
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Inside the loop still (its end would cancel leftovers anyway).
        return await until(lambda count: count == 0, session)

    assert run(scenario()) == 0
    (run_id,) = sink.runs
    assert sink.runs[run_id]["status"] == "cancelled"
    assert sink.types(run_id)[-1] == "run_finished"


async def until(check, session, seconds=30.0):
    """Poll the workers' calls in flight until ``check(count)`` holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check(count := await worker_calls_in_flight(session)):
        if time.monotonic() > deadline:
            raise AssertionError(f"the workers never reached the expected state: {count} calls in flight")
        await asyncio.sleep(0.05)
    return count


async def worker_calls_in_flight(session):
    snapshots = await asyncio.gather(*(worker.statistics.remote() for worker in session.runtime.workers))
    return sum(snapshot["in_flight"] for snapshot in snapshots)


def test_a_run_executes_only_once(session, model):
    engine = ScriptEngine(say, model=model(ByAgent(default="once")))
    fresh = engine.new_run(session=session)
    run(engine.execute(fresh))
    from opgraph.engines import EngineError

    with pytest.raises(EngineError, match="already executed"):
        run(engine.execute(fresh))
