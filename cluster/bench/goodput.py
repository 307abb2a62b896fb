"""Goodput under provider rate limits: a fan-out of model calls against a rate-limited
OpenAI-compatible server on 127.0.0.1, adaptive admission beside a fixed-concurrency baseline.

Owns the bench only: it starts ``RateLimitedChatServer``, registers one provider per mode
on the Session (so each mode learns from scratch) and prints, per mode, failed nodes, the
server's 429s and early retries, and achieved requests/s and tokens/s against what the
server allowed over the same run. Modes run one after another in one process and one Ray.

    python -m opgraph.cluster.bench.goodput [--nodes 2000] [--rpm 6000] [--tpm 240000]
        [--latency 0.2] [--fixed-concurrency 64] [--modes fixed,adaptive,budget]

The limits are scaled up from a real account's (say 500 RPM / 30,000 TPM) so 2,000 calls
take about half a minute per mode; the ratios do not depend on the scale.
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
from opgraph.actors.models import ChatRequest
from opgraph.actors.providers import OpenAICompatibleProvider, adaptive_statistics
from opgraph.kernel import Graph, create_operation

from .provider_server import RateLimitedChatServer

__all__ = ["build_parser", "goodput_call", "main", "run_mode"]

CALL = "goodput_call"
PROMPT_CHARACTERS = 160  # every request the same size, so tokens per request are constant


async def goodput_call(branch: Any, model: str = "", text: str = "", **parameters: Any) -> int:
    """One model call through the provider the run registered for ``model``; returns its tokens."""
    provider = branch.provider_for(model)
    response = await provider.complete(ChatRequest(model, [{"role": "user", "content": text}]))
    return response.usage.prompt_tokens + response.usage.completion_tokens


def fanout_of_calls(nodes: int, model: str) -> Graph:
    graph = Graph("goodput")
    for index in range(nodes):
        text = f"call {index:06d} ".ljust(PROMPT_CHARACTERS, ".")
        graph.add_node(create_operation(CALL, {"model": model, "text": text}))
    return graph


def provider_for(mode: str, name: str, server: RateLimitedChatServer,
                 fixed_concurrency: int) -> OpenAICompatibleProvider:
    if mode == "fixed":
        return OpenAICompatibleProvider(server.base_url, api_key="bench", name=name, adaptive=False,
                                        concurrency=fixed_concurrency)
    if mode == "adaptive":
        return OpenAICompatibleProvider(server.base_url, api_key="bench", name=name)
    if mode in ("budget", "warmup"):
        return OpenAICompatibleProvider(server.base_url, api_key="bench", name=name,
                                        requests_per_minute=server.rpm, tokens_per_minute=server.tpm)
    raise ValueError(f"unknown mode {mode!r}")


async def run_mode(session: Session, server: RateLimitedChatServer, mode: str, nodes: int,
                   fixed_concurrency: int, round_: int = 0) -> dict[str, Any]:
    """One fan-out in ``mode``; the figures of that run alone (the server is reset first).

    Each round's provider has a name of its own, so it learns from scratch (a cold start):
    the gate keeps what a provider learned for the runtime's life, by design.
    """
    name = f"goodput-{mode}-{round_}"
    session.register_provider(name, provider_for(mode, name, server, fixed_concurrency))
    server.reset()
    started_at = time.monotonic()
    started = time.perf_counter()
    envelope = await session.flow(fanout_of_calls(nodes, f"{name}/m"), max_concurrent=nodes)
    elapsed = time.perf_counter() - started
    counts = server.reset()
    statuses = list(envelope["operation_statuses"].values())
    tokens_per_request = counts.tokens / counts.accepted if counts.accepted else 1.0
    allowed = server.allowed_requests_per_second(tokens_per_request)
    gate = (await adaptive_statistics()).get(name, {})
    return {
        "mode": mode, "elapsed": elapsed, "completed": statuses.count("completed"),
        "failed": statuses.count("failed"), "accepted": counts.accepted, "rejected": counts.rejected,
        "early_retries": counts.early_retries, "requests_per_second": counts.accepted / elapsed,
        "tokens_per_second": counts.tokens / elapsed, "allowed_requests_per_second": allowed,
        "allowed_tokens_per_second": allowed * tokens_per_request,
        "goodput": counts.accepted / elapsed / allowed, "peak_in_flight": counts.peak_in_flight,
        "window": gate.get("window"), "gate": gate, "timeline": timeline(counts, started_at),
    }


def timeline(counts: Any, started_at: float) -> list[tuple[int, int]]:
    """Accepted calls and 429s in each second of the run."""
    seconds = int(max(counts.accepted_at + counts.rejected_at + [started_at]) - started_at) + 1
    accepted, rejected = [0] * seconds, [0] * seconds
    for at in counts.accepted_at:
        accepted[int(at - started_at)] += 1
    for at in counts.rejected_at:
        rejected[int(at - started_at)] += 1
    return list(zip(accepted, rejected, strict=True))


def line(result: dict[str, Any]) -> str:
    window = f", learned window {result['window']:g}" if result["window"] is not None else ""
    return (f"{result['mode']:>9}: {result['elapsed']:6.1f} s, completed {result['completed']:>5}, "
            f"failed nodes {result['failed']:>4}, "
            f"{result['requests_per_second']:6.1f} req/s of {result['allowed_requests_per_second']:.1f} allowed, "
            f"{result['tokens_per_second']:7.0f} tok/s of {result['allowed_tokens_per_second']:.0f}, "
            f"goodput {result['goodput']:.1%}, 429s {result['rejected']}, early retries {result['early_retries']}, "
            f"peak in flight {result['peak_in_flight']}{window}")


async def run(args: argparse.Namespace, session: Session) -> int:
    session.register_operation(CALL, goodput_call)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with RateLimitedChatServer(rpm=args.rpm, tpm=args.tpm, latency=args.latency,
                               completion_tokens=args.completion_tokens) as server:
        print(f"server: {args.rpm:g} RPM, {args.tpm:g} TPM, {args.latency * 1000:g} ms a call, "
              f"{args.nodes} calls a run, buckets of 1 s starting empty; fixed baseline at "
              f"{args.fixed_concurrency} in flight (429s among its 3 retries)")
        # Warm the runtime (workers import the providers, the limiter actor starts), as the
        # other benches leave cluster start out of their figures.
        await run_mode(session, server, "warmup", 50, args.fixed_concurrency)
        for repeat in range(args.repeat):
            for mode in modes:
                result = await run_mode(session, server, mode, args.nodes, args.fixed_concurrency, repeat)
                results[mode].append(result)
                print(f"[{repeat + 1}/{args.repeat}] " + line(result), flush=True)
                if args.verbose and result["gate"]:
                    print(f"    gate: {result['gate']}", flush=True)
                if args.verbose:
                    print(f"    per second (accepted, 429s): {result['timeline']}", flush=True)
    print("medians:")
    medians = {}
    for mode in modes:
        runs = results[mode]
        median = {key: statistics.median(run[key] for run in runs) for key in
                  ("elapsed", "completed", "failed", "requests_per_second", "tokens_per_second", "goodput", "rejected",
                   "early_retries", "peak_in_flight", "allowed_requests_per_second", "allowed_tokens_per_second")}
        median.update(mode=mode, window=runs[-1]["window"])
        medians[mode] = median
        print("  " + line(median))
    if "fixed" in medians:
        for mode in modes:
            if mode != "fixed":
                print(f"  {mode} / fixed goodput: {medians[mode]['goodput'] / medians['fixed']['goodput']:.2f}x")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.goodput", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--rpm", type=float, default=6000.0)
    parser.add_argument("--tpm", type=float, default=240_000.0)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--fixed-concurrency", type=int, default=64)
    parser.add_argument("--modes", default="fixed,adaptive,budget")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="print the adaptive gate's state after each run")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started_ray = not ray.is_initialized()
    try:
        session = Session()
        return asyncio.run(run(args, session))
    finally:
        if started_ray:
            ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
