"""The scheduler's cross-structure invariants, stated as code: one named check per invariant.

Owns ``validate()`` and the checks it runs, in order (``INVARIANTS``): nothing is both
waiting and running, capacity is respected, every waiting node has an unmet dependency,
counters match the states, and a story left implied is one the node's state implies.
Tests run it after every step; it is a mixin of FlowState and never mutates anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

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

__all__ = ["INVARIANTS", "InvariantChecks"]

# States in which a node has been let through its dependencies: none may be unsettled.
_PAST_ITS_DEPENDENCIES = (READY, RUNNING, EVALUATING)


def _fail(message: str, node_id: str | None = None) -> NoReturn:
    raise InvariantViolation(message, node_id=node_id)


class InvariantChecks:
    """``validate()`` and its named checks, mixed into FlowState. Each check reads the
    state and raises InvariantViolation (naming the node where one is concerned) if its
    invariant does not hold."""

    def validate(self) -> None:
        """Check every cross-structure invariant; raise InvariantViolation on the first break."""
        for check in INVARIANTS:
            check(self)

    def _unsettled_dependencies(self, node_id: str) -> int:
        """How many of the node's dependencies are not terminal, counted from the states."""
        state = self.state
        return sum(1 for dep in self.deps[node_id] if state.get(dep, WAITING) not in TERMINAL)

    def check_running_matches_states(self) -> None:
        """The operations in flight (``running``) are exactly the nodes in state RUNNING."""
        running = {n for n, s in self.state.items() if s == RUNNING}
        if running != self.running.keys():
            _fail(f"running set {sorted(self.running)} != running states {sorted(running)}")

    def check_flight_records(self) -> None:
        """An operation in flight carries its node's current attempt, its node and its dependencies."""
        for node_id, (attempt, node, deps) in self.running.items():
            if attempt != self.attempt.get(node_id):
                _fail(f"in flight as attempt {attempt}, but the node is at attempt {self.attempt.get(node_id)}",
                      node_id)
            if node is not self.graph.nodes.get(node_id) or deps is not self.deps.get(node_id):
                _fail("in flight with another node's record", node_id)

    def check_capacity(self) -> None:
        """No more operations, or weight when it counts weights, are in flight than the capacity allows."""
        if len(self.running) > self.capacity:
            _fail(f"{len(self.running)} operations in flight exceed capacity {self.capacity}")
        if self.weighted and len(self.running) > 1:
            load = self._weight_in_flight()
            if load > self.capacity:
                _fail(f"operations weighing {load} in flight exceed capacity {self.capacity}")

    def check_ready_queue(self) -> None:
        """The ready queue holds every READY node once, and nothing else."""
        if len(set(self.ready)) != len(self.ready):
            _fail("a node is queued twice")
        for node_id in self.ready:
            if self.state[node_id] != READY:
                _fail(f"queued node is {self.state[node_id]}", node_id)
        ready_states = sum(1 for s in self.state.values() if s == READY)
        if ready_states != len(self.ready):
            _fail("a ready node is missing from the queue")

    def check_open_count(self) -> None:
        """``open_nodes`` counts the registered nodes that are not terminal."""
        open_nodes = sum(1 for s in self.state.values() if s not in TERMINAL)
        if open_nodes != self.open_nodes:
            _fail(f"open node count {self.open_nodes} != {open_nodes}")

    def check_node_set(self) -> None:
        """The scheduler holds the graph's nodes: all once started, some before, none once the graph is let go."""
        registered, in_graph = self.state.keys(), self.graph.nodes.keys()
        if self.graph_released:  # a finished run whose graph nobody reads any more (completion.py)
            if not self.finished or in_graph:
                _fail("the graph was let go before the run finished, or holds nodes again")
        elif self.started and registered != in_graph:
            _fail("scheduler state and graph disagree on the node set")
        elif not registered <= in_graph:  # before the start: early admissions only
            _fail("the scheduler holds a node the graph does not")

    def check_dependency_counters(self) -> None:
        """An open node's unsettled counter is the number of its dependencies that are not terminal."""
        for node_id, state in self.state.items():
            if state not in TERMINAL:
                unsettled = self._unsettled_dependencies(node_id)
                if unsettled != self.unsettled[node_id]:
                    _fail(f"unsettled counter {self.unsettled[node_id]} != {unsettled}", node_id)

    def check_waiting_nodes_wait_on_something(self) -> None:
        """In a started run that is not cancelling, every waiting node has a dependency not yet settled."""
        if not self.started or self.cancelling:
            return
        for node_id, state in self.state.items():
            if state == WAITING and self._unsettled_dependencies(node_id) == 0:
                _fail("waiting node has no unmet dependency", node_id)

    def check_released_nodes_have_settled_dependencies(self) -> None:
        """A ready, running or evaluating node has every dependency settled."""
        for node_id, state in self.state.items():
            if state in _PAST_ITS_DEPENDENCIES and self._unsettled_dependencies(node_id):
                _fail(f"{state} node has an unsettled dependency", node_id)

    def check_skipped_nodes_have_no_result(self) -> None:
        """A skipped node has no result entry."""
        for node_id, state in self.state.items():
            if state == SKIPPED and node_id in self.results:
                _fail("skipped node has a result entry", node_id)

    def check_stories_off_the_common_path(self) -> None:
        """A node off the common path has its story recorded; only a common-path state implies it."""
        for node_id, state in self.state.items():
            if state not in IMPLIED_STATES and node_id not in self._stories:
                _fail(f"{state} node is off the common path but its story is not recorded", node_id)

    def check_spawn_cap(self) -> None:
        """No more children were admitted than ``max_spawn``."""
        if self.spawn_count > self.max_spawn:
            _fail("spawn cap exceeded")

    def check_finished_run_is_closed(self) -> None:
        """A finished run has no open node and nothing in flight."""
        if self.finished and (self.open_nodes or self.running):
            _fail("finished with open nodes")


#: Every invariant ``validate()`` checks, in the order it checks them.
INVARIANTS: tuple[Callable[[Any], None], ...] = (
    InvariantChecks.check_running_matches_states,
    InvariantChecks.check_flight_records,
    InvariantChecks.check_capacity,
    InvariantChecks.check_ready_queue,
    InvariantChecks.check_open_count,
    InvariantChecks.check_node_set,
    InvariantChecks.check_dependency_counters,
    InvariantChecks.check_waiting_nodes_wait_on_something,
    InvariantChecks.check_released_nodes_have_settled_dependencies,
    InvariantChecks.check_skipped_nodes_have_no_result,
    InvariantChecks.check_stories_off_the_common_path,
    InvariantChecks.check_spawn_cap,
    InvariantChecks.check_finished_run_is_closed,
)
