"""Failures the shell reports and the kernel decides on: undelivered attempts, retries, the cancel grace.

The shell only reports facts (an attempt never reached a live worker; an attempt failed
with a kind; the grace period after a cancel ran out); which status a node ends in, and
whether it runs again, is the kernel's decision (STYLE.md habit 15). Each test drives a
FlowState through the ``drive`` fixture, which validates it after every step.
"""

from __future__ import annotations

from kernel_graphs import build

from opgraph.kernel import (
    CancelGraceExpired,
    CancelOperation,
    CancelRequested,
    DispatchUndelivered,
    OperationError,
    OperationFinished,
    RetryPolicy,
)
from opgraph.kernel.failures import FAILURE_KINDS, OPERATION_TIMEOUT, WORKER_DIED


def failed(node_id: str, attempt: int, kind: str, error: str = "it broke") -> OperationFinished:
    return OperationFinished(node_id=node_id, attempt=attempt, status="failed", error=error, error_type=kind)


# -- an attempt that never started -----------------------------------------------------
def test_an_undelivered_attempt_is_dispatched_again_as_a_new_attempt_not_failed(drive):
    """a: attempt 1 went to a dead worker and never started; a runs again as attempt 2 and completes."""
    graph, n = build("a")
    driver = drive(graph)
    assert driver.dispatched()[n.a].attempt == 1
    driver._outstanding.pop(n.a)
    driver.handle(DispatchUndelivered(node_id=n.a, attempt=1, reason="worker 0 was dead"))
    assert driver.dispatched()[n.a].attempt == 2
    assert driver.signals("failed") == []
    driver.complete(n.a, "ok")
    assert driver.envelope["operation_statuses"] == {n.a: "completed"}
    assert driver.state.counters["redispatched"] == 1
    assert ("running", "ready", "attempt 1 never started: worker 0 was dead", 1) in driver.state.story(n.a)


