"""The HTTP API's request-body guard: size, encoding and shape, checked before any route sees a body.

Owns the body limit (413 as soon as the declared or received size passes it, before the
body is read whole) and the checks FastAPI's own parser turns into a bare 400 or a 500:
UTF-8, JSON syntax, nesting depth and lone surrogates. Each refusal is the API's problem
list. It must not know any route or model: what a valid body holds is the routes' business.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..store import is_unicode_text, problem

__all__ = ["BODY_METHODS", "DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "RequestBodyGuard", "body_problems"]

# 4 MiB: a definition holds at most 200 nodes and 400 edges, so this leaves long prompts
# room while a 100 MB body is refused before it is buffered (``opgraph serve --max-body-bytes``).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# Deeper than any definition may be (spec.MAX_DEPTH, 64) plus the request's own levels, and
# far below the recursion limit that made a 10,000-deep body a 400 from FastAPI's parser.
MAX_JSON_DEPTH = 100
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def body_problems(body: bytes) -> list[dict[str, Any]]:
    """Why ``body`` is no usable JSON request body, as problems; ``[]`` when it is one."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [problem(f"the request body is not UTF-8 text (byte {exc.start} cannot be decoded); "
                        "send JSON encoded as UTF-8")]
    try:
        value = json.loads(text)
    except RecursionError:
        return [problem(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")]
    except json.JSONDecodeError as exc:
        return [problem(f"the request body is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")]
    return _value_problems(value)


def _value_problems(value: Any) -> list[dict[str, Any]]:
    """Depth and Unicode problems of a decoded JSON value, walked without recursion."""
    pending: list[tuple[Any, str, int]] = [(value, "body", 1)]
    while pending:
        item, path, depth = pending.pop()
        if isinstance(item, (dict, list)) and depth > MAX_JSON_DEPTH:
            return [problem(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {path})")]
        if isinstance(item, dict):
            for key, child in item.items():
                if not is_unicode_text(key):
                    return [problem(f"{path} has a key that is not valid Unicode text (a lone surrogate "
                                    "such as \\ud800)")]
                pending.append((child, f"{path}.{key}", depth + 1))
        elif isinstance(item, list):
            pending.extend((child, f"{path}[{index}]", depth + 1) for index, child in enumerate(item))
        elif isinstance(item, str) and not is_unicode_text(item):
            return [problem(f"{path} is not valid Unicode text (it holds a lone surrogate such as \\ud800)")]
    return []


class RequestBodyGuard:
    """ASGI middleware: every POST/PUT/PATCH body is size-checked as it arrives, then shape-checked.

    Over ``max_body_bytes`` (by Content-Length, or by the bytes received so far) the answer
    is 413 at once and the rest is never read. A complete body that is not UTF-8 JSON, or
    nests deeper than ``MAX_JSON_DEPTH``, or holds a lone surrogate, is a 422 problem list.
    A good body is replayed to the app unchanged.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if type(max_body_bytes) is not int or max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send, declared)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left; there is nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._too_large(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problems = body_problems(body) if body and _is_json(scope) else []
        if problems:
            await _answer(send, 422, {"error": problems[0]["error"], "errors": problems})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the app may

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        error = (f"the request body is {size}; this server takes at most {self.max_body_bytes} bytes "
                 "(opgraph serve --max-body-bytes)")
        await _answer(send, 413, {"error": error, "errors": [problem(error)]}, close=True)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _is_json(scope: Scope) -> bool:
    """FastAPI reads a body as JSON when it says so, or says nothing about its type."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return True


async def _answer(send: Send, status: int, payload: dict[str, Any], *, close: bool = False) -> None:
    body = json.dumps(payload).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        # The unread rest of the body is not wanted: the connection cannot be reused.
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
