"""A whole node of a simulated cluster killed mid-run: its raylet and every process on it.

Owns the node-loss figure of issue 19: a head and two more raylets on this machine
(``ray.cluster_utils.Cluster``, as Ray's own tests build them), a durable runtime joined
through the cluster's address, a fan-out run once undisturbed and once with the node
that holds the most of the runtime's workers removed at ``--at`` of the way (no graceful
shutdown). Prints the envelope's status, the nodes run more than once (each attempt
counted by the operation itself, in a file per process) and both wall times.

    python -m opgraph.cluster.bench.node_loss [--nodes 2000] [--seconds 0.05] [--concurrency 200] [--executors 1]

``--executors`` is the runtime's executor pool (1 by default, as the figure was first
measured; 0 takes the runtime's own default, one per alive node).

Run it in a process without Ray of its own: it starts and shuts down its cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any

from .chaos_durable import SettledCounter, counting_operation, runs_per_node

__all__ = ["main", "node_loss"]


def _pool_nodes() -> dict[str, list[str]]:
    """Ray node id -> the names of the runtime's live actors on it (the cluster is this script's own)."""
    import ray

    placed: dict[str, list[str]] = {}
    for actor in ray._private.state.actors().values():
        if actor["State"] == "ALIVE" and actor["Name"].startswith("opgraph-"):
            placed.setdefault(actor["Address"]["NodeID"], []).append(actor["Name"])
    return placed


def node_loss(nodes: int = 2000, seconds: float = 0.05, concurrency: int = 200, at: float = 0.3,
              workers: int = 4, executors: int | None = 1) -> dict[str, Any]:
    """Run the scenario on a cluster of its own; returns the figures."""
    import ray
    from ray.cluster_utils import Cluster

    from opgraph.actors import Session
    from opgraph.kernel import OperationGraphBuilder

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    extra = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    namespace = "opgraph-node-loss"
    try:
        session = Session(address=cluster.address, namespace=namespace, workers=workers, branch_stores=2,
                          executors=executors)

        def graph():
            builder = OperationGraphBuilder("node-loss")
            for _ in range(nodes):
                builder.add_operation("counted", depends_on=[], seconds=seconds)
            return builder.get_graph()

        with tempfile.TemporaryDirectory() as quiet_marks, tempfile.TemporaryDirectory() as marks:
            session.register_operation("counted", counting_operation(quiet_marks), record_turn=False, retry=3)
            started = time.monotonic()
            baseline = asyncio.run(session.flow(graph(), max_concurrent=concurrency))
            undisturbed = time.monotonic() - started

            session.register_operation("counted", counting_operation(marks), record_turn=False, retry=3)
            placed = _pool_nodes()
            head = cluster.head_node.node_id
            # The node (not the head, where the driver runs) holding most of the pool's workers.
            victim = max(extra, key=lambda node: sum("-worker-" in name for name in placed.get(node.node_id, [])))
            on_victim = sorted(placed.get(victim.node_id, []))

            async def disturbed() -> tuple[dict[str, Any], float]:
                progress = SettledCounter(at * nodes)
                began = time.monotonic()
                flow = asyncio.create_task(session.flow(graph(), max_concurrent=concurrency, on_progress=progress))
                await progress.reached.wait()
                await asyncio.to_thread(cluster.remove_node, victim, False)  # its raylet and every process on it
                envelope = await flow
                return envelope, time.monotonic() - began

            envelope, killed = asyncio.run(disturbed())
            runs = runs_per_node(marks)
        after = _pool_nodes()
        twice = {node for node, count in runs.items() if count > 1}
        return {
            "cluster_nodes": 3, "head": head, "killed_node": victim.node_id,
            "actors_on_killed_node": on_victim,
            "status": envelope["status"], "nodes": len(envelope["operation_statuses"]),
            "completed": len(envelope["completed_operations"]),
            "nodes_run_more_than_once": len(twice),
            "wall_seconds_killed": round(killed, 2), "wall_seconds_undisturbed": round(undisturbed, 2),
            "ratio": round(killed / undisturbed, 2), "baseline_status": baseline["status"],
            "pool_after": {node: sorted(names) for node, names in after.items()},
            "killed_node_holds_nothing_after": victim.node_id not in after,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.node_loss",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--at", type=float, default=0.3, help="fraction of nodes completed when the node dies")
    parser.add_argument("--executors", type=int, default=1, help="executor pool size (0: the runtime's default)")
    options = parser.parse_args(argv)
    figures = node_loss(options.nodes, options.seconds, options.concurrency, options.at,
                        executors=options.executors or None)
    print(json.dumps(figures, indent=2), flush=True)
    return 0 if figures["status"] == "completed" and figures["completed"] == options.nodes else 1


if __name__ == "__main__":
    raise SystemExit(main())