def test_an_undelivered_report_for_a_stale_attempt_changes_nothing(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(DispatchUndelivered(node_id=n.a, attempt=7, reason="late"))
    assert driver.dispatched()[n.a].attempt == 1
    assert driver.state.counters["stale_results"] == 1


def test_an_undelivered_attempt_of_a_cancelling_run_is_cancelled_not_redispatched(drive):
    """a is in flight when the run is cancelled; its attempt turns out never to have started."""
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(CancelRequested())
    driver._outstanding.pop(n.a)
    driver.handle(DispatchUndelivered(node_id=n.a, attempt=1, reason="worker gone"))
    assert driver.envelope["operation_statuses"] == {n.a: "cancelled"}
    assert [signal.op_id for signal in driver.signals("cancelled")] == [n.a]


# -- retries under a policy --------------------------------------------------------------
def test_a_worker_death_is_retried_under_the_operations_policy_with_a_new_attempt(drive):
    """a (chat, up to 2 attempts on WorkerDied): attempt 1 dies with its worker, attempt 2 completes."""
    graph, n = build("a")
    driver = drive(graph, retry_policies={"chat": RetryPolicy.of(2)})
    driver._outstanding.pop(n.a)
    driver.handle(failed(n.a, 1, WORKER_DIED))
    assert driver.dispatched()[n.a].attempt == 2
    assert driver.signals("failed") == []
    driver.complete(n.a, "second time lucky")
    assert driver.envelope["operation_results"][n.a] == "second time lucky"


def test_retries_stop_at_max_attempts_and_the_node_fails_with_the_last_kind(drive):
    graph, n = build("a")
    driver = drive(graph, retry_policies={"chat": RetryPolicy.of(2)})
    for attempt in (1, 2):
        driver._outstanding.pop(n.a)
        driver.handle(failed(n.a, attempt, WORKER_DIED))
    assert driver.envelope["operation_statuses"] == {n.a: "failed"}
    assert driver.envelope["operation_results"][n.a]["error_type"] == WORKER_DIED


def test_a_failure_of_a_kind_the_policy_does_not_name_is_not_retried(drive):
    graph, n = build("a")
    driver = drive(graph, retry_policies={"chat": RetryPolicy.of(3, on={WORKER_DIED})})
    driver._outstanding.pop(n.a)
    driver.handle(failed(n.a, 1, "ValueError"))
    assert driver.envelope["operation_statuses"] == {n.a: "failed"}


def test_a_policy_can_name_timeouts_and_exception_classes(drive):
    graph, n = build("a")
    driver = drive(graph, retry_policies={"chat": RetryPolicy.of(3, on={OPERATION_TIMEOUT, "ConnectionError"})})
    driver._outstanding.pop(n.a)
    driver.handle(failed(n.a, 1, OPERATION_TIMEOUT))
    driver._outstanding.pop(n.a)
    driver.handle(failed(n.a, 2, "ConnectionError"))
    driver.complete(n.a, "third")
    assert driver.envelope["status"] == "completed"


def test_bad_retry_policies_are_refused_with_what_was_wrong(drive):
    graph, _ = build("a")
    for bad in (lambda: RetryPolicy.of(0), lambda: RetryPolicy.of(True), lambda: RetryPolicy.of(2, on={""})):
        try:
            bad()
        except OperationError as exc:
            assert "max_attempts" in exc.message or "retry kinds" in exc.message
        else:
            raise AssertionError("a bad policy was accepted")
    try:
        drive(graph, retry_policies={"chat": 3})
    except OperationError as exc:
        assert "'chat'" in exc.message
    else:
        raise AssertionError("a policy that is not a RetryPolicy was accepted")


def test_every_failure_kind_is_a_distinct_non_empty_name():
    assert all(kind and kind[0].isupper() and " " not in kind for kind in FAILURE_KINDS)
    assert WORKER_DIED in FAILURE_KINDS and OPERATION_TIMEOUT in FAILURE_KINDS


# -- cancellation, announced and bounded -------------------------------------------------
def test_every_cancelled_node_is_announced_cancelled(drive):
    """a -> b, c: cancel while a runs; a acknowledges: a, b and c are each announced cancelled once."""
    graph, n = build("a", "b", "c", edges=(("a", "b"), ("a", "c")))
    driver = drive(graph)
    driver.handle(CancelRequested())
    assert driver.of_type(CancelOperation, last=True) == [CancelOperation(n.a, 1)]
    driver.cancelled(n.a)
    assert sorted(signal.op_id for signal in driver.signals("cancelled")) == sorted([n.a, n.b, n.c])
    assert driver.envelope["status"] == "cancelled"


def test_operations_ignoring_cancellation_are_cancelled_when_the_grace_expires(drive):
    """a, b in flight ignore the cancel; the grace expires: both cancelled; a's late result is stale."""
    graph, n = build("a", "b")
    driver = drive(graph)
    driver.handle(CancelRequested())
    assert driver.envelope is None  # still waiting on a and b
    driver.handle(CancelGraceExpired(now=3.0))
    assert driver.envelope["operation_statuses"] == {n.a: "cancelled", n.b: "cancelled"}
    reasons = {signal.op_id: signal.reason for signal in driver.signals("cancelled")}
    assert all(reason.startswith("CancelGraceExpired") for reason in reasons.values())
    driver.complete(n.a, "too late")
    assert driver.state.counters["stale_results"] == 1
    assert driver.envelope["operation_statuses"][n.a] == "cancelled"


def test_a_grace_expiry_without_a_cancel_changes_nothing(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(CancelGraceExpired())
    assert driver.dispatched()[n.a].attempt == 1 and driver.envelope is None


def test_a_run_cancelled_before_its_start_announces_no_node(unstarted):
    graph, _ = build("a", "b")
    driver = unstarted(graph)
    driver.handle(CancelRequested())
    driver.start()
    assert driver.signals("cancelled") == []
    assert set(driver.envelope["cancelled_operations"]) == set(graph.nodes)
