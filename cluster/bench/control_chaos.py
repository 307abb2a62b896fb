"""Chaos for the control plane: two schedulers and three workers under a random SIGKILL schedule.

Owns the figures of issue 34's chaos run, on SQLite and then PostgreSQL. Schedules of every
overlap policy fire about ``--fires`` times over ``--seconds``; every process is a real one
(`python -m opgraph.cluster.bench.control_chaos --role ...`), and a seeded schedule SIGKILLs
schedulers and workers and starts them again. Then the queue drains and it prints and checks:

- lost fires: a nominal time of a schedule's cadence, inside the run, with no fire row: 0;
- doubled fires: a (schedule, nominal time) with more than one task: 0;
- tasks stuck past their lease: leased or running with a lease lapsed longer ago than a reap: 0;
- settled steps that ran twice: 0;
- every terminal transition (a ``task.*`` outbox event) delivered at least once to a receiver
  that fails 20% of deliveries (seeded), by ``webhook-id``; a duplicate only ever a retry of one
  ``webhook-id`` with the same body; every signature verified with ``standardwebhooks``;
- fire lateness p50 and p99.

The workers run a stand-in action (``chaos``: three steps, each settled once in a step log, a
run continued from that log when its lease lapsed), so the run measures the queue, leases and
schedules, not Ray. The runtime's own continuation from the run log is tested with Ray in
tests/cluster/test_task_queue_workers.py. A webhook relay (cluster/control/relay.py, on a fast
retry schedule) is a process of its own, SIGKILLed like the others; the receiver is an aiohttp
server on 127.0.0.1 in this process, and the endpoint allows loopback explicitly::

    python -m opgraph.cluster.bench.control_chaos --seconds 90 --seed 7 --postgres URL
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opgraph.actors.persistence.backends import describe, is_postgres

from ..control import OVERLAP_POLICIES, ControlDatabase
from ..control.actions import ActionContext, ActionOutcome, ActionRegistry
from ..control.relay import RelaySettings, WebhookRelay
from ..control.schedules import Scheduler
from ..control.webhooks import AllowList, Webhooks, generate_secret
from ..control.worker import Worker
from ..store import StoreDatabase
from .control_claims import fresh_target

__all__ = ["chaos", "main"]

STEPS = 3
LEASE = 2.0
SECRET_ENV = "OPGRAPH_CHAOS_WEBHOOK_SECRET"
TERMINAL_EVENTS = ("task.succeeded", "task.failed", "task.cancelled", "task.dead", "run.completed", "run.failed",
                   "run.cancelled")
FAIL_RATE = 0.2  # of deliveries the receiver answers 500
# A fast retry schedule, a short lease past a send, and no giving up: the drain waits for every event.
RELAY = RelaySettings(schedule=(0.0, 0.1, 0.2, 0.5), max_attempts=1000, timeout=2.0, disable_after=1_000_000,
                      poll_interval=0.1, lease_margin=1.0, allow=AllowList.parse(["loopback"]))
_STEP_TABLE = ("CREATE TABLE IF NOT EXISTS chaos_steps (run_id TEXT NOT NULL, step INTEGER NOT NULL, "
               "settled_at REAL NOT NULL, worker TEXT, PRIMARY KEY (run_id, step))")
_DOUBLE_TABLE = "CREATE TABLE IF NOT EXISTS chaos_doubles (run_id TEXT NOT NULL, step INTEGER NOT NULL, worker TEXT)"


class StepAction:
    """A stand-in run: ``STEPS`` steps, each settled once in ``chaos_steps``; a settled step is
    skipped when the run is continued, and a second settle of one is recorded as a double."""

    def __init__(self, action_kind: str, database: ControlDatabase, seconds: float) -> None:
        self.action_kind, self.database, self.seconds = action_kind, database, seconds

    async def run(self, task: Any, context: ActionContext) -> ActionOutcome:
        run_id = task.run_id or f"{task.task_id}-a{task.attempts}"
        if task.run_id is None:
            await context.started(run_id)
        for step in range(STEPS):
            if await asyncio.to_thread(self._settled, run_id, step):
                continue
            await asyncio.sleep(self.seconds)
            await asyncio.to_thread(self._settle, run_id, step, context.worker)
        return ActionOutcome("completed", {"run_id": run_id})

    def _settled(self, run_id: str, step: int) -> bool:
        with self.database.transaction() as db:
            return db.execute("SELECT 1 FROM chaos_steps WHERE run_id = ? AND step = ?",
                              (run_id, step)).fetchone() is not None

    def _settle(self, run_id: str, step: int, worker: str) -> None:
        with self.database.transaction(write=True) as db:
            inserted = db.execute("INSERT INTO chaos_steps (run_id, step, settled_at, worker) VALUES (?, ?, ?, ?) "
                                  "ON CONFLICT (run_id, step) DO NOTHING RETURNING run_id",
                                  (run_id, step, time.time(), worker)).fetchone()
            if inserted is None:
                db.execute("INSERT INTO chaos_doubles (run_id, step, worker) VALUES (?, ?, ?)", (run_id, step, worker))


# -- the roles (each a process) --------------------------------------------------------------
def _scheduler(target: str, name: str) -> None:
    scheduler = Scheduler(ControlDatabase(target), name=name)
    stop = {"stop": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(stop=True))
    while not stop["stop"]:
        scheduler.tick()
        time.sleep(0.1)


def _worker(target: str, seconds: float) -> None:
    database = ControlDatabase(target)
    registry = ActionRegistry(builtin={})
    registry.register(StepAction("agent", database, seconds))

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        worker = Worker(database, queue="chaos", concurrency=4, lease_seconds=LEASE, grace=5, poll=0.05,
                        registry=registry, log=lambda line: None)
        await worker.run(stop)

    asyncio.run(main())


def _relay(target: str) -> None:
    relay = WebhookRelay(StoreDatabase(target), RELAY)

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await relay.run(stop)

    asyncio.run(main())


# -- the webhook receiver (a thread of the conductor) ----------------------------------------
class Receiver:
    """An aiohttp server on 127.0.0.1 that answers 500 to a seeded ``FAIL_RATE`` of deliveries and
    keeps every request: (webhook-id, headers, body, status answered)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.requests: list[tuple[str, dict[str, str], bytes, int]] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    @contextlib.contextmanager
    def running(self) -> Iterator[Receiver]:
        from aiohttp import web

        loop, ready, box = asyncio.new_event_loop(), threading.Event(), []

        async def answer(request: web.Request) -> web.Response:
            body = await request.read()
            status = 500 if self.rng.random() < FAIL_RATE else 200
            self.requests.append((request.headers.get("webhook-id", ""), dict(request.headers), body, status))
            return web.Response(status=status, text="chaos" if status == 500 else "ok")

        async def start() -> web.AppRunner:
            app = web.Application()
            app.router.add_post("/hook", answer)
            runner = web.AppRunner(app, shutdown_timeout=0.5)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.port = runner.addresses[0][1]
            return runner

        def run() -> None:
            asyncio.set_event_loop(loop)
            box.append(loop.run_until_complete(start()))
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=run, name="chaos-webhook-receiver", daemon=True)
        thread.start()
        if not ready.wait(10):
            raise RuntimeError("the chaos webhook receiver did not start within 10 s")
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(box[0].cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()


def _webhook_checks(receiver: Receiver, secret: str, events: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """What the receiver saw against the outbox's terminal events (``events``: event id -> (type, subject))."""
    import standardwebhooks

    verifier = standardwebhooks.Webhook(secret)
    bodies: dict[str, set[bytes]] = {}
    ids_of: dict[tuple[Any, ...], set[str]] = {}
    delivered: dict[str, int] = {}
    bad_signatures = 0
    for webhook_id, headers, body, status in receiver.requests:
        try:
            data = verifier.verify(body, headers)
        except Exception:  # noqa: BLE001 - any failure to verify is what is counted
            bad_signatures += 1
            continue
        bodies.setdefault(webhook_id, set()).add(body)
        task = data["data"]
        ids_of.setdefault((data["type"], task.get("task_id") or task.get("run_id"), task.get("attempt")),
                          set()).add(webhook_id)
        if status == 200:
            delivered[webhook_id] = delivered.get(webhook_id, 0) + 1
    return {"terminal_events": len(events), "webhook_requests": len(receiver.requests),
            "webhook_failed_answers": sum(status != 200 for *_, status in receiver.requests),
            "undelivered_events": len(set(events) - set(delivered)),
            "unknown_webhook_ids": len(set(bodies) - set(events)),
            "redelivered_ids": sum(count > 1 for count in delivered.values()),
            "duplicates_with_new_id": sum(len(ids) > 1 for ids in ids_of.values()),
            "retries_with_other_body": sum(len(found) > 1 for found in bodies.values()),
            "bad_signatures": bad_signatures}


# -- the conductor ---------------------------------------------------------------------------
def _spawn(role: str, target: str, name: str, seconds: float, environ: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "opgraph.cluster.bench.control_chaos", "--role", role,
                             "--target", target, "--name", name, "--step-seconds", str(seconds)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=environ)


def chaos(base: str, *, seconds: float, fires: int, seed: int, folder: str, step_seconds: float = 0.05,
          kill_every: tuple[float, float] = (1.0, 4.0)) -> dict[str, Any]:
    """One chaos run on the database at ``base`` (a fresh file or schema); its figures and checks."""
    receiver = Receiver(seed)
    with receiver.running():
        return _chaos(base, receiver, seconds=seconds, fires=fires, seed=seed, folder=folder,
                      step_seconds=step_seconds, kill_every=kill_every)


def _chaos(base: str, receiver: Receiver, *, seconds: float, fires: int, seed: int, folder: str,
           step_seconds: float, kill_every: tuple[float, float]) -> dict[str, Any]:
    target = fresh_target(base, folder)
    store = StoreDatabase(target)  # first: the outbox is there, so every control database writes task events
    secret = generate_secret()
    environ = {**os.environ, SECRET_ENV: secret}
    Webhooks(store, allow=RELAY.allow).add("chaos", receiver.url, secret_ref=f"env:{SECRET_ENV}",
                                           events=TERMINAL_EVENTS, description="the chaos run's receiver")
    database = ControlDatabase(target)
    with database.transaction(write=True) as db:
        db.execute(_STEP_TABLE)
        db.execute(_DOUBLE_TABLE)
    scheduler = Scheduler(database, name="conductor")
    per_policy = 2
    count = per_policy * len(OVERLAP_POLICIES)
    interval = max(0.5, round(seconds * count / fires, 3))
    schedules = [scheduler.add(f"{policy}-{index}", action_kind="agent", target=f"{policy} {index}",
                               interval=interval, overlap=policy, queue="chaos", catchup_window=3600,
                               max_attempts=20)
                 for policy in OVERLAP_POLICIES for index in range(per_policy)]
    started_at = time.time()
    rng = random.Random(seed)
    processes: dict[str, subprocess.Popen] = {}
    roles = {"scheduler-a": "scheduler", "scheduler-b": "scheduler", "worker-1": "worker", "worker-2": "worker",
             "worker-3": "worker", "relay": "relay"}
    for name, role in roles.items():
        processes[name] = _spawn(role, target, name, step_seconds, environ)
    kills: list[str] = []
    dead: dict[str, float] = {}
    deadline = started_at + seconds
    next_kill = time.time() + rng.uniform(*kill_every)
    while time.time() < deadline:
        now = time.time()
        for name, back_at in list(dead.items()):
            if now >= back_at:
                processes[name] = _spawn(roles[name], target, name, step_seconds, environ)
                del dead[name]
        if now >= next_kill:
            victim = rng.choice(sorted(set(roles) - set(dead)))
            os.killpg(processes[victim].pid, signal.SIGKILL)
            processes[victim].wait()
            kills.append(victim)
            dead[victim] = now + rng.uniform(0.2, 1.5)
            next_kill = now + rng.uniform(*kill_every)
        time.sleep(0.05)
    for name in list(dead):
        processes[name] = _spawn(roles[name], target, name, step_seconds, environ)
    # Schedulers stop; the workers drain what was fired.
    for name in ("scheduler-a", "scheduler-b"):
        processes[name].send_signal(signal.SIGTERM)
        processes[name].wait(30)
    fired_until = min(record.cursor_at for record in scheduler.list_schedules())
    drain_deadline = time.time() + max(60.0, seconds)
    while time.time() < drain_deadline:
        with database.transaction() as db:
            open_tasks = db.execute("SELECT count(*) FROM control_tasks WHERE state IN ('queued', 'leased', "
                                    "'running')").fetchone()[0]
        if open_tasks == 0:
            break
        time.sleep(0.2)
    # The relay drains the outbox: every event fanned out, every delivery settled (bounded).
    outbox_deadline = time.time() + max(30.0, seconds / 2)
    while time.time() < outbox_deadline:
        with store.transaction() as tx:
            undispatched = tx.execute("SELECT count(*) FROM outbox WHERE dispatched_at IS NULL").fetchone()[0]
            pending = tx.execute("SELECT count(*) FROM webhook_deliveries WHERE status = 'pending'").fetchone()[0]
        if undispatched == pending == 0:
            break
        time.sleep(0.2)
    with store.transaction() as tx:
        deliveries = dict(tx.execute("SELECT status, count(*) FROM webhook_deliveries GROUP BY status").fetchall())
        events = {row[0]: (row[1], row[2]) for row in tx.execute(
            f"SELECT event_id, event_type, subject_id FROM outbox WHERE event_type IN "
            f"({', '.join('?' * len(TERMINAL_EVENTS))})", TERMINAL_EVENTS).fetchall()}
        events_by_task = {subject for _, subject in events.values()}
    now = time.time()
    with database.transaction() as db:
        ended = [row[0] for row in db.execute(
            "SELECT task_id FROM control_tasks WHERE state IN ('succeeded', 'failed', 'cancelled', 'dead')"
            ).fetchall()]
        stuck = db.execute("SELECT count(*) FROM control_tasks WHERE state IN ('leased', 'running') AND "
                           "lease_expires_at < ?", (now - LEASE,)).fetchone()[0]
        left_open = db.execute("SELECT count(*) FROM control_tasks WHERE state IN ('queued', 'leased', 'running')"
                               ).fetchone()[0]
        doubled = db.execute("SELECT count(*) FROM (SELECT schedule_id, nominal_at FROM control_tasks WHERE "
                             "schedule_id IS NOT NULL GROUP BY schedule_id, nominal_at HAVING count(*) > 1) d"
                             ).fetchone()[0]
        ran_twice = db.execute("SELECT count(*) FROM chaos_doubles").fetchone()[0]
        by_state = dict(db.execute("SELECT state, count(*) FROM control_tasks GROUP BY state").fetchall())
        by_status = dict(db.execute("SELECT status, count(*) FROM control_fires GROUP BY status").fetchall())
        lateness = sorted(row[0] for row in db.execute(
            "SELECT lateness FROM control_fires WHERE kind = 'scheduled' AND status <> 'skipped'").fetchall())
        recorded = {(row[0], round(row[1], 3)) for row in db.execute(
            "SELECT schedule_id, nominal_at FROM control_fires").fetchall()}
    lost = 0
    for record in schedules:
        for nominal in record.cadence.times(record.cursor_at, fired_until):
            lost += (record.schedule_id, round(nominal, 3)) not in recorded
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes.values():
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    database.close()
    store.close()
    webhooks = _webhook_checks(receiver, secret, events)
    webhooks["ended_tasks_without_event"] = sum(task_id not in events_by_task for task_id in ended)
    webhooks["deliveries_by_status"] = deliveries
    webhooks_ok = all(webhooks[key] == 0 for key in (
        "undelivered_events", "unknown_webhook_ids", "duplicates_with_new_id", "retries_with_other_body",
        "bad_signatures", "ended_tasks_without_event")) and webhooks["terminal_events"] > 0

    def quantile(q: float) -> float:
        return round(lateness[min(len(lateness) - 1, int(q * len(lateness)))], 3) if lateness else 0.0

    return {"database": "postgresql" if is_postgres(base) else "sqlite", "seed": seed, "seconds": seconds,
            "schedules": len(schedules), "interval": interval, "fires": sum(by_status.values()),
            "fires_by_status": by_status, "tasks_by_state": by_state, "kills": len(kills),
            "kills_by_process": {name: kills.count(name) for name in roles},
            "lost_fires": lost, "doubled_fires": doubled, "stuck_past_lease": stuck, "left_open": left_open,
            "settled_steps_ran_twice": ran_twice, "lateness_p50": quantile(0.5), "lateness_p99": quantile(0.99),
            "webhooks": webhooks, "ok": lost == doubled == stuck == ran_twice == left_open == 0 and webhooks_ok}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.control_chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long schedules fire under kills (120)")
    parser.add_argument("--fires", type=int, default=1000, help="about how many fires in that time (1000)")
    parser.add_argument("--seed", type=int, default=None, help="the kill schedule's seed (default: random, printed)")
    parser.add_argument("--postgres", default=None, metavar="URL", help="run on this PostgreSQL database too")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL only")
    parser.add_argument("--role", choices=("scheduler", "worker", "relay"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--name", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="each stand-in step's time (0.05)")
    arguments = parser.parse_args(argv)
    if arguments.role == "scheduler":
        _scheduler(arguments.target, arguments.name)
        return 0
    if arguments.role == "worker":
        _worker(arguments.target, arguments.step_seconds)
        return 0
    if arguments.role == "relay":
        _relay(arguments.target)
        return 0
    seed = arguments.seed if arguments.seed is not None else random.SystemRandom().randrange(1_000_000)
    print(f"seed {seed}", flush=True)
    bases = [] if arguments.no_sqlite else ["sqlite"]
    bases += [arguments.postgres] if arguments.postgres else []
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for base in bases:
            row = chaos(str(Path(folder) / base) if base == "sqlite" else base, seconds=arguments.seconds,
                        fires=arguments.fires, seed=seed, folder=folder, step_seconds=arguments.step_seconds)
            rows.append(row)
            where = describe(base) if is_postgres(base) else "sqlite"
            print(f"{where}: {json.dumps(row)}", flush=True)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
