"""Registration: turning graph nodes into the scheduler's indexes (ADR-0023 D2, D3).

Owns each node's dependencies (edges plus aggregation sources), the reverse dependency
index, the unsettled counters, ranks and branch preallocation: for the submitted graph
in one pass, and for each node admitted later. A mixin of FlowState: it keeps no state
of its own and is reached only through ``handle``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import islice, repeat
from operator import attrgetter, is_not
from typing import Any

from . import events as ev
from .errors import OperationError
from .events import new_record as _new_record
from .graph import Operation
from .states import TERMINAL, UNREGISTERED, WAITING

__all__ = ["NodeRegistration"]

# Shared by every node without dependencies (most of a fan-out): never mutated.
NO_DEPENDENCIES: tuple[str, ...] = ()


_METADATA, _BRANCH_ID, _STATUS = attrgetter("metadata"), attrgetter("branch_id"), attrgetter("status")


def plain_roots(graph: Any) -> bool:
    """Whether every node of ``graph`` is a root that needs nothing at the start: the graph has
    no edges, and no node holds metadata (so no aggregation sources and no inherited
    context), a branch of its own, or a settled status. Each check a C-level pass over
    the nodes (a fan-out's every node); any one that fails sends the start the long way."""
    if graph.edges:
        return False
    values = graph.nodes.values()
    return (not any(map(_METADATA, values))
            and not any(map(is_not, map(_BRANCH_ID, values), repeat(None)))
            and TERMINAL.isdisjoint(map(_STATUS, values)))


class NodeRegistration:
    """Dependency, dependent, counter, rank and branch bookkeeping, mixed into FlowState."""

    def _dependencies_of(self, node: Operation) -> list[str]:
        deps = self.graph.predecessors(node.id)
        sources = node.metadata.get("aggregation_sources")
        if sources:
            deps = _with_sources(deps, sources, node.id, self.graph)
        return deps

    def _register_initial_nodes(self, early: set[str], plain: bool = False) -> tuple[bool, list[str]]:
        """``_register`` for every node of the submitted graph, in one pass.

        ``plain`` (``plain_roots``: nothing registered early, no edges, no node with
        metadata, a branch or a settled status) registers every node as a root at once,
        with no pass over the nodes in Python: a fan-out of 10,000 is registered in
        1.6 ms instead of 4.2 (in process, issue #18).

        ``early`` holds the nodes registered already, on admission before the start:
        they are left as they are, so none is listed or counted twice.

        The same bookkeeping, with dependencies read straight from the adjacency and
        every lookup bound once; ranks are left to ``_rank_initial_nodes``, which
        always follows. Returns whether insertion order is already topological (every
        dependency was inserted before its dependent, the usual case for built graphs,
        which lets ranking skip its heap), and the nodes without dependencies, in
        insertion order: the only ones that can be ready before anything settles.
        """
        nodes = self.graph.nodes
        items = self._enter_initial_nodes(early, plain)
        if plain:  # every node a root, registered above
            self.open_nodes += len(nodes)
            return True, list(nodes)
        in_order, roots = self._index_initial_dependencies(items, fresh=not early)
        self.open_nodes += len(nodes) - len(early)
        return in_order, roots

    def _enter_initial_nodes(self, early: set[str], plain: bool) -> Iterable[tuple[str, Operation]]:
        """The submitted graph's nodes not in ``early``, registered WAITING in one batch with
        their stories started afresh; returned as (id, node) pairs, in graph order.

        On a fresh start (nothing ``early``) the per-node indexes are made at full size here.
        """
        nodes = self.graph.nodes
        if not early:
            # Built in one step, at full size: growing a dict of 100,000 entries one key
            # at a time rebuilds its table over and over. ``deps`` is None until a node's
            # turn in ``_index_initial_dependencies``, which is how a dependency not
            # registered yet shows. The empty internal indexes are replaced outright;
            # ``state`` is public, so it is filled. Plain roots have no dependencies: each
            # holds its final, empty ones at once.
            self._transition_batch(nodes, UNREGISTERED, WAITING)
            self.unsettled = dict.fromkeys(nodes, 0)
            self.deps = dict.fromkeys(nodes, NO_DEPENDENCIES if plain else None)
            self.attempt = dict.fromkeys(nodes, 0)
            items: Iterable[tuple[str, Operation]] = nodes.items()
        else:
            items = [(node_id, node) for node_id, node in nodes.items() if node_id not in early]
            self._transition_batch([node_id for node_id, _ in items], UNREGISTERED, WAITING)
        if self._stories:  # registration starts a node's story afresh
            for node_id, _ in items:
                self._stories.pop(node_id, None)
        return items

    def _index_initial_dependencies(self, items: Iterable[tuple[str, Operation]],
                                    fresh: bool) -> tuple[bool, list[str]]:
        """Each node's dependencies, its place in the dependents of each, and its unsettled
        counter. Returns whether insertion order is topological, and the roots in order."""
        nodes, edges, incoming = self.graph.nodes, self.graph.edges, self.graph._in
        state, all_deps, dependents, unsettled = self.state, self.deps, self.dependents, self.unsettled
        # Nothing registered before the start (a node spawned early may sit anywhere):
        # every dependency is then waiting, so a node waits on all of them.
        in_order = fresh
        roots, terminal = [], TERMINAL
        for node_id, node in items:
            edge_ids = incoming[node_id]
            if not edge_ids:
                deps = NO_DEPENDENCIES
            elif len(edge_ids) == 1:
                deps = [edges[edge_ids[0]].head]
            else:
                deps = list(dict.fromkeys([edges[edge_id].head for edge_id in edge_ids]))
            metadata = node.metadata
            if "weight" in metadata:
                self.weighted = True
            sources = metadata.get("aggregation_sources")
            if sources:
                deps = _with_sources(deps, sources, node_id, nodes)
            if deps:
                for dep in deps:
                    listed = dependents.get(dep)
                    if listed is None:
                        dependents[dep] = [node_id]
                    else:
                        listed.append(node_id)
                    if in_order and all_deps[dep] is None:  # not registered yet: inserted later, or itself
                        in_order = False
                if fresh:
                    unsettled[node_id] = len(deps)
                else:  # a dependency not registered yet counts as unsettled too
                    unsettled[node_id] = sum(1 for dep in deps if state.get(dep) not in terminal)
            else:
                roots.append(node_id)
                if not fresh:
                    unsettled[node_id] = 0
            all_deps[node_id] = deps
        return in_order, roots

    def _register(self, node_id: str, deps: list[str]) -> int:
        """A node admitted after the start: waiting, listed under each dependency, counted
        open. Returns how many of its dependencies have not settled. Its rank is the
        caller's to set (admission ranks a child after its emitter)."""
        state, dependents = self.state, self.dependents
        if self._stories:  # registration starts a node's story afresh
            self._stories.pop(node_id, None)
        # The fast step (UNREGISTERED, WAITING): admission hands over a node new to the graph.
        state[node_id] = WAITING
        self.deps[node_id] = deps
        unsettled = 0
        for dep in deps:
            dependents.setdefault(dep, []).append(node_id)
            if state.get(dep, WAITING) not in TERMINAL:
                unsettled += 1
        self.unsettled[node_id] = unsettled
        self.open_nodes += 1
        return unsettled

    def _rank_initial_nodes(self, in_order: bool = False) -> None:
        """Rank = position in the topological order that breaks ties by insertion order.

        Descendants always outrank ancestors, and parallel nodes are ordered by
        insertion, so shared-context collisions resolve the same way every run.
        When insertion order is itself topological (``in_order``), that order *is*
        the tie-broken topological order, and the graph is acyclic: no heap needed.
        """
        deps, dependents, rank = self.deps, self.dependents, self.rank
        if in_order:
            # The ranks are the insertion positions: written out on first use (``_ranks``),
            # since a run without shared-context writes or spawns never asks for one.
            self._deferred_ranks = len(self.graph.nodes)
            return
        order = {node_id: index for index, node_id in enumerate(self.graph.nodes)}
        indegree = {node_id: len(deps[node_id]) for node_id in order}
        heap = [order[n] for n, d in indegree.items() if d == 0]
        heapq.heapify(heap)
        names = list(order)
        position = 0
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            node_id = names[pop(heap)]
            rank[node_id] = (position,)
            position += 1
            for dependent in dependents.get(node_id, ()):
                remaining = indegree[dependent] - 1
                indegree[dependent] = remaining
                if remaining == 0:
                    push(heap, order[dependent])
        if position != len(order):
            if not self.graph.is_acyclic():
                raise OperationError("Graph must be acyclic for flow execution")
            stuck = next(n for n, remaining in indegree.items() if remaining > 0)
            raise OperationError(
                "Graph must be acyclic for flow execution (aggregation_sources form a cycle)",
                node_id=stuck,
            )

    def _ranks(self) -> dict[str, tuple[int, ...]]:
        """Every node's rank, writing out the deferred insertion-order ranks on first use.

        Deferred ranks belong to the first nodes of the graph: nodes admitted later are
        appended after them, and each is ranked (through here) as it is registered.
        """
        count = self._deferred_ranks
        if count:
            self._deferred_ranks = 0
            # node -> (position,), built in C: zip over one iterable yields 1-tuples.
            self.rank.update(zip(islice(self.graph.nodes, count), zip(range(count)), strict=True))
        return self.rank

    def _clone_branch(self, node_id: str, source: str | None, reactive: bool = False) -> None:
        """Give ``node_id`` a new branch of its own, cloned from ``source`` by the shell.

        The clone's id is deterministic and unique per (run, node): a plain string is
        10x cheaper than uuid5.
        """
        clone = f"branch-{self.run_id}-{node_id}" if self.run_id else f"branch-{node_id}"
        self.branch[node_id] = clone
        if self.known_branches is not None:
            self.known_branches.add(clone)
        self._out.append(_new_record(ev.CloneBranch, (node_id, clone, source, reactive)))

    def _branch_is_known(self, branch_id: str | None) -> bool:
        return branch_id is not None and (self.known_branches is None or branch_id in self.known_branches)

    def _preallocate_branch(self, node: Operation) -> None:
        """ADR-0023 D3: reuse an explicit branch, clone for dependent or inheriting nodes."""
        node_id, branch_id = node.id, node.branch_id
        if branch_id is not None and self._branch_is_known(branch_id):  # most nodes name none
            self.branch[node_id] = branch_id
            return
        if self.deps[node_id] or node.metadata.get("inherit_context"):
            # From the session's default branch, not the flow's (ADR-0023 D3): the flow's
            # default branch serves roots only.
            self._clone_branch(node_id, self.clone_source_branch_id)
            if self._inherits_into_clone(node):
                self.pending_inheritance.add(node_id)
        else:
            self.branch[node_id] = self.default_branch_id

    def _inherits_into_clone(self, node: Operation) -> bool:
        """ADR-0023 D3: ``node`` runs on a clone of its own, which takes its primary's
        messages before it is dispatched (``pending_inheritance``); a node on an explicit
        branch keeps that branch as it is."""
        metadata = node.metadata
        return (bool(metadata.get("inherit_context")) and bool(metadata.get("primary_dependency"))
                and self.branch.get(node.id) != node.branch_id)


def _with_sources(deps: list[str], sources: Any, node_id: str, known: Any) -> list[str]:
    """``deps`` plus the aggregation sources that are nodes and not yet listed, in order.

    Membership goes through a set: an aggregation over N sources whose edges already list
    them would otherwise scan the list once per source, N^2/2 string comparisons.
    """
    deps = list(deps)
    listed = set(deps)
    listed.add(node_id)
    for source in sources:
        if source not in listed and source in known:
            deps.append(source)
            listed.add(source)
    return deps
