"""`opgraph bench`: the standard shapes on the embedded local Ray, optionally beside lionagi and LangGraph.

Owns the shape catalogue, the timing loop (median of ``--repeat`` runs of ``flow()``, Ray
start excluded), the ratios to the ideal makespan, the table and the JSON file, and the
adapters that run the same shapes on the in-process libraries lionagi and LangGraph. It must
not tune or reach into the runtime (only ``Session.flow`` with registered operations),
and it never hides a failed or timed-out run: each is printed as such.

    opgraph bench [--shapes fanout-50ms,chain] [--nodes 10000] [--repeat 3]
                  [--compare lionagi,langgraph] [--compare-timeout 120] [--json PATH]
    opgraph bench --shapes engines [--engines research,review] [--engine-latency 0.2]
    opgraph bench --shapes map [--map-sizes 100000,1000000] [--map-concurrency 1000] [--map-kill-rows 100000]
    opgraph bench --shapes http,http-stream [--http-calls 10000] [--http-concurrency 500] [--compare lionagi,langgraph]

``engines`` is not a graph shape: it runs the domain engines (bench/engines.py) on the
same runtime, after any graph shapes asked for, and only when named. Nor is ``map``: the
dataset jobs (bench/map.py) run each in a client and a Ray of their own, last. Nor are
``http`` and ``http-stream``: chat calls over HTTP to a local server (bench/http_calls.py).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import operator
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from typing import Annotated, Any, TypedDict

import ray

from opgraph.actors import Session
from opgraph.kernel import OperationGraphBuilder, SpawnRequest, create_operation

from .runtime import RunNotCompleted, timed_flow

__all__ = ["Shape", "build_parser", "main", "standard_shapes"]

SLEEP = "bench_sleep"
EMIT_SPAWNS = "bench_emit_spawns"  # the root sends each request live: branch.emit(request)
RETURN_SPAWNS = "bench_return_spawns"  # the root returns the requests as its result
INSTALL_HINT = "pip install 'opgraph[bench]'"


@dataclass(frozen=True)
class Shape:
    """One benchmark graph: ``width`` nodes sleeping ``latency`` s, ``capacity`` in flight."""

    key: str
    kind: str  # "fanout", "chain", "aggregation", or "spawns-emitted"/"spawns-returned" (a root, ``width`` spawns)
    width: int
    latency: float
    capacity: int

    @property
    def nodes(self) -> int:
        """Nodes a run settles: the width, plus the spawn root or the aggregation node."""
        return self.width + (self.kind not in ("fanout", "chain"))

    @property
    def label(self) -> str:
        each = f"x {self.latency * 1000:g} ms"
        return {
            "fanout": f"fan-out {self.width:,} {each} @{self.capacity}",
            "chain": f"chain {self.width:,} {each}",
            "spawns-emitted": f"spawns 1 -> {self.width:,} {each} @{self.capacity}, emitted",
            "spawns-returned": f"spawns 1 -> {self.width:,} {each} @{self.capacity}, returned",
            "aggregation": f"fan-out {self.width:,} + 1 {each} @{self.capacity}",
        }[self.kind]

    @property
    def ideal(self) -> float:
        """The makespan with no overhead: whole waves of ``capacity`` nodes; a chain's latency sum.

        At the standard sizes a wave count is N / capacity exactly; rounding up keeps the
        ideal honest when ``--nodes`` makes a fan-out smaller than one wave.
        """
        if self.kind == "chain":
            return self.width * self.latency
        waves = math.ceil(self.width / self.capacity) * self.latency
        return waves + (self.latency if self.kind == "aggregation" else 0.0)


def standard_shapes(nodes: int = 10_000) -> list[Shape]:
    """The standard shapes; the chain and the spawns are a tenth of ``nodes`` wide.

    Spawns come two ways. Emitted live, they measure the reactive admission path alone.
    Returned as the root's result, each child also receives that result (every request)
    as its context, as both libraries define it: opgraph converts it once and the children
    share it, so its cost stays linear in the spawns.
    """
    tenth = max(1, nodes // 10)
    return [
        Shape("fanout-0ms", "fanout", nodes, 0.0, 1000),
        Shape("fanout-50ms", "fanout", nodes, 0.05, 1000),
        Shape("chain", "chain", tenth, 0.01, 1000),
        # 100 in flight, so the spawns take ten waves like the fan-out rather than one.
        Shape("spawns", "spawns-emitted", tenth, 0.05, 100),
        Shape("spawns-returned", "spawns-returned", tenth, 0.05, 100),
        Shape("aggregation", "aggregation", nodes, 0.05, 1000),
    ]


def build_graph(shape: Shape, builder: Any) -> Any:
    """Lay ``shape`` out with an OperationGraphBuilder: opgraph's or lionagi's take the same calls."""
    if shape.kind == "chain":
        for index in range(shape.width):
            builder.add_operation(SLEEP, seconds=shape.latency, result=index)  # depends_on=None chains
    elif shape.kind.startswith("spawns"):
        root = EMIT_SPAWNS if shape.kind == "spawns-emitted" else RETURN_SPAWNS
        builder.add_operation(root, depends_on=[], count=shape.width)
    else:
        leaves = [builder.add_operation(SLEEP, depends_on=[], seconds=shape.latency, result=index)
                  for index in range(shape.width)]
        if shape.kind == "aggregation":
            builder.add_aggregation(SLEEP, source_node_ids=leaves, seconds=shape.latency, result="aggregate")
    return builder.get_graph()


@dataclass(frozen=True)
class SleepingChild:
    """A node builder: each admitted SpawnRequest becomes a node sleeping ``seconds``."""

    create: Callable[[str, dict[str, Any]], Any]  # the library's create_operation(operation, parameters)
    seconds: float

    def __call__(self, request: Any, emitter: Any) -> Any:
        return self.create(SLEEP, {"seconds": self.seconds, "result": request.instruction})


def flow_options(shape: Shape, create: Callable[[str, dict[str, Any]], Any]) -> dict[str, Any]:
    """``flow()`` options beyond capacity: the spawn shapes run reactive, admitting every request."""
    if not shape.kind.startswith("spawns"):
        return {}
    return {"reactive": True, "max_spawn": shape.width, "node_builder": SleepingChild(create, shape.latency)}


# -- opgraph ------------------------------------------------------------------------------

async def opgraph_sleep(branch: Any, seconds: float = 0.0, **parameters: Any) -> Any:
    await asyncio.sleep(seconds)
    return parameters.get("result")


async def opgraph_emit_spawns(branch: Any, count: int = 0, **parameters: Any) -> int:
    for index in range(count):
        branch.emit(SpawnRequest(instruction=f"spawned {index}"))
    return count


async def opgraph_return_spawns(branch: Any, count: int = 0, **parameters: Any) -> list[SpawnRequest]:
    return [SpawnRequest(instruction=f"spawned {index}") for index in range(count)]


class OpgraphRunner:
    """Runs shapes through ``Session.flow`` on the runtime the session joined."""

    name = "opgraph"

    def __init__(self, session: Session, timeout: float, *, name: str = "opgraph", durable: bool = True) -> None:
        self.name = name
        self.durable = durable
        self.session = session
        self.timeout = timeout
        session.register_operation(SLEEP, opgraph_sleep, record_turn=False)
        session.register_operation(EMIT_SPAWNS, opgraph_emit_spawns, record_turn=False)
        session.register_operation(RETURN_SPAWNS, opgraph_return_spawns, record_turn=False)

    def unsupported(self, shape: Shape) -> str | None:
        return None

    async def run(self, shape: Shape) -> float:
        graph = build_graph(shape, OperationGraphBuilder())
        options = flow_options(shape, create_operation)
        options["durable"] = self.durable
        elapsed, envelope = await asyncio.wait_for(
            timed_flow(self.session, graph, shape.capacity, **options), self.timeout)
        settled = len(envelope["operation_statuses"])
        if settled != shape.nodes:
            raise RunNotCompleted(f"settled {settled} of {shape.nodes} nodes")
        return elapsed


# -- lionagi, the in-process reference library -------------------------------------------

async def lionagi_sleep(seconds: float = 0.0, **parameters: Any) -> Any:
    """lionagi calls a registered operation with the node's parameters only (no branch)."""
    await asyncio.sleep(seconds)
    return parameters.get("result")


