"""Session.turn: one verb on a branch, run on a worker, with a graph node's supervision and errors."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
from running import run

from opgraph.actors import TurnError, TurnResult
from opgraph.actors.workers.usage import record_usage
from opgraph.kernel import OperationError, RetryPolicy


async def where(branch: Any, **parameters: Any) -> dict[str, Any]:
    return {"pid": os.getpid(), "branch": branch.id, "key": list(branch.idempotency_key)}


def test_a_turn_runs_on_a_worker_on_the_given_branch(session):
    session.register_operation("where", where, record_turn=False)
    branch = session.new_branch()
    result = run(session.turn(branch, "where"))
    assert isinstance(result, TurnResult)
    assert result.response["pid"] != os.getpid()  # never in the driver
    assert result.response["branch"] == branch == result.branch_id
    assert result.attempt == 1 and result.elapsed > 0


def test_a_chat_turn_records_its_exchange_and_reports_token_usage(session):
    branch = session.new_branch()
    result = run(session.turn(branch, "chat", instruction="say something", model="sim/default"))
    assert isinstance(result.response, str) and result.response
    usage = result.usage
    assert usage["calls"] == 1 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert usage["by_model"]["sim/default"]["calls"] == 1
    messages = run(session.messages(branch))
    assert [message["role"] for message in messages] == ["user", "assistant"]


def test_a_failing_turn_raises_turn_error_with_its_kind(session):
    async def breaks(branch: Any, **parameters: Any) -> None:
        raise ValueError("no good")

    session.register_operation("breaks", breaks, record_turn=False)
    with pytest.raises(TurnError) as failed:
        run(session.turn(None, "breaks"))
    assert failed.value.error_type == "ValueError" and "no good" in failed.value.message
    assert failed.value.branch_id == session.default_branch


def test_a_turn_past_its_timeout_is_cancelled_on_its_worker_and_raises(session):
    with pytest.raises(TurnError) as failed:
        run(session.turn(None, "sleep", timeout=0.3, seconds=30))
    assert failed.value.error_type == "OperationTimeout"


def test_an_unknown_operation_or_bad_timeout_is_refused_before_anything_runs(session):
    with pytest.raises(OperationError, match="not registered"):
        run(session.turn(None, "no-such-verb"))
    with pytest.raises(OperationError, match="timeout"):
        run(session.turn(None, "noop", timeout=0))


async def paid_then_sleeps(branch: Any, seconds: float = 30.0, **parameters: Any) -> None:
    """One model call's worth of usage (100 tokens), then a wait the turn's timeout cuts off."""
    record_usage("scripted/m", 60, 40)
    await asyncio.sleep(seconds)


def test_a_timed_out_turn_carries_the_usage_of_the_calls_it_made(session):
    """The worker answers the cancelled call with its usage; the TurnError carries it, so a
    caller's budget counts what the timed-out turn paid for."""
    session.register_operation("paid_then_sleeps", paid_then_sleeps, record_turn=False)
    with pytest.raises(TurnError) as failed:
        run(session.turn(None, "paid_then_sleeps", timeout=0.5))
    assert failed.value.error_type == "OperationTimeout"
    assert failed.value.usage["total_tokens"] == 100 and failed.value.usage["calls"] == 1
    assert failed.value.usage["by_model"]["scripted/m"]["prompt_tokens"] == 60


async def paid_then_fails_once(branch: Any, **parameters: Any) -> str:
    record_usage("scripted/m", 60, 40)
    if branch.idempotency_key[2] == 1:
        raise ValueError("first attempt fails after paying")
    return "second attempt"


def test_a_retried_turn_reports_the_usage_of_every_attempt(session):
    session.register_operation("paid_then_fails_once", paid_then_fails_once, record_turn=False,
                               retry=RetryPolicy.of(2, on={"ValueError"}))
    result = run(session.turn(None, "paid_then_fails_once"))
    assert result.response == "second attempt" and result.attempt == 2
    assert result.usage["total_tokens"] == 200 and result.usage["by_model"]["scripted/m"]["calls"] == 2
