"""Letting go: a run kept open for admissions, and settled nodes released once recorded elsewhere.

Owns what a long-fed run needs so that its state stays bounded by the work in flight, not by
all the work it ever admitted (a dataset job admits a million rows over its life): the
``keep_open`` rule (no end while its feeder may still admit, until ``CloseRequested``) and
``ReleaseRequested`` (a settled node, once its caller recorded its outcome, leaves every
index; only a count by status stays). A mixin of FlowState: its attributes are declared
there, and it is reached only through ``handle``.
"""

from __future__ import annotations

from typing import Any

from . import events as ev
from .states import _ALLOWED_FROM, _PUBLIC_STATUS, TERMINAL, UNREGISTERED, illegal_transition

__all__ = ["NodeRelease"]


class NodeRelease:
    """``_on_release``, ``_on_close`` and the queries a feeder reconciles with, mixed into FlowState."""

    def _on_close(self, event: ev.CloseRequested) -> None:
        if self.closed:
            return
        self._record("close", event.now)
        self.closed = True

    def _on_release(self, event: ev.ReleaseRequested) -> None:
        """Drop each settled node of ``event.node_ids`` from every index (ids not held are ignored).

        A node is kept while it is open, or while a dependent that has not settled may still
        read its result. Deferred ranks are written out first: they are insertion positions
        read through the graph's order, which removing nodes would shift. One pass, every
        index bound once: a dataset job releases every row it ever admits through here.

        Each node's step out, (terminal, UNREGISTERED), is a row of TRANSITIONS: checked here,
        then its state is deleted rather than set, since an unregistered node has none.
        """
        state, dependents, released_by_status = self.state, self.dependents, self.released_by_status
        remove_node = self.graph.remove_node
        indexes = (self.unsettled, self.attempt, self.rank, self.branch, self.results, self._mapped_results,
                   self.errors, self._stories, self._children, self.spawned_ids)
        sets = (self.restored_failed, self.pending_inheritance, self._pause_announced)
        self._ranks()
        released = []
        for node_id in event.node_ids:
            current = state.get(node_id)
            if current not in TERMINAL:
                continue
            waiting = dependents.get(node_id)
            if waiting and any(state.get(dependent) not in TERMINAL for dependent in waiting):
                continue
            if UNREGISTERED not in _ALLOWED_FROM[current]:
                raise illegal_transition(current, UNREGISTERED, "released", node_id)
            for dep in self.deps.pop(node_id, ()):
                self._unlist_dependent(dep, node_id)
            if waiting is not None:
                del dependents[node_id]
            remove_node(node_id)
            del state[node_id]
            for index in indexes:
                if node_id in index:
                    del index[node_id]
            for members in sets:
                members.discard(node_id)
            status = _PUBLIC_STATUS[current]
            released_by_status[status] = released_by_status.get(status, 0) + 1
            released.append(node_id)
        if released:
            self.counters["released"] += len(released)
            self._record("released", event.now, tuple(released))

    def _unlist_dependent(self, dep: str, node_id: str) -> None:
        listed = self.dependents.get(dep)
        if listed is not None and node_id in listed:
            listed.remove(node_id)
            if not listed:
                del self.dependents[dep]

    # -- queries: what a feeder that lost track (a new client, a replaced executor) reads ---------
    def settled_outcomes(self) -> list[tuple[str, str, Any, dict[str, Any]]]:
        """``(node id, public status, result, metadata)`` of every settled node still held, in
        registration order: the outcomes a feeder has not released yet."""
        nodes, results = self.graph.nodes, self.results
        return [(node_id, _PUBLIC_STATUS[current], results.get(node_id), dict(nodes[node_id].metadata))
                for node_id, current in self.state.items() if current in TERMINAL]

    def open_admissions(self) -> list[tuple[str, dict[str, Any]]]:
        """``(node id, metadata)`` of every node not yet settled, in registration order."""
        nodes = self.graph.nodes
        return [(node_id, dict(nodes[node_id].metadata)) for node_id, current in self.state.items()
                if current not in TERMINAL]
