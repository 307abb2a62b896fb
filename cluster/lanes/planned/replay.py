"""Checkpoint replay (``opgraph o flow --resume``): the stored plan rebuilt as a new run, without a planner call.

Owns rebuilding a planned run from its checkpoint: the planned nodes keep their ids;
completed ones arrive terminal and short-circuit (ADR-0023 D5); every spawned child comes
back as a node after its parent, once; failed ops are refused unless ``retry_failed``,
which runs them again and drops the children they had spawned; each role's branch is
created again with its stored history, so ops that continue a role's conversation see it
(``allow_degraded_context`` lets a run go on when a history is missing, and says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opgraph.kernel import Graph

from .checkpoint import Checkpoint, CheckpointRefusedError, branch_history

__all__ = ["RESTORED_STATUSES", "Replay", "build_replay"]

# What a node settled as that a replay keeps; anything else (cancelled, never settled) runs again.
RESTORED_STATUSES = frozenset({"completed"})


@dataclass
class Replay:
    """The rebuilt graph (branch ids still the old run's), labels, and what the replay did."""

    graph: Graph
    labels: dict[str, str]
    histories: dict[str, list[Any]]  # old branch id -> messages to seed its new branch with
    restored: list[str] = field(default_factory=list)
    spawned_restored: int = 0
    retried: list[str] = field(default_factory=list)
    dropped_children: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)  # roles whose history was missing


def _descendants(roots: set[str], checkpoint: Checkpoint) -> set[str]:
    """Children spawned (transitively) by ``roots``."""
    dropped: set[str] = set()
    frontier = set(roots)
    while frontier:
        found = {child.operation.id for child in checkpoint.spawned
                 if (child.emitter_id in frontier or child.after in frontier) and child.operation.id not in dropped}
        dropped |= found
        frontier = found
    return dropped


def build_replay(checkpoint: Checkpoint, *, retry_failed: bool, allow_degraded_context: bool,
                 recorded_branches: Mapping[str, list[Any]]) -> Replay:
    record = checkpoint.record
    recovery = record.recovery or {}
    failed = sorted(node_id for node_id, settled in checkpoint.settled.items() if settled.status == "failed")
    labels = dict(recovery.get("labels", {}))
    if failed and not retry_failed:
        names = ", ".join(labels.get(node_id, node_id) for node_id in failed)
        raise CheckpointRefusedError(f"run {record.run_id} has failed ops ({names}); resume with --retry-failed to "
                                     "run them again (their spawned children are dropped)", run_id=record.run_id)
    dropped = _descendants(set(failed), checkpoint) if retry_failed else set()
    graph = Graph("planned-replay")
    replay = Replay(graph, labels, {}, retried=list(failed), dropped_children=sorted(dropped))

    def add(node: Any) -> None:
        node = node.model_copy(deep=True)
        settled = checkpoint.settled.get(node.id)
        if settled is not None and settled.status in RESTORED_STATUSES:
            node.status, node.response, node.error = settled.status, settled.response, None
            replay.restored.append(node.id)
        else:
            node.status, node.response, node.error = "pending", None, None
        graph.add_node(node)

    for node in checkpoint.graph.nodes.values():
        add(node)
    for edge in checkpoint.graph.edges.values():
        graph.add_edge(edge.head, edge.tail, label=list(edge.label or []), condition=edge.condition)
    taken = set(labels.values())
    for child in checkpoint.spawned:
        child_id = child.operation.id
        if child_id in dropped or child_id in graph.nodes:
            continue
        add(child.operation)
        graph.nodes[child_id].metadata["spawned"] = True
        if child.after is not None and child.after in graph.nodes:
            graph.add_edge(child.after, child_id, label=["spawn"])
            graph.nodes[child_id].metadata["parent_id"] = child.after
        parent = labels.get(child.after or child.emitter_id or "", "root")
        label = f"{parent}>{child.operation.metadata.get('spawn_id') or child_id[:8]}"
        labels[child_id] = label if label not in taken else f"{label}#{child_id[:8]}"
        taken.add(labels[child_id])
        replay.spawned_restored += 1
    # Every branch a node that runs again continues: its history must come back.
    branches: dict[str, str] = dict(recovery.get("branches", {}))
    needed = {node.branch_id for node in graph.nodes.values() if node.status == "pending" and node.branch_id}
    for role, branch_id in branches.items():
        history = branch_history(branch_id, recorded_branches)
        if history is None:
            if branch_id in needed:
                replay.degraded.append(role)
            history = []
        replay.histories[branch_id] = history
    if replay.degraded and not allow_degraded_context:
        raise CheckpointRefusedError(
            f"run {record.run_id}: the conversation history of role(s) {', '.join(replay.degraded)} is not stored, "
            "and ops that continue it have not run yet; resume with --allow-degraded-context to run them without "
            "it (the run's metadata will say so)", run_id=record.run_id)
    return replay
