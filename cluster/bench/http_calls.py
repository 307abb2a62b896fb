"""The HTTP-shaped benchmark (`opgraph bench --shapes http,http-stream`): 10,000 chat calls to a
local OpenAI-compatible server, through opgraph's real ``openai/`` provider path and beside
the peers and plain clients, against the ideal makespan of the server's own latencies.

Owns the clients' side only: each client runs the same calls ("item 0".."item N-1") at the
same concurrency against one server process (``http_server.py``), and is measured the same
way: wall time, CPU of every process the client uses (opgraph: the driver and its Ray
actors; Ray's own daemons are shown apart), and for each call the time to its first token
beyond the latency the server was told to wait. It must not tune the runtime: opgraph runs
a fan-out through ``Session.flow`` with one registered operation that calls ``openai/``.

    python -m opgraph.cluster.bench.http_calls [--calls 10000] [--concurrency 500] [--stream]
        [--clients opgraph,aiohttp,openai] [--compare lionagi,langgraph] [--repeat 1] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import operator
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypedDict

import psutil

from .http_server import DEFAULT_SEED, ideal_makespan, latencies

__all__ = ["CLIENTS", "ChatServer", "Measured", "build_parser", "main"]

MODEL = "bench"
CALL = "http_bench_call"
CLIENTS = ("aiohttp", "openai", "opgraph", "lionagi", "langgraph")
BASELINES = ("aiohttp", "openai")
# The openai client's own default but for its 5 s connect deadline: opening 500 connections on a
# loaded machine took longer, and the run failed on APITimeoutError (its retries did not save it).
OPENAI_TIMEOUT = 600.0


class ChatServer:
    """``with ChatServer(seed, scale) as server:`` the server process on 127.0.0.1; ``server.base_url``."""

    def __init__(self, seed: int = DEFAULT_SEED, scale: float = 1.0) -> None:
        self.seed, self.scale = seed, scale
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ChatServer:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "opgraph.cluster.bench.http_server", "--seed", str(self.seed),
             "--scale", str(self.scale)], stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline() if self.process.stdout else ""
        if not line.startswith("port "):
            self.__exit__()
            raise RuntimeError(f"the benchmark's chat server did not start (it printed {line!r})")
        self.port = int(line.split()[1])
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    @property
    def cpu_seconds(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times() if self.process else None
        return times.user + times.system if times else 0.0


@dataclass
class Measured:
    """One client's run: wall seconds, CPU seconds by process role, and each call's first-token time."""

    elapsed: float
    cpu: dict[str, float]
    first_token: dict[int, float] = field(default_factory=dict)  # index -> seconds from the call's start

    def client_cpu(self) -> float:
        return sum(seconds for role, seconds in self.cpu.items() if role != "ray daemons")


IN_PROCESS = ("driver",)  # the roles an in-process client's CPU is counted from

# -- CPU of a client's processes ----------------------------------------------------------

def _role(process: psutil.Process) -> str:
    if process.pid == os.getpid():
        return "driver"
    try:
        name = " ".join(process.cmdline()[:1]) or process.name()
    except psutil.Error:
        return "gone"
    # An actor's process title names the method it runs ("ray::OperationWorker.forget"): keep the class.
    return name.split()[0].split(".")[0] if name.startswith("ray::") else "ray daemons"


def _cpu_by_pid() -> dict[int, tuple[str, float]]:
    """This process and every descendant (an embedded Ray's daemons and workers): role and CPU seconds."""
    me = psutil.Process()
    seen = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            seen[process.pid] = (_role(process), times.user + times.system)
        except psutil.Error:
            continue
    return seen


def _cpu_spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent


async def measured(run: Callable[[], Awaitable[dict[int, float]]], in_process: bool) -> Measured:
    """``run()`` timed; its CPU from this process alone (``in_process``) or from every descendant too."""
    before = _cpu_by_pid()
    started = time.perf_counter()
    first_token = await run()
    elapsed = time.perf_counter() - started
    spent = _cpu_spent(before, _cpu_by_pid())
    if in_process:  # an embedded Ray idles beside an in-process client: not that client's CPU
        spent = {role: seconds for role, seconds in spent.items() if role in IN_PROCESS}
    return Measured(elapsed, spent, first_token)


async def _in_order(calls: int, concurrency: int, one: Callable[[int], Awaitable[float]]) -> dict[int, float]:
    """Run ``one(index)`` for every index, ``concurrency`` at a time, started in index order."""
    first_token: dict[int, float] = {}
    indexes = iter(range(calls))

    async def lane() -> None:
        for index in indexes:
            first_token[index] = await one(index)

    await asyncio.gather(*(lane() for _ in range(min(concurrency, calls))))
    return first_token


def _messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"item {index}"}]


