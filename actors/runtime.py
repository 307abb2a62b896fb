"""Joining Ray, and finding (or starting) the executor that supervises a runtime's actors.

Owns actor placement from the driver's side: one executor per runtime, which starts and
supervises its workers and branch stores. A detached runtime (joined through an
address) is shared by name by every process of the namespace and outlives them all; an
owned runtime's names carry its creator's id, so no other process can come to depend
on actors that die with it. A dead executor is replaced at the next call that needs one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from .branches import BranchStore
from .errors import RuntimeLostError, is_actor_death, translate
from .executor import GraphExecutor
from .settings import (
    DEFAULT_NAMESPACE,
    EXECUTOR_CONCURRENCY,
    EXECUTOR_PREFIX,
    WORKER_CONCURRENCY,
    ActorNames,
    names_in,
    newest_generation,
)
from .workers import OperationWorker

__all__ = ["DEFAULT_NAMESPACE", "Runtime", "connect", "find_executors", "joined_with_address"]

_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
EXECUTOR_START_DEADLINE = 60.0  # seconds to find or start a live executor before giving up
_RUNTIMES: dict[tuple[str, bool], Runtime] = {}  # this process's runtimes, by (namespace, detached)
_JOINED_WITH_ADDRESS = False


def connect(address: str | None = None, *, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Join Ray: the embedded local instance by default, or ``address`` ("auto", "ray://...", "host:port")."""
    global _JOINED_WITH_ADDRESS
    if ray.is_initialized():
        return
    address = address or os.environ.get("OPGRAPH_RAY_ADDRESS") or None
    _JOINED_WITH_ADDRESS = address is not None or bool(os.environ.get("RAY_ADDRESS"))
    options: dict[str, Any] = {"namespace": namespace, "logging_level": "warning", "log_to_driver": True}
    if address is None:
        options.update(include_dashboard=False, configure_logging=True)
        # The embedded instance keeps Ray's default token authentication; Ray's notice
        # that it did so ("set RAY_AUTH_MODE=disabled to opt out") was the first line a
        # new user saw, as a WARNING, on every command. Quiet for this start only.
        notice = logging.getLogger(_AUTH_NOTICE_LOGGER)
        level = notice.level
        notice.setLevel(logging.ERROR)
        try:
            ray.init(address=address, **options)
        finally:
            notice.setLevel(level)
        return
    ray.init(address=address, **options)


def joined_with_address() -> bool:
    """True when this process joined Ray through an address (a cluster others share)."""
    return _JOINED_WITH_ADDRESS


