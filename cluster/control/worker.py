"""A worker: claims tasks of one queue under leases and runs each through its action adapter.

Owns the claim loop (up to ``concurrency`` tasks at once), a heartbeat per task that extends its
lease and hears a cancellation or a lost lease, recording each outcome under the lease's token,
and stopping: on SIGTERM it claims no more, lets running tasks finish within ``grace`` seconds,
then cancels the rest and gives their leases back. It picks the adapter by ``action_kind`` only
after it has won the lease (ADR-0068 D5), through the action registry; it never schedules a graph.

A worker that dies holding a lease writes nothing more: the lease lapses, the task is queued
again with its run id, and the next worker continues that run from the run log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .actions import ACTIONS, ActionContext, ActionOutcome, ActionRegistry
from .database import ControlDatabase
from .errors import ControlError, LeaseLostError, UnknownActionKindError
from .queue import Claim, TaskQueue, new_worker_id

__all__ = ["Worker"]

SEEN_EVERY = 5.0  # seconds between a worker's rows in control_workers


class Worker:
    """Claims from ``queue`` and runs up to ``concurrency`` tasks at once.

    ``session_factory()`` opens the Session runs go to (once, on the first task); ``store`` is
    the run store lane runs are recorded in. ``action_kinds`` limits what this worker claims
    (default: every kind the registry has). ``log`` gets one line per task transition and
    per node signal.
    """

    def __init__(self, database: ControlDatabase, *, queue: str = "default", concurrency: int = 1,
                 lease_seconds: float = 30.0, grace: float = 30.0, poll: float = 0.25,
                 registry: ActionRegistry = ACTIONS, action_kinds: Sequence[str] | None = None,
                 store: Any = None, session_factory: Callable[[], Any] | None = None, worker_id: str | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"a worker runs at least one task at once, got concurrency {concurrency}")
        self.queue = TaskQueue(database)
        self.queue_name = queue
        self.concurrency = concurrency
        self.lease_seconds = lease_seconds
        self.grace = grace
        self.poll = poll
        self.registry = registry
        self.action_kinds = tuple(action_kinds) if action_kinds is not None else registry.kinds()
        self.store = store
        self._session_factory = session_factory
        self._session: Any = None
        self._session_lock = asyncio.Lock()
        self.worker_id = worker_id or new_worker_id()
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.active: dict[str, asyncio.Task] = {}
        self._releasing = False
        self.counts = {"claimed": 0, "succeeded": 0, "failed": 0, "cancelled": 0, "released": 0, "lease_lost": 0}

    async def session(self) -> Any:
        async with self._session_lock:
            if self._session is None:
                if self._session_factory is None:
                    raise ControlError("this worker has no runtime to run tasks on", actor=self.worker_id)
                self._session = await asyncio.to_thread(self._session_factory)
            return self._session

    async def run(self, stop: asyncio.Event | None = None, *, max_tasks: int | None = None,
                  until_idle: bool = False) -> dict[str, int]:
        """Claim and run until ``stop`` is set (or ``max_tasks`` were claimed and ran, or with
        ``until_idle`` once nothing is queued and nothing runs); then stop as on SIGTERM."""
        stop = stop or asyncio.Event()
        last_seen = last_reap = 0.0
        claimed = 0
        if self._session_factory is not None:
            # The runtime first: a worker that cannot reach Ray claims nothing, and a lease is never
            # spent waiting for Ray to start.
            await self.session()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if now - last_seen >= SEEN_EVERY:
                    await asyncio.to_thread(self._seen, "running")
                    last_seen = now
                if now - last_reap >= self.lease_seconds / 4:
                    for task in await asyncio.to_thread(self.queue.reap):
                        self.log(f"task {task.task_id} {task.state}: {task.reason}")
                    last_reap = now
                got = False
                while len(self.active) < self.concurrency and not stop.is_set() and \
                        (max_tasks is None or claimed < max_tasks):
                    claim = await asyncio.to_thread(self.queue.claim, self.queue_name, self.worker_id,
                                                    lease_seconds=self.lease_seconds, action_kinds=self.action_kinds)
                    if claim is None:
                        break
                    got, claimed = True, claimed + 1
                    self.counts["claimed"] += 1
                    self.log(f"task {claim.task.task_id} leased ({claim.task.action_kind} {claim.task.target!r}, "
                             f"attempt {claim.task.attempts} of {claim.task.max_attempts})")
                    self.active[claim.task.task_id] = asyncio.create_task(self._execute(claim))
                if not self.active and ((max_tasks is not None and claimed >= max_tasks) or (until_idle and not got)):
                    break
                waiters = [*self.active.values(), asyncio.ensure_future(stop.wait())]
                await asyncio.wait(waiters, timeout=self.poll, return_when=asyncio.FIRST_COMPLETED)
                waiters[-1].cancel()
        finally:
            await self._stop()
        return dict(self.counts)

    async def _stop(self) -> None:
        if self.active:
            await asyncio.to_thread(self._seen, "stopping")
            self.log(f"worker {self.worker_id} stopping: waiting up to {self.grace:g} s for "
                     f"{len(self.active)} task(s)")
            _, pending = await asyncio.wait(list(self.active.values()), timeout=self.grace)
            if pending:
                self._releasing = True
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        with contextlib.suppress(ControlError):
            await asyncio.to_thread(self._seen, "stopped")

    def _seen(self, state: str) -> None:
        self.queue.worker_seen(self.worker_id, queue=self.queue_name, action_kinds=self.action_kinds,
                               concurrency=self.concurrency, state=state)

    async def _execute(self, claim: Claim) -> None:
        task = claim.task
        holder = {"claim": claim, "why": None}
        try:
            try:
                adapter = self.registry.adapter(task.action_kind)
            except UnknownActionKindError as exc:
                await self._record(holder, ActionOutcome("failed", error={"error": str(exc)}, retryable=False))
                return

            async def started(run_id: str) -> None:
                current = holder["claim"]
                updated = await asyncio.to_thread(self.queue.mark_running, current, run_id)
                holder["claim"] = dataclasses.replace(current, task=updated)
                self.log(f"task {task.task_id} running as run {run_id}")

            def progress(label: str, name: str, status: str, elapsed: float) -> None:
                self.log(f"task {task.task_id} {status} {label}")

            context = ActionContext(session=self.session, store=self.store, started=started, on_progress=progress,
                                    worker=self.worker_id)
            running = asyncio.create_task(adapter.run(task, context))
            heart = asyncio.create_task(self._heartbeat(holder, running))
            try:
                outcome = await running
            except asyncio.CancelledError:
                if holder["why"] is None and not self._releasing:
                    raise
                outcome = None
            except Exception as exc:  # noqa: BLE001 - a run that raised is a failed attempt, retried by its policy
                outcome = ActionOutcome("failed", error={"error": f"{type(exc).__name__}: {exc}",
                                                         "type": type(exc).__name__})
            finally:
                heart.cancel()
                await asyncio.gather(heart, return_exceptions=True)
            if holder["why"] == "lease_lost":
                self.counts["lease_lost"] += 1
                self.log(f"task {task.task_id}: lease lost; another worker has it, nothing recorded here")
                return
            if outcome is None and holder["why"] == "cancel_requested":
                outcome = ActionOutcome("cancelled", error={"error": "cancelled as asked"})
            if outcome is None:  # the grace period ended: the lease goes back, the next attempt runs anew
                await asyncio.to_thread(self._release, holder["claim"])
                return
            await self._record(holder, outcome)
        finally:
            self.active.pop(task.task_id, None)

    def _release(self, claim: Claim) -> None:
        try:
            self.queue.release(claim, f"worker {self.worker_id} stopped before the task ended (grace "
                                      f"{self.grace:g} s); its run was cancelled, the next attempt starts anew",
                               keep_run=False)
            self.counts["released"] += 1
            self.log(f"task {claim.task.task_id} released")
        except LeaseLostError:
            self.counts["lease_lost"] += 1

    async def _record(self, holder: dict[str, Any], outcome: ActionOutcome) -> None:
        claim = holder["claim"]
        try:
            if outcome.status == "completed":
                task = await asyncio.to_thread(self.queue.succeed, claim, outcome.result)
                self.counts["succeeded"] += 1
            elif outcome.status == "cancelled":
                task = await asyncio.to_thread(self.queue.cancelled_by_worker, claim,
                                               (outcome.error or {}).get("error", "cancelled"))
                self.counts["cancelled"] += 1
            else:
                error = {**(outcome.error or {}), **({"run_id": outcome.result["run_id"]}
                                                    if outcome.result.get("run_id") else {})}
                task = await asyncio.to_thread(self.queue.fail, claim, error, retryable=outcome.retryable)
                self.counts["failed"] += 1
        except LeaseLostError:
            self.counts["lease_lost"] += 1
            self.log(f"task {claim.task.task_id}: lease lost before its outcome was recorded; the next worker "
                     f"reads the run's end from the log")
            return
        self.log(f"task {task.task_id} {task.state}" + (f": {task.reason}" if task.reason else ""))

    async def _heartbeat(self, holder: dict[str, Any], running: asyncio.Task) -> None:
        every = max(0.05, self.lease_seconds / 3)
        while not running.done():
            await asyncio.sleep(every)
            try:
                cancel = await asyncio.to_thread(self.queue.heartbeat, holder["claim"],
                                                 lease_seconds=self.lease_seconds)
            except LeaseLostError:
                holder["why"] = "lease_lost"
                running.cancel()
                return
            except ControlError as exc:  # the database is away (restarting): the lease runs on until it answers
                self.log(f"task {holder['claim'].task.task_id}: heartbeat failed, retrying: {exc}")
                continue
            if cancel and holder["why"] is None:
                holder["why"] = "cancel_requested"
                running.cancel()
