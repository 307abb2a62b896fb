"""Each named invariant check catches the break it names (kernel/invariants.py).

One run, ``a, b, d`` roots and ``a -> c``, ``b -> c``, at capacity 1, is taken to the
point where ``a`` completed, ``b`` runs, ``d`` waits in the ready queue and ``c`` waits
on ``b``. Every case corrupts a copy of that state the way a kernel bug would (a lost
release, a node dispatched past capacity, a story never written out...) and shows that
the first check of ``INVARIANTS`` to fail is the one named for that invariant, and that
``validate()`` and the next ``handle()`` both raise it, naming the node concerned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kernel_graphs import build

from opgraph.kernel import (
    INVARIANTS,
    DispatchHeld,
    FlowState,
    InvariantViolation,
    create_operation,
)
from opgraph.kernel.states import CANCELLED, COMPLETED, READY, RUNNING, SKIPPED


def a_few_steps(drive) -> tuple[FlowState, Any]:
    """``a, b, d`` roots, ``a -> c``, ``b -> c``, capacity 1: a completed, b running, d ready, c waiting."""
    graph, n = build("a", "b", "c", "d", edges=(("a", "c"), ("b", "c")))
    driver = drive(graph, max_concurrent=1)
    driver.complete(n.a, {"a": 1})
    state = driver.state
    assert [state.state[node] for node in (n.a, n.b, n.c, n.d)] == [COMPLETED, RUNNING, "waiting", READY]
    assert list(state.ready) == [n.d]
    return state, n


def first_broken(state: FlowState) -> str | None:
    """The name of the first check of INVARIANTS that fails on ``state`` (None: all hold)."""
    for check in INVARIANTS:
        try:
            check(state)
        except InvariantViolation:
            return check.__name__
    return None


# -- the corruptions, one per invariant ------------------------------------------------
def lose_a_flight_record(state: FlowState, n: Any) -> str | None:
    """b stays RUNNING, but its operation is no longer tracked in flight."""
    del state.running[n.b]
    return None


def count_an_attempt_twice(state: FlowState, n: Any) -> str | None:
    """b's attempt counter moved on while attempt 1 is still in flight."""
    state.attempt[n.b] += 1
    return n.b


def dispatch_past_capacity(state: FlowState, n: Any) -> str | None:
    """d is dispatched, consistently, while b already fills the one slot."""
    state.ready.remove(n.d)
    state.state[n.d] = RUNNING
    state.attempt[n.d] = 1
    state.running[n.d] = (1, state.graph.nodes[n.d], state.deps[n.d])
    return None


def queue_a_node_twice(state: FlowState, n: Any) -> str | None:
    state.ready.append(n.d)
    return None


def miscount_open_nodes(state: FlowState, n: Any) -> str | None:
    state.open_nodes += 1
    return None


def add_a_node_behind_the_schedulers_back(state: FlowState, n: Any) -> str | None:
    """The graph gains a node that was never registered (admission bypassed)."""
    state.graph.add_node(create_operation("chat", {"instruction": "stowaway"}))
    return None


def miscount_a_dependency(state: FlowState, n: Any) -> str | None:
    """c's counter says both its dependencies are unsettled, though a completed."""
    state.unsettled[n.c] = 2
    return n.c


def lose_a_release(state: FlowState, n: Any) -> str | None:
    """b settles and c's counter reaches 0, but c is never gated: it waits on nothing."""
    del state.running[n.b]
    state.state[n.b] = COMPLETED
    state.open_nodes -= 1
    state.unsettled[n.c] = 0
    return n.c


def release_too_early(state: FlowState, n: Any) -> str | None:
    """c is made ready (and queued) while b, one of its dependencies, still runs."""
    state.state[n.c] = READY
    state.ready.append(n.c)
    return n.c


def skip_with_a_result(state: FlowState, n: Any) -> str | None:
    """d is skipped (story and counts kept right) but keeps a result entry."""
    state.ready.remove(n.d)
    state._recorded_story(n.d).append((READY, SKIPPED, "corrupted", 0))
    state.state[n.d] = SKIPPED
    state.open_nodes -= 1
    state.results[n.d] = {"stale": True}
    return n.d


def leave_the_path_without_a_story(state: FlowState, n: Any) -> str | None:
    """d is cancelled by a write that recorded no story."""
    state.ready.remove(n.d)
    state.state[n.d] = CANCELLED
    state.open_nodes -= 1
    return n.d


def admit_past_the_cap(state: FlowState, n: Any) -> str | None:
    state.spawn_count = state.max_spawn + 1
    return None


def finish_with_work_open(state: FlowState, n: Any) -> str | None:
    state.finished = True
    return None


BREAKS: dict[str, Callable[[FlowState, Any], str | None]] = {
    "check_running_matches_states": lose_a_flight_record,
    "check_flight_records": count_an_attempt_twice,
    "check_capacity": dispatch_past_capacity,
    "check_ready_queue": queue_a_node_twice,
    "check_open_count": miscount_open_nodes,
    "check_node_set": add_a_node_behind_the_schedulers_back,
    "check_dependency_counters": miscount_a_dependency,
    "check_waiting_nodes_wait_on_something": lose_a_release,
    "check_released_nodes_have_settled_dependencies": release_too_early,
    "check_skipped_nodes_have_no_result": skip_with_a_result,
    "check_stories_off_the_common_path": leave_the_path_without_a_story,
    "check_spawn_cap": admit_past_the_cap,
    "check_finished_run_is_closed": finish_with_work_open,
}


def test_every_named_check_has_a_break_that_it_catches_and_says_what_it_states():
    names = [check.__name__ for check in INVARIANTS]
    assert len(set(names)) == len(names)
    assert set(names) == set(BREAKS)
    for check in INVARIANTS:
        doc = (check.__doc__ or "").strip()
        assert doc and "\n" not in doc, f"{check.__name__} needs a one-line docstring stating its invariant"


def test_every_check_holds_on_the_uncorrupted_state(drive):
    state, _ = a_few_steps(drive)
    assert first_broken(state) is None


@pytest.mark.parametrize("check_name", list(BREAKS))
def test_each_break_is_caught_first_by_the_check_named_for_it(drive, check_name):
    state, n = a_few_steps(drive)
    node_id = BREAKS[check_name](state, n)

    assert first_broken(state) == check_name
    with pytest.raises(InvariantViolation) as caught:
        state.validate()
    assert caught.value.node_id == node_id
    # The kernel tests validate after every step: the next handle() finds the break too.
    with pytest.raises(InvariantViolation) as after_a_step:
        state.handle(DispatchHeld(held=True))
    assert after_a_step.value.message == caught.value.message
