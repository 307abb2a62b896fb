"""Where opgraph follows the records through Session.flow on Ray (ADR-0023 D3, D5, D6; ADR-0033 D5).

Each test pins one rule the in-process library states and an earlier opgraph broke:
the custom spawn type found in results, an object seen twice recorded as a duplicate,
an injected settled operation never invoked, every lifecycle signal reaching the caller
typed, the idempotency key, and hook errors reaching the caller.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel
from running import run

from opgraph.actors import Session
from opgraph.kernel import (
    EscalationRequest,
    Graph,
    NodeCancelled,
    NodeEscalated,
    NodePaused,
    NodeSpawned,
    Signal,
    SpawnRequest,
    create_operation,
)

TIMEOUT = 60.0


def single_node(operation: str, **parameters: Any) -> tuple[Graph, str]:
    graph = Graph("record")
    node = graph.add_node(create_operation(operation, parameters))
    return graph, node.id


def children_of(envelope: dict[str, Any], graph: Graph) -> list[str]:
    return [node_id for node_id in envelope["operation_statuses"] if node_id not in graph.nodes]


async def handled(branch: Any, instruction: str = "", **parameters: Any) -> dict[str, str]:
    return {"handled": instruction}


class Ticket(BaseModel):
    """A custom spawn type: not a SpawnRequest."""

    instruction: str
    priority: int = 1


def ticket_builder(request: Ticket, emitter: Any) -> Any:
    return create_operation("handle_ticket", {"instruction": f"{request.instruction} (p{request.priority})"})


def test_requests_of_a_custom_spawn_type_returned_in_a_result_are_admitted(session):
    """emitter returns [Ticket, Ticket] with spawn_type=Ticket: both become children (they were lost)."""

    async def returns_tickets(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"tickets": [Ticket(instruction="refund"), Ticket(instruction="escalate", priority=2)]}

    session.register_operation("returns_tickets", returns_tickets, record_turn=False)
    session.register_operation("handle_ticket", handled, record_turn=False)
    graph, _ = single_node("returns_tickets")

    envelope = run(session.flow(graph, reactive=True, spawn_type=Ticket, node_builder=ticket_builder))

    children = children_of(envelope, graph)
    assert sorted(envelope["operation_results"][child]["handled"] for child in children) == ["escalate (p2)",
                                                                                             "refund (p1)"]


def test_the_same_request_object_returned_twice_is_admitted_once_and_recorded_duplicate(session):
    async def returns_twice(branch: Any, **parameters: Any) -> list[Any]:
        request = SpawnRequest(instruction="only once")
        return [request, {"again": request}]

    session.register_operation("returns_twice", returns_twice, record_turn=False)
    session.register_operation("operate", handled, record_turn=False)
    graph, emitter = single_node("returns_twice")

    envelope = run(session.flow(graph, reactive=True))

    assert envelope["spawned_operations"] == 1
    assert envelope["dropped_spawns"] == [{"reason": "duplicate", "assignee": None, "emitter_id": emitter}]


def test_an_operation_injected_already_settled_is_never_invoked(session, gauge):
    """inject x (status cancelled) while the emitter is held: admitted, settled cancelled, never run
    (had it run, it would have completed with a result)."""

    async def held(branch: Any, key: str, **parameters: Any) -> str:
        await gauge.enter.remote(key)
        await gauge.wait_released.remote(key)
        return "held"

    async def must_not_run(branch: Any, **parameters: Any) -> str:
        return "it ran"

    session.register_operation("held_for_inject", held, record_turn=False)
    session.register_operation("must_not_run", must_not_run, record_turn=False)
    graph, _ = single_node("held_for_inject", key="inject-settled")
    injected = create_operation("must_not_run", {"instruction": "x"})
    injected.status = "cancelled"
    executor_ref: dict[str, Any] = {}

    async def scenario() -> tuple[dict[str, Any], bool]:
        flow = asyncio.create_task(session.flow(graph, reactive=True, executor_ref=executor_ref))
        await asyncio.wait_for(gauge.wait_entered.remote("inject-settled", 1), TIMEOUT)
        accepted = await executor_ref["executor"].inject(injected, independent=True)
        await gauge.release.remote("inject-settled")
        return await flow, accepted

    envelope, accepted = run(scenario())
    assert accepted is True
    assert envelope["operation_statuses"][injected.id] == "cancelled"
    assert injected.id not in envelope["operation_results"]


def test_on_signal_receives_spawned_paused_escalated_and_cancelled_signals_typed(session, gauge):
    """emitter (held) is paused, then spawns a child and escalates (human route): the child waits at
    the pause gate; then the run is cancelled. on_signal sees each kind as its typed model."""
    signals: list[Signal] = []
    arrived = asyncio.Event()

    def on_signal(signal: Signal) -> None:
        signals.append(signal)
        arrived.set()

    async def wait_for(kind: type) -> None:
        while not any(isinstance(signal, kind) for signal in signals):
            arrived.clear()
            await arrived.wait()

    async def spawns_when_told(branch: Any, key: str, **parameters: Any) -> str:
        await gauge.enter.remote(key)
        await gauge.wait_released.remote(f"{key}/emit")
        branch.emit(SpawnRequest(instruction="follow up", independent=True))
        branch.emit(EscalationRequest(reason="needs a person", route="human"))
        await gauge.wait_released.remote(key)
        return "done"

    session.register_operation("spawns_when_told", spawns_when_told, record_turn=False)
    session.register_operation("operate", handled, record_turn=False)
    graph, emitter = single_node("spawns_when_told", key="signals")
    executor_ref: dict[str, Any] = {}

    async def scenario() -> dict[str, Any]:
        flow = asyncio.create_task(session.flow(graph, reactive=True, executor_ref=executor_ref,
                                                on_signal=on_signal))
        await asyncio.wait_for(gauge.wait_entered.remote("signals", 1), TIMEOUT)
        control = executor_ref["executor"]
        await control.pause()
        await gauge.release.remote("signals/emit")
        await asyncio.wait_for(wait_for(NodePaused), TIMEOUT)  # the spawned child, held at the gate
        await asyncio.wait_for(wait_for(NodeEscalated), TIMEOUT)
        await control.cancel()
        await gauge.release.remote("signals")
        return await flow

    envelope = run(scenario())

    kinds = {type(signal) for signal in signals}
    assert {NodeSpawned, NodePaused, NodeEscalated, NodeCancelled} <= kinds
    assert all(isinstance(signal, Signal) and signal.schema_version == 1 for signal in signals)
    (escalated,) = [signal for signal in signals if isinstance(signal, NodeEscalated)]
    assert escalated.op_id == emitter and escalated.route == "human"
    (spawned,) = [signal for signal in signals if isinstance(signal, NodeSpawned)]
    cancelled = {signal.op_id for signal in signals if isinstance(signal, NodeCancelled)}
    # The child at the gate, always; the emitter too unless its release outran the cancel to its worker.
    assert spawned.op_id in cancelled and cancelled <= {spawned.op_id, emitter}
    assert (emitter in cancelled) == (envelope["operation_statuses"][emitter] == "cancelled")
    assert envelope["status"] == "cancelled"


def test_every_operation_can_read_its_idempotency_key(session):
    async def keyed(branch: Any, **parameters: Any) -> list[Any]:
        return list(branch.idempotency_key)

    session.register_operation("keyed", keyed, record_turn=False)
    graph, node = single_node("keyed")
    envelope = run(session.flow(graph, run_id="keyed-run"))
    assert envelope["operation_results"][node] == ["keyed-run", node, 1]


def test_errors_of_spawn_branch_setup_reach_the_caller_in_the_envelope(session):
    async def spawn_one(branch: Any, **parameters: Any) -> dict[str, Any]:
        return {"spawn": SpawnRequest(instruction="child")}

    def broken_setup(child: Any, branch: Any) -> None:
        raise RuntimeError("setup exploded")

    session.register_operation("spawn_one", spawn_one, record_turn=False)
    session.register_operation("operate", handled, record_turn=False)
    graph, _ = single_node("spawn_one")

    envelope = run(session.flow(graph, reactive=True, spawn_branch_setup=broken_setup))

    [child] = children_of(envelope, graph)
    assert envelope["operation_statuses"][child] == "completed"
    assert envelope["hook_errors"] == [{"hook": "spawn_branch_setup", "node_id": child,
                                        "error": "RuntimeError: setup exploded"}]


def test_a_fresh_session_in_another_namespace_has_its_own_runtime(session):
    """Two namespaces, two executors: nothing of one run can reach the other runtime."""
    with Session(namespace="opgraph-record-fixes-other") as other:
        assert other.runtime.executor._actor_id != session.runtime.executor._actor_id
        graph, node = single_node("noop", instruction="elsewhere")
        assert run(other.flow(graph))["operation_results"][node] == "elsewhere"