async def lionagi_return_spawns(count: int = 0, **parameters: Any) -> list[Any]:
    from lionagi.casts import SpawnRequest as LionagiSpawnRequest

    return [LionagiSpawnRequest(instruction=f"spawned {index}") for index in range(count)]


class LionagiRunner:
    """Runs shapes through lionagi's own ``Session.flow``, in this process and event loop.

    Each run gets a fresh lionagi Session (made before the clock starts): lionagi keeps
    every branch it clones on the session, and a shared one would grow run after run.
    """

    name = "lionagi"

    def __init__(self, timeout: float) -> None:
        import lionagi
        from lionagi.operations.node import create_operation as lionagi_create_operation

        self.lionagi = lionagi
        self.create_operation = lionagi_create_operation
        self.timeout = timeout

    def unsupported(self, shape: Shape) -> str | None:
        if shape.kind == "spawns-emitted":
            return "a registered lionagi operation is called without its branch, so it cannot emit live"
        return None

    async def run(self, shape: Shape) -> float:
        session = self.lionagi.Session()
        session.register_operation(SLEEP, lionagi_sleep)
        session.register_operation(RETURN_SPAWNS, lionagi_return_spawns)
        graph = build_graph(shape, self.lionagi.Builder())
        options = flow_options(shape, self.create_operation)
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(session.flow(graph, max_concurrent=shape.capacity, **options),
                                            self.timeout)
        except TimeoutError:
            raise
        except Exception as exc:  # the foreign library's own error, translated once here
            raise RunNotCompleted(f"{type(exc).__name__}: {exc}") from exc
        elapsed = time.perf_counter() - start
        completed, failed = len(result["completed_operations"]), len(result["failed_operations"])
        if failed or completed != shape.nodes:
            raise RunNotCompleted(f"{completed} of {shape.nodes} nodes completed, {failed} failed")
        return elapsed


