"""This server's runs: one asyncio task per run it started, how many it admits, and the one Session they run on.

Owns admitting a run under the server's cap (``max_runs`` in flight, counting those being
prepared; past it a ``RunCapacityError``, HTTP 429), starting a lane's run as a task,
cancelling it through its control handle (falling back to the task), recording a failure
that escaped the lane, cancelling everything at shutdown, and starting the Session with the
server. It must not decide what a run is:
the routes prepare it through the lane registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool

from ..store import RunNotFoundError, RunStore
from .limits import DEFAULT_MAX_RUNS
from .problems import RunCapacityError, RuntimeUnavailableError

__all__ = ["CANCEL_GRACE_SECONDS", "DEFAULT_MAX_RUNS", "RETRY_AFTER_SECONDS", "SHUTDOWN_GRACE_SECONDS", "AdmissionSlot",
           "RunTasks", "SessionSlot", "say"]

# How long a cancel request waits for the executor to settle the run before it also
# cancels the driving task (which cancels on the executor again, from Session.flow).
CANCEL_GRACE_SECONDS = 5.0
SHUTDOWN_GRACE_SECONDS = 10.0
RETRY_AFTER_SECONDS = 2  # what a 429 tells the client to wait: about a short run's length


def say(text: str) -> None:
    print(f"opgraph serve: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _InFlight:
    task: asyncio.Task
    control: dict[str, Any]  # the lane puts its LaneRunControl at "control" once admitted


class AdmissionSlot:
    """One run's place under the cap, held from the request's first step until its task starts (then the
    task holds it until it settles) or the admission fails."""

    def __init__(self) -> None:
        self.held = True


class RunTasks:
    """The runs this server started: one asyncio task each, forgotten once it settles; at most ``max_runs``.

    Cancelling goes through the run's LaneRunControl (the executor settles the run and
    the runner records ``cancelled``); the task itself is cancelled only when that handle
    is not published yet or the run does not settle within ``CANCEL_GRACE_SECONDS``.
    """

    def __init__(self, store: RunStore, *, max_runs: int = DEFAULT_MAX_RUNS) -> None:
        if type(max_runs) is not int or max_runs < 1:
            raise ValueError(f"max_runs must be a positive integer, got {max_runs!r}")
        self._store = store
        self._runs: dict[str, _InFlight] = {}
        self.max_runs = max_runs
        self._admitting = 0  # slots held by requests still preparing their run

    def __contains__(self, run_id: str) -> bool:
        return run_id in self._runs

    @contextlib.contextmanager
    def admission(self) -> Iterator[AdmissionSlot]:
        """A place for one more run, taken before anything is prepared; ``RunCapacityError`` when the
        server already has ``max_runs`` runs in flight or being admitted. Give the slot to ``start``."""
        if len(self._runs) + self._admitting >= self.max_runs:
            raise RunCapacityError(
                f"this server already runs {self.max_runs} runs, the most it admits at once (opgraph serve "
                f"--max-runs); retry in {RETRY_AFTER_SECONDS} s", limit=self.max_runs,
                retry_after=RETRY_AFTER_SECONDS)
        slot = AdmissionSlot()
        self._admitting += 1
        try:
            yield slot
        finally:
            if slot.held:
                self._admitting -= 1

    async def control(self, run_id: str) -> Any:
        """The LaneRunControl of a run this server started, once published (None: not ours, or it ended)."""
        run = self._runs.get(run_id)
        if run is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_GRACE_SECONDS
        while "control" not in run.control and not run.task.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return run.control.get("control")

    def start(self, run_id: str, control: dict[str, Any], run: Any, slot: AdmissionSlot | None = None) -> asyncio.Task:
        """Run ``run`` as this server's task; it takes ``slot``'s place under the cap until it settles."""
        task = asyncio.create_task(run, name=f"workflow-run-{run_id}")
        if slot is not None and slot.held:
            slot.held = False
            self._admitting -= 1
        self._runs[run_id] = _InFlight(task, control)
        task.add_done_callback(lambda done: self._settled(run_id, done))
        return task

    def _settled(self, run_id: str, task: asyncio.Task) -> None:
        self._runs.pop(run_id, None)
        # A cancelled task needs nothing here: the runner records "cancelled" at any await
        # after it wrote the row, and a task cancelled before its first step wrote none.
        if task.cancelled() or (exc := task.exception()) is None:
            return
        # The runner records runtime errors itself; anything escaping it (a store error,
        # say) has no caller left, so it becomes the run's recorded failure.
        kind = type(exc).__name__
        error = {"run": {"error": f"{kind}: {exc}", "type": kind}}
        written = self._store.writer.submit(self._record_failure, run_id, error)  # off the event loop
        written.add_done_callback(lambda done: done.exception() and say(
            f"run {run_id} failed with {kind}: {exc}, and recording that failed too: {done.exception()}"))

    def _record_failure(self, run_id: str, error: dict[str, Any]) -> None:
        with contextlib.suppress(RunNotFoundError):  # it ended before writing its row
            self._store.finish_run(run_id, "failed", error=error)

    async def cancel(self, run_id: str) -> None:
        """Cancel through the executor, falling back to the task; wait for the run to settle."""
        run = self._runs.get(run_id)
        if run is None:
            return
        # The runner publishes the handle once the executor admitted the run (milliseconds);
        # cancelling the task before that could strand a run the executor just started.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CANCEL_GRACE_SECONDS
        while "control" not in run.control and not run.task.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        control = run.control.get("control")
        if control is None:
            run.task.cancel()
        else:
            # False means the executor already settled the run: the task is recording its outcome.
            await control.cancel()
        done, _ = await asyncio.wait({run.task}, timeout=CANCEL_GRACE_SECONDS)
        if not done:
            run.task.cancel()
            await asyncio.wait({run.task}, timeout=CANCEL_GRACE_SECONDS)

    async def cancel_all(self) -> None:
        """Shutdown: cancel every in-flight task and wait for each to record ``cancelled``."""
        tasks = [run.task for run in self._runs.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_SECONDS)

    def statistics(self) -> dict[str, int]:
        return {"in_flight": len(self._runs), "admitting": self._admitting, "max_runs": self.max_runs}


class SessionSlot:
    """One Session for the whole server, started with the server (it costs seconds), so the
    first run is admitted as fast as any other; if that start fails, each run retries it."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._session: Any = None
        self._lock = asyncio.Lock()

    def start(self) -> Any:
        """Start the Session on this thread: at startup, before any request, when blocking
        the loop costs nobody. The server keeps its own SIGTERM handling (a graceful
        shutdown that records in-flight runs cancelled): ray.init in the main thread
        would replace it with an immediate exit."""
        if self._session is None:
            main = threading.current_thread() is threading.main_thread()
            previous = signal.getsignal(signal.SIGTERM) if main else None
            try:
                self._session = self._create()
            finally:
                if previous is not None:  # None: a handler not set from Python, which ray.init leaves alone
                    signal.signal(signal.SIGTERM, previous)
        return self._session

    @property
    def current(self) -> Any:
        """The Session, once started (None before): what a reader uses without starting one."""
        return self._session

    async def get(self) -> Any:
        async with self._lock:
            if self._session is None:
                # Session() joins Ray with blocking calls: once serving, never on the event loop.
                self._session = await run_in_threadpool(self._create)
            return self._session

    def _create(self) -> Any:
        try:
            return self._factory()
        except Exception as exc:  # Ray's own errors, translated once here; a run retries
            raise RuntimeUnavailableError(f"cannot start the runtime: {type(exc).__name__}: {exc}; "
                                          "check the Ray address, then retry") from exc
