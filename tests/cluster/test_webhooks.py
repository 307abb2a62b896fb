"""Signed webhooks delivered from the outbox to real receivers, verified as a receiver would.

    run transition -> outbox -> WebhookRelay -> aiohttp receiver on 127.0.0.1 (/ok 200, /fail 500, /hang)
                                             -> standardwebhooks.Webhook(secret).verify(body, headers)

Retries run on a fake clock (nothing sleeps through a backoff); the hanging receiver costs
one short timeout. Every test allows loopback explicitly: by default it is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import standardwebhooks
from aiohttp import web
from api_server import serve

from opgraph.cluster.cli import main
from opgraph.cluster.control.relay import RelaySettings, WebhookRelay
from opgraph.cluster.control.webhooks import (
    AllowList,
    WebhookNameConflictError,
    WebhookNotFoundError,
    Webhooks,
    WebhookSecretError,
    WebhookTargetError,
    delivery_statistics,
    generate_secret,
    resolve_secret,
)
from opgraph.cluster.http import create_app
from opgraph.cluster.metrics.webhooks import StoreCollector
from opgraph.cluster.store import RunStore, StoreDatabase

LOOPBACK = AllowList.parse(["loopback"])
PROVENANCE = {"lane": "prompt", "source": {"kind": "prompt", "ref": "a short note"}}
SECRET_VARIABLE = "OPGRAPH_TEST_WEBHOOK_SECRET"
DEADLINE = 10.0


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """A real aiohttp server on a 127.0.0.1 port, in its own thread: /ok answers 200, /fail 500, and
    /hang answers nothing until the receiver closes."""

    port: int = 0
    received: list[Received] = field(default_factory=list)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}"

    def on(self, path: str) -> list[Received]:
        return [request for request in self.received if request.path == f"/{path}"]


@contextlib.contextmanager
def running_receiver() -> Iterator[Receiver]:
    receiver, ready, loop = Receiver(), threading.Event(), asyncio.new_event_loop()
    release = asyncio.Event()

    async def answer(request: web.Request) -> web.Response:
        receiver.received.append(Received(request.path, dict(request.headers), await request.read()))
        if request.path == "/fail":
            return web.Response(status=500, text="the receiver is broken")
        if request.path == "/hang":
            await release.wait()
        return web.Response(text="ok")

    async def start() -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/{path}", answer)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        receiver.port = runner.addresses[0][1]
        return runner

    def run() -> None:
        asyncio.set_event_loop(loop)
        runner_box.append(loop.run_until_complete(start()))
        ready.set()
        loop.run_forever()

    runner_box: list[web.AppRunner] = []
    thread = threading.Thread(target=run, name="webhook-receiver", daemon=True)
    thread.start()
    assert ready.wait(DEADLINE), "the receiver did not start"
    try:
        yield receiver
    finally:
        loop.call_soon_threadsafe(release.set)
        asyncio.run_coroutine_threadsafe(runner_box[0].cleanup(), loop).result(DEADLINE)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(DEADLINE)
        loop.close()


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as running:
        yield running


@pytest.fixture
def secret(monkeypatch) -> str:
    value = generate_secret()
    monkeypatch.setenv(SECRET_VARIABLE, value)
    return value


class FakeClock:
    """The relay's schedule clock: moved by hand, so a 30-minute backoff takes no time."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _verify(secret: str, request: Received) -> dict:
    """What a receiver does: check the signature and the timestamp, then read the body."""
    return standardwebhooks.Webhook(secret).verify(request.body, request.headers)


def _run(store: RunStore, run_id: str, status: str = "completed") -> None:
    store.create_run(run_id, session_id="s", provenance=PROVENANCE, inputs={})
    store.mark_running(run_id)
    store.finish_run(run_id, status, error={"error": "no", "error_type": "Boom"} if status == "failed" else None)