# -- LangGraph, the other in-process peer ---------------------------------------------------

class LangGraphState(TypedDict, total=False):
    """A LangGraph run's state: every node's result (appended, in settling order), the root's requests."""

    results: Annotated[list, operator.add]
    requests: list[str]


def _langgraph_node(results_key: str = "results") -> Callable[[dict[str, Any]], Any]:
    """A LangGraph node that sleeps the ``seconds`` it is sent and adds its ``result`` to the state."""

    async def sleep(arguments: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(arguments["seconds"])
        return {results_key: [arguments["result"]]}

    return sleep


class LangGraphRunner:
    """Runs shapes as LangGraph ``StateGraph``s, in this process and event loop.

    The same work in LangGraph's own terms: a fan-out is one ``Send`` per node from the
    start (what LangGraph offers for a map of unknown width); a chain is N nodes joined
    by edges; the aggregation node follows every sent node; the returned spawns are the
    root's ``Send``s, each child handed the root's result (its requests), as the other two
    libraries hand it. Capacity is LangGraph's ``max_concurrency``. Every node adds its
    result to one list (an ``operator.add`` reducer), which is how completion is checked.
    The graph is built and compiled before the clock starts, as the others' graphs are.
    """

    name = "langgraph"

    def __init__(self, timeout: float) -> None:
        from langgraph.graph import END, START, StateGraph
        from langgraph.types import Send

        self.StateGraph, self.Send, self.START, self.END = StateGraph, Send, START, END
        self.timeout = timeout

    def unsupported(self, shape: Shape) -> str | None:
        if shape.kind == "spawns-emitted":
            return "a LangGraph node starts others only through what it returns (Send), not while it runs"
        return None

    def compile(self, shape: Shape) -> Any:
        graph, Send, START, END = self.StateGraph(LangGraphState), self.Send, self.START, self.END
        sleep = _langgraph_node()
        if shape.kind == "chain":
            names = [f"link-{index}" for index in range(shape.width)]
            for index, name in enumerate(names):
                graph.add_node(name, _langgraph_link(sleep, shape.latency, index))
            graph.add_edge(START, names[0])
            for head, tail in zip(names, names[1:], strict=False):
                graph.add_edge(head, tail)
            graph.add_edge(names[-1], END)
        elif shape.kind == "spawns-returned":
            async def root(state: dict[str, Any]) -> dict[str, Any]:
                return {"requests": [f"spawned {index}" for index in range(shape.width)], "results": ["root"]}

            def children(state: dict[str, Any]) -> list[Any]:
                requests = state["requests"]
                return [Send("child", {"seconds": shape.latency, "result": request, "context": requests})
                        for request in requests]

            graph.add_node("root", root)
            graph.add_node("child", sleep)
            graph.add_edge(START, "root")
            graph.add_conditional_edges("root", children, ["child"])
            graph.add_edge("child", END)
        else:
            def leaves(state: dict[str, Any]) -> list[Any]:
                return [Send("leaf", {"seconds": shape.latency, "result": index}) for index in range(shape.width)]

            graph.add_node("leaf", sleep)
            graph.add_conditional_edges(START, leaves, ["leaf"])
            if shape.kind == "aggregation":
                graph.add_node("aggregate", _langgraph_link(sleep, shape.latency, "aggregate"))
                graph.add_edge("leaf", "aggregate")
                graph.add_edge("aggregate", END)
            else:
                graph.add_edge("leaf", END)
        return graph.compile()

    async def run(self, shape: Shape) -> float:
        compiled = self.compile(shape)
        config = {"max_concurrency": shape.capacity, "recursion_limit": shape.width + 10}
        start = time.perf_counter()
        try:
            state = await asyncio.wait_for(compiled.ainvoke({"results": []}, config=config), self.timeout)
        except TimeoutError:
            raise
        except Exception as exc:  # the foreign library's own error, translated once here
            raise RunNotCompleted(f"{type(exc).__name__}: {exc}") from exc
        elapsed = time.perf_counter() - start
        settled = len(state.get("results", ()))
        if settled != shape.nodes:
            raise RunNotCompleted(f"{settled} of {shape.nodes} nodes completed")
        return elapsed


def _langgraph_link(sleep: Callable[[dict[str, Any]], Any], seconds: float, result: Any) -> Callable[..., Any]:
    """A node of a fixed graph (a chain link, the aggregation): sleeps ``seconds``, adds ``result``."""

    async def link(state: dict[str, Any]) -> dict[str, Any]:
        return await sleep({"seconds": seconds, "result": result})

    return link


# -- measuring ----------------------------------------------------------------------------

@dataclass
class Outcome:
    """One library's runs of one shape: the wall seconds of each, or why they stopped."""

    status: str = "ok"  # "ok", "timeout", "failed" or "n/a" (the library cannot run the shape)
    seconds: list[float] = field(default_factory=list)
    reason: str = ""

    @property
    def median(self) -> float | None:
        return statistics.median(self.seconds) if self.status == "ok" and self.seconds else None

    def figures(self, shape: Shape) -> dict[str, Any]:
        median = self.median
        return {
            "status": self.status,
            "reason": self.reason,
            "seconds": self.seconds,
            "median_seconds": median,
            "nodes_per_second": shape.nodes / median if median else None,
            "ratio_to_ideal": median / shape.ideal if median and shape.ideal else None,
            # A chain's time beyond its ideal, per link: what each hop from one call to the next costs.
            "per_link_overhead_ms": 1000 * (median - shape.ideal) / shape.width
            if median and shape.kind == "chain" else None,
        }


async def measure_shape(shape: Shape, runners: Sequence[Any], repeat: int) -> dict[str, Outcome]:
    """Run ``shape`` ``repeat`` times per library, interleaved so both see the same machine load.

    The order alternates from one repeat to the next (A B, B A, ...): whoever went first
    would otherwise always take the shape's first-run costs (a heap grown to the new size,
    a database file extended)."""
    outcomes = {runner.name: Outcome() for runner in runners}
    for runner in runners:
        reason = runner.unsupported(shape)
        if reason is not None:
            outcomes[runner.name] = Outcome("n/a", reason=reason)
    for index in range(repeat):
        for runner in (runners if index % 2 == 0 else runners[::-1]):
            outcome = outcomes[runner.name]
            if outcome.status != "ok":
                continue  # a timed-out or failed library gets no further runs of this shape
            start = time.perf_counter()
            try:
                outcome.seconds.append(await runner.run(shape))
            except TimeoutError:
                outcome.status = "timeout"
                outcome.reason = (f"a run exceeded the {runner.timeout:g} s budget "
                                  f"(stopped after {time.perf_counter() - start:.0f} s)")
            except RunNotCompleted as exc:
                outcome.status, outcome.reason = "failed", str(exc)
    return outcomes


def table(shapes: Sequence[Shape], results: list[dict[str, Outcome]], names: Sequence[str]) -> list[str]:
    """The aligned figures table, then one note per run that did not finish."""
    header = ["shape", "nodes", "ideal s"]
    for name in names:
        header += [f"{name} s", f"{name} nodes/s", f"{name}/ideal"]
    header += [f"{names[0]}/{peer}" for peer in names[1:]]
    rows, notes = [header], []
    for shape, outcomes in zip(shapes, results, strict=True):
        row = [shape.label, f"{shape.nodes:,}", f"{shape.ideal:.2f}" if shape.ideal else "-"]
        for name in names:
            outcome = outcomes[name]
            figures = outcome.figures(shape)
            if outcome.median is None:
                row += [outcome.status, "-", "-"]
                notes.append(f"{name} {shape.key}: {outcome.status}: {outcome.reason}")
                continue
            ratio = figures["ratio_to_ideal"]
            row += [f"{outcome.median:.2f}", f"{figures['nodes_per_second']:,.0f}",
                    f"{ratio:.2f}x" if ratio else "-"]
        first = outcomes[names[0]].median
        for peer in names[1:]:
            second = outcomes[peer].median
            row.append(f"{first / second:.2f}x" if first and second else "-")
        rows.append(row)
        if shape.kind == "chain":
            overheads = [f"{name} {outcomes[name].figures(shape)['per_link_overhead_ms']:.2f} ms" for name in names
                         if outcomes[name].median is not None]
            if overheads:
                notes.append(f"{shape.label}: per-link overhead (wall time beyond the ideal, per link): "
                             + ", ".join(overheads))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                       for column, (cell, width) in enumerate(zip(row, widths, strict=True))) for row in rows]
    return lines + notes


