"""A real HTTP server on 127.0.0.1 speaking the OpenAI chat-completions protocol, for tests.

Owns the scripted server side: each request takes the next queued behaviour (or one
chosen by the model name), and every request is recorded. It runs in a background thread
on a free port and stops cleanly, releasing any handler still waiting in a slow reply.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opgraph.actors.providers import example_from_schema

__all__ = [
    "Hangup",
    "Malformed",
    "OpenAIChatServer",
    "RecordedRequest",
    "Refusal",
    "Reply",
    "Slow",
    "Status",
    "StructuredReply",
    "ToolCallReply",
]


@dataclass(frozen=True)
class Reply:
    """A plain assistant message; ``None`` text echoes the last user message."""

    text: str | None = None


@dataclass(frozen=True)
class ToolCallReply:
    """An assistant message calling one tool; ``arguments`` as a str is sent verbatim (to break it)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)
    call_id: str = "call_1"


@dataclass(frozen=True)
class StructuredReply:
    """Content that is JSON fitting the request's ``response_format`` JSON schema."""


@dataclass(frozen=True)
class Status:
    """A non-2xx answer, optionally with ``Retry-After`` (seconds, or any header text)."""

    code: int
    retry_after: str | None = None
    body: str = '{"error": {"message": "scripted failure"}}'


@dataclass(frozen=True)
class Slow:
    """Wait ``seconds`` (released early when the server stops), then send ``then``."""

    seconds: float
    then: Any = Reply("late")


@dataclass(frozen=True)
class Malformed:
    """A 200 whose body is not a chat completion (not JSON by default)."""

    body: str = "this is not json"
    content_type: str = "application/json"


@dataclass(frozen=True)
class Hangup:
    """Close the connection without answering."""


@dataclass(frozen=True)
class Refusal:
    """The model declines: ``content`` null and ``refusal`` holding its words, as OpenAI answers."""

    text: str = "I'm sorry, but I can't help with that."


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: Any
    received: float


# With nothing queued, the model name picks the behaviour; any other model gets Reply().
BY_MODEL: dict[str, Any] = {
    "tools": ToolCallReply("lookup", {"query": "weather"}),
    "structured": StructuredReply(),
    "malformed": Malformed(),
    "hold": Slow(3600.0),  # in flight until the server stops (then the connection closes unanswered)
    "slow": Slow(1.0, Reply()),  # a second in flight, then an echo: long enough to kill what waits on it
    "refuses": Refusal(),
}


class OpenAIChatServer:
    """``with OpenAIChatServer() as server:`` serves ``server.base_url`` (``http://127.0.0.1:<port>/v1``).

    ``server.script(*behaviours)`` queues behaviours for the next requests, in order;
    ``server.requests`` lists what arrived.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: collections.deque[Any] = collections.deque()
        self._requests: list[RecordedRequest] = []
        self.in_flight = 0  # requests being answered now
        self.peak_in_flight = 0  # the most answered at once, since the last reset_peak()
        self.stopping = threading.Event()
        self.handler_errors: list[BaseException] = []
        self._httpd = _RecordingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.errors = self.handler_errors
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="openai-chat-server", daemon=True)

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def script(self, *behaviours: Any) -> None:
        with self._lock:
            self._queue.extend(behaviours)

    def start(self) -> OpenAIChatServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()  # release slow handlers first, so nothing outlives the server
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OpenAIChatServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _next(self, body: Any) -> Any:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
        model = body.get("model") if isinstance(body, dict) else None
        return BY_MODEL.get(model, Reply())

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_in_flight = self.in_flight

    def _entered(self, delta: int) -> None:
        with self._lock:
            self.in_flight += delta
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)


class _RecordingHTTPServer(ThreadingHTTPServer):
    """Daemon handler threads; a handler's exception is kept for the test instead of printed."""

    daemon_threads = True
    errors: list[BaseException]

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.errors.append(sys.exc_info()[1])


def _completion(body: dict[str, Any], message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    prompt = sum(len(str(m.get("content") or "")) for m in body.get("messages", []))
    completion = len(str(message.get("content") or "")) + 4 * len(message.get("tool_calls", []))
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", ""),
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


def _handler_for(server: OpenAIChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            return  # the test reads server.requests, not stderr

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw.decode("utf-8", errors="replace")
            server._record(RecordedRequest(self.path, dict(self.headers.items()), body, time.monotonic()))
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            server._entered(1)
            try:
                self._act(server._next(body), body)
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The client gave up first (a timeout test): note it, there is no one to answer.
                server.handler_errors.append(exc)
            finally:
                server._entered(-1)

        def _act(self, behaviour: Any, body: dict[str, Any]) -> None:
            if isinstance(behaviour, Slow):
                if server.stopping.wait(behaviour.seconds):
                    return
                behaviour = behaviour.then
            if isinstance(behaviour, Reply):
                text = behaviour.text if behaviour.text is not None else f"echo: {_last_user_text(body)}"
                self._send(200, _completion(body, {"role": "assistant", "content": text}, "stop"))
            elif isinstance(behaviour, ToolCallReply):
                arguments = behaviour.arguments
                call = {"id": behaviour.call_id, "type": "function",
                        "function": {"name": behaviour.name,
                                     "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                self._send(200, _completion(body, message, "tool_calls"))
            elif isinstance(behaviour, StructuredReply):
                response_format = body.get("response_format") or {}
                schema = response_format.get("json_schema", {}).get("schema", {"type": "object"})
                content = json.dumps(example_from_schema(schema, hint="from-server"))
                self._send(200, _completion(body, {"role": "assistant", "content": content}, "stop"))
            elif isinstance(behaviour, Status):
                headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after is not None else {}
                self._send_raw(behaviour.code, behaviour.body.encode(), "application/json", headers)
            elif isinstance(behaviour, Malformed):
                self._send_raw(200, behaviour.body.encode(), behaviour.content_type)
            elif isinstance(behaviour, Refusal):
                message = {"role": "assistant", "content": None, "refusal": behaviour.text}
                self._send(200, _completion(body, message, "stop"))
            elif isinstance(behaviour, Hangup):
                self.close_connection = True
                self.connection.close()
            else:
                raise TypeError(f"unknown behaviour {behaviour!r}")

        def _send(self, code: int, payload: Any) -> None:
            self._send_raw(code, json.dumps(payload).encode(), "application/json")

        def _send_raw(self, code: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

    return Handler
