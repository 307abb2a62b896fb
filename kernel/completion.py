"""Completion: the end of a run and its result (ADR-0023 D4, D6).

Owns finishing once nothing is open or in flight, writing each node's final status,
response and error back onto its Operation (or, for a graph nobody reads afterwards,
letting it go), and the result envelope. A mixin of
FlowState: it keeps no state of its own, and ``envelope()`` only reads.
"""

from __future__ import annotations

from operator import countOf
from typing import Any

from . import events as ev
from .graph import Graph
from .results import validate_envelope
from .states import _PUBLIC_STATUS, CANCELLED, COMPLETED, FAILED, SKIPPED

__all__ = ["RunCompletion"]

_MISSING = object()


class RunCompletion:
    """``_maybe_finish``, ``_write_back`` and ``envelope()``, mixed into FlowState."""

    def _maybe_finish(self) -> None:
        if self.finished or not self.started or self.open_nodes > 0 or self.running:
            return
        if self.keep_open and not self.closed and not self.cancelling:
            return  # its feeder may admit more (release.py): it ends once closed
        self.finished = True
        if self.write_back:
            self._write_back()
        self._out.append(ev.FinishRun(self.envelope()))
        if not self.write_back:
            # The graph is then the shell's own copy, and nothing reads a node of it once the
            # run has ended (the last signals carry their nodes; the envelope is built): let it
            # go before the shell writes and ships the envelope. For a million-node fan-out it
            # was most of the executor's memory, just when the envelope needed more (issue #18).
            self.graph = Graph(self.graph.name)
            self.graph_released = True

    def _write_back(self) -> None:
        """Record final status, response and error on each Operation, once, at the end.

        Done here rather than per transition: pydantic attribute assignment is the
        costliest step of a settlement, and nobody reads node fields mid-run.
        """
        state, results, errors, public, missing = self.state, self.results, self.errors, _PUBLIC_STATUS, _MISSING
        for node_id, node in self.graph.nodes.items():
            fields = node.__dict__
            current = state[node_id]
            fields["status"] = public[current]
            if current == COMPLETED:
                result = results.get(node_id, missing)
                if result is not missing:
                    fields["response"] = result
            if errors and node_id in errors:
                fields["error"] = errors[node_id]

    def envelope(self) -> dict[str, Any]:
        """The result envelope (ADR-0023 D4/D6) plus the truthful additions of DESIGN.md.

        ``completed_operations`` keeps the record's meaning: settled with a result
        entry and not skipped (so failures appear in it). ``failed_operations`` and
        ``operation_statuses`` tell the truth per node.
        """
        results, state, missing = self.results, self.state, _MISSING
        # Everything in registration order. Comprehensions and C-level passes rather
        # than one loop with branches: at the end of a large run every node goes through.
        statuses = dict(zip(state, map(_PUBLIC_STATUS.__getitem__, state.values()), strict=True))
        by_state: dict[str, list[str]] = {SKIPPED: [], FAILED: [], CANCELLED: []}
        if countOf(state.values(), COMPLETED) == len(state) == len(results):
            # Every node completed, so each has a result: the common large run, in C.
            operation_results = dict(zip(state, map(results.__getitem__, state), strict=True))
            completed = list(operation_results)
        else:
            operation_results = {
                node_id: result for node_id in state if (result := results.get(node_id, missing)) is not missing
            }
            for node_id, current in state.items():
                if current in by_state:
                    by_state[current].append(node_id)
            if by_state[SKIPPED]:
                completed = [node_id for node_id in operation_results if state[node_id] != SKIPPED]
            else:
                completed = list(operation_results)
        envelope: dict[str, Any] = {
            "completed_operations": completed,
            "operation_results": operation_results,
            "final_context": self.shared.snapshot(),
            "skipped_operations": by_state[SKIPPED],
            "failed_operations": by_state[FAILED],
            "cancelled_operations": by_state[CANCELLED],
            "operation_statuses": statuses,
            "context_collisions": list(self.shared.collisions),
            "status": CANCELLED if self.cancelling else FAILED if by_state[FAILED] else COMPLETED,
        }
        if self.released_by_status:
            # Settled nodes let go as the run went (release.py): counted, not listed.
            envelope["released_operations"] = dict(self.released_by_status)
        if self.reactive:
            envelope["spawned_operations"] = self.spawn_count
            envelope["escalated_operations"] = list(self.escalated_operations)
            envelope["dropped_spawns"] = [dict(entry) for entry in self.dropped_spawns]
        validate_envelope(envelope)
        return envelope