# -- the plain clients ----------------------------------------------------------------------

async def run_aiohttp(base_url: str, calls: int, concurrency: int, stream: bool) -> dict[int, float]:
    import aiohttp

    url = base_url + "/chat/completions"
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:
        async def one(index: int) -> float:
            started = time.perf_counter()
            body = {"model": MODEL, "messages": _messages(index), "stream": stream}
            async with client.post(url, json=body) as response:
                response.raise_for_status()
                if not stream:
                    answer = await response.json()
                    assert answer["choices"][0]["message"]["content"]
                    return time.perf_counter() - started
                first = None
                async for line in response.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - started
                return first if first is not None else float("nan")

        return await _in_order(calls, concurrency, one)


async def run_openai(base_url: str, calls: int, concurrency: int, stream: bool) -> dict[int, float]:
    """The official client as a user makes it (its own connection pool: 1,000 connections, 100 kept alive)."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", timeout=OPENAI_TIMEOUT) as client:
        async def one(index: int) -> float:
            return await _openai_call(client, index, stream)

        return await _in_order(calls, concurrency, one)


async def _openai_call(client: Any, index: int, stream: bool) -> float:
    started = time.perf_counter()
    if not stream:
        answer = await client.chat.completions.create(model=MODEL, messages=_messages(index))
        assert answer.choices[0].message.content
        return time.perf_counter() - started
    first = None
    chunks = await client.chat.completions.create(model=MODEL, messages=_messages(index), stream=True)
    async for _chunk in chunks:
        if first is None:
            first = time.perf_counter() - started
    return first if first is not None else float("nan")


# -- the peers -------------------------------------------------------------------------------

def lionagi_token_counting() -> str:
    """Give lionagi the ``o200k_base`` file it counts tokens with, rebuilt from js-tiktoken into the test
    cache (it cannot be downloaded here); else turn its counting off. Returns what was done, to print.

    Without the file, lionagi tries the download on every call and counts 0 when it fails:
    a network round trip per call that is no part of what is measured."""
    from .tiktoken_file import ensure_o200k_base

    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return f"lionagi counts tokens with tiktoken's files in TIKTOKEN_CACHE_DIR={os.environ['TIKTOKEN_CACHE_DIR']}"
    cache = os.environ.get("OPGRAPH_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "opgraph")
    try:
        os.environ["TIKTOKEN_CACHE_DIR"] = ensure_o200k_base(os.path.join(cache, "tiktoken"),
                                                             os.path.join(cache, "js-tiktoken"))
        return (f"lionagi counts tokens with o200k_base rebuilt from js-tiktoken (tiktoken's pinned SHA-256), "
                f"in {os.environ['TIKTOKEN_CACHE_DIR']}")
    except ValueError as exc:
        from lionagi.service.token_calculator import TokenCalculator

        TokenCalculator.calculate_message_tokens = staticmethod(lambda messages, /, **kwargs: 0)
        return f"lionagi's token counting is OFF (counts 0): o200k_base could not be made here: {exc}"


async def run_lionagi(base_url: str, calls: int, concurrency: int, stream: bool) -> dict[int, float]:
    from lionagi import iModel

    model = iModel(provider="openai", model=MODEL, base_url=base_url, api_key="bench", allow_local_network=True,
                   concurrency_limit=concurrency, queue_capacity=concurrency, limit_requests=calls * 10,
                   limit_tokens=calls * 10_000)

    async def one(index: int) -> float:
        started = time.perf_counter()
        if stream:
            first = None
            async for _chunk in model.stream(messages=_messages(index)):
                if first is None:
                    first = time.perf_counter() - started
            return first if first is not None else float("nan")
        calling = await model.invoke(messages=_messages(index))
        if calling.response is None:
            raise RuntimeError(f"lionagi call {index} got no response: {calling.execution.error}")
        return time.perf_counter() - started

    return await _in_order(calls, concurrency, one)


class LangGraphCalls(TypedDict, total=False):
    """The LangGraph run's state: each call's (index, seconds to first token), appended."""

    first_token: Annotated[list, operator.add]


async def run_langgraph(base_url: str, calls: int, concurrency: int, stream: bool) -> dict[int, float]:
    """A ``Send`` fan-out; each node calls the official ``openai`` client (LangGraph's own integrations
    wrap it); ``max_concurrency`` is the concurrency."""
    import openai
    from langgraph.graph import END, START, StateGraph
    from langgraph.types import Send

    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", timeout=OPENAI_TIMEOUT) as client:
        async def call(arguments: dict[str, Any]) -> dict[str, Any]:
            index = arguments["index"]
            return {"first_token": [(index, await _openai_call(client, index, stream))]}

        graph = StateGraph(LangGraphCalls)
        graph.add_node("call", call)
        graph.add_conditional_edges(START, lambda state: [Send("call", {"index": i}) for i in range(calls)], ["call"])
        graph.add_edge("call", END)
        compiled = graph.compile()
        state = await compiled.ainvoke({"first_token": []},
                                       config={"max_concurrency": concurrency, "recursion_limit": calls + 10})
    return dict(state["first_token"])


# -- opgraph ---------------------------------------------------------------------------------

async def opgraph_call(branch: Any, index: int = 0, stream: bool = False, **parameters: Any) -> float:
    """One chat call through the run's ``openai/`` provider; returns the seconds to its first token."""
    from opgraph.actors.models import ChatRequest

    started = time.perf_counter()
    response = await branch.provider_for(f"openai/{MODEL}").complete(
        ChatRequest(f"openai/{MODEL}", _messages(index), stream=stream))
    if not response.content:
        raise RuntimeError(f"call {index} got an empty answer")
    first = response.first_token_seconds
    return first if first is not None else time.perf_counter() - started


