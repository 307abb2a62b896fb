"""Live control of one run from any process: pause, resume, steer, inject, cancel, status, watch.

Owns ``RunControl`` (the ``executor_ref`` handle, and what a second client gets from
``RunControl.attach``) and the items ``watch()`` yields. It finds a run by id on any
executor of the namespace, and translates every Ray error at its boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray

from opgraph.kernel import FlowEvent, Operation

from .errors import UnknownRunError, translate
from .runtime import connect, find_executors
from .settings import DEFAULT_NAMESPACE

__all__ = ["EventsDropped", "RunControl", "RunFinished"]


@dataclass(frozen=True)
class EventsDropped:
    """``RunControl.watch()`` fell behind: ``count`` settled-node events were dropped for it."""

    count: int


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

    def __init__(self, executor: Any, run_id: str, executor_name: str | None = None) -> None:
        self.executor = executor
        self.run_id = run_id
        self.executor_name = executor_name

    @classmethod
    def attach(cls, run_id: str, *, address: str | None = "auto",
               namespace: str = DEFAULT_NAMESPACE) -> RunControl:
        """Join the cluster at ``address`` and find run ``run_id`` on the namespace's executors.

        Raises ``UnknownRunError`` when no executor of the namespace has such a run (never
        started, or already settled and returned to its owner). Starts no actors. Call it
        outside a running event loop, like ``Session()``.
        """
        connect(address, namespace=namespace)
        executors = find_executors(namespace)
        if not executors:
            raise UnknownRunError(f"no opgraph executor in namespace {namespace!r}: nothing has run there; "
                                  f"check --address and --namespace", run_id=run_id)
        asked = [(name, handle, handle.has_run.remote(run_id)) for name, handle in executors]
        for name, handle, ref in asked:
            try:
                if ray.get(ref):
                    return cls(handle, run_id, name)
            except ray.exceptions.RayError as exc:  # a dead executor holds no live run: ask the next
                if not isinstance(exc, ray.exceptions.RayActorError):
                    raise translate(exc, actor=name, run_id=run_id) from None
        raise UnknownRunError(f"run {run_id} is unknown or already finished "
                              f"(asked {len(executors)} executor(s) in namespace {namespace!r})", run_id=run_id)

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.executor, method).remote(*args)
        except ray.exceptions.RayError as exc:
            raise translate(exc, actor=self.executor_name, run_id=self.run_id, doing=method) from None

    async def pause(self) -> bool:
        return await self._call("pause", self.run_id)

    async def resume(self) -> bool:
        return await self._call("resume", self.run_id)

    async def inject(self, operation: Operation, *, after: Operation | str | None = None,
                     independent: bool = False) -> bool:
        """Admit a prebuilt operation; False outside a running reactive run (ADR-0023 D6)."""
        after_id = getattr(after, "id", after)
        return await self._call("inject", self.run_id, operation, after_id, independent)

    async def send_operator_message(self, text: str) -> bool:
        return await self._call("send_operator_message", self.run_id, text)

    async def cancel(self) -> bool:
        return await self._call("cancel", self.run_id)

    async def status(self) -> dict[str, Any]:
        return await self._call("status", self.run_id)

    async def watch(self, *, buffer: int = 1024, poll_timeout: float = 5.0,
                    ) -> AsyncIterator[FlowEvent | EventsDropped | RunFinished]:
        """Yield this run's settled nodes from now on, then one ``RunFinished``.

        Ideal over retrospective: a watcher has its own bounded queue on the executor
        and never slows the run; when it falls ``buffer`` events behind, the oldest are
        dropped and an ``EventsDropped`` says how many. Nodes settled before attaching
        are not replayed (``status()`` counts them). Leaving early detaches the watcher.
        """
        watcher_id = await self._call("watch", self.run_id, buffer)
        finished = False
        try:
            while True:
                items, dropped, summary = await self._call("next_watch_events", watcher_id, 2048, poll_timeout)
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
                await asyncio.shield(self._call("unwatch", watcher_id))
