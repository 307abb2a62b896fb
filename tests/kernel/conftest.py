"""Fixtures for the pure kernel tests: fast, deterministic, no Ray.

Every FlowState in these tests runs ``validate()`` at the end of every ``handle()``
(``validate_each_step``, switched on for each test by an autouse fixture), so every
scheduling step of the suite, the run log's replays included, is checked against every
invariant (kernel/invariants.py). ``Driver`` plays the GraphExecutor's part by hand: it
feeds events into a FlowState and remembers what came out, so a test reads as a
sequence of outside facts ("a completed", "b failed") and checks the instructions.
"""

from __future__ import annotations

from typing import Any

import pytest

from opgraph.kernel import (
    DispatchOperation,
    EmitSignal,
    FinishRun,
    FlowStarted,
    FlowState,
    Graph,
    OperationFinished,
)


@pytest.fixture(autouse=True)
def validate_every_step(monkeypatch):
    """Every FlowState of the test validates its invariants after each ``handle()``."""
    monkeypatch.setattr(FlowState, "validate_each_step", True)


class Driver:
    """A FlowState plus the instructions it produced, checked after every step."""

    def __init__(self, graph: Graph, **options: Any) -> None:
        self.state = FlowState(graph, **options)
        self.graph = graph
        self.instructions: list[Any] = []  # everything, in emission order
        self.last: list[Any] = []  # the instructions of the latest handle() call
        self._outstanding: dict[str, DispatchOperation] = {}
        self.envelope: dict[str, Any] | None = None

    # -- feeding events -------------------------------------------------------
    def handle(self, *events: Any) -> list[Any]:
        out = self.state.handle(*events)  # validated at its end (validate_every_step)
        self.last = out
        self.instructions.extend(out)
        for instruction in out:
            if isinstance(instruction, DispatchOperation):
                self._outstanding[instruction.node_id] = instruction
            elif isinstance(instruction, FinishRun):
                assert self.envelope is None, "FinishRun emitted twice"
                self.envelope = instruction.envelope
        return out

    def start(self, now: float = 0.0) -> list[Any]:
        return self.handle(FlowStarted(now=now))

    def complete(self, node_id: str, response: Any = None, *, now: float = 0.0, **extra: Any) -> list[Any]:
        dispatch = self._outstanding.pop(node_id)
        return self.handle(
            OperationFinished(now=now, node_id=node_id, attempt=dispatch.attempt, response=response, **extra)
        )

    def fail(self, node_id: str, error: str = "boom", *, now: float = 0.0) -> list[Any]:
        dispatch = self._outstanding.pop(node_id)
        return self.handle(
            OperationFinished(now=now, node_id=node_id, attempt=dispatch.attempt, status="failed", error=error)
        )

    def cancelled(self, node_id: str, *, now: float = 0.0) -> list[Any]:
        dispatch = self._outstanding.pop(node_id)
        return self.handle(
            OperationFinished(now=now, node_id=node_id, attempt=dispatch.attempt, status="cancelled")
        )

    def run_to_end(self, respond=lambda dispatch: {"done": dispatch.node_id}) -> dict[str, Any]:
        """Complete outstanding dispatches oldest first until the run finishes."""
        while self._outstanding:
            node_id = next(iter(self._outstanding))
            self.complete(node_id, respond(self._outstanding[node_id]))
        assert self.envelope is not None, "run did not finish"
        return self.envelope

    # -- reading what came out ------------------------------------------------
    def dispatched(self) -> dict[str, DispatchOperation]:
        """Outstanding dispatches (sent, not yet reported back) by node id."""
        return dict(self._outstanding)

    def of_type(self, kind: type, *, last: bool = False) -> list[Any]:
        source = self.last if last else self.instructions
        return [i for i in source if isinstance(i, kind)]

    def signals(self, kind: str | None = None, *, op_id: str | None = None) -> list[Any]:
        found = [i.signal for i in self.instructions if isinstance(i, EmitSignal)]
        return [
            s
            for s in found
            if (kind is None or s.kind == kind) and (op_id is None or getattr(s, "op_id", None) == op_id)
        ]


@pytest.fixture
def drive():
    """``drive(graph, **FlowState options)`` -> a started Driver."""

    def start(graph: Graph, **options: Any) -> Driver:
        driver = Driver(graph, **options)
        driver.start()
        return driver

    return start


@pytest.fixture
def unstarted():
    """``unstarted(graph, **FlowState options)`` -> a Driver whose run has not started."""
    return Driver
