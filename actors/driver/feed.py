"""A run its client feeds: operations admitted in batches into one live run, outcomes drained, released.

Owns the caller's side of a run that is kept open for admissions (``FedRun``): it starts
one (an empty reactive run, logged, isolated), or adopts one its previous client left
(live on an executor of the namespace, or only in the run log: then continued here); it
admits operations in batches (``admit``), drains settled nodes (``outcomes``), releases
what its caller recorded (``release``) so the run holds only its work in flight, and
closes it. It decides nothing about what to admit or when: a dataset job does
(opgraph.cluster.jobs). Nothing here makes a model call.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

from opgraph.kernel import FlowEvent, Graph, Operation, OpGraphError

from ..calls import ExecutorStub, ask
from ..errors import UnknownRunError
from ..protocol import AdmittedRow
from .control import RunControl, _logged
from .session import _Following

__all__ = ["FEED_POLL_ITEMS", "FedRun", "HeldState"]

FEED_POLL_ITEMS = 4096  # settled nodes one poll of the executor takes at most
ALWAYS_ROOM = 2**62  # the spawn cap of a fed run: its feeder bounds what is open, not the cap


class HeldState:
    """What the run holds that its feeder must reconcile with: ``settled`` nodes not yet released
    (FlowEvents, metadata in ``metadata``) and ``open`` ones, (node id, metadata) each."""

    __slots__ = ("metadata", "open", "settled")

    def __init__(self, settled: list[FlowEvent], metadata: dict[str, dict[str, Any]],
                 open_nodes: list[tuple[str, dict[str, Any]]]) -> None:
        self.settled = settled
        self.metadata = metadata
        self.open = open_nodes


class FedRun:
    """One live run kept open for its feeder (``RunOptions.keep_open``), followed on its executor.

    Start one with ``await FedRun.start(session, ...)``, or take over one a previous client
    left with ``await FedRun.adopt(session, run_id)``. Should the executor die, the run is
    rebuilt from the log on its replacement and every call follows it there;
    ``recoveries`` counts that, and the feeder then reconciles with ``held()``, since the
    settled nodes the dead executor had not delivered yet are not delivered again.
    """

    def __init__(self, session: Any, following: _Following) -> None:
        self.session = session
        self.following = following
        self.run_id = following.run_id
        self.done = False
        self.envelope: dict[str, Any] | None = None

    @property
    def recoveries(self) -> int:
        """Executor replacements this run was followed through (each rebuilt it from the log)."""
        return self.following.recoveries

    @property
    def control(self) -> RunControl:
        """Pause, resume, cancel or status of the run, on its current executor."""
        runtime = self.following.runtime
        return RunControl(self.following.executor, self.run_id, runtime.name_of(self.following.executor),
                          runtime.namespace)

    # -- opening ----------------------------------------------------------------------------------
    @classmethod
    async def start(cls, session: Any, *, run_id: str | None = None, max_concurrent: int = 100,
                    buffer: int = 8192) -> FedRun:
        """Open an empty, durable, isolated reactive run for ``session``'s registered operations.

        ``max_concurrent`` bounds its operations in flight; ``buffer`` is how many settled
        nodes may wait undelivered before the executor stops dispatching (backpressure).
        Needs a durable runtime: a fed run outlives its executor and its client."""
        if not session.runtime.database:
            raise OpGraphError("a fed run needs a durable runtime (Session(durable=True), the default)")
        run_id = run_id or f"fed-{uuid.uuid4()}"
        options = session._options(
            run_id=run_id, context=None, max_concurrent=max_concurrent, parallel=True, reactive=True,
            max_spawn=ALWAYS_ROOM, spawn_type=None, node_builder=None, default_branch=None,
            spawn_branch_setup=None, reducers=None, want_signals=False, want_events=True,
            stream_buffer=max(1, buffer), isolated=True, durable=True)
        options.keep_open = True
        options.scope_parent = None  # its branches are its own: a Session closing must not drop them
        executor = await session._start(run_id, Graph(f"fed {run_id}"), options)
        return cls(session, _Following(session.runtime, executor, run_id, True))

    @classmethod
    async def adopt(cls, session: Any, run_id: str) -> FedRun | None:
        """Take over ``run_id``, which a previous client fed: found live on an executor of the
        namespace (its outcomes since then are waiting there), or continued here from the run
        log (its client died with its runtime). None when the run is not live anywhere."""
        runtime = session.runtime
        found = await asyncio.to_thread(RunControl._find, run_id, runtime.namespace)
        if found is not None:
            return cls(session, _Following(runtime, found[1], run_id, True))
        logged = await asyncio.to_thread(_logged, run_id)
        if logged is None or logged[0] != "live":
            return None
        executor = await runtime.live_executor(await runtime.place())
        following = _Following(runtime, executor, run_id, True)
        overrides = {"detached": False, "want_events": True, "want_signals": False}
        if not await ask(following, ExecutorStub.resume_run, run_id, overrides, run_id=run_id):
            return None  # it could not be rebuilt (the executor recorded why): a new run takes over
        return cls(session, following)

    # -- feeding ----------------------------------------------------------------------------------
    async def admit(self, operations: Sequence[Operation | AdmittedRow]) -> list[tuple[bool, str | None]]:
        """Admit ``operations`` (each independent) in one step; per operation (accepted, why not).
        Answered once the admissions are durable. ``duplicate`` means it is in the run already.

        Each is an Operation, or the row that describes one (protocol ``AdmittedRow``: id,
        operation, parameters, metadata), cheaper to send; either way it is admitted with its
        id, operation, parameters and metadata alone (a fed run's operations name no branch)."""
        if not operations:
            return []
        rows = [operation if type(operation) is tuple else
                (operation.id, operation.operation, operation.parameters, operation.metadata)
                for operation in operations]
        return await ask(self.following, ExecutorStub.admit_many, self.run_id, rows, run_id=self.run_id)

    async def outcomes(self, timeout: float = 5.0) -> list[FlowEvent]:
        """The settled nodes delivered since the last call, waited for up to ``timeout`` seconds;
        once the run has ended, ``done`` is set and ``envelope`` holds its result (or its error
        is raised)."""
        items, done, result = await ask(self.following, ExecutorStub.next_events, self.run_id, FEED_POLL_ITEMS,
                                        timeout, False, run_id=self.run_id)
        events = [item for kind, item in items if kind == "event"]
        if done:
            self.done = True
            if isinstance(result, BaseException):
                raise result
            self.envelope = result
        return events

    async def release(self, node_ids: Sequence[str]) -> int:
        """Let the run forget settled nodes whose outcomes were recorded; returns how many it let go."""
        if not node_ids:
            return 0
        return await ask(self.following, ExecutorStub.release_nodes, self.run_id, list(node_ids),
                         run_id=self.run_id)

    async def held(self) -> HeldState:
        """The settled nodes the run still holds (not released) and the open ones."""
        settled, open_nodes = await ask(self.following, ExecutorStub.held, self.run_id, run_id=self.run_id)
        events = [FlowEvent(node_id, metadata.get("reference_id") or "", status, result, True)
                  for node_id, status, result, metadata in settled]
        return HeldState(events, {node_id: metadata for node_id, _, _, metadata in settled}, open_nodes)

    async def close(self) -> bool:
        """No more admissions: the run ends once what it holds has settled."""
        return await ask(self.following, ExecutorStub.close_run, self.run_id, run_id=self.run_id)

    async def cancel(self) -> bool:
        return await ask(self.following, ExecutorStub.cancel, self.run_id, run_id=self.run_id)

    async def forget(self) -> None:
        """Let the executor forget the ended run (its end is in the log): a drained run's last step."""
        with contextlib.suppress(OpGraphError, UnknownRunError):
            await ask(self.following, ExecutorStub.forget_run, self.run_id, run_id=self.run_id)
