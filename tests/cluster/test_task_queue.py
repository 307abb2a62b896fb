"""The leased task queue on SQLite and PostgreSQL (``database_target``), driven by a fake clock.

    submit -> claim (lease, token) -> heartbeat ... -> succeed | fail -> retry/backoff -> dead
                      \\-- lease lapses --> reap -> queued -> another worker claims (same run id)
"""

from __future__ import annotations

import threading

import pytest
from control_clock import FakeClock

from opgraph.cluster.control import (
    ControlDatabase,
    ControlInputError,
    LeaseLostError,
    TaskQueue,
    TaskStateError,
    UnknownActionKindError,
)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def queue(database_target, clock):
    database = ControlDatabase(database_target, clock=clock)
    yield TaskQueue(database)
    database.close()


def test_task_queue_claims_by_priority_then_age_and_leases_once(queue, clock):
    low, _ = queue.submit("workflow", "triage", priority=0)
    clock.advance(1)
    high, _ = queue.submit("workflow", "triage", priority=5)
    clock.advance(1)
    low2, _ = queue.submit("workflow", "triage", priority=0)
    order = [queue.claim("default", f"w{i}").task.task_id for i in range(3)]
    assert order == [high.task_id, low.task_id, low2.task_id]
    assert queue.claim("default", "w9") is None
    assert {task.state for task in queue.list_tasks()} == {"leased"}
    assert all(task.attempts == 1 for task in queue.list_tasks())


def test_task_queue_idempotency_key_makes_one_task(queue):
    first, created = queue.submit("workflow", "triage", idempotency_key="order-17")
    again, created_again = queue.submit("workflow", "triage", idempotency_key="order-17")
    assert created and not created_again and again.task_id == first.task_id
    assert len(queue.list_tasks()) == 1


def test_task_queue_refuses_bad_input_before_writing(queue):
    with pytest.raises(UnknownActionKindError, match="unknown action_kind 'shell'"):
        queue.submit("shell", "rm -rf /")
    with pytest.raises(ControlInputError, match="max_attempts"):
        queue.submit("workflow", "triage", max_attempts=0)
    with pytest.raises(ControlInputError, match="needs a concurrency_key"):
        queue.submit("workflow", "triage", concurrency_limit=2)
    assert queue.list_tasks() == []


def test_task_queue_lease_lapse_returns_the_task_with_its_run_and_fences_the_old_worker(queue, clock):
    queue.submit("workflow", "triage", max_attempts=3)
    first = queue.claim("default", "worker-a", lease_seconds=10)
    queue.mark_running(first, "run-1")
    clock.advance(5)
    assert queue.heartbeat(first, lease_seconds=10) is False  # extended to t+15
    clock.advance(9)
    assert queue.reap() == []
    clock.advance(2)  # the lease lapsed: worker-a stopped heartbeating
    (reaped,) = queue.reap()
    assert reaped.state == "queued" and reaped.run_id == "run-1" and "lapsed" in reaped.reason
    second = queue.claim("default", "worker-b", lease_seconds=10)
    assert second.task.run_id == "run-1" and second.task.attempts == 2 and second.token > first.token
    with pytest.raises(LeaseLostError):
        queue.heartbeat(first)
    with pytest.raises(LeaseLostError):
        queue.succeed(first, {"late": True})
    done = queue.succeed(second, {"ok": True})
    assert done.state == "succeeded" and done.result == {"ok": True}
    kinds = [event["kind"] for event in queue.events(done.task_id)]
    assert kinds == ["submitted", "started", "lease_expired", "succeeded"]
    assert queue.statistics()["lease_expiries"] == 1


def test_task_queue_attempts_back_off_then_die_with_the_reason(queue, clock):
    task, _ = queue.submit("workflow", "triage", max_attempts=3, backoff_base=2, backoff_max=3)
    claim = queue.claim("default", "w")
    again = queue.fail(claim, {"error": "boom"})
    assert again.state == "queued" and again.available_at == clock.now + 2 and again.run_id is None
    assert queue.claim("default", "w") is None  # backing off
    clock.advance(2)
    again = queue.fail(queue.claim("default", "w"), {"error": "boom"})
    assert again.available_at == clock.now + 3  # doubled, capped at 3
    clock.advance(3)
    dead = queue.fail(queue.claim("default", "w"), {"error": "boom"})
    assert dead.state == "dead" and dead.reason.startswith("attempt 3 of 3 failed: boom")
    retried = queue.retry(task.task_id)
    assert retried.state == "queued" and retried.attempts == 0
    with pytest.raises(TaskStateError):
        queue.retry(task.task_id)


def test_task_queue_lease_lapse_on_the_last_attempt_is_dead(queue, clock):
    queue.submit("workflow", "triage", max_attempts=1)
    queue.claim("default", "w", lease_seconds=5)
    clock.advance(6)
    (dead,) = queue.reap()
    assert dead.state == "dead" and "attempts spent" in dead.reason


def test_task_queue_concurrency_key_slot_is_freed_by_lease_expiry(queue, clock):
    """A crashed worker's slot is not leaked: the count is over unexpired leases only."""
    for _ in range(3):
        queue.submit("workflow", "triage", concurrency_key="tenant-1", concurrency_limit=1)
    held = queue.claim("default", "crashes", lease_seconds=10)
    assert held is not None
    assert queue.claim("default", "other") is None
    waiting = queue.list_tasks(state="queued")[0]
    assert "slot of concurrency key 'tenant-1'" in queue.why_waiting(waiting) or "no live worker" in \
        queue.why_waiting(waiting)
    clock.advance(11)  # the holder crashed: no heartbeat, and nobody has reaped yet
    taken = queue.claim("default", "other", lease_seconds=10)
    assert taken is not None and taken.task.task_id != held.task.task_id