class OpgraphClient:
    """A fan-out of ``calls`` nodes at ``max_concurrent=concurrency`` on one Session, started once."""

    def __init__(self, base_url: str) -> None:
        import ray

        from opgraph.actors import Session
        from opgraph.actors.providers import OpenAICompatibleProvider

        os.environ["OPENAI_BASE_URL"] = base_url  # a Ray started here gives its workers this environment
        self.started_ray = not ray.is_initialized()
        self.warm = False
        self.session = Session()
        self.session.register_operation(CALL, opgraph_call, record_turn=False)
        self.session.register_provider("openai", OpenAICompatibleProvider(base_url, api_key="bench"))

    async def run(self, calls: int, concurrency: int, stream: bool) -> dict[int, float]:
        from opgraph.kernel import Graph, create_operation

        graph = Graph("http-calls")
        ids = [graph.add_node(create_operation(CALL, {"index": index, "stream": stream})).id for index in range(calls)]
        envelope = await self.session.flow(graph, max_concurrent=concurrency, durable=False)
        statuses, results = envelope["operation_statuses"], envelope.get("operation_results", {})
        failed = [node_id for node_id in ids if statuses.get(node_id) != "completed"]
        if failed:
            raise RuntimeError(f"opgraph: {len(failed)} of {calls} calls did not complete; first: "
                               f"{results.get(failed[0])!r:.300}")
        return {index: results[node_id] for index, node_id in enumerate(ids)}

    def close(self) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()


