"""A run's spawned work: active tasks, pending coroutines, quiescence and bounded cancellation.

Owns the task half of ADR-0034 D2: ``spawn`` (refused without budget), the pending
queue for spawns made without a running loop, ``wait_quiescence`` and
``cancel_active``. The budget decision itself is the run's, passed in as a callable.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import EngineBudgetError

__all__ = ["TaskSet"]

log = logging.getLogger(__name__)


def _close(coro: Any) -> None:
    close = getattr(coro, "close", None)
    if callable(close):
        close()


class TaskSet:
    """Spawned coroutines of one run; errors surface at ``wait_quiescence``, never lost.

    ``admit()`` answers whether budget is left (and notifies once when it is not).
    CancelledError and EngineBudgetError in a spawned task mean bounded expansion
    stopped; ``budget_hit`` remembers that a spawned task ran out of budget.
    """

    def __init__(self, admit: Callable[[], bool], *, name: str = "engine") -> None:
        self._admit = admit
        self._name = name
        self.active: set[asyncio.Task] = set()
        self.pending: deque[Coroutine[Any, Any, Any]] = deque()
        self.budget_hit = False
        self.spawned = 0
        self.refused = 0
        self.unobserved_errors: list[BaseException] = []

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        """Schedule ``coro`` if budget is left; else close it and return None.

        Without a running loop the coroutine waits in ``pending`` until ``drain_pending()``.
        """
        if not self._admit():
            _close(coro)
            self.refused += 1
            self.budget_hit = True
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.pending.append(coro)
            return None
        return self._start(loop, coro)

    def _start(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        self.spawned += 1
        task = loop.create_task(coro, name=f"{self._name}-spawn-{self.spawned}")
        self.active.add(task)
        return task

    def drain_pending(self) -> list[asyncio.Task]:
        """Schedule every queued coroutine (a running loop is required now)."""
        loop = asyncio.get_running_loop()
        started = []
        while self.pending:
            started.append(self._start(loop, self.pending.popleft()))
        return started

    async def wait_quiescence(self) -> None:
        """Gather active tasks until none is left, including ones spawned meanwhile.

        Cancellation and budget errors end expansion quietly; any other error is raised
        once everything has settled, alone or (several) as an ExceptionGroup.
        """
        self.drain_pending()
        errors: list[Exception] = []
        while self.active:
            batch = list(self.active)
            outcomes = await asyncio.gather(*batch, return_exceptions=True)
            self.active.difference_update(batch)
            for outcome in outcomes:
                if isinstance(outcome, EngineBudgetError):
                    self.budget_hit = True
                elif isinstance(outcome, asyncio.CancelledError):
                    continue
                elif isinstance(outcome, Exception):
                    errors.append(outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome  # KeyboardInterrupt, SystemExit: never collected
            self.drain_pending()
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise ExceptionGroup(f"{len(errors)} spawned tasks of {self._name} failed", errors)

    async def cancel_active(self, timeout: float) -> list[asyncio.Task]:
        """Cancel every active task, wait at most ``timeout`` s, cancel again; return the stragglers.

        A task that suppresses cancellation can outlive the wait: the run does not wait
        for it indefinitely (ADR-0034 D2). Pending coroutines are closed unscheduled.
        """
        while self.pending:
            _close(self.pending.popleft())
        tasks = [task for task in self.active if not task.done()]
        for task in tasks:
            task.cancel()
        stragglers: list[asyncio.Task] = []
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=timeout)
            stragglers = list(still)
            for task in stragglers:
                log.warning("%s: task %s is still running %.1f s after cancellation; cancelling again and "
                            "leaving it", self._name, task.get_name(), timeout)
                task.cancel()
        # Tasks that had already failed when cleanup began: their errors are handed to the
        # run (as notifications), not left as "exception never retrieved".
        for task in list(self.active):
            if task.done() and not task.cancelled():
                error = task.exception()
                if error is not None and not isinstance(error, EngineBudgetError):
                    self.unobserved_errors.append(error)
        self.active.difference_update([task for task in self.active if task.done()])
        return stragglers
