"""A rate-limited OpenAI-compatible chat-completions server on 127.0.0.1, for the goodput
bench and its test.

Owns the server side only: token buckets for requests and tokens per minute (429 with
``Retry-After`` and ``retry-after-ms`` above them, as OpenAI-style servers answer), a fixed
answer latency, and counters that say whether clients honoured the waits they were given.
It runs an asyncio loop in a background thread (HTTP/1.1 keep-alive, one coroutine a
connection), so thousands of calls cost no thread each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RateLimitedChatServer", "ServerCounts"]

# Requests within this many seconds before the time a 429 gave them count as early:
# the client's clock and ours are the same, but a wake-up may land a hair before.
EARLY_SLACK = 0.005


@dataclass
class ServerCounts:
    """What the server saw: answered (200) calls and their tokens, 429s, and early retries."""

    accepted: int = 0
    rejected: int = 0
    early_retries: int = 0  # a request repeated before the Retry-After its 429 gave
    tokens: int = 0
    first_accepted: float | None = None
    last_accepted: float | None = None
    in_flight: int = 0
    peak_in_flight: int = 0
    retry_after_sent: list[float] = field(default_factory=list)
    accepted_at: list[float] = field(default_factory=list)
    rejected_at: list[float] = field(default_factory=list)


class _Bucket:
    def __init__(self, per_minute: float, burst_seconds: float, now: float, start_full: bool) -> None:
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate * burst_seconds)
        self.level = self.capacity if start_full else 0.0
        self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate


class RateLimitedChatServer:
    """``with RateLimitedChatServer(rpm=600, tpm=60_000) as server:`` serves ``server.base_url``.

    A request costs one request and its tokens (prompt text at four characters a token,
    plus ``completion_tokens``, the size of every answer); it is answered after
    ``latency`` seconds, or at once with 429 when either bucket cannot pay. Buckets hold
    ``burst_seconds`` of their rate and start empty unless ``start_full``, so over any
    run the server allows at most ``limit x elapsed`` (plus one burst if started full).
    """

    def __init__(self, *, rpm: float, tpm: float | None = None, latency: float = 0.2, completion_tokens: int = 16,
                 burst_seconds: float = 1.0, start_full: bool = False) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self.latency = latency
        self.completion_tokens = completion_tokens
        self.burst_seconds = burst_seconds
        self.start_full = start_full
        self.counts = ServerCounts()
        self._not_before: dict[str, float] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rate-limited-chat-server", daemon=True)
        self.port = 0
        self.reset()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def allowed_requests_per_second(self, tokens_per_request: float) -> float:
        """The most this server lets through in the long run, for calls of that size."""
        rate = self.rpm / 60.0
        if self.tpm is not None:
            rate = min(rate, self.tpm / 60.0 / tokens_per_request)
        return rate

    def reset(self) -> ServerCounts:
        """Fresh buckets and counters (buckets as at start); returns the counts until now."""
        with self._lock:
            now = time.monotonic()
            previous = self.counts
            self.counts = ServerCounts()
            self._requests = _Bucket(self.rpm, self.burst_seconds, now, self.start_full)
            self._tokens = _Bucket(self.tpm, self.burst_seconds, now, self.start_full) if self.tpm else None
            self._not_before.clear()
            return previous

    def start(self) -> RateLimitedChatServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the rate-limited chat server did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> RateLimitedChatServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the loop thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self._server = loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=1024))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                headers: dict[str, str] = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                path = request_line.split()[1].decode("latin-1") if len(request_line.split()) > 1 else ""
                status, payload, extra = await self._answer(path, body)
                data = json.dumps(payload).encode()
                head = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}", "Content-Type: application/json",
                        f"Content-Length: {len(data)}", *(f"{key}: {value}" for key, value in extra.items())]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return  # the client hung up
        except asyncio.CancelledError:
            return  # the server is stopping: its loop ends right after, nothing waits on this
        finally:
            writer.close()

    async def _answer(self, path: str, raw: bytes) -> tuple[int, Any, dict[str, str]]:
        if path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {path}"}}, {}
        body = json.loads(raw)
        messages = body.get("messages") or []
        prompt_tokens = sum(math.ceil(len(str(message.get("content") or "")) / 4) for message in messages)
        cost = prompt_tokens + self.completion_tokens
        key = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        with self._lock:
            now = time.monotonic()
            if now < self._not_before.get(key, 0.0) - EARLY_SLACK:
                self.counts.early_retries += 1
            wait = self._requests.wait_for(1.0, now)
            if self._tokens is not None:
                wait = max(wait, self._tokens.wait_for(min(cost, self._tokens.capacity), now))
            if wait > 0:
                self.counts.rejected += 1
                self.counts.retry_after_sent.append(wait)
                self.counts.rejected_at.append(now)
                self._not_before[key] = now + wait
                limited = "requests" if self._requests.level < 1.0 else "tokens"
                return 429, {"error": {"message": f"Rate limit reached for {limited}; try again in {wait:.3f}s",
                                       "type": limited, "code": "rate_limit_exceeded"}}, {
                    "Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": f"{wait * 1000:.0f}"}
            self._requests.level -= 1.0
            if self._tokens is not None:
                self._tokens.level -= cost
            self.counts.in_flight += 1
            self.counts.peak_in_flight = max(self.counts.peak_in_flight, self.counts.in_flight)
        await asyncio.sleep(self.latency)
        with self._lock:
            self.counts.in_flight -= 1
            self.counts.accepted += 1
            self.counts.tokens += cost
            self.counts.first_accepted = self.counts.first_accepted or now
            self.counts.last_accepted = now
            self.counts.accepted_at.append(now)
        content = ("ok " * self.completion_tokens * 2)[: 4 * self.completion_tokens]
        return 200, {
            "id": "chatcmpl-bench", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                      "total_tokens": cost},
        }, {}
