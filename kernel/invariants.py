"""The scheduler's cross-structure invariants, stated as code.

Owns ``validate()``: nothing is both waiting and running, capacity is respected, every
waiting node has an unmet dependency, counters match the states, and a story left
implied is one the node's state implies. Tests call it after every step; it is a mixin
of FlowState and never mutates anything.
"""

from __future__ import annotations

from .errors import InvariantViolation
from .states import (
    EVALUATING,
    IMPLIED_STATES,
    READY,
    RUNNING,
    SKIPPED,
    TERMINAL,
    WAITING,
)

__all__ = ["InvariantChecks"]


class InvariantChecks:
    """``validate()`` for FlowState."""

    def validate(self) -> None:
        """Check every cross-structure invariant; raise InvariantViolation on the first break."""

        def fail(message: str, node_id: str | None = None) -> None:
            raise InvariantViolation(message, node_id=node_id)

        running = {n for n, s in self.state.items() if s == RUNNING}
        if running != self.running.keys():
            fail(f"running set {sorted(self.running)} != running states {sorted(running)}")
        for node_id, (attempt, node, deps) in self.running.items():
            if attempt != self.attempt.get(node_id):
                fail(f"in flight as attempt {attempt}, but the node is at attempt {self.attempt.get(node_id)}", node_id)
            if node is not self.graph.nodes.get(node_id) or deps is not self.deps.get(node_id):
                fail("in flight with another node's record", node_id)
        if len(self.running) > self.capacity:
            fail(f"{len(self.running)} operations in flight exceed capacity {self.capacity}")
        if len(set(self.ready)) != len(self.ready):
            fail("a node is queued twice")
        for node_id in self.ready:
            if self.state[node_id] != READY:
                fail(f"queued node is {self.state[node_id]}", node_id)
        ready_states = sum(1 for s in self.state.values() if s == READY)
        if ready_states != len(self.ready):
            fail("a ready node is missing from the queue")
        open_nodes = sum(1 for s in self.state.values() if s not in TERMINAL)
        if open_nodes != self.open_nodes:
            fail(f"open node count {self.open_nodes} != {open_nodes}")
        registered, in_graph = self.state.keys(), self.graph.nodes.keys()
        if self.graph_released:  # a finished run whose graph nobody reads any more (completion.py)
            if not self.finished or in_graph:
                fail("the graph was let go before the run finished, or holds nodes again")
        elif self.started and registered != in_graph:
            fail("scheduler state and graph disagree on the node set")
        elif not registered <= in_graph:  # before the start: early admissions only
            fail("the scheduler holds a node the graph does not")
        for node_id, state in self.state.items():
            unsettled = sum(1 for dep in self.deps[node_id] if self.state.get(dep, WAITING) not in TERMINAL)
            if state not in TERMINAL and unsettled != self.unsettled[node_id]:
                fail(f"unsettled counter {self.unsettled[node_id]} != {unsettled}", node_id)
            if self.started and not self.cancelling and state == WAITING and unsettled == 0:
                fail("waiting node has no unmet dependency", node_id)
            if state in (READY, RUNNING, EVALUATING) and unsettled:
                fail(f"{state} node has an unsettled dependency", node_id)
            if state == SKIPPED and node_id in self.results:
                fail("skipped node has a result entry", node_id)
            if state not in IMPLIED_STATES and node_id not in self._stories:
                fail(f"{state} node is off the common path but its story is not recorded", node_id)
        if self.spawn_count > self.max_spawn:
            fail("spawn cap exceeded")
        if self.finished and (self.open_nodes or self.running):
            fail("finished with open nodes")
