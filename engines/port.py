"""The engine's one port to the runtime: make a branch, run one turn on a worker, run a graph.

Owns ``AgentPort`` (what an EngineRun needs from the actor runtime) and ``SessionPort``
(the port over a real ``Session``). Unit tests of pure engine semantics pass a fake
port; everything else uses the Session, so every turn runs on an OperationWorker.

TEMPORARY (until ``Session.turn`` lands on main): when the Session has no ``turn``
method, ``SessionPort`` runs each turn as a one-node graph through ``Session.flow`` with
the metered ``engine_turn`` operation, and ``TurnResult``/``TurnError`` below stand in
for ``opgraph.actors``' own. Both go away once the Session has its single-call API.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opgraph.kernel import Graph, OpGraphError, create_operation

from .usage import ENGINE_OPERATE, ENGINE_TURN, empty_usage, engine_operate, engine_turn

__all__ = ["AgentPort", "SessionPort", "TurnError", "TurnResult"]

try:  # the coordinator's single-call API (Session.turn), once it is on main
    from opgraph.actors import TurnError, TurnResult  # type: ignore[attr-defined]
except ImportError:  # TEMPORARY stand-ins with the same contract; see the module docstring
    @dataclass(frozen=True)
    class TurnResult:  # type: ignore[no-redef]
        """What one turn returned: the operation's response and its provider usage."""

        response: Any
        usage: dict[str, Any]
        branch_id: str
        attempt: int
        elapsed: float

    class TurnError(OpGraphError):  # type: ignore[no-redef]
        """The turn failed; ``error_type`` is the failure kind (``ParseError``, ``OperationTimeout``...)."""

        def __init__(self, message: str, *, error_type: str = "ExecutionError", branch_id: str | None = None,
                     node_id: str | None = None, edge_id: str | None = None) -> None:
            super().__init__(message, node_id=node_id, branch_id=branch_id, edge_id=edge_id)
            self.error_type = error_type

        def __reduce__(self):
            return (_rebuild_turn_error, (type(self), self.message, self.error_type, self.branch_id, self.node_id))


def _rebuild_turn_error(cls, message, error_type, branch_id, node_id):
    return cls(message, error_type=error_type, branch_id=branch_id, node_id=node_id)


@runtime_checkable
class AgentPort(Protocol):
    """What an engine run asks of the runtime; a test seam, not a second runtime."""

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str: ...

    async def turn(self, branch: str, operation: str, /, *, timeout: float | None = None,
                   **parameters: Any) -> TurnResult: ...

    async def flow(self, graph: Graph, **options: Any) -> dict[str, Any]: ...


class SessionPort:
    """The port over a live ``Session``; the session is used as it is, never reset.

    It registers the metered operations engines need (``engine_operate`` for planned
    task nodes, ``engine_turn`` for the temporary turn adapter) and nothing else.
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        session.register_operation(ENGINE_OPERATE, engine_operate, record_turn=False)
        if not callable(getattr(session, "turn", None)):
            session.register_operation(ENGINE_TURN, engine_turn, record_turn=False)

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str:
        # Session.new_branch waits on the BranchStore synchronously: keep the loop free.
        return await asyncio.to_thread(self.session.new_branch, name, messages)

    async def turn(self, branch: str, operation: str, /, *, timeout: float | None = None,
                   **parameters: Any) -> TurnResult:
        native = getattr(self.session, "turn", None)
        if callable(native):
            return await native(branch, operation, timeout=timeout, **parameters)
        return await self._turn_through_flow(branch, operation, timeout, parameters)

    async def flow(self, graph: Graph, **options: Any) -> dict[str, Any]:
        return await self.session.flow(graph, **options)

    async def _turn_through_flow(self, branch: str, operation: str, timeout: float | None,
                                 parameters: dict[str, Any]) -> TurnResult:
        """TEMPORARY: one turn as a one-node graph on the workers (Session.flow), metered.

        A timeout cancels the flow (and so the call on its worker) and raises
        ``TurnError(error_type="OperationTimeout")``; cancelling the caller cancels the flow.
        """
        graph = Graph("turn")
        node = graph.add_node(create_operation(ENGINE_TURN, {"verb": operation, "arguments": dict(parameters)},
                                               branch_id=branch))
        started = time.monotonic()
        try:
            envelope = await asyncio.wait_for(self.session.flow(graph, max_concurrent=1), timeout)
        except asyncio.TimeoutError:
            raise TurnError(f"{operation} exceeded its {timeout} s timeout", error_type="OperationTimeout",
                            branch_id=branch) from None
        status = envelope.get("operation_statuses", {}).get(node.id)
        result = envelope.get("operation_results", {}).get(node.id)
        if status == "completed" and isinstance(result, dict):
            return TurnResult(response=result.get("response"), usage=result.get("usage") or empty_usage(),
                              branch_id=branch, attempt=1, elapsed=time.monotonic() - started)
        error = result.get("error") if isinstance(result, dict) else None
        error_type = result.get("error_type") if isinstance(result, dict) else None
        if status == "cancelled":
            error_type = error_type or "Cancelled"
        raise TurnError(str(error or f"{operation} ended {status}"), error_type=error_type or "ExecutionError",
                        branch_id=branch)
