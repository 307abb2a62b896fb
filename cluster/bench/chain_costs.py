"""Where a chain's time goes: per-link overhead, with and without the run log and the
recorded turn, interleaved in one run.

Owns this measurement only. Each link of ``chain N x 10 ms`` costs the sleep plus: the
executor's dispatch and the worker's answer (two messages), the run-log flush that gates
the next dispatch (``durable``), and the branch-store append of the node's turn
(``record_turn``, one store round trip and its write). The four variants run round-robin,
so drift hits them alike; medians and ratios to the default (durable, turn) are printed,
beside what ``asyncio.sleep(0.01)`` itself takes on this machine now.

    python -m opgraph.cluster.bench.chain_costs [--links 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

import ray

from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder

from .shapes import SLEEP, opgraph_sleep

__all__ = ["build_parser", "main"]

NO_TURN = "bench_sleep_no_turn"
LINK_SECONDS = 0.01
VARIANTS = {  # label: (operation, durable)
    "durable, turn recorded (default)": (SLEEP, True),
    "not durable, turn recorded": (SLEEP, False),
    "durable, no turn": (NO_TURN, True),
    "not durable, no turn": (NO_TURN, False),
}


def chain(operation: str, links: int) -> Any:
    builder = OperationGraphBuilder()
    previous = None
    for index in range(links):
        previous = builder.add_operation(operation, depends_on=[previous] if previous else [],
                                         seconds=LINK_SECONDS, result=index)
    return builder.get_graph()


async def run(args: argparse.Namespace, session: Session) -> int:
    session.register_operation(SLEEP, opgraph_sleep)
    session.register_operation(NO_TURN, opgraph_sleep, record_turn=False)
    await session.flow(chain(SLEEP, 50), max_concurrent=1000)  # warm the workers and the store
    times: dict[str, list[float]] = {label: [] for label in VARIANTS}
    messages: dict[str, float] = {}
    for _ in range(args.repeat):
        for label, (operation, durable) in VARIANTS.items():
            graph = chain(operation, args.links)
            started = time.perf_counter()
            envelope = await session.flow(graph, max_concurrent=1000, durable=durable)
            times[label].append(time.perf_counter() - started)
            messages[label] = envelope["scheduler_messages"] / args.links
    started = time.perf_counter()
    for _ in range(100):
        await asyncio.sleep(LINK_SECONDS)
    sleep_takes = (time.perf_counter() - started) / 100
    ideal = args.links * LINK_SECONDS
    print(f"chain {args.links} x {LINK_SECONDS * 1000:g} ms, median of {args.repeat}, variants interleaved; "
          f"asyncio.sleep({LINK_SECONDS:g}) takes {sleep_takes * 1000:.2f} ms here now")
    default = statistics.median(times[next(iter(VARIANTS))])
    for label, values in times.items():
        median = statistics.median(values)
        print(f"  {label:>34}: {median:6.2f} s, {median / ideal:.2f}x ideal, per-link overhead "
              f"{(median - ideal) / args.links * 1000:5.2f} ms, {median / default:.2f}x the default, "
              f"{messages[label]:.2f} scheduler messages a link")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.chain_costs",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--links", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=5)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started_ray = not ray.is_initialized()
    try:
        return asyncio.run(run(args, Session()))
    finally:
        if started_ray:
            ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
