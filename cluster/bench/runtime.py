"""Benchmark of the Ray runtime on the embedded local cluster (issue #3 figures).

Owns the runtime figures: wall time (cluster start excluded), ratio to the ideal
makespan, scheduler messages per node and peak memory of executor and stores, for a
10,000-node fan-out at 50 ms and 0 ms, a 1,000-node chain, and 10,000 branch clones.

    python -m opgraph.cluster.bench.runtime [--nodes 10000] [--chain 1000] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import ray

from opgraph.actors import Session
from opgraph.kernel import Graph, create_operation

__all__ = ["RunNotCompleted", "main", "timed_flow"]


class RunNotCompleted(RuntimeError):
    """A timed run ended with a status other than "completed"; its figures would be wrong."""

    def __init__(self, status: str) -> None:
        super().__init__(f"benchmark run did not complete: {status}")
        self.status = status


def fanout(n: int, seconds: float) -> Graph:
    graph = Graph("fanout")
    for i in range(n):
        graph.add_node(create_operation("sleep", {"seconds": seconds, "result": i}))
    return graph


def chain(n: int, seconds: float) -> Graph:
    graph = Graph("chain")
    previous = None
    for i in range(n):
        node = graph.add_node(create_operation("sleep", {"seconds": seconds, "result": i}))
        if previous is not None:
            graph.add_edge(previous, node.id)
        previous = node.id
    return graph


async def timed_flow(session: Session, graph: Graph, capacity: int, **options: Any) -> tuple[float, dict]:
    """Wall seconds of one ``session.flow`` (``options`` pass through) and its envelope."""
    start = time.perf_counter()
    envelope = await session.flow(graph, max_concurrent=capacity, **options)
    elapsed = time.perf_counter() - start
    if envelope["status"] != "completed":
        raise RunNotCompleted(envelope["status"])
    return elapsed, envelope


async def clone_cost(session: Session, clones: int, history: int) -> dict[str, float]:
    store = session.runtime.stores[0]
    source = f"bench-source-{time.time_ns()}"
    await store.create.remote(source, [{"role": "user", "content": f"message {i}"} for i in range(history)])
    before = await store.statistics.remote()
    pairs = [(source, f"{source}-clone-{i}") for i in range(clones)]
    start = time.perf_counter()
    await store.clone_many.remote(pairs)
    elapsed = time.perf_counter() - start
    after = await store.statistics.remote()
    for _, destination in pairs:
        store.drop.remote(destination)
    return {"seconds": elapsed, "added_bytes": after["bytes"] - before["bytes"],
            "source_bytes": before["bytes"], "added_branches": after["branches"] - before["branches"]}


async def run(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    session = Session()
    await session.runtime.executor.ping.remote()
    print(f"cluster start (excluded below): {time.perf_counter() - start:.1f} s")
    # Warm-up: first run ships operations and warms every actor.
    await timed_flow(session, fanout(200, 0.0), 1000)
    rows = []
    for label, build, capacity, ideal in [
        (f"fan-out {args.nodes} x 50 ms @1000", lambda: fanout(args.nodes, 0.05), 1000, args.nodes * 0.05 / 1000),
        (f"fan-out {args.nodes} x 0 ms @1000", lambda: fanout(args.nodes, 0.0), 1000, 0.0),
        (f"chain {args.chain} x 10 ms", lambda: chain(args.chain, 0.01), 5, args.chain * 0.01),
    ]:
        times, messages = [], 0
        for _ in range(args.repeat):
            graph = build()
            elapsed, envelope = await timed_flow(session, graph, capacity)
            times.append(elapsed)
            messages = envelope["scheduler_messages"]
        median = statistics.median(times)
        nodes = len(graph.nodes)
        ratio = f"{median / ideal:.2f}x" if ideal else "-"
        rows.append((label, median, ratio, nodes / median, messages / nodes))
    executor = await session.runtime.executor.statistics.remote()
    stores = [await s.statistics.remote() for s in session.runtime.stores]
    print(f"{'shape':<32}{'median s':>10}{'vs ideal':>10}{'nodes/s':>10}{'msgs/node':>11}")
    for label, median, ratio, rate, per_node in rows:
        print(f"{label:<32}{median:>10.2f}{ratio:>10}{rate:>10,.0f}{per_node:>11.3f}")
    print(f"peak RSS: executor {executor['max_rss_mib']:.0f} MiB, "
          + ", ".join(f"store {s['shard']} {s['max_rss_mib']:.0f} MiB" for s in stores))
    cost = await clone_cost(session, args.clones, 1000)
    print(f"clone {args.clones} branches from a 1,000-message branch: {cost['seconds']:.3f} s, "
          f"added {cost['added_branches']} branches and {cost['added_bytes']} bytes of messages "
          f"(source holds {cost['source_bytes']} bytes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--chain", type=int, default=1_000)
    parser.add_argument("--clones", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        asyncio.run(run(args))
    except RunNotCompleted as exc:
        print(exc)
        return 1
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
