"""The control plane under /api/ (schedules, tasks, workers), through the real app and its access guard.

    client --token--> AccessGuard --> /api/schedules, /api/tasks, /api/workers --> control tables
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from opgraph.cluster.http import create_app
from opgraph.cluster.http.guard import AccessPolicy
from opgraph.cluster.lanes import open_store

TOKEN = "t" * 32


@pytest.fixture
def client(tmp_path):
    with open_store(tmp_path / "opgraph.db") as store:
        app = create_app(store, start_runtime=False, access=AccessPolicy(TOKEN, allowed_hosts=("testserver",)))
        with TestClient(app, headers={"authorization": f"Bearer {TOKEN}"}) as http:
            yield http


def test_schedule_api_adds_fires_and_refuses_bad_input(client):
    made = client.post("/api/schedules", json={"name": "n", "action_kind": "agent", "target": "hi",
                                                "cron": "*/5 * * * *", "timezone": "Europe/Paris"})
    assert made.status_code == 201 and made.json()["timezone"] == "Europe/Paris"
    bad = client.post("/api/schedules", json={"name": "m", "action_kind": "agent", "target": "x", "cron": "bad"})
    assert bad.status_code == 422 and bad.json()["field"] == "cron"
    zone = client.post("/api/schedules", json={"name": "m", "action_kind": "agent", "target": "x",
                                               "cron": "* * * * *", "timezone": "Europe"})
    assert zone.status_code == 422 and "unknown time zone" in zone.json()["error"]
    missing = client.post("/api/schedules", json={"name": "m", "action_kind": "workflow", "target": "nope",
                                                  "cron": "* * * * *"})
    assert missing.status_code == 404 and "no workflow named 'nope'" in missing.json()["error"]
    assert client.post("/api/schedules/n/trigger").json()["status"] == "fired"
    too_many = client.post("/api/schedules/n/backfill", json={"start": 0, "end": 1e10})
    assert too_many.status_code == 422 and "more than 1000 fires" in too_many.json()["error"]
    paused = client.post("/api/schedules/n/pause", json={"note": "holiday"}).json()
    assert paused["paused"] == 1 and paused["note"] == "holiday"
    shown = client.get("/api/schedules/n").json()
    assert len(shown["fires"]) == 1 and len(shown["next"]) == 5
    assert client.post("/api/schedules/nope/pause", json={}).status_code == 404
    assert client.delete("/api/schedules/n").status_code == 200
    assert client.get("/api/schedules").json() == {"schedules": []}


def test_task_queue_api_submits_once_per_key_cancels_retries_and_explains(client):
    first = client.post("/api/tasks", json={"action_kind": "agent", "target": "x", "idempotency_key": "a"})
    again = client.post("/api/tasks", json={"action_kind": "agent", "target": "x", "idempotency_key": "a"})
    assert (first.status_code, first.json()["created"], again.json()["created"]) == (201, True, False)
    task_id = again.json()["task_id"]
    assert first.json()["task_id"] == task_id
    shown = client.get(f"/api/tasks/{task_id}").json()
    assert shown["waiting_because"].startswith("no live worker on queue 'default'")
    assert client.post(f"/api/tasks/{task_id}/cancel", json={}).json()["state"] == "cancelled"
    assert client.post(f"/api/tasks/{task_id}/cancel", json={}).status_code == 409
    assert client.post(f"/api/tasks/{task_id}/retry").json()["state"] == "queued"
    assert client.get("/api/tasks/none").status_code == 404
    refused = client.post("/api/tasks", json={"action_kind": "flow_yaml", "target": "/etc/passwd"})
    assert refused.status_code == 422 and refused.json()["field"] == "action_kind"
    assert client.post("/api/tasks", json={"action_kind": "shell", "target": "x"}).status_code == 422
    assert client.post("/api/tasks", json={"action_kind": "workflow", "target": "../x.json"}).status_code == 422
    assert [task["task_id"] for task in client.get("/api/tasks").json()["tasks"]] == [task_id]
    assert client.get("/api/workers").json() == {"workers": []}
    unsigned = client.get("/api/tasks", headers={"authorization": ""})
    assert unsigned.status_code == 401
    document = client.get("/openapi.json").json()["paths"]
    for path in ("/api/schedules", "/api/schedules/{name}/backfill", "/api/tasks", "/api/tasks/{task_id}/retry",
                 "/api/workers"):
        assert path in document


def test_task_queue_and_schedule_metrics_count_depth_age_expiries_fires_and_lateness(tmp_path):
    from control_clock import FakeClock
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from opgraph.cluster.control import ControlDatabase, TaskQueue
    from opgraph.cluster.control.schedules import Scheduler
    from opgraph.cluster.metrics.control import ControlCollector

    clock = FakeClock()
    target = tmp_path / "control.db"
    database = ControlDatabase(target, clock=clock)
    queue, scheduler = TaskQueue(database), Scheduler(database)
    queue.submit("agent", "a", queue="q1")
    queue.submit("agent", "b", queue="q1")
    queue.claim("q1", "w", lease_seconds=5)
    scheduler.add("s", action_kind="agent", target="x", interval=60, overlap="skip", catchup_window=30)
    clock.advance(130)  # the lease lapsed; the schedule missed 60 (beyond the window) and fires 120 late by 10 s
    scheduler.tick()
    registry = CollectorRegistry()
    registry.register(ControlCollector(target, clock=clock))
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(generate_latest(registry).decode())
               for sample in family.samples}
    assert samples[("opgraph_control_tasks", (("queue", "q1"), ("state", "queued")))] == 2
    assert samples[("opgraph_control_tasks", (("queue", "default"), ("state", "queued")))] == 1
    assert samples[("opgraph_control_oldest_queued_seconds", (("queue", "q1"),))] == 130
    assert samples[("opgraph_control_lease_expiries_total", ())] == 1
    assert samples[("opgraph_control_fires_total", (("status", "fired"),))] == 1
    assert samples[("opgraph_control_fires_total", (("status", "skipped"),))] == 1
    assert samples[("opgraph_control_fire_lateness_seconds", (("quantile", "0.99"),))] == 10
    empty = CollectorRegistry()
    empty.register(ControlCollector(tmp_path / "none.db"))
    assert "opgraph_control_tasks{queue=\"default\",state=\"dead\"} 0.0" in generate_latest(empty).decode()
    assert not (tmp_path / "none.db").exists()
    database.close()
