"""Live control of one run from any process: pause, resume, steer, inject, cancel, status, watch.

Owns ``RunControl`` (the ``executor_ref`` handle, and what a second client gets from
``RunControl.attach``) and the items ``watch()`` yields. It finds a run by id on any
executor of the namespace; its calls go through the call seam (actors/calls.py), which finds
the run again should its executor die (``AttachedRun``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from opgraph.kernel import ExecutionError, FlowEvent, Operation, OpGraphError

from ..calls import AttachedRun, ExecutorStub, answers, ask
from ..errors import UnknownRunError
from ..executor.watchers import UnknownWatcherError
from ..settings import DEFAULT_NAMESPACE
from .runtime import connect, find_executors

__all__ = ["EventsDropped", "Reconnected", "RunControl", "RunFinished"]

REFIND_SECONDS = 60.0  # how long a control looks for its run on a replacement executor
ADMISSION_GRACE_SECONDS = 2.0  # a run logged live but listed by no executor yet: looked for this long


@dataclass(frozen=True)
class EventsDropped:
    """``RunControl.watch()`` fell behind: ``count`` settled-node events were dropped for it."""

    count: int


@dataclass(frozen=True)
class Reconnected:
    """``RunControl.watch()`` lost the run's executor and found the run again on its replacement
    (rebuilt from the run log); events settled in between were not seen."""

    executor: str


@dataclass(frozen=True)
class RunFinished:
    """The last item ``RunControl.watch()`` yields: how the run ended.

    ``status`` is the envelope's ("completed", "failed", "cancelled"), or "error" when the
    run failed as a whole, or "forgotten" when its owner left before it settled.
    """

    status: str
    summary: dict[str, Any]


class RunControl:
    """Live control of one run (the ``executor_ref`` handle): pause, resume, inject, steer, cancel.

    A second client process finds a run by id with ``RunControl.attach(run_id, address=...)``
    and can also ``watch()`` its settled nodes. The run lives as long as the client that
    started it waits on ``flow()``; that client owns the result envelope.
    """

    def __init__(self, executor: Any, run_id: str, executor_name: str | None = None,
                 namespace: str | None = DEFAULT_NAMESPACE, *, durable: bool | None = None) -> None:
        self.executor = executor
        self.run_id = run_id
        self.executor_name = executor_name
        self.namespace = namespace
        # Whether the run is logged (None: not known). A run that is not died with its executor:
        # no replacement will ever hold it, so its loss is reported at once instead of after
        # REFIND_SECONDS of looking for it.
        self.durable = durable
        self._attached = AttachedRun(self)  # where its calls go, found again should its executor die

    @classmethod
    def attach(cls, run_id: str, *, address: str | None = "auto",
               namespace: str = DEFAULT_NAMESPACE) -> RunControl:
        """Join the cluster at ``address`` and find run ``run_id`` on the namespace's executors.

        Raises ``UnknownRunError`` when no executor of the namespace has such a run (never
        started, or already settled and returned to its owner). Starts no actors. Call it
        outside a running event loop, like ``Session()``.
        """
        connect(address, namespace=namespace)
        found = cls._find(run_id, namespace)
        if found is None:
            logged = _logged(run_id)
            if logged is not None and logged[0] == "live":
                # Logged live but on no executor: being admitted (its header is written before
                # the executor lists it), or its executor is being replaced; else orphaned.
                deadline = time.monotonic() + ADMISSION_GRACE_SECONDS
                while found is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                    found = cls._find(run_id, namespace)
        if found is None:
            if logged is not None:  # finished (or orphaned): its end is read from the log
                return cls(None, run_id, None, namespace)
            raise UnknownRunError(f"run {run_id} is unknown or already finished (no executor in namespace "
                                  f"{namespace!r} has it, and the run log does not know it)", run_id=run_id)
        name, handle, durable = found
        return cls(handle, run_id, name, namespace, durable=durable)

    @staticmethod
    def _find(run_id: str, namespace: str | None) -> tuple[str, Any, bool] | None:
        """The (name, handle, whether the run is durable) of the live executor of ``namespace`` that
        has ``run_id``."""
        executors = find_executors(namespace)
        stubs = [ExecutorStub(handle, name) for name, handle in executors]
        for (name, handle), answer in zip(executors, answers(stubs, ExecutorStub.run_durability, run_id),
                                          strict=True):
            if answer.died:  # a dead executor holds no live run: ask the next
                continue
            if answer.error is not None:
                raise answer.error
            if answer.value is not None:
                return name, handle, answer.value
        return None

    async def refind(self) -> bool:
        """The executor died: find the run again (a replacement rebuilt it from the log). A run
        known not to be durable is not looked for: it died with its executor."""
        if self.durable is False:
            return False
        deadline = asyncio.get_running_loop().time() + REFIND_SECONDS
        while asyncio.get_running_loop().time() < deadline:
            found = await asyncio.to_thread(self._find, self.run_id, self.namespace)
            if found is not None:
                self.executor_name, self.executor, self.durable = found
                return True
            await asyncio.sleep(0.25)
        return False

    async def _ask(self, method: Any, *args: Any) -> Any:
        """``method`` (an ExecutorStub method) on the run's executor; should it have died, on the
        executor that has the run now."""
        return await ask(self._attached, method, *args, run_id=self.run_id)

    async def result(self, timeout: float | None = None, *, poll: float = 30.0) -> dict[str, Any]:
        """The run's envelope: waited for while the run is live, else read from the run log.

        Works from any process, also after the process that started the run has exited.
        Raises the run's own error if it failed as a whole, ``TimeoutError`` past ``timeout``.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.executor is not None:
            wait = poll if deadline is None else max(0.0, min(poll, deadline - loop.time()))
            try:
                done, outcome = await self._ask(ExecutorStub.wait_result, self.run_id, wait)
            except UnknownRunError:
                break  # finished and forgotten meanwhile: the log has its end
            if done:
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"run {self.run_id} did not finish within {timeout} s")
        entry = await asyncio.to_thread(_logged, self.run_id)
        if entry is None:
            raise UnknownRunError(f"run {self.run_id} is not in the run log", run_id=self.run_id)
        status, envelope, error = entry
        if envelope is not None:
            return envelope
        if status == "live":
            raise UnknownRunError(f"run {self.run_id} is live in the run log but no executor has it: its "
                                  f"owner died; continue it with `opgraph run resume {self.run_id}`",
                                  run_id=self.run_id)
        raise ExecutionError(f"run {self.run_id} ended {status}: {error}", run_id=self.run_id)

    @staticmethod
    async def resume_from_log(run_id: str, session: Any, **drain: Any) -> dict[str, Any]:
        """Continue an orphaned run (its owner and executor are gone) from the run log, on
        ``session``'s runtime, and return its envelope. Settled nodes are not run again;
        attempts that were in flight run again as new attempts. ``drain`` takes flow()'s
        ``on_progress``, ``on_signal`` and ``on_branch_created``.
        """
        if await asyncio.to_thread(RunControl._find, run_id, session.runtime.namespace) is not None:
            raise OpGraphError(f"run {run_id} is live on an executor: attach to it instead of resuming it",
                               run_id=run_id)
        return await session.follow_recovered(run_id, **drain)

    async def pause(self) -> bool:
        return await self._ask(ExecutorStub.pause, self.run_id)

    async def resume(self) -> bool:
        return await self._ask(ExecutorStub.resume, self.run_id)

    async def inject(self, operation: Operation, *, after: Operation | str | None = None,
                     independent: bool = False) -> bool:
        """Admit a prebuilt operation; False outside a running reactive run (ADR-0023 D6)."""
        after_id = getattr(after, "id", after)
        return await self._ask(ExecutorStub.inject, self.run_id, operation, after_id, independent)

    async def send_operator_message(self, text: str) -> bool:
        return await self._ask(ExecutorStub.send_operator_message, self.run_id, text)

    async def cancel(self) -> bool:
        return await self._ask(ExecutorStub.cancel, self.run_id)

    async def status(self) -> dict[str, Any]:
        return await self._ask(ExecutorStub.status, self.run_id)

    async def watch(self, *, buffer: int = 1024, poll_timeout: float = 5.0,
                    ) -> AsyncIterator[FlowEvent | EventsDropped | RunFinished]:
        """Yield this run's settled nodes from now on, then one ``RunFinished``.

        Ideal over retrospective: a watcher has its own bounded queue on the executor
        and never slows the run; when it falls ``buffer`` events behind, the oldest are
        dropped and an ``EventsDropped`` says how many. Nodes settled before attaching
        are not replayed (``status()`` counts them). Leaving early detaches the watcher.
        """
        watcher_id = await self._ask(ExecutorStub.watch, self.run_id, buffer)
        finished = False
        try:
            while True:
                executor = self.executor
                try:
                    items, dropped, summary = await self._ask(ExecutorStub.next_watch_events, watcher_id, 2048,
                                                              poll_timeout)
                except UnknownWatcherError:
                    if self.executor is executor:
                        raise
                    # The executor was replaced: the run goes on there; watch it afresh, and say so once.
                    watcher_id = await self._ask(ExecutorStub.watch, self.run_id, buffer)
                    yield Reconnected(self.executor_name or "")
                    continue
                if dropped:
                    yield EventsDropped(dropped)
                for event in items:
                    yield event
                if summary is not None:
                    finished = True
                    yield RunFinished(str(summary.get("status")), summary)
                    return
        finally:
            if not finished:
                await asyncio.shield(self._ask(ExecutorStub.unwatch, watcher_id))


def _logged(run_id: str) -> tuple[str, dict[str, Any] | None, str | None] | None:
    """(status, envelope, error) of ``run_id`` in this process's run log (``OPGRAPH_DB``), or None."""
    from ..persistence import RunLog, database_exists, database_path  # local: only a finished run's reader needs it

    if not database_exists(database_path()):
        return None
    log = RunLog(database_path())
    entry = log.entry(run_id)
    if entry is None:
        return None
    return entry.status, log.envelope(run_id), entry.error
