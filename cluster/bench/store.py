"""What recording a fixed run as it goes costs: the same wide workflow with and without its store.

Owns one measurement: a fan-out workflow of N nodes run through ``run_workflow``,
alternately with no store and with a SQLite store that records every signal and every
settled node's result as it happens (on the store's writer thread). Each node returns a
record shaped like a chat node's (text, model, provider, usage) at once, so the figure is
the recording's cost, not a model's: chat nodes that share the run's default branch
would also re-read a history that grows with every node. Prints the medians, their ratio,
and the store transactions the writer used.

    python -m opgraph.cluster.bench.store --nodes 1000 --repeat 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from opgraph.kernel import Graph, create_operation

from ..lanes.fixed import CompiledWorkflow, WorkflowSource, run_workflow
from ..store import RunStore

__all__ = ["CountingStore", "main", "wide_workflow"]


def _record(index: int) -> dict[str, Any]:
    text = f"reply {index}: " + "lorem ipsum dolor sit amet " * 8
    return {"text": text, "model": "sim/instant", "provider": "sim", "finish_reason": "stop",
            "usage": {"calls": 1, "prompt_tokens": 40, "completion_tokens": 60, "total_tokens": 100}}


def wide_workflow(nodes: int) -> CompiledWorkflow:
    """``nodes`` independent nodes, compiled directly (a definition holds at most 200)."""
    graph = Graph("store-bench")
    ids = {}
    for index in range(nodes):
        operation = create_operation("noop", {"result": _record(index)})
        operation.metadata.update(reference_id=f"n{index}", workflow_node_id=f"n{index}")
        graph.add_node(operation)
        ids[f"n{index}"] = operation.id
    return CompiledWorkflow(graph=graph, context=MappingProxyType({}), node_ids_by_spec_id=MappingProxyType(ids),
                            edge_ids_by_spec_id=MappingProxyType({}), omitted_edge_ids=(),
                            content_hash="sha256:" + "0" * 64, declared_outputs=tuple(ids))


class CountingStore(RunStore):
    """Counts the progress transactions the writer thread makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.transactions = self.signals = self.nodes = 0

    def record_progress(self, run_id: str, *, signals: Any = (), nodes: Any = ()) -> int:
        signals, nodes = list(signals), list(nodes)
        self.transactions += 1
        self.signals += len(signals)
        self.nodes += len(nodes)
        return super().record_progress(run_id, signals=signals, nodes=nodes)


async def _one(session: Any, nodes: int, capacity: int, store: RunStore | None) -> float:
    compiled = wide_workflow(nodes)
    source = WorkflowSource(kind="workflow_file", ref="store-bench", content_hash=compiled.content_hash, spec=None)
    started = time.perf_counter()
    result = await run_workflow(session, source, store=store, compiled=compiled, max_concurrent=capacity)
    elapsed = time.perf_counter() - started
    if result.status != "completed":
        raise RuntimeError(f"the benchmark run ended {result.status}: {result.errors}")
    return elapsed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.store", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="nodes in the fan-out (1000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each kind, alternated (5)")
    parser.add_argument("--max-concurrent", type=int, default=100, help="operations in flight (100)")
    arguments = parser.parse_args(argv)

    from opgraph.actors import Session  # local: --help must not start Ray

    session = Session()
    timings: dict[str, list[float]] = {"no store": [], "store": []}
    transactions: list[int] = []
    written = (0, 0)
    with tempfile.TemporaryDirectory(prefix="store-bench-") as folder:
        asyncio.run(_one(session, 50, arguments.max_concurrent, None))  # warm the workers
        for round_ in range(arguments.repeat):
            timings["no store"].append(asyncio.run(_one(session, arguments.nodes, arguments.max_concurrent, None)))
            with CountingStore(Path(folder) / f"round-{round_}.db") as store:
                timings["store"].append(asyncio.run(_one(session, arguments.nodes, arguments.max_concurrent, store)))
                transactions.append(store.transactions)
                written = (store.signals, store.nodes)
    bare, recorded = statistics.median(timings["no store"]), statistics.median(timings["store"])
    print(f"{arguments.nodes} nodes, max_concurrent={arguments.max_concurrent}, median of {arguments.repeat}:")
    print(f"  no store            {bare:7.3f} s  ({arguments.nodes / bare:,.0f} nodes/s)")
    print(f"  store, as it goes   {recorded:7.3f} s  ({arguments.nodes / recorded:,.0f} nodes/s)")
    print(f"  ratio store/none    {recorded / bare:7.2f}x  (+{(recorded - bare) * 1000 / arguments.nodes:.2f} ms/node)")
    print(f"  progress transactions per run: {statistics.median(transactions):.0f} "
          f"(for {written[0]} signals and {written[1]} node results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
