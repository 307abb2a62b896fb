"""An executor pool against one executor: 8 concurrent runs of 10,000 x 0 ms on a simulated cluster.

Owns the executor-pool figure of issue 19: a head and three more raylets on this machine
(``ray.cluster_utils.Cluster``, as Ray's own tests build them), two runtimes joined to it
side by side (one with a pool of 1 executor, one with a pool of 4; the same workers and
branch stores each), and batches of concurrent fan-outs sent to each in turn. Prints the
aggregate nodes/s of every batch, their medians and the ratio, where each run was placed,
and the CPU seconds each kind of process used (read from /proc: every simulated node is
a process of this machine, so the pool shares its cores).

    python -m opgraph.cluster.bench.pool [--runs 8] [--nodes 10000] [--pools 1,4] [--repeat 3]

Run it in a process without Ray of its own: it starts and shuts down its cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

__all__ = ["main", "pool_figures"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _load_average() -> float:
    """The machine's 1-minute load average: what else competed for its cores meanwhile."""
    return round(os.getloadavg()[0], 1)


def _processes(session: Any) -> dict[str, list[int]]:
    """Kind of actor -> the pids of the runtime's executors, workers and stores."""
    import ray

    runtime = session.runtime
    kinds = {"executors": runtime.executors, "workers": runtime.workers, "stores": runtime.stores}
    found = {kind: [ray.get(handle.statistics.remote())["pid"] for handle in handles]
             for kind, handles in kinds.items()}
    found["driver"] = [os.getpid()]
    return found


def _fanout(nodes: int) -> Any:
    from opgraph.kernel import Graph, create_operation

    graph = Graph("pool-fanout")
    for index in range(nodes):
        graph.add_node(create_operation("sleep", {"seconds": 0.0, "result": index}))
    return graph


async def _batch(session: Any, runs: int, nodes: int, capacity: int) -> tuple[float, list[str], float]:
    """Wall seconds of ``runs`` concurrent fan-outs (graphs built before the clock starts), the
    executor each run was placed on, and the scheduler's messages per node."""
    graphs = [_fanout(nodes) for _ in range(runs)]
    refs: list[dict[str, Any]] = [{} for _ in graphs]
    started = time.perf_counter()
    envelopes = await asyncio.gather(*(session.flow(graph, max_concurrent=capacity, executor_ref=ref)
                                       for graph, ref in zip(graphs, refs, strict=True)))
    elapsed = time.perf_counter() - started
    bad = [envelope["status"] for envelope in envelopes if envelope["status"] != "completed"]
    if bad:
        raise RuntimeError(f"a benchmark run did not complete: {bad}")
    messages = sum(envelope["scheduler_messages"] for envelope in envelopes) / (runs * nodes)
    return elapsed, [ref["executor"].executor_name for ref in refs], messages


def pool_figures(runs: int = 8, nodes: int = 10_000, pools: tuple[int, ...] = (1, 4), repeat: int = 3,
                 cluster_nodes: int = 4, workers: int = 4, branch_stores: int = 2,
                 capacity: int = 1000) -> dict[str, Any]:
    """Run the comparison on a cluster of its own; returns the figures."""
    import ray
    from ray.cluster_utils import Cluster

    from opgraph.actors import Session

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    for _ in range(cluster_nodes - 1):
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        sessions = {}
        for size in pools:
            sessions[size] = Session(address=cluster.address, namespace=f"opgraph-bench-pool-{size}",
                                     detached=False, durable=False, executors=size, workers=workers,
                                     branch_stores=branch_stores)
        placed_on = {}
        for size, session in sessions.items():  # warm-up: operations shipped, every actor warm
            asyncio.run(_batch(session, runs, 500, capacity))
            placed_on[size] = _placement(session)
        pids = {size: _processes(session) for size, session in sessions.items()}
        batches: dict[int, list[dict[str, Any]]] = {size: [] for size in pools}
        for _ in range(repeat):
            for size, session in sessions.items():  # interleaved, so drift falls on every pool alike
                before = {kind: sum(_cpu_seconds(pid) for pid in found) for kind, found in pids[size].items()}
                elapsed, owners, messages = asyncio.run(_batch(session, runs, nodes, capacity))
                cpu = {kind: round(sum(_cpu_seconds(pid) for pid in found) - before[kind], 2)
                       for kind, found in pids[size].items()}
                batches[size].append({"seconds": round(elapsed, 3), "nodes_per_second": round(runs * nodes / elapsed),
                                      "cpu_seconds": cpu, "messages_per_node": round(messages, 3),
                                      "cpu_ms_per_node": round(1000 * sum(cpu.values()) / (runs * nodes), 3),
                                      "load_average": _load_average(),
                                      "runs_per_executor": {name: owners.count(name) for name in sorted(set(owners))}})
        medians = {size: statistics.median(batch["nodes_per_second"] for batch in found)
                   for size, found in batches.items()}
        baseline = medians[pools[0]]
        return {
            "cluster_nodes": cluster_nodes, "cores": os.cpu_count(), "runs": runs, "nodes_per_run": nodes,
            "capacity": capacity, "workers": workers, "branch_stores": branch_stores, "repeat": repeat,
            "executors_on_nodes": placed_on,
            "batches": {str(size): found for size, found in batches.items()},
            "median_nodes_per_second": {str(size): round(rate) for size, rate in medians.items()},
            f"ratio_vs_pool_of_{pools[0]}": {str(size): round(rate / baseline, 2) for size, rate in medians.items()},
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


def _placement(session: Any) -> dict[str, str]:
    """Executor name -> the Ray node it runs on."""
    import ray

    names = set(session.runtime.executor_names)
    return {actor["Name"]: actor["Address"]["NodeID"][:8] for actor in ray._private.state.actors().values()
            if actor["State"] == "ALIVE" and actor["Name"] in names}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.pool", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8, help="concurrent runs per batch")
    parser.add_argument("--nodes", type=int, default=10_000, help="0 ms nodes per run (a fan-out)")
    parser.add_argument("--pools", default="1,4", help="pool sizes compared, the first is the baseline")
    parser.add_argument("--repeat", type=int, default=3, help="batches per pool, interleaved")
    parser.add_argument("--cluster-nodes", type=int, default=4, help="simulated Ray nodes (2 CPUs each)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=1000, help="max_concurrent of each run")
    options = parser.parse_args(argv)
    pools = tuple(int(size) for size in options.pools.split(","))
    figures = pool_figures(options.runs, options.nodes, pools, options.repeat, options.cluster_nodes,
                           options.workers, capacity=options.capacity)
    print(json.dumps(figures, indent=2), flush=True)
    print(f"{'pool':>5}{'median nodes/s':>16}{'ratio':>8}{'CPU ms/node':>13}{'msgs/node':>11}   batches (nodes/s)")
    ratios = figures[f"ratio_vs_pool_of_{pools[0]}"]
    for size in pools:
        found = figures["batches"][str(size)]
        rates = ", ".join(f"{batch['nodes_per_second']:,}" for batch in found)
        cpu = statistics.median(batch["cpu_ms_per_node"] for batch in found)
        messages = statistics.median(batch["messages_per_node"] for batch in found)
        print(f"{size:>5}{figures['median_nodes_per_second'][str(size)]:>16,}{ratios[str(size)]:>7.2f}x"
              f"{cpu:>13.3f}{messages:>11.3f}   {rates}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
