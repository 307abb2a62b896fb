"""Triage requests a second on the local model, with one server slot and with several: a figure, not a target.

Owns one measurement: `opgraph models serve --parallel N` started for each N asked, then
``--tickets`` triage requests sent through the real ``openai/`` provider over HTTP, ``--concurrency``
at once (default: twice the slots). A triage request is the bundled support-triage workflow's
three model calls for one ticket, in order and bounded as the workflow bounds them: classify
(JSON-schema-constrained, the category from its enum), escalate, check. It prints requests a second,
the median and p90 latency of a request, and completion tokens a second, per N.

    python -m opgraph.cluster.bench.triage_local [--tickets 24] [--parallel 1,2] [--concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from opgraph.actors.models import ChatRequest
from opgraph.actors.providers import OpenAICompatibleProvider

from ..lanes import FIXED_WORKFLOW, lane_entry

__all__ = ["main"]

START_DEADLINE = 120.0
TICKETS = [
    "I was charged twice for my subscription this month.",
    "The whole site is down, nobody can log in or pay.",
    "The export button crashes the app when the list is empty.",
    "Please change the email address on my account.",
    "How do I add a second user to my team?",
    "Checkout fails with error 502 for every customer paying by card.",
]


def _serve(parallel: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "opgraph.cluster.cli", "models", "serve", "--port", "0",
                                "--parallel", str(parallel)], stdout=subprocess.PIPE, text=True)
    found: dict[str, str] = {}

    def read() -> None:
        for line in process.stdout:
            if line.startswith("export OPENAI_BASE_URL="):
                found["url"] = line.strip().split("=", 1)[1]

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + START_DEADLINE
    while "url" not in found:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"opgraph models serve --parallel {parallel} did not start")
        time.sleep(0.05)
    return process, found["url"]


def _steps() -> list[dict[str, Any]]:
    spec = json.loads(lane_entry(FIXED_WORKFLOW).examples["support-triage"].read_text())
    nodes = {node["id"]: node.get("config", {}) for node in spec["nodes"]}
    return [nodes["classify"], nodes["escalate"], nodes["check"]]


async def _triage(provider: OpenAICompatibleProvider, ticket: str, steps: list[dict[str, Any]]) -> tuple[float, int]:
    started = time.perf_counter()
    earlier: dict[str, str] = {}
    tokens = 0
    for index, step in enumerate(steps):
        shown = json.dumps({"ticket": ticket, "priority": "high"})
        results = f"Results of earlier steps:\n{json.dumps(earlier)}\n\n" if earlier else ""
        schema = step.get("schema")
        request = ChatRequest(
            "openai/smollm2", [{"role": "user", "content": f"{results}Shared context:\n{shown}\n\n{step['prompt']}"}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            if schema else None, temperature=0, max_tokens=step.get("max_tokens"), stop=step.get("stop"))
        response = await provider.complete(request)
        earlier[f"step {index + 1}"] = response.content or ""
        tokens += response.usage.completion_tokens
    return time.perf_counter() - started, tokens


async def _measure(base_url: str, tickets: int, concurrency: int) -> dict[str, float]:
    provider = OpenAICompatibleProvider(base_url, max_retries=0)
    steps = _steps()
    await _triage(provider, TICKETS[0], steps)  # warm: the first call pays for nothing else
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> tuple[float, int]:
        async with gate:
            return await _triage(provider, TICKETS[index % len(TICKETS)], steps)

    started = time.perf_counter()
    done = await asyncio.gather(*(one(index) for index in range(tickets)))
    elapsed = time.perf_counter() - started
    await provider.aclose()
    latencies = sorted(seconds for seconds, _ in done)
    return {"requests_per_s": tickets / elapsed, "p50_s": statistics.median(latencies),
            "p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))],
            "completion_tokens_per_s": sum(tokens for _, tokens in done) / elapsed, "elapsed_s": elapsed}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.triage_local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tickets", type=int, default=24, help="triage requests per setting (24)")
    parser.add_argument("--parallel", default="1,2", help="server slots to measure, comma-separated (1,2)")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (twice the slots)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON too")
    args = parser.parse_args(argv)
    settings = [int(part) for part in args.parallel.split(",") if part.strip()]
    if args.tickets < 1 or not settings or min(settings) < 1:
        parser.error("--tickets and every --parallel must be at least 1")
    figures = []
    print("slots  in flight  triage req/s  p50 s  p90 s  completion tok/s")
    for parallel in settings:
        process, base_url = _serve(parallel)
        try:
            concurrency = args.concurrency or 2 * parallel
            measured = asyncio.run(_measure(base_url, args.tickets, concurrency))
        finally:
            process.terminate()
            process.wait(timeout=30)
        figures.append({"slots": parallel, "concurrency": concurrency, **measured})
        print(f"{parallel:>5}  {concurrency:>9}  {measured['requests_per_s']:>12.2f}  {measured['p50_s']:>5.2f}  "
              f"{measured['p90_s']:>5.2f}  {measured['completion_tokens_per_s']:>16.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"tickets": args.tickets, "figures": figures}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
