"""The HTTP-shaped benchmark's server: an OpenAI-compatible chat-completions endpoint on 127.0.0.1,
run as a process of its own, answering "item N" after a latency seeded by N.

Owns the workload's latencies (log-normal, median 1 s, p99 about 8 s, the same for every
client), the ideal makespan they imply, and the server side of the wire: a JSON answer, or
(``"stream": true``) a first SSE chunk after the latency and then ``chunks`` more 10 ms apart.
It keeps no figure a client could game: clients measure themselves; the server only says
how many calls it answered and how many it held at once (``GET /stats``).

    python -m opgraph.cluster.bench.http_server --seed 36 [--scale 1.0] [--port 0]

prints ``port N`` on its first line once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import re
import time
from collections.abc import Sequence

__all__ = ["DEFAULT_SEED", "ideal_makespan", "latencies", "latency", "main"]

DEFAULT_SEED = 36
MEDIAN = 1.0
P99 = 8.0
SIGMA = math.log(P99 / MEDIAN) / 2.3263478740408408  # the standard normal's 99th percentile
CHUNKS = 20  # chunks a streamed answer sends after its first
CHUNK_GAP = 0.010  # seconds between them
ITEM = re.compile(rb"item (\d+)")


def latency(seed: int, index: int, scale: float = 1.0) -> float:
    """Seconds the server waits before answering call ``index``: log-normal, median ``scale`` s."""
    return scale * random.Random(seed * 1_000_003 + index).lognormvariate(math.log(MEDIAN), SIGMA)


def latencies(seed: int, count: int, scale: float = 1.0) -> list[float]:
    return [latency(seed, index, scale) for index in range(count)]


def ideal_makespan(waits: Sequence[float], concurrency: int, tail: float = 0.0) -> float:
    """The makespan of ``waits`` (each plus ``tail``) at ``concurrency``, started greedily in index order."""
    finishing: list[float] = []
    for wait in waits:
        start = heapq.heappop(finishing) if len(finishing) >= concurrency else 0.0
        heapq.heappush(finishing, start + wait + tail)
    return max(finishing, default=0.0)


class _Counts:
    def __init__(self) -> None:
        self.answered = 0
        self.in_flight = 0
        self.peak_in_flight = 0


def build_app(seed: int, scale: float):  # -> aiohttp.web.Application
    from aiohttp import web

    counts = _Counts()

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        found = ITEM.findall(raw)
        if not found:
            return web.json_response({"error": {"message": "no 'item N' in the request"}}, status=400)
        index = int(found[-1])
        body = json.loads(raw)
        stream = bool(body.get("stream"))
        counts.in_flight += 1
        counts.peak_in_flight = max(counts.peak_in_flight, counts.in_flight)
        try:
            await asyncio.sleep(latency(seed, index, scale))
            text = f"answer {index}"
            usage = {"prompt_tokens": 8, "completion_tokens": CHUNKS + 1 if stream else 3,
                     "total_tokens": CHUNKS + 9 if stream else 11}
            if not stream:
                return web.json_response({
                    "id": f"chatcmpl-{index}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", ""),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop"}],
                    "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            try:
                return await _stream(request, response, body, index, text, usage)
            except ConnectionError:  # the client gave up (its timeout): nothing to answer
                return response
        finally:
            counts.in_flight -= 1
            counts.answered += 1

    async def _stream(request: web.Request, response: web.StreamResponse, body: dict, index: int, text: str,
                      usage: dict) -> web.StreamResponse:
        await response.prepare(request)
        head = {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.get("model", "")}
        pieces = [text] + [f" {part}" for part in range(CHUNKS)]
        for number, piece in enumerate(pieces):
            if number:
                await asyncio.sleep(CHUNK_GAP)
            delta = {"role": "assistant", "content": piece} if number == 0 else {"content": piece}
            last = number == len(pieces) - 1
            chunk = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if last else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode()
                                 + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def stats(request: web.Request) -> web.Response:
        answer = {"answered": counts.answered, "in_flight": counts.in_flight, "peak_in_flight": counts.peak_in_flight}
        if request.query.get("reset"):
            counts.answered, counts.peak_in_flight = 0, counts.in_flight
        return web.json_response(answer)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/stats", stats)
    return app


async def _serve(seed: int, scale: float, port: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(build_app(seed, scale), access_log=None, handle_signals=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # the port the kernel chose for port 0
    print(f"port {bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.http_server")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--scale", type=float, default=1.0, help="median latency in seconds (1.0)")
    parser.add_argument("--port", type=int, default=0)
    arguments = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_serve(arguments.seed, arguments.scale, arguments.port))
    except ImportError:
        asyncio.run(_serve(arguments.seed, arguments.scale, arguments.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