def find_executors(namespace: str | None = None) -> list[tuple[str, Any]]:
    """Every opgraph executor of the namespace, by name (detached and owned alike)."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=namespace is not None):
        name, space = (entry["name"], entry["namespace"]) if isinstance(entry, dict) else (entry, None)
        if not name.startswith(EXECUTOR_PREFIX) or (namespace is not None and space != namespace):
            continue
        try:
            found.append((name, ray.get_actor(name, namespace=namespace)))
        except ValueError:  # it died between the listing and the lookup
            continue
    return found


# An owned runtime's names end in this process's own token: job ids start again at 01000000
# with every new Ray instance, and an owned executor must never take up (and recover the
# runs of) another process's runtime that happened to share a job id.
_PROCESS_TOKEN = uuid.uuid4().hex[:8]


def _process_suffix() -> str:
    return _PROCESS_TOKEN


@dataclass
class Runtime:
    """The driver's handle on one runtime: its executor, and the workers and stores it supervises.

    ``workers`` and ``stores`` are the executor's current handles, as of the latest
    ``refresh()`` (the executor replaces dead ones; ask it again to see replacements).
    """

    executor: Any
    workers: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    names: ActorNames = field(default_factory=ActorNames)
    namespace: str | None = None
    detached: bool = False
    sizes: tuple[int, int] = (2, 1)
    database: str | None = None
    _owned: list[Any] = field(default_factory=list, repr=False)  # keeps this process's actors referenced
    _dead: Any = field(default=None, repr=False)
    standby: Any = field(default=None, repr=False)  # the warm spare executor (durable owned runtimes)
    executor_name: str = ""

    @classmethod
    def get_or_start(cls, *, workers: int = 2, branch_stores: int = 1, detached: bool = False,
                     namespace: str | None = None, database: str | None = None) -> Runtime:
        """This process's runtime of ``namespace``: found, or started. Every Session of the process shares it.

        ``database`` (a path) makes the runtime durable: its run log and branches live
        there. Whoever starts the runtime decides; a runtime found keeps its setting."""
        space = namespace or ray.get_runtime_context().namespace
        cached = _RUNTIMES.get((space, detached))
        if cached is not None:
            return cached
        names = ActorNames("" if detached else _process_suffix())
        runtime = cls(executor=None, names=names, namespace=space, detached=detached,
                      sizes=(workers, branch_stores), database=database)
        if not detached:
            runtime._start_owned_pool()
        runtime.executor = runtime._find_or_start(dead=None)
        runtime.refresh()
        _RUNTIMES[(space, detached)] = runtime
        return runtime

    def _start_owned_pool(self) -> None:
        """An owned runtime's first workers and stores belong to this process, not to the executor:
        should the executor die, they live on, and its replacement adopts them (with their branches
        and calls in flight) instead of starting everything again."""
        workers, stores = self.sizes
        store_names = [self.names.store(index) for index in range(stores)]
        owner = self.names.owner(self.namespace)
        self._owned = [BranchStore.options(name=name, namespace=self.namespace).remote(index, self.database, owner)
                       for index, name in enumerate(store_names)]
        store_handles = list(self._owned)
        for index in range(workers):
            name = self.names.worker(index)
            self._owned.append(OperationWorker.options(name=name, namespace=self.namespace,
                                                       max_concurrency=WORKER_CONCURRENCY)
                               .remote(index, store_handles, store_names, None, name))

    def refresh(self) -> None:
        """Read the executor's current worker and store handles."""
        pool = self._translated(ray.get, self.executor.pool.remote())
        self.workers[:] = pool["workers"]
        self.stores[:] = pool["stores"]

    def _translated(self, getter: Any, ref: Any) -> Any:
        try:
            return getter(ref)
        except ray.exceptions.RayError as exc:
            raise translate(exc, actor=self.executor_name) from None

    def _find_or_start(self, dead: Any) -> Any:
        """A live executor for this runtime: the newest generation there is, or a new one.

        ``dead`` is a handle known dead. A dead actor's name is not always released at once,
        so its replacement takes the next generation's name (``opgraph-executor-0.g1``)
        instead of waiting for it; processes racing to replace it agree on that name.
        """
        deadline = time.monotonic() + EXECUTOR_START_DEADLINE
        dead_ids = {dead._actor_id} if dead is not None else set()
        workers, stores = self.sizes
        floor = 0  # a generation whose name still finds a dead actor is passed over
        while time.monotonic() < deadline:
            newest = newest_generation(names_in(self.namespace), self.names.executor)
            generation = max(floor, newest[1] if newest else 0)
            handle = GraphExecutor.options(
                name=self.names.executor_of(generation), namespace=self.namespace, get_if_exists=True,
                max_concurrency=EXECUTOR_CONCURRENCY, lifetime="detached" if self.detached else None,
            ).remote(self.names, workers, stores, self.detached, self.namespace, generation, self.database)
            if handle._actor_id in dead_ids:
                floor = generation + 1
                continue
            try:
                ray.get(handle.start.remote(), timeout=EXECUTOR_START_DEADLINE)
            except ray.exceptions.RayError as exc:
                if not is_actor_death(exc):
                    raise translate(exc, actor=self.names.executor_of(generation),
                                    doing="starting the executor") from None
                dead_ids.add(handle._actor_id)
                floor = generation + 1
                continue
            self.executor_name = self.names.executor_of(generation)
            self._start_standby(generation + 1)
            return handle
        raise RuntimeLostError(f"no live executor could be found or started within {EXECUTOR_START_DEADLINE:.0f} s",
                               actor=self.names.executor)

    def _start_standby(self, generation: int) -> None:
        """Start (without waiting) the spare executor that the next replacement promotes.

        Only an owned, durable runtime has one: its names are this process's alone, so no
        other process takes the spare for the executor, and a promoted spare has the run
        log to recover the runs from. ``OPGRAPH_STANDBY_EXECUTOR=0`` turns it off."""
        if self.detached or not self.database or os.environ.get("OPGRAPH_STANDBY_EXECUTOR", "1") == "0":
            return
        workers, stores = self.sizes
        self.standby = GraphExecutor.options(
            name=self.names.executor_of(generation), namespace=self.namespace, get_if_exists=True,
            max_concurrency=EXECUTOR_CONCURRENCY,
        ).remote(self.names, workers, stores, False, self.namespace, generation, self.database, True)
        self._owned.append(self.standby)  # the handle that created it keeps it alive, promoted or not

    async def replace_executor(self, dead: Any) -> Any:
        """After ``dead`` died: find or start a live executor (off the event loop) and use it."""
        if self.executor is not dead:
            return self.executor  # another caller replaced it already
        handle = await asyncio.to_thread(self._find_or_start, dead)
        if self.executor is dead:
            self.executor = handle
            self._dead = None
            await asyncio.to_thread(self.refresh)
        return self.executor

    async def live_executor(self) -> Any:
        """The executor to send new work to: replaced first if it is known to have died."""
        if self._dead is not None and self._dead is self.executor:
            await self.replace_executor(self._dead)
        return self.executor

    async def call(self, method: str, *args: Any, run_id: str | None = None, retry_if_dead: bool = False) -> Any:
        """``executor.method(*args)`` with Ray's errors translated; a death is remembered, and
        the next call that needs an executor starts by replacing it.

        ``retry_if_dead``: the call is safe to send twice (it had no effect on a dead
        executor), so a dead executor is replaced and the call sent to the replacement.
        """
        executor = await self.live_executor()
        try:
            return await getattr(executor, method).remote(*args)
        except ray.exceptions.RayError as exc:
            if is_actor_death(exc):
                self._dead = executor
                if retry_if_dead:
                    replacement = await self.replace_executor(executor)
                    try:
                        return await getattr(replacement, method).remote(*args)
                    except ray.exceptions.RayError as again:
                        if is_actor_death(again):
                            self._dead = replacement
                        raise translate(again, actor=self.executor_name, run_id=run_id, doing=method) from None
            raise translate(exc, actor=self.executor_name, run_id=run_id, doing=method) from None

    def call_sync(self, method: str, *args: Any, retry_if_dead: bool = False) -> Any:
        """``call`` for synchronous callers (``Session()``, ``close()``); not from inside an event loop."""
        if self._dead is not None and self._dead is self.executor:
            self.executor = self._find_or_start(self._dead)
            self._dead = None
            self.refresh()
        executor = self.executor
        try:
            return ray.get(getattr(executor, method).remote(*args))
        except ray.exceptions.RayError as exc:
            if is_actor_death(exc):
                self._dead = executor
                if retry_if_dead:
                    self.executor = self._find_or_start(executor)
                    self._dead = None
                    self.refresh()
                    return self._translated(ray.get, getattr(self.executor, method).remote(*args))
            raise translate(exc, actor=self.executor_name, doing=method) from None

    def mark_dead(self, executor: Any) -> None:
        """A call elsewhere found ``executor`` dead: the next call replaces it."""
        self._dead = executor