def test_task_queue_limit_per_queue(queue):
    queue.set_queue_limit("default", 2)
    for _ in range(4):
        queue.submit("workflow", "triage")
    claims = [queue.claim("default", "w") for _ in range(4)]
    assert sum(claim is not None for claim in claims) == 2
    queue.succeed(claims[0])
    assert queue.claim("default", "w") is not None


def test_task_queue_routes_only_kinds_a_worker_takes_and_says_why_a_task_waits(queue):
    task, _ = queue.submit("agent", "say hi")
    assert queue.claim("default", "w", action_kinds=["workflow"]) is None
    assert "no live worker on queue 'default'" in queue.why_waiting(queue.get(task.task_id))
    queue.worker_seen("host:1:abc", queue="default", action_kinds=["workflow"], concurrency=2)
    assert "takes action_kind 'agent'" in queue.why_waiting(queue.get(task.task_id))


def test_task_queue_cancel_terminates_a_lease_and_release_keeps_the_run(queue):
    queue.submit("workflow", "a")
    queue.submit("workflow", "b")
    claim_a = queue.claim("default", "w")
    queue.cancel(claim_a.task.task_id)
    with pytest.raises(LeaseLostError):
        queue.heartbeat(claim_a)
    claim_b = queue.claim("default", "w")
    queue.mark_running(claim_b, "run-b")
    released = queue.release(claim_b, "worker stopping")
    assert released.state == "queued" and released.attempts == 0 and released.run_id == "run-b"
    with pytest.raises(TaskStateError):
        queue.cancel(claim_a.task.task_id)


def test_task_queue_concurrent_claimers_never_share_a_task(database_target, clock):
    """Four threads, each with its own connection, claim 200 tasks: each task is leased exactly once."""
    producer = TaskQueue(ControlDatabase(database_target, clock=clock))
    for index in range(200):
        producer.submit("workflow", f"t{index}", concurrency_key=None if index % 5 else f"k{index % 3}")
    won: list[str] = []
    lock = threading.Lock()

    def claimer(name: str) -> None:
        queue = TaskQueue(ControlDatabase(database_target, clock=clock))
        while True:
            claim = queue.claim("default", name, lease_seconds=600)
            if claim is None:
                if not queue.list_tasks(state="queued", limit=1):
                    break
                continue
            with lock:
                won.append(claim.task.task_id)
            if claim.task.concurrency_key:
                queue.succeed(claim)
        queue.db.close()

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(won) == len(set(won)) == 200
    producer.db.close()


def test_task_queue_survives_a_postgresql_restart_with_nothing_lost(clock):
    """A server of its own, restarted (``-m immediate``: a crash) under a worker's open connection: the
    statement that meets the restart fails with a ControlError, the next one reconnects; every task and
    the lease held before the restart are there, and the holder's token still fences."""
    from components import require
    from postgres_server import PostgresServer

    from opgraph.cluster.control import ControlError

    require("postgresql")
    server = PostgresServer.start(durable=True)  # the tests' fast server would lose its last commits in a crash
    try:
        database = ControlDatabase(server.database(), clock=clock)
        queue = TaskQueue(database)
        for index in range(3):
            queue.submit("agent", f"t{index}")
        held = queue.claim("default", "w", lease_seconds=60)
        queue.mark_running(held, "run-1")
        server._run("pg_ctl", "-D", server.data, "-l", f"{server.folder}/server.log", "-m", "immediate", "-w",
                    "restart")
        failures = 0
        for _ in range(5):
            try:
                assert queue.heartbeat(held) is False
                break
            except LeaseLostError:
                raise
            except ControlError:
                failures += 1
        assert failures <= 1
        states = sorted(task.state for task in queue.list_tasks())
        assert states == ["queued", "queued", "running"]
        assert queue.claim("default", "w2") is not None and queue.claim("default", "w3") is not None
        assert queue.succeed(held).state == "succeeded"
        database.close()
    finally:
        server.stop()


def test_task_queue_writes_a_task_end_to_the_outbox_in_its_own_transaction(database_target, clock):
    """A store with the dispatch outbox: a task's end (succeeded, dead, cancelled) is a task.<state> row,
    committed with the transition; a claim writes none (it stays one statement)."""
    from opgraph.cluster.lanes import open_store

    with open_store(database_target):
        pass  # the run store's tables, its outbox among them
    database = ControlDatabase(database_target, clock=clock)
    queue = TaskQueue(database)
    done, _ = queue.submit("agent", "a", max_attempts=1, priority=3)
    dead, _ = queue.submit("agent", "b", max_attempts=1, priority=2)
    gone, _ = queue.submit("agent", "c", priority=1)
    queue.succeed(queue.claim("default", "w"))
    queue.fail(queue.claim("default", "w"), {"error": "boom"})
    queue.cancel(gone.task_id)
    with database.transaction() as db:
        rows = db.execute("SELECT event_type, subject_id, payload FROM outbox ORDER BY seq").fetchall()
    assert [(row[0], row[1]) for row in rows] == [("task.succeeded", done.task_id), ("task.dead", dead.task_id),
                                                  ("task.cancelled", gone.task_id)]
    assert '"queue": "default"' in rows[0][2]
    database.close()
