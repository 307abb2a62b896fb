"""Session.turn: one verb on a branch, run on a worker, with a graph node's supervision and errors."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from opgraph.actors import TurnError, TurnResult
from opgraph.kernel import OperationError

TIMEOUT = 60.0


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT))


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
