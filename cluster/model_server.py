"""`opgraph models serve`: a local model served OpenAI-compatibly on the loopback, so ``openai/<name>``
with ``OPENAI_BASE_URL`` calls it over HTTP as it would vLLM or llama.cpp's server in production.

Owns the HTTP surface (``/v1/chat/completions``, streamed or not, ``/v1/models``, ``/health``), the
pool of model slots (each a llama.cpp instance of its own, so ``--parallel N`` answers N requests at
once), and a clean stop on Ctrl-C or SIGTERM. Which models exist and how a request becomes a
completion belong to ``opgraph.actors.providers.local``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the handler's annotations here

from opgraph.actors.providers.local import LocalModel, llama_response_format, load_llama, plain_message

__all__ = ["DEFAULT_PORT", "build_app", "serve"]

DEFAULT_PORT = 8080
_DONE = object()


class _Slots:
    """``count`` llama.cpp instances of one model; a request holds one for its whole completion."""

    def __init__(self, model: LocalModel, count: int, threads: int) -> None:
        self.model = model
        self.count = count
        self.threads = threads
        self.idle: asyncio.Queue[Any] = asyncio.Queue()
        for _ in range(count):
            self.idle.put_nowait(load_llama(model, threads=threads).llama)


def _error(status: int, message: str, kind: str = "invalid_request_error") -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": None}}, status_code=status)


def _arguments(body: dict[str, Any]) -> dict[str, Any]:
    """The body's OpenAI fields as llama.cpp's create_chat_completion takes them."""
    stop = body.get("stop")
    return {
        "messages": [plain_message(message) for message in body["messages"]],
        "response_format": llama_response_format(body.get("response_format")),
        "temperature": 0.0 if body.get("temperature") is None else float(body["temperature"]),
        "max_tokens": body.get("max_tokens") or body.get("max_completion_tokens"),
        "stop": [stop] if isinstance(stop, str) else list(stop or []),
        "seed": body.get("seed"),
    }


def build_app(model: LocalModel, *, slots: int = 1, threads: int | None = None) -> Any:
    """The FastAPI app serving ``model`` from ``slots`` instances (``threads`` each: half the cores shared out)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    # llama.cpp's own default is half the cores (one a physical core); its threads spin while they wait,
    # so more threads than cores, or than a busy machine has free, is slower, never faster.
    threads = threads or max(1, (os.cpu_count() or 2) // 2 // slots)
    state: dict[str, _Slots] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["slots"] = _Slots(model, slots, threads)
        yield

    app = FastAPI(title=f"opgraph models serve: {model.name}", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        pool = state["slots"]
        return {"status": "ok", "model": model.name, "slots": pool.count, "idle": pool.idle.qsize()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                              "owned_by": "opgraph-local", "path": str(model.path)}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "the body needs a non-empty 'messages' list")
        if body.get("model") not in (model.name, f"local/{model.name}", None):
            return _error(404, f"the model {body.get('model')!r} does not exist here; this server serves "
                               f"{model.name!r}", "not_found_error")
        if body.get("tools"):
            return _error(400, "tool calls are not supported by local models")
        arguments = _arguments(body)
        pool = state["slots"]
        if body.get("stream"):
            return StreamingResponse(_stream(pool, arguments), media_type="text/event-stream")
        try:
            result = await asyncio.to_thread(_complete, pool, await pool.idle.get(), arguments,
                                             asyncio.get_running_loop())
        except ValueError as exc:  # a prompt longer than the context, say
            return _error(400, f"llama.cpp refused the request: {exc}")
        result["model"] = model.name
        return result

    return app


def _hand_to_loop(loop: asyncio.AbstractEventLoop, put: Callable[[Any], None], value: Any) -> None:
    """From a completion's thread: ``put(value)`` on the server's loop (nothing once it closed: the
    server is stopping)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(put, value)


def _give_back(pool: _Slots, llama: Any, loop: asyncio.AbstractEventLoop) -> None:
    """From a completion's thread: the slot returns to the pool."""
    _hand_to_loop(loop, pool.idle.put_nowait, llama)


def _complete(pool: _Slots, llama: Any, arguments: dict[str, Any], loop: asyncio.AbstractEventLoop) -> Any:
    """One whole completion, in a thread; the slot goes back when llama.cpp is done with it, even
    if the request that asked was cancelled meanwhile (no second request may share the instance)."""
    try:
        return llama.create_chat_completion(**arguments)
    finally:
        _give_back(pool, llama, loop)


async def _stream(pool: _Slots, arguments: dict[str, Any]) -> AsyncIterator[str]:
    """Server-sent events of the completion's chunks, as OpenAI sends them.

    The slot goes back to the pool from the thread that used it, once llama.cpp is done with it:
    never from this generator's cleanup, which a client gone mid-stream cancels (an await there
    was cancelled too, and the slot was lost, so the next request waited for ever). A client gone
    stops the generation at its next token."""
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[Any] = asyncio.Queue()
    gone = threading.Event()
    llama = await pool.idle.get()

    def tell(value: Any) -> None:
        _hand_to_loop(loop, chunks.put_nowait, value)

    def produce() -> None:
        try:
            for chunk in llama.create_chat_completion(stream=True, **arguments):
                if gone.is_set():
                    break
                tell(chunk)
        except ValueError as exc:
            tell({"error": {"message": str(exc), "type": "invalid_request"}})
        finally:
            tell(_DONE)
            _give_back(pool, llama, loop)

    threading.Thread(target=produce, name="opgraph-models-stream", daemon=True).start()
    try:
        while (chunk := await chunks.get()) is not _DONE:
            chunk["model"] = pool.model.name
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        gone.set()


def serve(model: LocalModel, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, slots: int = 1,
          threads: int | None = None, announce: Callable[[str, float], None] | None = None) -> int:
    """Serve ``model`` until Ctrl-C or SIGTERM (uvicorn stops accepting, finishes what is in flight,
    and returns); ``announce`` is told the base URL (port 0: any free one) and the seconds the start
    took, once the slots are loaded and the server answers."""
    import uvicorn

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    bound_port = listener.getsockname()[1]
    started = time.perf_counter()
    config = uvicorn.Config(build_app(model, slots=slots, threads=threads), log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        if announce is not None:
            announce(f"http://{host}:{bound_port}/v1", time.perf_counter() - started)

    server.startup = startup  # type: ignore[method-assign]
    # uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found: here one that ends quietly, so a stop asked for is exit 0, not a KeyboardInterrupt or -15.
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, frame: stopped.append(number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[listener])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
