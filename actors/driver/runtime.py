"""Joining Ray, and finding (or starting) the executors that supervise a runtime's actors.

Owns actor placement from the driver's side: a pool of executors per runtime (one by
default on one machine), which start and supervise the workers and branch stores they
share, and the choice of the member a new run goes to. A detached runtime (joined through an
address) is shared by name by every process of the namespace and outlives them all; an
owned runtime's names carry its creator's id, so no other process can come to depend
on actors that die with it. A dead executor is replaced at the next call that needs one
(``Runtime.member``: a target of the call seam, actors/calls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from opgraph.kernel import OpGraphError

from ..branches.store import BranchStore, expand_histories
from ..calls import ExecutorStub, RuntimeMember, answers, ask, ask_sync, start
from ..errors import RuntimeLostError, UnknownBranchError
from ..executor.actor import GraphExecutor
from ..settings import (
    DEFAULT_NAMESPACE,
    EXECUTOR_CONCURRENCY,
    EXECUTOR_PREFIX,
    WORKER_CONCURRENCY,
    ActorNames,
    executor_pool_size,
    names_in,
    newest_generation,
)
from ..workers.worker import OperationWorker

__all__ = ["DEFAULT_NAMESPACE", "Runtime", "connect", "find_executors", "joined_with_address"]

_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
POOL_MEMBER_CPUS = 0.01  # what a pool member asks of its node (see Runtime._placement)
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
        embedded = None
        if not _JOINED_WITH_ADDRESS and (recorded := dead_recorded_cluster()) is not None:
            logging.getLogger(__name__).warning(
                "opgraph: the Ray cluster `ray start` recorded at %s does not answer (stopped without `ray stop`?); "
                "starting an embedded local Ray instead (--address or RAY_ADDRESS joins a cluster)", recorded)
            embedded = "local"  # Ray's word for a new local instance, whatever it recorded
        options.update(include_dashboard=False, configure_logging=True)
        # The embedded instance keeps Ray's default token authentication; Ray's notice
        # that it did so ("set RAY_AUTH_MODE=disabled to opt out") was the first line a
        # new user saw, as a WARNING, on every command. Quiet for this start only.
        notice = logging.getLogger(_AUTH_NOTICE_LOGGER)
        level = notice.level
        notice.setLevel(logging.ERROR)
        try:
            ray.init(address=embedded, **options)
        finally:
            notice.setLevel(level)
        return
    ray.init(address=address, **options)


def dead_recorded_cluster(timeout: float = 1.0) -> str | None:
    """The address a `ray start` on this machine recorded for ``ray.init()`` to join, when nothing
    answers there any more; else None.

    Ideal over retrospective: Ray's ``ray.init()`` joins the cluster recorded in its temp folder's
    ``ray_current_cluster``, and a head killed without `ray stop` leaves that record behind, so
    every later start waited on a GCS that is gone (minutes, then an error) instead of starting
    the embedded instance a user with no cluster expects."""
    try:
        from ray._private.utils import read_ray_address

        recorded = read_ray_address(None)
    except (ImportError, OSError):  # another Ray's layout, or an unreadable record: Ray decides as it does
        return None
    if not recorded:
        return None
    host, _, port = recorded.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return None
    except (OSError, ValueError):
        return recorded


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
    """The driver's handle on one runtime: its pool of executors, and the workers and stores they share.

    ``executors`` holds the pool's members (``executor`` is member 0, the home member:
    branches, turns and statistics go there). Each run is owned by one member, chosen
    when it is admitted (``place``). ``workers`` and ``stores`` are member 0's current
    handles, as of the latest ``refresh()`` (a dead one is replaced; ask again to see it).
    """

    executors: list[Any] = field(default_factory=list)
    workers: list[Any] = field(default_factory=list)
    stores: list[Any] = field(default_factory=list)
    names: ActorNames = field(default_factory=ActorNames)
    namespace: str | None = None
    detached: bool = False
    sizes: tuple[int, int] = (2, 1)
    database: str | None = None
    pool_size: int = 1
    _owned: list[Any] = field(default_factory=list, repr=False)  # keeps this process's actors referenced
    _dead: dict[int, Any] = field(default_factory=dict, repr=False)  # member -> its handle known dead
    _members: dict[Any, int] = field(default_factory=dict, repr=False)  # actor id of every handle -> member
    _admitting: list[set[str]] = field(default_factory=list, repr=False)  # ids of runs being placed, per member
    _placed: int = field(default=0, repr=False)
    _placing: tuple[Any, asyncio.Lock] | None = field(default=None, repr=False)  # (its loop, the lock)
    standbys: dict[int, Any] = field(default_factory=dict, repr=False)  # member -> its warm spare
    executor_names: list[str] = field(default_factory=list)

    # -- member 0, as a single-executor runtime had it ---------------------------------
    @property
    def executor(self) -> Any:
        return self.executors[0] if self.executors else None

    @property
    def executor_name(self) -> str:
        return self.executor_names[0] if self.executor_names else ""

    @property
    def standby(self) -> Any:
        """Member 0's warm spare executor (durable owned runtimes), or None."""
        return self.standbys.get(0)

    @classmethod
    def get_or_start(cls, *, workers: int = 2, branch_stores: int = 1, detached: bool = False,
                     namespace: str | None = None, database: str | None = None,
                     executors: int | None = None) -> Runtime:
        """This process's runtime of ``namespace``: found, or started. Every Session of the process shares it.

        ``database`` (a path) makes the runtime durable: its run log and branches live
        there. ``executors`` is the size of its executor pool (default ``OPGRAPH_EXECUTORS``,
        else one per alive Ray node). Whoever starts the runtime decides; a runtime found
        keeps its settings (a process joining a detached runtime uses at least as many
        members as it finds)."""
        space = namespace or ray.get_runtime_context().namespace
        cached = _RUNTIMES.get((space, detached))
        if cached is not None:
            return cached
        names = ActorNames("" if detached else _process_suffix())
        size = executor_pool_size(executors)
        if detached:
            size = max(size, _members_listed(names, space))
        runtime = cls(names=names, namespace=space, detached=detached, sizes=(workers, branch_stores),
                      database=database, pool_size=size)
        runtime.executors = [None] * size
        runtime.executor_names = [""] * size
        runtime._admitting = [set() for _ in range(size)]
        if not detached:
            runtime._start_owned_pool()
        runtime.executors[0] = runtime._find_or_start(dead=None, member=0)
        if size > 1:  # the others adopt what member 0 found or started: in parallel
            with ThreadPoolExecutor(max_workers=size - 1) as threads:
                handles = list(threads.map(lambda member: runtime._find_or_start(None, member), range(1, size)))
            runtime.executors[1:] = handles
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
        self._owned = [start(BranchStore, {"name": name, "namespace": self.namespace}, index, self.database, owner)
                       for index, name in enumerate(store_names)]
        store_handles = list(self._owned)
        for index in range(workers):
            name = self.names.worker(index)
            options = {"name": name, "namespace": self.namespace, "max_concurrency": WORKER_CONCURRENCY}
            self._owned.append(start(OperationWorker, options, index, store_handles, store_names, None, name))

    def member(self, member: int = 0) -> RuntimeMember:
        """Where a call to pool member ``member`` goes (``calls.ask``): a death is remembered, and the
        member replaced before the next call to it; a call safe to send twice follows the replacement."""
        return RuntimeMember(self, member)

    def refresh(self) -> None:
        """Read member 0's current worker and store handles."""
        pool = ask_sync(ExecutorStub(self.executor, self.executor_name), ExecutorStub.pool)
        self.workers[:] = pool["workers"]
        self.stores[:] = pool["stores"]

    def name_of(self, executor: Any) -> str:
        """The current name of the member ``executor`` is (member 0's when it is not one)."""
        member = self.member_of(executor)
        return self.executor_names[member if member is not None else 0]

    def run_durability_sync(self, run_id: str) -> list[bool | None]:
        """Per member: None when it does not hold run ``run_id`` (or does not answer), else whether
        the run is durable there."""
        stubs = [ExecutorStub(executor, name) for executor, name in zip(self.executors, self.executor_names,
                                                                       strict=True)]
        return [answer.value if answer.error is None else None
                for answer in answers(stubs, ExecutorStub.run_durability, run_id)]

    def member_of(self, executor: Any) -> int | None:
        """The pool member ``executor`` is (or was, before a replacement), or None."""
        return self._members.get(getattr(executor, "_actor_id", None))

    def _find_or_start(self, dead: Any, member: int = 0) -> Any:
        """A live executor for pool member ``member``: the newest generation there is, or a new one.

        ``dead`` is a handle known dead. A dead actor's name is not always released at once,
        so its replacement takes the next generation's name (``opgraph-executor-0.g1``)
        instead of waiting for it; processes racing to replace it agree on that name.
        """
        deadline = time.monotonic() + EXECUTOR_START_DEADLINE
        dead_ids = {dead._actor_id} if dead is not None else set()
        workers, stores = self.sizes
        base = self.names.executor_member(member)
        # A replacement goes where Ray puts it: the node it would prefer may be the one that
        # died, still listed alive until Ray notices (seen: a replacement waited for that).
        placement = self._placement(member) if dead is None else {}
        floor = 0  # a generation whose name still finds a dead actor is passed over
        while time.monotonic() < deadline:
            newest = newest_generation(names_in(self.namespace), base)
            generation = max(floor, newest[1] if newest else 0)
            name = self.names.executor_of(generation, member)
            options = {"name": name, "namespace": self.namespace, "get_if_exists": True,
                       "max_concurrency": EXECUTOR_CONCURRENCY, "lifetime": "detached" if self.detached else None,
                       **placement}
            handle = start(GraphExecutor, options, self.names, workers, stores, self.detached, self.namespace,
                           generation, self.database, False, member)
            if handle._actor_id in dead_ids:
                floor = generation + 1
                continue
            (started,) = answers([ExecutorStub(handle, name)], ExecutorStub.start, timeout=EXECUTOR_START_DEADLINE,
                                 doing="starting the executor")
            if started.died:
                dead_ids.add(handle._actor_id)
                floor = generation + 1
                continue
            if started.error is not None:
                raise started.error
            self.executor_names[member] = name
            self._members[handle._actor_id] = member
            self._start_standby(generation + 1, member)
            return handle
        raise RuntimeLostError(f"no live executor could be found or started within {EXECUTOR_START_DEADLINE:.0f} s",
                               actor=base)

    def _start_standby(self, generation: int, member: int = 0) -> None:
        """Start (without waiting) the spare executor that member ``member``'s next replacement promotes.

        Only an owned, durable runtime has them: its names are this process's alone, so no
        other process takes a spare for an executor, and a promoted spare has the run log
        to recover the runs from. ``OPGRAPH_STANDBY_EXECUTOR=0`` turns them off."""
        if self.detached or not self.database or os.environ.get("OPGRAPH_STANDBY_EXECUTOR", "1") == "0":
            return
        workers, stores = self.sizes
        options = {"name": self.names.executor_of(generation, member), "namespace": self.namespace,
                   "get_if_exists": True, "max_concurrency": EXECUTOR_CONCURRENCY, **self._placement(member, 1)}
        standby = start(GraphExecutor, options, self.names, workers, stores, False, self.namespace, generation,
                        self.database, True, member)
        self.standbys[member] = standby
        self._owned.append(standby)  # the handle that created it keeps it alive, promoted or not

    def _placement(self, member: int, offset: int = 0) -> dict[str, Any]:
        """Where member ``member`` goes: a pool's members one per alive node in turn (its standby on the
        next node, so one node lost does not take both), preferred, not required; a single executor
        stays where Ray's default placement puts it."""
        if self.pool_size == 1:
            return {}
        nodes = sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))
        if not nodes:
            return {}
        node = nodes[(member + offset) % len(nodes)]
        # A token share of a CPU, held while it runs: with Ray's default (1 CPU to be placed), a node
        # whose CPUs other actors' placement holds for a moment sent the member elsewhere; with 0,
        # Ray ignored the node affinity altogether (both seen on a simulated 4-node cluster).
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True),
                "num_cpus": POOL_MEMBER_CPUS}

    async def replace_executor(self, dead: Any) -> Any:
        """After ``dead`` died: find or start a live executor for its member (off the event loop) and use it."""
        member = self.member_of(dead) or 0
        if self.executors[member] is not dead:
            return self.executors[member]  # another caller replaced it already
        handle = await asyncio.to_thread(self._find_or_start, dead, member)
        if self.executors[member] is dead:
            self.executors[member] = handle
            self._dead.pop(member, None)
            if member == 0:
                await asyncio.to_thread(self.refresh)
        return self.executors[member]

    def known_dead(self, member: int) -> bool:
        """True when member ``member``'s current executor was found dead (the next call replaces it)."""
        dead = self._dead.get(member)
        return dead is not None and dead is self.executors[member]

    async def live_executor(self, member: int = 0) -> Any:
        """Member ``member``'s executor to send new work to: replaced first if it is known to have died."""
        dead = self._dead.get(member)
        if dead is not None and dead is self.executors[member]:
            await self.replace_executor(dead)
        return self.executors[member]

    def live_executor_sync(self, member: int = 0) -> Any:
        """``live_executor`` for synchronous callers (``Session()``, ``close()``); not inside an event loop."""
        dead = self._dead.get(member)
        if dead is not None and dead is self.executors[member]:
            self.replace_executor_sync(dead)
        return self.executors[member]

    def replace_executor_sync(self, dead: Any) -> Any:
        """``replace_executor`` for synchronous callers."""
        member = self.member_of(dead) or 0
        if self.executors[member] is dead:
            self.executors[member] = self._find_or_start(dead, member)
            self._dead.pop(member, None)
            if member == 0:
                self.refresh()
        return self.executors[member]

    async def drop_scope(self, scope: str) -> int:
        """Drop every branch of ``scope`` on every member (each knows the branches of its own runs)."""
        dropped = await asyncio.gather(*(ask(self.member(member), ExecutorStub.drop_scope, scope)
                                         for member in range(self.pool_size)))
        return sum(dropped)

    def drop_scope_sync(self, scope: str) -> int:
        """``drop_scope`` for synchronous callers (``Session.close()``)."""
        return sum(ask_sync(self.member(member), ExecutorStub.drop_scope, scope) for member in range(self.pool_size))

    def kill(self) -> None:
        """Kill every actor of this runtime: its executors and their warm spares, its workers and
        branch stores. For a throwaway runtime (a test's or a benchmark scenario's own namespace)."""
        for handle in [*self.executors, *self.standbys.values(), *self.workers, *self.stores]:
            try:
                ray.kill(handle)
            except (ValueError, TypeError):  # already dead, or a slot never filled
                continue

    async def branch_messages(self, branch_id: str) -> list[Any]:
        """A branch's messages, from the member that knows it (member 0 holds the Sessions' own)."""
        first: UnknownBranchError | None = None
        for member in range(self.pool_size):
            try:
                return await ask(self.member(member), ExecutorStub.branch_messages, branch_id)
            except UnknownBranchError as exc:
                first = first or exc
        raise first

    async def branch_messages_many(self, branch_ids: list[str]) -> dict[str, list[Any]]:
        """Many branches' messages, one call per member (and store shard); UnknownBranchError names
        the first no member holds."""
        found: dict[str, list[Any]] = {}
        for member in range(self.pool_size):
            missing = [branch_id for branch_id in branch_ids if branch_id not in found]
            if not missing:
                break
            # The histories come as the records they share (a run's clones of one long branch are
            # its messages once and a short tail each), made lists here.
            for held, histories in await ask(self.member(member), ExecutorStub.branch_histories, missing):
                found.update((branch_id, history) for branch_id, history
                             in zip(held, expand_histories(histories), strict=True) if history is not None)
        for branch_id in branch_ids:
            if branch_id not in found:
                raise UnknownBranchError("this runtime holds no such branch", branch_id=branch_id)
        return found

    async def place(self, run_id: str | None = None) -> int:
        """The member a new run goes to: the least loaded (fewest live runs, then fewest unsettled
        nodes), counting the runs this process is admitting there right now; ties go round robin.
        ``run_id`` is counted as admitting there from the moment it is placed (see ``admitting``).

        One placement at a time in this process, and each counts exactly the runs it asked the
        members to leave out: a run whose admission ended while the loads were on their way
        was in neither the loads nor the admitting count, and four runs placed together went
        3 and 1 (CI, tests/actors/test_executor_pool.py).

        A member that does not answer is passed over (its death is remembered; it is replaced
        when a run is sent to it)."""
        size = self.pool_size
        if size == 1:
            return 0
        async with self._placement_lock():
            left_out = [set(admitting) for admitting in self._admitting]
            loads = await asyncio.gather(*(self._load(member, left_out[member]) for member in range(size)))
            self._placed += 1
            start = self._placed

            def weight(member: int) -> tuple:
                runs, nodes = loads[member]
                return runs + len(left_out[member] | self._admitting[member]), nodes, (member - start) % size

            member = min(range(size), key=weight)
            if run_id is not None:
                self._admitting[member].add(run_id)
            return member

    def _placement_lock(self) -> asyncio.Lock:
        """The lock of ``place`` on the running loop (a Session may be driven by one loop, then another)."""
        loop = asyncio.get_running_loop()
        if self._placing is None or self._placing[0] is not loop:
            self._placing = (loop, asyncio.Lock())
        return self._placing[1]

    async def _load(self, member: int, left_out: set[str]) -> tuple[float, float]:
        """A member's load without ``left_out``, the runs this process is admitting there, which
        ``place`` counts itself: one already live on the member counted twice, and runs placed
        together piled up on the other member (3 of 4 on one, in a loaded test session)."""
        try:
            return tuple(await ask(self.member(member), ExecutorStub.load, sorted(left_out)))
        except OpGraphError:  # a member that does not answer (its death is remembered) takes no run
            return float("inf"), float("inf")

    @contextlib.contextmanager
    def admitting(self, member: int, run_id: str):
        """While run ``run_id`` is being admitted to ``member``: counted by ``place`` whether its
        load shows it yet or not."""
        self._admitting[member].add(run_id)
        try:
            yield
        finally:
            self._admitting[member].discard(run_id)

    def mark_dead(self, executor: Any) -> None:
        """A call elsewhere found ``executor`` dead: the next call to its member replaces it."""
        member = self.member_of(executor)
        if member is not None:
            self._dead[member] = executor


def _members_listed(names: ActorNames, namespace: str | None) -> int:
    """How many members the pool of ``names`` has by the names listed (a detached runtime others started)."""
    listed = names_in(namespace)
    count = 1
    while newest_generation(listed, names.executor_member(count)) is not None:
        count += 1
    return count
