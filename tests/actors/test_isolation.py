"""Runs isolated from each other, branches freed, and the Session's lifetime.

A run started ``isolated`` has a default branch of its own (nothing of another run
reaches it) and its branches are dropped by ``release_run``; a Session's branches are
dropped by ``close()``. Each test counts the branches the runtime holds before and after.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray
from running import run

from opgraph.actors import Session, UnknownBranchError
from opgraph.kernel import OperationGraphBuilder, OpGraphError


def held_branches(session: Session) -> int:
    """Branches the executor knows, across every store shard."""
    return ray.get(session.runtime.executor.statistics.remote())["branches"]["branches"]


def stored_branches(session: Session) -> int:
    return sum(ray.get(store.statistics.remote())["branches"] for store in session.runtime.stores)


async def remember_and_recall(branch: Any, ticket: str, **parameters: Any) -> list[Any]:
    """Return what the branch held before, then write this run's ticket into it."""
    history = await branch.messages()
    await branch.append({"role": "user", "content": ticket})
    return [message["content"] for message in history]


def one_ticket_run(session: Session, ticket: str) -> tuple[dict[str, Any], str]:
    builder = OperationGraphBuilder(ticket)
    node = builder.add_operation("remember_and_recall", ticket=ticket)
    return run(session.flow(builder.get_graph(), isolated=True)), node


def test_isolated_runs_of_one_session_never_see_each_others_conversation(session):
    """alpha then beta, one Session: beta's root starts from an empty branch, not alpha's ticket."""
    session.register_operation("remember_and_recall", remember_and_recall, record_turn=False)
    alpha, alpha_node = one_ticket_run(session, "alpha: card payments fail")
    beta, beta_node = one_ticket_run(session, "beta: password reset")
    assert alpha["operation_results"][alpha_node] == []
    assert beta["operation_results"][beta_node] == []
    assert alpha["default_branch"] != beta["default_branch"] != session.default_branch
    messages = run(session.messages(beta["default_branch"]))
    assert [message["content"] for message in messages] == ["beta: password reset"]
    for envelope in (alpha, beta):
        run(session.release_run(envelope["run_id"]))


def test_releasing_an_isolated_run_drops_every_branch_it_made(session):
    """root -> 50 dependents (50 clones + the run's own default): all dropped by release_run."""
    builder = OperationGraphBuilder("release")
    root = builder.add_operation("noop", instruction="root")
    for index in range(50):
        builder.add_operation("noop", depends_on=[root], instruction=f"leaf {index}")
    before_held, before_stored = held_branches(session), stored_branches(session)

    envelope = run(session.flow(builder.get_graph(), isolated=True, max_concurrent=50))
    assert held_branches(session) == before_held + 51
    dropped = run(session.release_run(envelope["run_id"]))

    assert dropped == 51
    assert held_branches(session) == before_held and stored_branches(session) == before_stored
    with pytest.raises(UnknownBranchError):
        run(session.messages(envelope["default_branch"]))


def test_a_session_keeps_its_branches_until_closed_then_drops_them_all(session):
    """A Session's default, named and cloned branches live until close(); a closed Session refuses work."""
    before = held_branches(session)
    with Session() as own:
        own.new_branch("notes", messages=[{"role": "system", "content": "keep"}])
        for _ in range(2):  # the second run's clones belong to the Session too
            builder = OperationGraphBuilder("kept")
            root = builder.add_operation("noop", instruction="root")
            builder.add_operation("noop", depends_on=[root], instruction="leaf")
            run(own.flow(builder.get_graph()))
        assert held_branches(session) == before + 2 + 2  # default, notes, and one clone per run
    assert own.closed and held_branches(session) == before
    with pytest.raises(OpGraphError, match="closed"):
        run(own.flow(builder.get_graph()))
    assert own.close() == 0  # idempotent


def test_an_isolated_run_left_unreleased_is_dropped_with_its_session(session):
    async def scenario() -> int:
        async with Session() as own:
            builder = OperationGraphBuilder("unreleased")
            root = builder.add_operation("noop", instruction="root")
            builder.add_operation("noop", depends_on=[root], instruction="leaf")
            await own.flow(builder.get_graph(), isolated=True)
            return held_branches(session)

    before = held_branches(session)
    during = run(scenario())
    assert during == before + 1 + 2  # the Session's default; the run's default and its clone
    assert held_branches(session) == before
