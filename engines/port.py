"""The engine's one port to the runtime: make a branch, run one turn on a worker, run a graph.

Owns ``AgentPort`` (what an EngineRun needs from the actor runtime) and ``SessionPort``
(the port over a real ``Session``: turns go through ``Session.turn``, graphs through
``Session.flow``). Unit tests of pure engine semantics pass a fake port; everything else
uses the Session, so every turn runs on an OperationWorker.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from opgraph.actors import TurnResult
from opgraph.kernel import Graph

from .usage import ENGINE_OPERATE, engine_operate

__all__ = ["AgentPort", "SessionPort"]


@runtime_checkable
class AgentPort(Protocol):
    """What an engine run asks of the runtime; a test seam, not a second runtime.

    ``turn`` has ``Session.turn``'s contract: it returns a ``TurnResult`` and raises
    ``TurnError`` (with the failed turn's ``usage``) when the turn fails.
    """

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str: ...

    async def turn(self, branch: str, operation: str, /, *, timeout: float | None = None,
                   **parameters: Any) -> TurnResult: ...

    async def flow(self, graph: Graph, **options: Any) -> dict[str, Any]: ...


class SessionPort:
    """The port over a live ``Session``; the session is used as it is, never reset or closed.

    It registers the one operation engines add (``engine_operate``, a planned task
    node's metered ``operate``) and nothing else; turns run the Session's own verbs.
    """

    def __init__(self, session: Any) -> None:
        self.session = session
        registered = getattr(session, "operations", {}).get(ENGINE_OPERATE)
        if getattr(registered, "fn", None) is not engine_operate:  # once per Session, not per run
            session.register_operation(ENGINE_OPERATE, engine_operate, record_turn=False)

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str:
        # Session.new_branch waits on the BranchStore synchronously: keep the loop free.
        return await asyncio.to_thread(self.session.new_branch, name, messages)

    async def turn(self, branch: str, operation: str, /, *, timeout: float | None = None,
                   **parameters: Any) -> TurnResult:
        return await self.session.turn(branch, operation, timeout=timeout, **parameters)

    async def flow(self, graph: Graph, **options: Any) -> dict[str, Any]:
        return await self.session.flow(graph, **options)