def test_the_relay_delivers_each_run_event_signed_and_records_the_attempt(database_target, receiver, secret):
    """admitted -> running -> completed: three signed deliveries that standardwebhooks verifies."""
    with RunStore(database_target) as store:
        webhooks = Webhooks(store, allow=LOOPBACK)
        name = f"ok-{os.getpid()}-{id(store)}"
        webhooks.add(name, receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        run_id = f"run-{name}"
        _run(store, run_id)
        before = len(receiver.on("ok"))
        done = asyncio.run(WebhookRelay(store, RelaySettings(allow=LOOPBACK)).run_once())
        assert (done.fanned_out, done.attempted, done.outcomes) == (3, 3, {"delivered": 3})
        bodies = [_verify(secret, request) for request in receiver.on("ok")[before:]]
        assert sorted(body["type"] for body in bodies) == ["run.admitted", "run.completed", "run.running"]
        assert {body["data"]["run_id"] for body in bodies} == {run_id}
        for request in receiver.on("ok")[before:]:
            assert request.headers["webhook-id"].startswith("msg_")
            assert request.headers["webhook-signature"].startswith("v1,")
        deliveries = webhooks.deliveries(name)
        assert {row["status"] for row in deliveries} == {"delivered"}
        for row in deliveries:
            (attempt,) = row["attempt_log"]
            assert attempt["outcome"] == "delivered" and attempt["status_code"] == 200
            assert 0 < attempt["latency"] < DEADLINE
        # Nothing is left to do: the next pass sends nothing again.
        assert asyncio.run(WebhookRelay(store, RelaySettings(allow=LOOPBACK)).run_once()).attempted == 0
        assert delivery_statistics(store)["attempts"]["delivered"] == 3


def test_a_receiver_that_answers_500_is_retried_on_the_schedule_then_disabled(database_target, receiver, secret):
    """Attempts at 0, 5 s, 5 min, 30 min (a fake clock), all 500: the delivery dies, the endpoint is
    disabled with a reason a user can read, and the run it reports stays completed."""
    clock = FakeClock()
    with RunStore(database_target, clock=clock) as store:
        webhooks = Webhooks(store, allow=LOOPBACK, clock=clock)
        webhooks.add("broken", receiver.url("fail"), secret_ref=f"env:{SECRET_VARIABLE}", events=["run.completed"])
        _run(store, "run-500")
        relay = WebhookRelay(store, RelaySettings(schedule=(0, 5, 300, 1800), max_attempts=4, allow=LOOPBACK),
                             clock=clock)
        attempted = []
        for wait in (0, 4.9, 0.1, 299.9, 0.1, 1799.9, 0.1):
            clock.advance(wait)
            attempted.append(asyncio.run(relay.run_once()).attempted)
        assert attempted == [1, 0, 1, 0, 1, 0, 1]
        requests = receiver.on("fail")[-4:]
        assert len({request.headers["webhook-id"] for request in requests}) == 1  # retries of one message
        assert all(_verify(secret, request)["type"] == "run.completed" for request in requests)
        (delivery,) = webhooks.deliveries("broken")
        assert delivery["status"] == "dead" and delivery["attempts"] == 4
        assert [attempt["outcome"] for attempt in delivery["attempt_log"]] == ["failed"] * 4
        assert [attempt["at"] - delivery["attempt_log"][0]["at"] for attempt in delivery["attempt_log"]] == \
            pytest.approx([0, 5, 305, 2105])
        assert delivery["attempt_log"][0]["error"] == "HTTP 500: the receiver is broken"
        endpoint = webhooks.get("broken")
        assert not endpoint.enabled
        assert "failed all 4 attempts" in endpoint.disabled_reason and "HTTP 500" in endpoint.disabled_reason
        assert receiver.url("fail") in endpoint.disabled_reason
        assert store.get_run("run-500").status == "completed"  # dispatch never owns the run's status
        # Disabled: new events are not sent to it; enabled again, they are.
        _run(store, "run-500-b")
        assert asyncio.run(relay.run_once()).attempted == 0
        webhooks.enable("broken")
        _run(store, "run-500-c")
        assert asyncio.run(relay.run_once()).attempted == 1
        statistics = delivery_statistics(store)
        assert statistics["attempts"]["failed"] == 5 and statistics["dead"] == 1


def test_failures_in_a_row_disable_an_endpoint_before_any_delivery_dies(tmp_path, receiver, secret):
    clock = FakeClock()
    with RunStore(tmp_path / "opgraph.db", clock=clock) as store:
        webhooks = Webhooks(store, allow=LOOPBACK, clock=clock)
        webhooks.add("flaky", receiver.url("fail"), secret_ref=f"env:{SECRET_VARIABLE}", events=["run.*"])
        _run(store, "run-flaky")  # three events: three failed attempts in one pass
        relay = WebhookRelay(store, RelaySettings(disable_after=3, allow=LOOPBACK), clock=clock)
        done = asyncio.run(relay.run_once())
        assert done.outcomes == {"failed": 3} and done.disabled == ["flaky"]
        assert "3 attempts in a row failed" in webhooks.get("flaky").disabled_reason
        assert {row["status"] for row in webhooks.deliveries("flaky")} == {"pending"}  # kept for when it is enabled


def test_a_receiver_that_hangs_is_a_timeout_and_is_tried_again_later(tmp_path, receiver, secret):
    clock = FakeClock()
    with RunStore(tmp_path / "opgraph.db", clock=clock) as store:
        webhooks = Webhooks(store, allow=LOOPBACK, clock=clock)
        webhooks.add("slow", receiver.url("hang"), secret_ref=f"env:{SECRET_VARIABLE}")
        event_id = webhooks.test("slow")
        relay = WebhookRelay(store, RelaySettings(timeout=0.5, allow=LOOPBACK), clock=clock)
        done = asyncio.run(relay.run_once())
        assert done.outcomes == {"timeout": 1}
        (delivery,) = webhooks.deliveries("slow")
        (attempt,) = delivery["attempt_log"]
        assert delivery["event_id"] == event_id and delivery["status"] == "pending"
        assert attempt["error"] == "no answer within 0.5 s" and 0.5 <= attempt["latency"] < 3
        assert delivery["next_attempt_at"] == pytest.approx(clock.now + 5)
        assert _verify(secret, receiver.on("hang")[-1])["type"] == "webhook.test"


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/hook", "http://localhost/hook", "http://10.1.2.3/hook", "http://192.168.0.7/",
    "http://169.254.169.254/latest/meta-data", "http://[::1]/hook", "http://[::ffff:127.0.0.1]/hook",
    "http://0.0.0.0/hook", "ftp://example.com/hook", "http://user:password@example.com/hook", "not a url",
    "http:///no-host"])