def machine() -> dict[str, Any]:
    described = {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                 "ray": ray.__version__, "opgraph": version("opgraph")}
    for peer in ("lionagi", "langgraph"):
        if peer in sys.modules:
            described[peer] = version(peer)
    return described


async def run(args: argparse.Namespace, shapes: list[Shape], session: Session, ray_start: float) -> int:
    runners: list[Any] = [OpgraphRunner(session, args.timeout)]
    if args.compare == "durability":  # the same runtime, each run logged or not: the cost of durability
        runners = [OpgraphRunner(session, args.timeout, name="durable"),
                   OpgraphRunner(session, args.timeout, name="volatile", durable=False)]
    for peer in args.compare if isinstance(args.compare, list) else ():
        if peer == "lionagi":
            runners.append(LionagiRunner(args.compare_timeout))
        elif peer == "langgraph":
            runners.append(LangGraphRunner(args.compare_timeout))
    names = [runner.name for runner in runners]
    described = machine()
    print(f"opgraph bench: median of {args.repeat} run(s) per shape, wall seconds of flow(); "
          f"embedded Ray start excluded ({ray_start:.1f} s)")
    print("machine: " + ", ".join(f"{key} {value}" for key, value in described.items()))
    for peer in names[1:]:
        print(f"{names[0]}/{peer}: ratio of median wall times (below 1: {names[0]} is faster); "
              f"budget per {peer} run {args.compare_timeout:g} s")
    # Warm-up, not timed: the first runs ship operations and warm every actor and import.
    for kind in ("fanout", "spawns-emitted", "spawns-returned"):
        await measure_shape(Shape("warm-up", kind, 100, 0.0, 100), runners, 1)
    results = []
    for shape in shapes:
        outcomes = await measure_shape(shape, runners, args.repeat)
        results.append(outcomes)
        done = ", ".join(f"{name} {outcomes[name].median:.2f} s" if outcomes[name].median is not None
                         else f"{name} {outcomes[name].status}" for name in names)
        print(f"measured {shape.label}: {done}", file=sys.stderr, flush=True)
    print("\n".join(table(shapes, results, names)))
    if args.json:
        document = {"repeat": args.repeat, "machine": described, "ray_start_seconds": ray_start, "libraries": names,
                    "shapes": [{**asdict(shape), "label": shape.label, "nodes": shape.nodes,
                                "ideal_seconds": shape.ideal,
                                "results": {name: outcomes[name].figures(shape) for name in names}}
                               for shape, outcomes in zip(shapes, results, strict=True)]}
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    return 0 if all(outcomes[names[0]].status == "ok" for outcomes in results) else 1


