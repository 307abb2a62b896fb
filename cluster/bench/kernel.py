"""Benchmark of the scheduler state machine alone, with instant completions.

Owns the kernel figures of issue #2: settlements per second and peak memory for a
fan-out plus aggregation, a chain, and reactive spawn admissions, each at N and 2N to
show linear cost. It lives in cluster/ because it reads the clock; the kernel may not.

    python -m opgraph.cluster.bench.kernel [--scale 1.0] [--repeat 3] [--only chain,spawns]

The driver feeds the kernel the way the GraphExecutor does (actors/executor/shell.py). A
worker streams outcomes back in messages of at most ``OUTCOME_BATCH`` (256, from
actors/workers/worker.py, gathered over a 2 ms window), and the executor turns each message
into one ``handle(*events)`` call of ``OperationFinished`` events built positionally,
requests already extracted (``extracted=True``), each stamped with a later ``now``.
Here every operation finishes at once, so outcomes are settled oldest dispatch first in
batches of that size; ``--batch 0`` settles everything outstanding in one call instead.
Event construction is timed too: the executor pays it for every outcome. Like the
executor, the runs do not write results back onto the graph's nodes (``write_back=False``),
and, like the executor of a run nobody subscribed signals for (``Session.flow``'s default),
they emit no queued, started or spawned signals (``progress_signals=False``);
``--signals`` measures runs that emit them.

``settle/s`` is from the median wall time. ``cpu settle/s`` is from the median process
CPU time of the same runs: on a shared machine it moves less with other people's load,
so compare changes with it (and with A/B runs in one session), not across days.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
import uuid
from collections import deque
from collections.abc import Callable, Sequence

from opgraph.kernel import (
    DispatchOperation,
    FlowStarted,
    FlowState,
    Graph,
    OperationFinished,
    SpawnRequest,
    SpawnRequested,
    create_operation,
    default_node_builder,
)

__all__ = ["main"]

# actors/workers/worker.py OUTCOME_BATCH: outcomes per streamed worker message, so per handle()
# call. Not imported: that would load Ray into a benchmark of the pure kernel.
OUTCOME_BATCH = 256
OUTCOME_WINDOW = 0.002  # seconds between a worker's messages (actors/workers/worker.py)


def roots_graph(n: int, name: str = "roots") -> Graph:
    """``n`` independent nodes."""
    graph = Graph(name)
    for i in range(n):
        graph.add_node(create_operation("noop", {"instruction": str(i)}))
    return graph


def fanout_graph(n: int) -> Graph:
    graph = roots_graph(n, "fanout")
    leaves = list(graph.nodes)
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


def drive(state: FlowState, spawns_from_root: Sequence[SpawnRequest] = (), batch_size: int = OUTCOME_BATCH) -> int:
    """Complete every dispatch instantly, oldest first, ``batch_size`` outcomes per handle().

    The root's outcome carries ``spawns_from_root``, built beforehand: the executor
    receives request objects already made (unpickled from the worker's outcome).
    """
    now = 0.0
    instructions = state.handle(FlowStarted(now=now))
    outstanding: deque[DispatchOperation] = deque()
    settled = 0
    while not state.finished:
        for instruction in instructions:
            if type(instruction) is DispatchOperation:
                outstanding.append(instruction)
        if not outstanding:
            raise RuntimeError("the run stalled: nothing outstanding and no FinishRun")
        count = len(outstanding) if batch_size <= 0 else min(batch_size, len(outstanding))
        now += OUTCOME_WINDOW
        batch = []
        for _ in range(count):
            dispatch = outstanding.popleft()
            requests = ()
            if spawns_from_root and dispatch.parameters.get("instruction") == "root":
                # As the executor builds them from an outcome's requests (_finished_event).
                requests = tuple(
                    SpawnRequested(now=now, emitter_id=dispatch.node_id, request=request,
                                   dedupe_key=(dispatch.node_id, i), redelivery=False)
                    for i, request in enumerate(spawns_from_root)
                )
            # Positional, as the executor builds it from an outcome row (_finished_event).
            batch.append(OperationFinished(now, dispatch.node_id, dispatch.attempt, "completed", "ok", None, None,
                                           requests, True))
        settled += count
        instructions = state.handle(*batch)
    return settled


Shape = Callable[[], tuple[FlowState, Sequence[SpawnRequest]]]


def _without_spawns(graph: Callable[[], Graph], signals: bool) -> Shape:
    """A shape whose nodes are all in ``graph()``: no spawn requests to feed."""
    def build():
        return FlowState(graph(), max_concurrent=None, write_back=False, progress_signals=signals), ()
    return build


def shape_roots(n: int, signals: bool = False) -> Shape:
    """``n`` independent nodes: a settlement with nothing before or after it."""
    return _without_spawns(lambda: roots_graph(n), signals)


def shape_fanout(n: int, signals: bool = False) -> Shape:
    return _without_spawns(lambda: fanout_graph(n), signals)


def shape_chain(n: int, signals: bool = False) -> Shape:
    return _without_spawns(lambda: chain_graph(n), signals)


def shape_spawns(n: int, signals: bool = False) -> Shape:
    def build():
        graph = Graph("spawns")
        graph.add_node(create_operation("noop", {"instruction": "root"}))
        requests = [SpawnRequest(instruction=f"s{i}") for i in range(n)]
        state = FlowState(graph, max_concurrent=None, reactive=True, max_spawn=n, write_back=False,
                          progress_signals=signals)
        return state, requests
    return build


def timed_run(build: Shape, batch_size: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, settlements) of one run; building it is not timed."""
    state, spawns = build()
    gc.collect()
    start, cpu_start = time.perf_counter(), time.process_time()
    settled = drive(state, spawns, batch_size)
    return time.perf_counter() - start, time.process_time() - cpu_start, settled


def peak_memory(build: Shape, batch_size: int) -> float:
    state, spawns = build()
    tracemalloc.start()
    drive(state, spawns, batch_size)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def measure(shape: Callable[[int], Shape], n: int, repeat: int, batch_size: int) -> dict[str, float]:
    """Medians at ``n``, and the 2N/N ratios measured in alternating rounds.

    Each round times N and 2N back to back (the order alternates), and the ratio is
    taken within the round: on a shared machine the speed drifts by more than 10%
    over a minute, which timing all of N and then all of 2N would book as nonlinearity.
    """
    times, cpu_times, ratios, cpu_ratios = [], [], [], []
    settled = 0
    for round_index in range(repeat):
        sizes = (n, 2 * n) if round_index % 2 == 0 else (2 * n, n)
        runs = {size: timed_run(shape(size), batch_size) for size in sizes}
        seconds, cpu_seconds, settled = runs[n]
        times.append(seconds)
        cpu_times.append(cpu_seconds)
        ratios.append(runs[2 * n][0] / seconds)
        cpu_ratios.append(runs[2 * n][1] / cpu_seconds)
    median, cpu_median = statistics.median(times), statistics.median(cpu_times)
    return {"seconds": median, "cpu_seconds": cpu_median, "settled": settled, "per_second": settled / median,
            "cpu_per_second": settled / cpu_median, "peak_mib": peak_memory(shape(n), batch_size),
            "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios)}


def bytecodes_per_node(build: Shape, batch_size: int) -> float:
    """Bytecodes the interpreter executes per settlement of one run: work, not time.

    Counted through ``sys.settrace`` opcode events, so it does not move with the
    machine's speed; it is slow (about a second per 10,000 nodes), so it is opt-in.
    """
    state, spawns = build()
    count = 0

    def on_opcode(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return on_opcode

    def on_call(frame, event, arg):
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return on_opcode

    sys.settrace(on_call)
    try:
        settled = drive(state, spawns, batch_size)
    finally:
        sys.settrace(None)
    return count / settled


def dict_baseline(n: int, repeat: int) -> float:
    """The 2N/N of a plain workload of the same size: one update per key in each of 8 dicts.

    The dicts are keyed by ``n`` fresh UUID strings, as the kernel's indexes are, and
    built untimed; the ratio is taken as in ``measure``. It does no scheduling at all,
    so its 2N/N is what the machine's memory hierarchy alone makes of doubling n.
    """
    def timed(size: int) -> float:
        keys = [str(uuid.uuid4()) for _ in range(size)]
        tables = [dict.fromkeys(keys, 0) for _ in range(8)]
        gc.collect()
        start = time.perf_counter()
        for table in tables:
            for key in keys:
                table[key] += 1
        return time.perf_counter() - start

    ratios = []
    for round_index in range(repeat):
        sizes = (n, 2 * n) if round_index % 2 == 0 else (2 * n, n)
        runs = {size: timed(size) for size in sizes}
        ratios.append(runs[2 * n] / runs[n])
    return statistics.median(ratios)


def spawn_ceiling(n: int, repeat: int, batch_size: int, signals: bool) -> tuple[float, float]:
    """Seconds per child of what the records require of a spawn, and of a plain settlement.

    Every admitted child is an Operation returned by the node builder (here the
    default one), inserted into the graph with a ``spawn`` Edge from its emitter
    (ADR-0023 D6); then it is dispatched and settled like any node, measured here on
    ``n`` independent nodes. Admission's own bookkeeping (de-duplication, the cap,
    ranks, the branch clone) comes on top, so one over the sum bounds spawn
    admissions per second from above, whatever that bookkeeping costs. Medians of
    ``repeat`` rounds each.
    """
    requests = [SpawnRequest(instruction=f"s{i}") for i in range(n)]
    objects = []
    for _ in range(repeat):
        graph = Graph("ceiling")
        root = graph.add_node(create_operation("noop", {"instruction": "root"}))
        gc.collect()
        start = time.perf_counter()
        for request in requests:
            child = graph.add_node(default_node_builder(request, root))
            graph.add_edge(root.id, child.id, label=["spawn"])
        objects.append((time.perf_counter() - start) / n)
    settlements = [timed_run(shape_roots(n, signals), batch_size)[0] / n for _ in range(repeat)]
    return statistics.median(objects), statistics.median(settlements)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size by this")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed rounds, each of N and 2N (medians reported)")
    parser.add_argument("--gc-threshold", type=int, default=50_000,
                        help="generation-0 GC threshold (default 50,000, as the executor sets; Python's own is 700)")
    parser.add_argument("--bytecodes", action="store_true",
                        help="also count bytecodes per settlement at N and 2N (slow; does not vary with machine speed)")
    parser.add_argument("--signals", action="store_true",
                        help="emit queued, started and spawned signals, as a run with a signal subscriber does")
    parser.add_argument("--batch", type=int, default=OUTCOME_BATCH,
                        help=f"outcomes per handle() call (default {OUTCOME_BATCH}, as the executor; "
                             "0: all outstanding)")
    parser.add_argument("--only", default="",
                        help="comma-separated subset of shapes to run: fanout, chain, spawns (default: all)")
    args = parser.parse_args(argv)
    _, second, third = gc.get_threshold()
    gc.set_threshold(args.gc_threshold, second, third)
    print(f"gc threshold: {gc.get_threshold()}; outcomes per handle(): {args.batch or 'all outstanding'}; "
          f"progress signals: {'on' if args.signals else 'off'}")
    shapes = [
        ("fanout", "fan-out + aggregation", shape_fanout, int(100_000 * args.scale)),
        ("chain", "chain", shape_chain, int(10_000 * args.scale)),
        ("spawns", "spawn admissions", shape_spawns, int(10_000 * args.scale)),
    ]
    wanted = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = wanted - {key for key, *_ in shapes}
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(sorted(unknown))}")
    selected = [(label, shape, n) for key, label, shape, n in shapes if not wanted or key in wanted]
    print(f"{'shape':<24}{'nodes':>9}{'median s':>10}{'settle/s':>11}{'cpu settle/s':>14}"
          f"{'peak MiB':>10}{'2N/N time':>11}{'2N/N cpu':>10}")
    for label, shape, n in selected:
        base = measure(lambda size, shape=shape: shape(size, args.signals), n, args.repeat, args.batch)
        print(f"{label:<24}{base['settled']:>9}{base['seconds']:>10.3f}{base['per_second']:>11,.0f}"
              f"{base['cpu_per_second']:>14,.0f}{base['peak_mib']:>10.1f}{base['ratio']:>11.2f}{base['cpu_ratio']:>10.2f}")
    if args.bytecodes:
        for label, shape, n in selected:
            at_n, at_2n = (bytecodes_per_node(shape(size, args.signals), args.batch) for size in (n, 2 * n))
            print(f"{label:<24}{n:>9}  bytecodes per settlement: {at_n:,.1f} at N, {at_2n:,.1f} at 2N")
    for n in [n for _, shape, n in selected if shape is shape_spawns]:  # the spawn shape's own size
        objects, settlement = spawn_ceiling(n, args.repeat, args.batch, args.signals)
        print(f"spawn ceiling at {n:,}: a child's Operation, graph insertion and spawn Edge {objects * 1e6:.1f} us "
              f"+ a plain settlement {settlement * 1e6:.1f} us = at most {1 / (objects + settlement):,.0f} "
              f"spawn admissions/s, before admission's own bookkeeping")
    # The same rounds over a workload with no scheduling in it, at each size used above.
    for n in sorted({n for _, _, n in selected}):
        print(f"{'dict baseline':<24}{n:>9}{'':>10}{'':>11}{'':>14}{'':>10}{dict_baseline(n, args.repeat):>11.2f}")
    print("dict baseline: one update per key in 8 dicts keyed by N UUID strings; its 2N/N is the machine's alone.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