def test_a_webhook_url_outside_the_allow_list_is_refused_and_nothing_is_stored(tmp_path, url):
    with RunStore(tmp_path / "opgraph.db") as store:
        webhooks = Webhooks(store, allow=AllowList())
        with pytest.raises(WebhookTargetError) as refused:
            webhooks.add("inside", url, secret_ref="env:ANY")
        assert refused.value.endpoint == "inside"
        assert webhooks.list() == []
    if url.startswith("http://127.") or url.startswith("http://10."):
        assert "outside the allow-list" in refused.value.message
        assert "OPGRAPH_WEBHOOK_ALLOWED_NETWORKS" in refused.value.message


def test_the_allow_list_is_checked_again_at_each_send(tmp_path, receiver, secret):
    """Added while loopback was allowed; a relay that does not allow it refuses the send (recorded, not sent)."""
    with RunStore(tmp_path / "opgraph.db") as store:
        webhooks = Webhooks(store, allow=LOOPBACK)
        webhooks.add("moved", receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        webhooks.test("moved")
        sent = len(receiver.received)
        done = asyncio.run(WebhookRelay(store, RelaySettings(allow=AllowList.parse(["10.0.0.0/8"]))).run_once())
        assert done.outcomes == {"refused": 1} and len(receiver.received) == sent
        (delivery,) = webhooks.deliveries("moved")
        assert "outside the allow-list" in delivery["attempt_log"][0]["error"]


def test_names_and_secret_references_are_checked(tmp_path, monkeypatch):
    with RunStore(tmp_path / "opgraph.db") as store:
        webhooks = Webhooks(store, allow=LOOPBACK)
        webhooks.add("one", "http://127.0.0.1:9/x", secret_ref="env:ONE")
        with pytest.raises(WebhookNameConflictError):
            webhooks.add("one", "http://127.0.0.1:9/y", secret_ref="env:ONE")
        with pytest.raises(WebhookNotFoundError):
            webhooks.deliveries("two")
        with pytest.raises(WebhookSecretError, match="env:VARIABLE"):
            webhooks.add("three", "http://127.0.0.1:9/x", secret_ref="whsec_c2VjcmV0IGluIGEgcm93")
    monkeypatch.setenv("SHORT_SECRET", "whsec_c2hvcnQ=")
    with pytest.raises(WebhookSecretError, match="bytes"):
        resolve_secret("env:SHORT_SECRET")
    with pytest.raises(WebhookSecretError, match="is not set"):
        resolve_secret("env:OPGRAPH_NO_SUCH_SECRET_HERE")
    shared = tmp_path / "shared-secret"
    shared.write_text(generate_secret())
    shared.chmod(0o644)
    with pytest.raises(WebhookSecretError, match="chmod 600"):
        resolve_secret(f"file:{shared}")
    shared.chmod(0o600)
    assert len(resolve_secret(f"file:{shared}")) == 32


def test_two_relays_on_one_store_send_each_event_once(tmp_path, receiver, secret):
    path = tmp_path / "opgraph.db"
    with RunStore(path) as store, StoreDatabase(path) as other:
        Webhooks(store, allow=LOOPBACK).add("shared", receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        for index in range(10):
            _run(store, f"run-shared-{index}")
        before = len(receiver.on("ok"))
        settings = RelaySettings(batch=7, allow=LOOPBACK)
        relays = (WebhookRelay(store, settings), WebhookRelay(other, settings))

        async def both() -> int:
            total = 0
            for _ in range(8):
                passes = await asyncio.gather(*(relay.run_once() for relay in relays))
                total += sum(done.attempted for done in passes)
            return total

        assert asyncio.run(both()) == 30
        ids = [request.headers["webhook-id"] for request in receiver.on("ok")[before:]]
        assert len(ids) == len(set(ids)) == 30


def test_the_cli_adds_tests_and_lists_with_the_secret_kept_out_of_the_database(tmp_path, receiver, monkeypatch,
                                                                               capsys):
    monkeypatch.setenv("OPGRAPH_HOME", str(tmp_path / "home"))
    store = str(tmp_path / "cli.db")
    assert main(["webhook", "add", "cli", receiver.url("ok"), "--allow-network", "loopback", "--store", store]) == 0
    out = capsys.readouterr().out
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("whsec_")
    secrets_file = tmp_path / "home" / "webhook-secrets"
    assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600 and f"cli={secret}" in secrets_file.read_text()

    assert main(["webhook", "test", "cli", "--send", "--allow-network", "loopback", "--store", store]) == 0
    assert "delivered after 1 attempt(s)" in capsys.readouterr().out
    assert _verify(secret, receiver.on("ok")[-1])["data"]["webhook"] == "cli"

    assert main(["webhook", "deliveries", "cli", "--json", "--store", store]) == 0
    (delivery,) = json.loads(capsys.readouterr().out)["deliveries"]
    assert delivery["event_type"] == "webhook.test" and delivery["attempt_log"][0]["status_code"] == 200
    assert main(["webhook", "list", "--store", store]) == 0
    assert "cli" in capsys.readouterr().out
    assert main(["webhook", "relay", "--once", "--allow-network", "loopback", "--store", store]) == 0
    assert json.loads(capsys.readouterr().out)["attempted"] == 0

    # Refused input: exit 2, said plainly, nothing stored.
    assert main(["webhook", "add", "private", "http://10.0.0.8/hook", "--store", store]) == 2
    assert "outside the allow-list" in capsys.readouterr().err
    assert main(["webhook", "show", "nobody", "--store", store]) == 1
    assert "no webhook named 'nobody'" in capsys.readouterr().err
    raw = b"".join(path.read_bytes() for path in tmp_path.glob("cli.db*"))
    assert secret.encode() not in raw and b"whsec_" not in raw  # the row names the secret, never holds it


def test_the_api_serves_webhooks_behind_the_token_and_its_relay_delivers(tmp_path, receiver, secret):
    """create_app(relay=...) as `opgraph serve` runs it: the relay task delivers a test event queued over HTTP."""
    with RunStore(tmp_path / "api.db") as store:
        app = create_app(store, start_runtime=False, webhooks=Webhooks(store, allow=LOOPBACK),
                         relay=RelaySettings(poll_interval=0.05, allow=LOOPBACK))
        with serve(app) as served, served.client() as client:
            assert httpx.get(f"{served.url}/api/webhooks").status_code == 401  # no token
            body = {"name": "api", "url": receiver.url("ok"), "secret_ref": f"env:{SECRET_VARIABLE}",
                    "events": ["run.completed"]}
            created = client.post("/api/webhooks", json=body)
            assert created.status_code == 201, created.text
            assert created.json()["events"] == ["run.completed"] and "whsec_" not in created.text
            assert client.post("/api/webhooks", json=body).status_code == 409
            refused = client.post("/api/webhooks", json={**body, "name": "meta",
                                                         "url": "http://169.254.169.254/latest"})
            assert refused.status_code == 422 and "allow-list" in refused.json()["error"]
            assert client.post("/api/webhooks", json={**body, "name": "x", "events": ["Not An Event"]}
                               ).status_code == 422
            assert client.get("/api/webhooks/nobody").status_code == 404
            queued = client.post("/api/webhooks/api/test")
            assert queued.status_code == 202
            event_id = queued.json()["event_id"]

            def delivered() -> list[dict]:
                rows = client.get("/api/webhooks/api/deliveries").json()["deliveries"]
                return [row for row in rows if row["event_id"] == event_id and row["status"] == "delivered"]

            _wait_for(delivered)
            assert client.get("/api/webhooks").json()["webhooks"][0]["name"] == "api"
            assert client.get("/api/webhooks/api").json()["deliveries"] == {"delivered": 1}
            assert client.post("/api/webhooks/api/enable").status_code == 200
            paths = client.get("/openapi.json").json()["paths"]
            assert {"/api/webhooks", "/api/webhooks/{name}", "/api/webhooks/{name}/test",
                    "/api/webhooks/{name}/deliveries", "/api/webhooks/{name}/enable"} <= set(paths)
        sent = [request for request in receiver.on("ok") if request.headers.get("webhook-id") == event_id]
        assert len(sent) == 1 and _verify(secret, sent[0])["type"] == "webhook.test"


def test_the_metrics_export_attempts_by_outcome_with_zeros_before_any(tmp_path, receiver, secret):
    empty = {sample.labels.get("outcome"): sample.value for family in StoreCollector(str(tmp_path / "none.db"))
             .collect() for sample in family.samples if family.name == "opgraph_webhook_attempts"}
    assert empty == {"delivered": 0, "failed": 0, "timeout": 0, "error": 0, "refused": 0}
    assert not (tmp_path / "none.db").exists()  # a scrape never makes a store
    path = tmp_path / "metrics.db"
    with RunStore(path) as store:
        webhooks = Webhooks(store, allow=LOOPBACK)
        webhooks.add("good", receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        webhooks.add("bad", receiver.url("fail"), secret_ref=f"env:{SECRET_VARIABLE}")
        webhooks.test("good")
        webhooks.test("bad")
        asyncio.run(WebhookRelay(store, RelaySettings(allow=LOOPBACK)).run_once())
    collector = StoreCollector(str(path))
    samples = {(sample.name, sample.labels.get("outcome")): sample.value
               for family in collector.collect() for sample in family.samples}
    collector.close()
    assert samples[("opgraph_webhook_attempts_total", "delivered")] == 1
    assert samples[("opgraph_webhook_attempts_total", "failed")] == 1
    assert samples[("opgraph_webhook_deliveries_pending", None)] == 1


def _wait_for(condition, timeout: float = DEADLINE) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_opgraph_webhook_relay_runs_on_its_own_and_stops_on_ctrl_c(tmp_path, receiver, secret):
    """The standalone relay (a second process beside a server, or instead of its relay): delivers, then exits 0."""
    import signal
    import subprocess
    import sys

    from opgraph.cluster.processes import start_server

    path = tmp_path / "relay.db"
    with RunStore(path) as store:
        webhooks = Webhooks(store, allow=LOOPBACK)
        webhooks.add("standalone", receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        event_id = webhooks.test("standalone")
        with start_server([sys.executable, "-m", "opgraph.cluster.cli", "webhook", "relay", "--store", str(path),
                           "--allow-network", "loopback"], ready=r"relaying webhooks from (\S+)", timeout=30,
                          what="opgraph webhook relay", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=dict(os.environ)) as relay:
            _wait_for(lambda: [row["status"] for row in webhooks.deliveries("standalone")] == ["delivered"])
            relay.process.send_signal(signal.SIGINT)
            out, errors = relay.process.communicate(timeout=DEADLINE)
        assert relay.process.returncode == 0, errors
        assert '"delivered": 1' in out
    (request,) = [request for request in receiver.on("ok") if request.headers["webhook-id"] == event_id]
    assert _verify(secret, request)["type"] == "webhook.test"


def test_a_relay_killed_after_its_claim_loses_nothing_its_lease_lapses(tmp_path, receiver, secret):
    """Relay A claims a delivery and dies before sending; relay B sends it once A's lease lapses."""
    clock = FakeClock()
    path = tmp_path / "opgraph.db"
    with RunStore(path, clock=clock) as store, StoreDatabase(path) as other:
        webhooks = Webhooks(store, allow=LOOPBACK, clock=clock)
        webhooks.add("leased", receiver.url("ok"), secret_ref=f"env:{SECRET_VARIABLE}")
        event_id = webhooks.test("leased")
        settings = RelaySettings(timeout=1.0, allow=LOOPBACK)
        dead, alive = WebhookRelay(store, settings, clock=clock), WebhookRelay(other, settings, clock=clock)
        dead._fan_out()
        assert len(dead._claim()) == 1  # then it is killed: no send, no record
        assert asyncio.run(alive.run_once()).attempted == 0  # the lease holds
        clock.advance(settings.lease)
        assert asyncio.run(alive.run_once()).outcomes == {"delivered": 1}
        (delivery,) = webhooks.deliveries("leased")
        assert delivery["status"] == "delivered" and delivery["attempts"] == 1
    sent = [request for request in receiver.on("ok") if request.headers["webhook-id"] == event_id]
    assert len(sent) == 1 and _verify(secret, sent[0])["type"] == "webhook.test"


def test_the_relay_retry_schedule_and_lease_margin_are_settings():
    settings = RelaySettings.from_environment({"OPGRAPH_WEBHOOK_SCHEDULE": "0, 0.1,0.5",
                                               "OPGRAPH_WEBHOOK_TIMEOUT": "2"})
    assert settings.schedule == (0.0, 0.1, 0.5) and settings.delay_after(1) == 0.1 and settings.delay_after(9) == 0.5
    assert settings.lease == 32.0 and RelaySettings(timeout=2.0, lease_margin=1.0).lease == 3.0
    with pytest.raises(ValueError, match="OPGRAPH_WEBHOOK_SCHEDULE is seconds"):
        RelaySettings.from_environment({"OPGRAPH_WEBHOOK_SCHEDULE": "soon"})
    with pytest.raises(ValueError, match="retry schedule"):
        RelaySettings.from_environment({"OPGRAPH_WEBHOOK_SCHEDULE": "1,-2"})
    with pytest.raises(ValueError, match="lease_margin"):
        RelaySettings(lease_margin=0)