PEERS = ("lionagi", "langgraph")  # in-process libraries --compare runs beside opgraph
ENGINES = "engines"  # not a graph shape: the domain engines' benchmark (bench/engines.py)
MAP = "map"  # not a graph shape: dataset jobs (bench/map.py), each in a client and a Ray of its own
CONSOLE = "console"  # not a graph shape: the run console in Chromium (bench/console.py), on a Ray of its own
PLANNED = "planned"  # not a graph shape: the planned lane's 700-op plan (bench/planned.py), beside a plain fan-out
HTTP, HTTP_STREAM = "http", "http-stream"  # chat calls over HTTP beside plain clients and peers (bench/http_calls.py)


def _peers(text: str) -> list[str] | str:
    """``--compare``: 'durability' alone, or one or more of PEERS, comma-separated, in that order."""
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if chosen == ["durability"]:
        return "durability"
    unknown = [name for name in chosen if name not in PEERS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose 'durability', or one or more of {', '.join(PEERS)} "
                                         f"(comma-separated); got {text!r}")
    return list(dict.fromkeys(chosen))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opgraph bench",
        description="Benchmark the standard graph shapes on the embedded local Ray (median of --repeat runs), "
                    "optionally beside lionagi and LangGraph in the same process.")
    keys = [shape.key for shape in standard_shapes()]
    parser.add_argument("--shapes", default=",".join(keys),
                        help=f"comma-separated subset of: {', '.join(keys)} (default: all); or {ENGINES}: each "
                             f"domain engine on sim/ against the critical path its record implies; or {MAP}: "
                             "dataset jobs (`opgraph map`) of 100,000 and 1,000,000 rows, and one killed twice; or "
                             f"{CONSOLE}: the run console in Chromium (a finished and a live --nodes fan-out); or "

                             f"{HTTP} and {HTTP_STREAM}: 10,000 chat calls through opgraph's openai/ provider to a "
                             "local OpenAI-compatible server (log-normal latencies, median 1 s), beside bare aiohttp, "
                             "the openai client and the --compare peers, against the ideal makespan; or "
                             f"{PLANNED}: the planned lane's plan of 700 ops (200 assigned, 500 spawned) at 100 in "
                             "flight, beside a plain fan-out of 700")
    parser.add_argument("--engines", default=None, metavar="KINDS",
                        help=f"with --shapes {ENGINES}: a comma-separated subset of the engines (default: all)")
    parser.add_argument("--engine-latency", type=float, default=0.2, metavar="SECONDS",
                        help=f"with --shapes {ENGINES}: sim/ seconds per model call (0.2)")
    parser.add_argument("--map-sizes", default="100000,1000000", metavar="ROWS",
                        help=f"with --shapes {MAP}: rows of each dataset job, smallest first (100000,1000000)")
    parser.add_argument("--map-concurrency", type=int, default=1000, metavar="N",
                        help=f"with --shapes {MAP}: model calls in flight (1000)")
    parser.add_argument("--map-kill-rows", type=int, default=100_000, metavar="ROWS",
                        help=f"with --shapes {MAP}: rows of the job killed twice and run again (100000)")
    parser.add_argument("--map-parts", default="speed,zero,kills", metavar="PARTS",
                        help=f"with --shapes {MAP}: speed (each size at 50 ms, every process's peak memory), zero "
                             "(the largest at 0 ms), kills (default: all)")
    parser.add_argument("--planned-latency", type=float, default=0.05, metavar="SECONDS",
                        help=f"with --shapes {PLANNED}: seconds each of the plan's ops takes (0.05)")
    parser.add_argument("--http-calls", type=int, default=10_000, metavar="N",
                        help=f"with --shapes {HTTP}/{HTTP_STREAM}: chat calls (10000)")
    parser.add_argument("--http-concurrency", type=int, default=500, metavar="N",
                        help=f"with --shapes {HTTP}/{HTTP_STREAM}: calls in flight (500)")
    parser.add_argument("--http-scale", type=float, default=1.0, metavar="SECONDS",
                        help=f"with --shapes {HTTP}/{HTTP_STREAM}: the server's median latency (1.0; p99 ~8x it)")
    parser.add_argument("--http-clients", default="aiohttp,openai,opgraph", metavar="CLIENTS",
                        help=f"with --shapes {HTTP}/{HTTP_STREAM}: clients beside the --compare peers "
                             "(aiohttp,openai,opgraph)")
    parser.add_argument("--http-repeat", type=int, default=1, metavar="N",
                        help=f"with --shapes {HTTP}/{HTTP_STREAM}: runs per client, median reported (1)")
    parser.add_argument("--nodes", type=int, default=10_000,
                        help="fan-out width; the chain and the spawns are a tenth of it (default 10000)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per shape, median reported (default 3)")
    parser.add_argument("--compare", type=_peers, default=None, metavar="PEERS",
                        help=f"also run every shape on lionagi and/or langgraph (comma-separated, side by side), in "
                             f"this process ({INSTALL_HINT}); or 'durability': every shape with its run logged and "
                             f"without, side by side")
    parser.add_argument("--compare-timeout", type=float, default=120.0,
                        help="seconds one run of a shape may take on the compared library (default 120)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one run of a shape may take on opgraph (default 600)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    return parser


# The shapes that are not graph shapes: each is its own benchmark, run beside the graph shapes.
EXTRA_SHAPES = (ENGINES, MAP, CONSOLE, HTTP, HTTP_STREAM, PLANNED)


@dataclass
class Selection:
    """What ``--shapes`` asked for: the graph shapes (``graphs``), and which other benchmarks (``extras``)."""

    graphs: list[str]
    extras: set[str]

    @property
    def http_streams(self) -> list[bool]:
        return [stream for key, stream in ((HTTP, False), (HTTP_STREAM, True)) if key in self.extras]

    def without_console(self) -> str:
        return ",".join(self.graphs + [key for key in EXTRA_SHAPES if key in self.extras and key != CONSOLE])


def _selection(parser: argparse.ArgumentParser, args: argparse.Namespace, catalogue: dict[str, Any]) -> Selection:
    """``--shapes`` and the options they need, checked (``parser.error`` on bad input)."""
    if args.nodes < 1 or args.repeat < 1:
        parser.error("--nodes and --repeat must be at least 1")
    keys = [key.strip() for key in args.shapes.split(",") if key.strip()]
    selection = Selection([key for key in keys if key not in EXTRA_SHAPES],
                          {key for key in keys if key in EXTRA_SHAPES})
    unknown = [key for key in selection.graphs if key not in catalogue]
    if unknown or not (selection.graphs or selection.extras):
        parser.error(f"unknown shape(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(catalogue)}"
                     f", {', '.join(EXTRA_SHAPES)}")
    if selection.http_streams and (args.http_calls < 1 or args.http_concurrency < 1 or args.http_repeat < 1
                                   or not args.http_scale > 0):
        parser.error("--http-calls, --http-concurrency and --http-repeat must be at least 1, --http-scale above 0")
    return selection


def _missing_peer(args: argparse.Namespace) -> str | None:
    """The first ``--compare`` peer whose package is not installed."""
    for peer in args.compare if isinstance(args.compare, list) else ():
        if peer in PEERS:
            try:
                importlib.import_module(peer)
            except ImportError:
                return peer
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    catalogue = {shape.key: shape for shape in standard_shapes(args.nodes)}
    selection = _selection(parser, args, catalogue)
    extras = selection.extras
    if CONSOLE in extras:  # the console's figures last, on a Ray of their own (after this one stopped)
        args.shapes = selection.without_console()
        status = main(_without_console(argv or sys.argv[1:], args.shapes)) if args.shapes else 0
        return max(status, _console(args))
    if not (selection.graphs or extras & {ENGINES, PLANNED}):  # these start their own servers, clients and Rays
        status = _http_calls(args, selection.http_streams) if selection.http_streams else 0
        return max(status, _dataset_jobs(args)) if MAP in extras else status
    peer = _missing_peer(args)
    if peer is not None:
        print(f"opgraph bench: --compare {peer} needs the {peer} package: {INSTALL_HINT}", file=sys.stderr)
        return 2
    # Join a Ray that is already up (a test's shared one) and leave it up; stop only our own.
    started_ray = not ray.is_initialized()
    start = time.perf_counter()
    try:
        session = Session()
        ray.get(session.runtime.executor.ping.remote())
        ray_start = time.perf_counter() - start
        graphs = [catalogue[key] for key in selection.graphs]
        status = asyncio.run(run(args, graphs, session, ray_start)) if graphs else 0
        if ENGINES in extras:
            status = max(status, _engines(args, session, separate_json=bool(graphs)))
        if PLANNED in extras:
            status = max(status, _planned_lane(args, session))
        if selection.http_streams:
            status = max(status, _http_calls(args, selection.http_streams))
        if MAP in extras:
            status = max(status, _dataset_jobs(args))
        return status
    finally:
        if started_ray:
            ray.shutdown()


def _engines(args: argparse.Namespace, session: Session, *, separate_json: bool) -> int:
    """The engines benchmark on this session (its figures in ``--json``, or beside it with graph shapes)."""
    from .engines import main as engines_main

    argv = ["--repeat", str(args.repeat), "--latency", str(args.engine_latency)]
    if args.engines:
        argv += ["--engines", args.engines]
    if args.json:
        root, dot, suffix = args.json.rpartition(".")
        argv += ["--json", f"{root}-engines.{suffix}" if separate_json and dot else
                 (f"{args.json}-engines" if separate_json else args.json)]
    return engines_main(argv, session=session)


def _without_console(argv: Sequence[str], shapes: str) -> list[str]:
    """``argv`` with ``--shapes`` given as ``shapes`` (the console's taken out)."""
    out, skip = [], False
    for index, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item == "--shapes":
            out += ["--shapes", shapes]
            skip = index + 1 < len(argv)
        elif item.startswith("--shapes="):
            out.append(f"--shapes={shapes}")
        else:
            out.append(item)
    return out


def _console(args: argparse.Namespace) -> int:
    """The console's benchmark (bench/console.py): a finished and a live ``--nodes`` fan-out in Chromium."""
    from .console import main as console_main

    argv = ["--width", str(args.nodes), "--live-width", str(args.nodes)]
    if args.json:
        root, dot, suffix = args.json.rpartition(".")
        argv += ["--json", f"{root}-console.{suffix}" if dot else f"{args.json}-console"]
    return console_main(argv)


def _planned_lane(args: argparse.Namespace, session: Session) -> int:
    """The planned lane's 700-op plan (bench/planned.py), ``--repeat`` runs, beside a fan-out of as
    many ``sleep`` nodes at the same concurrency through ``Session.flow`` in the same run (the baseline)."""
    from .planned import large_plan_figures

    figures = large_plan_figures(session, args.repeat, latency=args.planned_latency)
    if args.json:
        root, dot, suffix = args.json.rpartition(".")
        with open(f"{root}-planned.{suffix}" if dot else f"{args.json}-planned", "w") as handle:
            json.dump(figures, handle, indent=2)
    return 0 if figures["status"] == "completed" else 1


def _http_calls(args: argparse.Namespace, streams: list[bool]) -> int:
    """The HTTP-shaped benchmark (bench/http_calls.py), its figures in ``--json`` (or beside it)."""
    from .http_calls import build_parser as http_parser
    from .http_calls import run_benchmarks

    argv = ["--calls", str(args.http_calls), "--concurrency", str(args.http_concurrency), "--scale",
            str(args.http_scale), "--clients", args.http_clients, "--repeat", str(args.http_repeat),
            "--timeout", str(max(args.timeout, args.compare_timeout))]
    if isinstance(args.compare, list):
        argv += ["--compare", ",".join(args.compare)]
    if args.json:
        root, dot, suffix = args.json.rpartition(".")
        argv += ["--json", f"{root}-http.{suffix}" if dot else f"{args.json}-http"]
    return run_benchmarks(http_parser().parse_args(argv), streams)


def _dataset_jobs(args: argparse.Namespace) -> int:
    """The dataset jobs' benchmark (bench/map.py), with its figures in ``--json`` (or beside it)."""
    from .map import main as map_main

    argv = ["--sizes", args.map_sizes, "--concurrency", str(args.map_concurrency), "--kill-rows",
            str(args.map_kill_rows), "--parts", args.map_parts]
    if args.json:
        root, dot, suffix = args.json.rpartition(".")
        argv += ["--json", f"{root}-map.{suffix}" if dot else f"{args.json}-map"]
    return map_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
