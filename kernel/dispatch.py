"""Dispatch: ready nodes into flight, with the parameters they run with (ADR-0023 D3, D4).

Owns the capacity pump, the READY -> RUNNING step and each operation's prepared
parameters: its context (own, dependency results, shared context), the operator steer in
its instruction, and an inheriting node's primary history. A mixin of FlowState: it keeps
no state of its own and is reached only through ``handle``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from . import events as ev
from . import signals as sig
from .context import OPERATOR_MESSAGES_KEY, render_operator_messages, to_mapping
from .contracts import PLAIN_TYPES
from .events import new_record as _new_record
from .graph import Operation
from .states import COMPLETED, FAILED, READY, RUNNING, SKIPPED, illegal_transition

__all__ = ["OperationDispatch", "node_weight"]

_MISSING = object()


def node_weight(node: Operation) -> int:
    """The share of the run's capacity ``node`` takes in flight: its metadata's ``weight`` (a
    whole number above 1), else 1."""
    weight = node.metadata.get("weight", 1)
    return weight if type(weight) is int and weight > 1 else 1


class OperationDispatch:
    """``_pump``, ``_dispatch_ready`` and the context each dispatch carries, mixed into FlowState."""

    def _pump(self) -> None:
        # Once round, unless a node failed to dispatch: what that released is ready now.
        while not (self.paused or self.held or self.cancelling or not self.started):
            if self.weighted:
                count = self._weighted_room()
            else:
                count = min(len(self.ready), self.capacity - len(self.running))
            if count <= 0 or not self._dispatch_ready(count):
                return

    def _weighted_room(self) -> int:
        """How many of the oldest ready nodes fit in the capacity, when it counts weights.

        Ideal over retrospective: the records count every operation in flight as one. A node
        whose metadata says ``weight: N`` (a dataset job's operation carrying N rows, each a
        model call) counts N, so ``max_concurrent`` bounds the calls in flight whatever the
        operations carry. The oldest ready node goes first (no smaller one passes it), and
        one heavier than the whole capacity goes alone."""
        nodes = self.graph.nodes
        free = self.capacity - self._weight_in_flight()
        count = 0
        for node_id in self.ready:
            weight = node_weight(nodes[node_id])
            if weight > free and (count or self.running):
                break
            free -= weight
            count += 1
        return count

    def _weight_in_flight(self) -> int:
        """The weights of the operations in flight, summed (``node_weight`` each)."""
        return sum(node_weight(entry[1]) for entry in self.running.values())

    def _dispatch_ready(self, count: int) -> bool:
        """Dispatch the ``count`` oldest ready nodes, each with its prepared parameters.

        One loop with the per-node lookups bound once, because it runs for every node of
        a run (and once per link of a chain, so the binding is kept short too);
        READY -> RUNNING is the common path's second step, a fast step applied inline
        once the old state is checked (see ``FAST_STEPS`` in states.py).

        A node whose parameters cannot be prepared (a dependency's result that will not
        convert to a mapping, or nests past the interpreter's recursion limit) fails
        with ``DispatchError`` and the run goes on. Returns whether any node failed so.
        """
        ready, running, state, attempts, stories = self.ready, self.running, self.state, self.attempt, self._stories
        nodes, deps, branch, default_branch = self.graph.nodes, self.deps, self.branch, self.default_branch_id
        shared, append, operation_context = self.shared.data, self._out.append, self._operation_context
        progress, run_id, elapsed = self.progress_signals, self.run_id, self._elapsed
        dispatched, failed = 0, False
        try:
            for _ in range(count):
                node_id = ready.popleft()
                if state[node_id] != READY:  # pins the old state of the fast step (READY, RUNNING)
                    raise illegal_transition(state[node_id], RUNNING, "dispatched", node_id)
                attempt = attempts.get(node_id, 0) + 1
                attempts[node_id] = attempt
                state[node_id] = RUNNING
                if node_id in stories:
                    stories[node_id].append((READY, RUNNING, "dispatched", attempt))
                node, node_deps = nodes[node_id], deps[node_id]
                running[node_id] = (attempt, node, node_deps)
                branch_id = branch.get(node_id, default_branch)
                if self.pending_inheritance and node_id in self.pending_inheritance:
                    self._inherit_primary_history(node, attempt, branch_id)
                parameters = dict(node.parameters)
                own = parameters.get("context")
                if own is None and not shared and not node_deps:
                    parameters["context"] = {}  # a root with nothing to pass on (the common fan-out leaf)
                else:
                    try:
                        parameters["context"] = operation_context(node_deps, own, shared)
                        if shared:
                            self._render_steer(node_id, parameters, shared)
                    except Exception as exc:  # noqa: BLE001 - data from user operations; the node fails
                        del running[node_id]
                        message = f"parameters could not be prepared: {type(exc).__name__}: {exc}"
                        self._settle_failed(node_id, message, "DispatchError")
                        failed = True
                        continue
                if progress:
                    append(_new_record(ev.EmitSignal, (sig.NodeStarted, run_id, node, elapsed, node_deps, None)))
                append(_new_record(ev.DispatchOperation, (node_id, attempt, node.operation, parameters, branch_id)))
                dispatched += 1
        finally:  # counts what went out, should a node fail to dispatch
            self.counters["dispatched"] += dispatched
        return failed

    @staticmethod
    def _render_steer(node_id: str, parameters: dict[str, Any], shared: dict[str, Any]) -> None:
        """Put pending operator steer messages in front of the instruction (ADR-0023 D4)."""
        queue = shared.get(OPERATOR_MESSAGES_KEY)
        if queue and isinstance(queue, list):
            instruction = parameters.get("instruction") or ""
            rendered = render_operator_messages(queue, str(instruction), node_id)
            if rendered != instruction:
                parameters["instruction"] = rendered

    def _inherit_primary_history(self, node: Operation, attempt: int, branch_id: str | None) -> None:
        """ADR-0023 D3: an inheriting node's branch takes its settled primary's messages."""
        node_id = node.id
        self.pending_inheritance.discard(node_id)
        primary = node.metadata.get("primary_dependency")
        if primary in self.results and self.state.get(primary) in (COMPLETED, FAILED):
            source = self.branch.get(primary, self.default_branch_id)
            if source != branch_id:
                self._out.append(ev.ReplaceHistory(node_id, attempt, branch_id, source))

    def _operation_context(self, deps: Sequence[str], own: Any, shared: dict[str, Any]) -> dict[str, Any]:
        """Own context, then each settled dependency's result, then the shared context."""
        if own is None:
            context = {}
        elif isinstance(own, Mapping):
            context = dict(own)
            # The raw steer queue is control input, never model context (ADR-0023 D4);
            # below, the shared context's copy of it is skipped for the same reason.
            context.pop(OPERATOR_MESSAGES_KEY, None)
        else:
            context = {"original_context": own}
        if deps:
            results, state, scalars, missing = self.results, self.state, PLAIN_TYPES, _MISSING
            for dep in deps:  # all of an aggregation's inputs: keep the loop lean
                result = results.get(dep, missing)
                if result is not missing and state[dep] != SKIPPED:
                    context[dep + "_result"] = result if type(result) in scalars else self._mapped_result(dep, result)
        # Copied, not shared: later merges mutate shared values in place, and an emitted
        # DispatchOperation must keep the context it was prepared with.
        for key, value in shared.items():
            if key != OPERATOR_MESSAGES_KEY:
                context[key] = value if type(value) in PLAIN_TYPES else copy.deepcopy(value)
        return context

    def shared_results(self) -> dict[str, Any]:
        """Node id -> the one mapping of its result that its dependents' contexts share
        (``_mapped_result``); read-only for the caller. The runtime ships a large one to
        each worker once, instead of once per dependent."""
        return self._mapped_results

    def dependency_result(self, dep: str) -> Any:
        """What a dependent's context holds under ``dep + "_result"``: the shared mapping of a
        settled node's result (made now if none is kept yet, as after a rebuild)."""
        result = self.results[dep]
        return result if type(result) in PLAIN_TYPES else self._mapped_result(dep, result)

    def _mapped_result(self, dep: str, result: Any) -> Any:
        """``to_mapping(result)`` of a settled node, made once for all of its dependents.

        A node that returns N spawn requests has N children, each handed the node's
        result: converted per child, that was N^2 model dumps (and as much to ship).
        A settled node's result never changes, so its dependents share one mapping,
        as they share the result object itself in the record's in-process flow. A
        node with a single dependent is converted without keeping a copy.
        """
        if len(self.dependents.get(dep, ())) < 2:
            return to_mapping(result)
        mapped = self._mapped_results.get(dep, _MISSING)
        if mapped is _MISSING:
            mapped = self._mapped_results[dep] = to_mapping(result)
        return mapped