# -- measuring and printing ---------------------------------------------------------------

def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def figures(measure: Measured, waits: Sequence[float], ideal: float, calls: int) -> dict[str, Any]:
    added = [measure.first_token[index] - waits[index] for index in measure.first_token]
    return {"seconds": measure.elapsed, "ratio": measure.elapsed / ideal,
            "cpu_ms_per_call": 1000 * measure.client_cpu() / calls,
            "cpu_ms_by_role": {role: round(1000 * seconds / calls, 3) for role, seconds in measure.cpu.items()},
            "ttft_added_p50_ms": 1000 * _percentile(added, 0.5), "ttft_added_p99_ms": 1000 * _percentile(added, 0.99),
            "calls_answered": len(measure.first_token)}


def table(rows: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    header = ["client", "runs", "median s", "ratio to ideal", "client CPU ms/call", "TTFT added p50 ms", "p99 ms"]
    lines = [header]
    for name, runs in rows:
        if not runs:
            continue
        pick = statistics.median
        lines.append([name, str(len(runs)), f"{pick(r['seconds'] for r in runs):.2f}",
                      f"{pick(r['ratio'] for r in runs):.3f}", f"{pick(r['cpu_ms_per_call'] for r in runs):.2f}",
                      f"{pick(r['ttft_added_p50_ms'] for r in runs):.0f}",
                      f"{pick(r['ttft_added_p99_ms'] for r in runs):.0f}"])
    widths = [max(len(row[column]) for row in lines) for column in range(len(header))]
    return ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                      for column, (cell, width) in enumerate(zip(row, widths, strict=True))) for row in lines]


