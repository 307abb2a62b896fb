"""Benchmark of the scheduler state machine alone, with instant completions.

Owns the kernel figures of issue #2: settlements per second and peak memory for a
fan-out plus aggregation, a chain, and reactive spawn admissions, each at N and 2N to
show linear cost. It lives in cluster/ because it reads the clock; the kernel may not.

    python -m opgraph.cluster.kernel_bench [--scale 1.0] [--repeat 3] [--only chain,spawns]

``settle/s`` is from the median wall time. ``cpu settle/s`` is from the median process
CPU time of the same runs: on a shared machine it moves less with other people's load,
so compare changes with it (and with A/B runs in one session), not across days.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable

from opgraph.kernel import (
    DispatchOperation,
    FlowStarted,
    FlowState,
    Graph,
    OperationFinished,
    SpawnRequest,
    SpawnRequested,
    create_operation,
)

__all__ = ["main"]


def fanout_graph(n: int) -> Graph:
    graph = Graph("fanout")
    leaves = [graph.add_node(create_operation("noop", {"instruction": str(i)})).id for i in range(n)]
    aggregate = graph.add_node(create_operation("noop", {"instruction": "aggregate"}))
    for leaf in leaves:
        graph.add_edge(leaf, aggregate.id)
    return graph


def chain_graph(n: int) -> Graph:
    graph = Graph("chain")
    previous = None
    for i in range(n):
        node = graph.add_node(create_operation("noop", {"instruction": str(i)}))
        if previous is not None:
            graph.add_edge(previous, node.id)
        previous = node.id
    return graph


def drive(state: FlowState, spawns_from_root: int = 0) -> int:
    """Complete every dispatch instantly, in batches, until the run finishes."""
    instructions = state.handle(FlowStarted(now=0.0))
    settled = 0
    while not state.finished:
        batch = []
        for instruction in instructions:
            if type(instruction) is DispatchOperation:
                requests = ()
                if spawns_from_root and instruction.parameters.get("instruction") == "root":
                    requests = tuple(
                        SpawnRequested(emitter_id=instruction.node_id, request=SpawnRequest(instruction=f"s{i}"),
                                       dedupe_key=i)
                        for i in range(spawns_from_root)
                    )
                batch.append(OperationFinished(node_id=instruction.node_id, attempt=instruction.attempt,
                                               response="ok", requests=requests))
        settled += len(batch)
        instructions = state.handle(*batch)
    return settled


def shape_fanout(n: int) -> Callable[[], tuple[FlowState, int]]:
    def build():
        return FlowState(fanout_graph(n), max_concurrent=None), 0
    return build


def shape_chain(n: int) -> Callable[[], tuple[FlowState, int]]:
    def build():
        return FlowState(chain_graph(n), max_concurrent=None), 0
    return build


def shape_spawns(n: int) -> Callable[[], tuple[FlowState, int]]:
    def build():
        graph = Graph("spawns")
        graph.add_node(create_operation("noop", {"instruction": "root"}))
        return FlowState(graph, max_concurrent=None, reactive=True, max_spawn=n), n
    return build


def measure(build: Callable[[], tuple[FlowState, int]], repeat: int) -> dict[str, float]:
    times = []
    cpu_times = []
    settled = 0
    for _ in range(repeat):
        state, spawns = build()
        gc.collect()
        start, cpu_start = time.perf_counter(), time.process_time()
        settled = drive(state, spawns)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    state, spawns = build()
    tracemalloc.start()
    drive(state, spawns)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    median = statistics.median(times)
    cpu_median = statistics.median(cpu_times)
    return {"seconds": median, "cpu_seconds": cpu_median, "settled": settled, "per_second": settled / median,
            "cpu_per_second": settled / cpu_median, "peak_mib": peak / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size by this")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions (median reported)")
    parser.add_argument("--gc-threshold", type=int, default=None,
                        help="generation-0 GC threshold (the executor runs with 50,000; Python's default is 700)")
    parser.add_argument("--only", default="",
                        help="comma-separated subset of shapes to run: fanout, chain, spawns (default: all)")
    args = parser.parse_args(argv)
    if args.gc_threshold is not None:
        _, second, third = gc.get_threshold()
        gc.set_threshold(args.gc_threshold, second, third)
    print(f"gc threshold: {gc.get_threshold()}")
    shapes = [
        ("fanout", "fan-out + aggregation", shape_fanout, int(100_000 * args.scale)),
        ("chain", "chain", shape_chain, int(10_000 * args.scale)),
        ("spawns", "spawn admissions", shape_spawns, int(10_000 * args.scale)),
    ]
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = wanted - {key for key, *_ in shapes}
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(sorted(unknown))}")
    print(f"{'shape':<24}{'nodes':>9}{'median s':>10}{'settle/s':>11}{'cpu settle/s':>14}"
          f"{'peak MiB':>10}{'2N/N time':>11}{'2N/N cpu':>10}")
    for key, label, shape, n in shapes:
        if wanted and key not in wanted:
            continue
        base = measure(shape(n), args.repeat)
        double = measure(shape(2 * n), args.repeat)
        ratio = double["seconds"] / base["seconds"]
        cpu_ratio = double["cpu_seconds"] / base["cpu_seconds"]
        print(f"{label:<24}{base['settled']:>9}{base['seconds']:>10.3f}{base['per_second']:>11,.0f}"
              f"{base['cpu_per_second']:>14,.0f}{base['peak_mib']:>10.1f}{ratio:>11.2f}{cpu_ratio:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
