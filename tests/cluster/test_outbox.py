"""The dispatch outbox: a run's transition and its event commit together, or neither does (SQLite and PostgreSQL).

    RunStore.create_run / mark_running / finish_run  --same transaction-->  outbox row (run.<status>)

No relay runs here: these tests read the outbox table itself.
"""

from __future__ import annotations

import json

import pytest

from opgraph.cluster.control.outbox import RUN_EVENT_TYPES, event_body, record
from opgraph.cluster.store import RunNotFoundError, RunStore

PROVENANCE = {"lane": "prompt", "source": {"kind": "prompt", "ref": "a short note"}}


def _events(store: RunStore) -> list[dict]:
    with store.transaction() as tx:
        return [dict(row) for row in tx.execute("SELECT event_id, event_type, subject_id, payload FROM outbox"
                                                " ORDER BY seq")]


def test_each_run_transition_writes_its_event_and_a_refused_one_writes_none(database_target):
    with RunStore(database_target) as store:
        store.create_run("run-1", session_id="s", provenance=PROVENANCE, inputs={})
        assert store.mark_running("run-1")
        assert store.finish_run("run-1", "failed", error={"error": "boom", "error_type": "ProviderTimeout"})
        # Terminal is final: a later finish changes nothing, and so announces nothing.
        assert not store.finish_run("run-1", "completed")
        assert not store.mark_running("run-1")
        with pytest.raises(RunNotFoundError):
            store.finish_run("no-such-run", "completed")
        events = _events(store)
        assert [event["event_type"] for event in events] == ["run.admitted", "run.running", "run.failed"]
        assert {event["subject_id"] for event in events} == {"run-1"}
        assert len({event["event_id"] for event in events}) == 3
        failed = json.loads(events[-1]["payload"])
        assert failed == {"run_id": "run-1", "status": "failed", "lane": "prompt", "workflow": "a short note",
                          "error_type": "ProviderTimeout"}
        assert {event["event_type"] for event in events} <= set(RUN_EVENT_TYPES)
        assert store.get_run("run-1").status == "failed"


def test_an_event_commits_with_its_callers_transaction_or_not_at_all(database_target):
    """record(tx, ...) is what the task queue calls in its own transactions: a rollback takes the event too."""
    with RunStore(database_target) as store:
        with pytest.raises(RuntimeError), store.transaction(write=True) as tx:
            record(tx, "task.succeeded", "task-1", {"task_id": "task-1"})
            raise RuntimeError("the fact failed after its event was written")
        assert _events(store) == []
        with store.transaction(write=True) as tx:
            event_id = record(tx, "task.succeeded", "task-2", {"task_id": "task-2"})
        assert [(event["event_id"], event["event_type"]) for event in _events(store)] == [(event_id, "task.succeeded")]
        with pytest.raises(ValueError, match="event type"), store.transaction(write=True) as tx:
            record(tx, "", "task-3", {})


def test_a_body_is_the_same_bytes_on_every_attempt():
    once = event_body("run.completed", 1_700_000_000.25, '{"run_id": "r", "status": "completed"}')
    assert once == event_body("run.completed", 1_700_000_000.25, '{"status": "completed", "run_id": "r"}')
    assert json.loads(once) == {"type": "run.completed", "timestamp": "2023-11-14T22:13:20.250000Z",
                                "data": {"run_id": "r", "status": "completed"}}


def test_pruning_a_run_takes_its_events_and_their_deliveries(database_target):
    """runs prune: the run's outbox events go with it, with every delivery and attempt recorded for them."""
    import asyncio

    from opgraph.cluster.control.relay import RelaySettings, WebhookRelay
    from opgraph.cluster.control.webhooks import AllowList, Webhooks
    from opgraph.cluster.store import RetentionPolicy, prune_runs

    loopback = AllowList.parse(["loopback"])
    with RunStore(database_target) as store:
        # No such secret: each attempt is recorded (refused), and nothing is sent.
        Webhooks(store, allow=loopback).add("nowhere", "http://127.0.0.1:9/hook", secret_ref="env:NO_SECRET_HERE")
        for run_id in ("old", "new"):
            store.create_run(run_id, session_id="s", provenance=PROVENANCE, inputs={})
            store.finish_run(run_id, "completed")
        done = asyncio.run(WebhookRelay(store, RelaySettings(allow=loopback)).run_once())
        assert done.attempted == 4
        report = prune_runs(store, RetentionPolicy(keep_last=1), run_log_here=False)
        assert report.runs == 1
        assert (report.rows["outbox"], report.rows["webhook_deliveries"], report.rows["webhook_attempts"]) == (2, 2, 2)
        assert {event["subject_id"] for event in _events(store)} == {"new"}


def test_an_engine_runs_transitions_write_their_events_too(database_target):
    from opgraph.cluster.store import EngineRunStore

    with EngineRunStore(database_target) as store:
        store.open_run("engine-1", engine="review", inputs={}, config={})
        store.close_run("engine-1", "degraded", result="partial", degrade_reason="budget", statistics={},
                        error={"error": "over budget", "error_type": "EngineBudgetError"})
        store.close_run("engine-1", "completed", result="late", degrade_reason="", error=None, statistics={})
        events = _events(store)
    assert [event["event_type"] for event in events] == ["engine_run.running", "engine_run.degraded"]
    assert json.loads(events[-1]["payload"]) == {"run_id": "engine-1", "engine": "review", "status": "degraded",
                                                 "error_type": "EngineBudgetError"}


def test_a_tasks_end_writes_its_event_in_the_transaction_that_commits_it(database_target):
    """submit -> claim -> succeed: one task.succeeded event (claims are not announced); fail -> dead likewise."""
    from opgraph.cluster.control import ControlDatabase, TaskQueue
    from opgraph.cluster.control.outbox import deliver_task_transitions

    with RunStore(database_target):
        pass  # the store (its outbox) is there before the control tables: their own hook and this one are one
    with ControlDatabase(database_target) as control, RunStore(database_target) as store:
        queue = TaskQueue(deliver_task_transitions(control))
        deliver_task_transitions(control)  # once only
        task, _ = queue.submit("workflow", "triage")
        claim = queue.claim("default", "worker-1")
        queue.succeed(claim, {"ok": True})
        doomed, _ = queue.submit("workflow", "triage", max_attempts=1)
        queue.fail(queue.claim("default", "worker-1"), {"error": "no"}, retryable=False)
        ended = queue.get(doomed.task_id).state
        events = _events(store)
    assert ended in ("failed", "dead")
    assert [(event["event_type"], event["subject_id"]) for event in events] == [
        ("task.succeeded", task.task_id), (f"task.{ended}", doomed.task_id)]
    assert json.loads(events[0]["payload"])["action_kind"] == "workflow"