async def bench(args: argparse.Namespace, stream: bool, server: ChatServer, opgraph: OpgraphClient | None,
                out: Callable[[str], None]) -> dict[str, Any]:
    waits = latencies(args.seed, args.calls, args.scale)
    tail = 20 * 0.010 if stream else 0.0
    ideal = ideal_makespan(waits, args.concurrency, tail)
    label = "streamed" if stream else "non-streaming"
    out(f"http {label}: {args.calls:,} chat calls at concurrency {args.concurrency}, latencies log-normal "
        f"(median {args.scale:g} s, p99 ~{8 * args.scale:g} s, seed {args.seed}); ideal makespan {ideal:.2f} s"
        + (" (the 20 chunks' 0.2 s included)" if stream else ""))
    runners: dict[str, Callable[[], Awaitable[dict[int, float]]]] = {}
    for name in args.clients:
        if name == "opgraph" and opgraph is not None:
            runners[name] = lambda: opgraph.run(args.calls, args.concurrency, stream)
        elif name != "opgraph":
            function = globals()[f"run_{name}"]
            runners[name] = (lambda function=function: function(server.base_url, args.calls, args.concurrency,
                                                                 stream))
    if opgraph is not None and not opgraph.warm:  # untimed: the first run ships the operation and starts workers
        await opgraph.run(min(args.calls, 20), args.concurrency, stream)
        opgraph.warm = True
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    failures: dict[str, str] = {}
    for repeat in range(args.repeat):
        for name, run in (runners.items() if repeat % 2 == 0 else reversed(runners.items())):
            if name in failures:
                continue
            try:
                measure = await asyncio.wait_for(measured(run, in_process=name != "opgraph"), args.timeout)
            except Exception as exc:  # noqa: BLE001 - a client that fails is printed as failed, the rest go on
                failures[name] = f"{type(exc).__name__}: {exc}"[:300]
                out(f"  {name}: failed: {failures[name]}")
                continue
            result = figures(measure, waits, ideal, args.calls)
            results[name].append(result)
            roles = ", ".join(f"{role} {ms:.2f}" for role, ms in result["cpu_ms_by_role"].items() if ms >= 0.01)
            out(f"  {name} run {repeat + 1}: {result['seconds']:.2f} s ({result['ratio']:.3f}x ideal), CPU ms/call "
                f"by process: {roles}; load {os.getloadavg()[0]:.2f}")
    for line in table([(name, runs) for name, runs in results.items()]):
        out(line)
    if "ray daemons" in (results.get("opgraph") or [{}])[0].get("cpu_ms_by_role", {}):
        out("client CPU counts every process the client runs in (opgraph: driver, executor, workers, branch store); "
            "Ray's own daemons (raylet, GCS, dashboard) are left out and shown per run above")
    out("TTFT added: each call's time to its first token minus the latency the server waited, over all calls")
    return {"stream": stream, "ideal_seconds": ideal, "results": results, "failures": failures}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.http_calls")
    add_arguments(parser)
    parser.add_argument("--stream", action="store_true", help="streamed calls instead of whole answers")
    parser.add_argument("--both", action="store_true", help="non-streaming, then streamed")
    return parser


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    parser.add_argument(f"--{prefix}calls", dest="calls", type=int, default=10_000, help="chat calls (10000)")
    parser.add_argument(f"--{prefix}concurrency", dest="concurrency", type=int, default=500,
                        help="calls in flight (500)")
    parser.add_argument(f"--{prefix}scale", dest="scale", type=float, default=1.0,
                        help="median latency, seconds (1.0; the p99 is about 8 times it)")
    parser.add_argument(f"--{prefix}seed", dest="seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(f"--{prefix}clients", dest="clients", default="aiohttp,openai,opgraph",
                        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
                        help="clients to run beside the --compare peers (aiohttp,openai,opgraph)")
    if not prefix:
        parser.add_argument("--compare", default="", help="peers: lionagi,langgraph")
        parser.add_argument("--repeat", type=int, default=1)
        parser.add_argument("--timeout", type=float, default=600.0, help="seconds one client's run may take")
        parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")


def run_benchmarks(args: argparse.Namespace, streams: Sequence[bool], out: Callable[[str], None] = print) -> int:
    clients = list(dict.fromkeys(args.clients + [name.strip() for name in (args.compare or "").split(",")
                                                 if name.strip()]))
    unknown = [name for name in clients if name not in CLIENTS]
    if unknown:
        raise SystemExit(f"unknown client(s) {', '.join(unknown)}; choose from {', '.join(CLIENTS)}")
    args.clients = clients
    # lionagi's import sets the root logger to INFO (a provider module calls logging.basicConfig), and
    # httpx and its fork httpx2 (lionagi's client) then log every request: not what is measured.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if "lionagi" in clients:
        out(lionagi_token_counting())
    documents = []
    with ChatServer(args.seed, args.scale) as server:
        opgraph = OpgraphClient(server.base_url) if "opgraph" in clients else None
        try:
            server_cpu = server.cpu_seconds

            async def every_stream() -> None:
                for stream in streams:
                    documents.append(await bench(args, stream, server, opgraph, out))

            asyncio.run(every_stream())
            out(f"server CPU over all runs: {server.cpu_seconds - server_cpu:.1f} s; "
                f"load average {' '.join(f'{load:.2f}' for load in os.getloadavg())} on {os.cpu_count()} cores")
        finally:
            if opgraph is not None:
                opgraph.close()
    args.documents = documents
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"calls": args.calls, "concurrency": args.concurrency, "scale": args.scale, "seed": args.seed,
                       "cores": os.cpu_count(), "load_average": os.getloadavg(), "benchmarks": documents},
                      handle, indent=2)
    return 0 if all(not document["failures"] for document in documents) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    streams = [False, True] if args.both else [args.stream]
    return run_benchmarks(args, streams)


if __name__ == "__main__":
    raise SystemExit(main())
