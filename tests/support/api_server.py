"""uvicorn in a background thread on a free 127.0.0.1 port, for tests of the workflow HTTP API.

``Served.client()`` is an httpx client of it that sends the app's token (``app.state.access``),
as every client of a real server does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from opgraph.cluster.processes import free_port

__all__ = ["START_DEADLINE", "Served", "free_port", "serve"]

START_DEADLINE = 30.0  # seconds for uvicorn to bind (and the app's lifespan to start)


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    url: str
    port: int
    token: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The header that carries the app's token (none when the app has no token)."""
        return {} if self.token is None else {"authorization": f"Bearer {self.token}"}

    def client(self, **settings: Any) -> httpx.Client:
        """An httpx client of this server that sends its token; close it (or use it in a ``with``)."""
        settings.setdefault("timeout", 30)
        return httpx.Client(base_url=self.url, headers=self.headers, **settings)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def serve(app: Any, **config: Any) -> Served:
    """Serve ``app`` until ``stop()`` (or the end of a ``with`` block); returns once uvicorn listens (after
    the app's startup). ``config`` overrides uvicorn settings (``http=`` a protocol, say)."""
    config = uvicorn.Config(app, **{"host": "127.0.0.1", "port": 0, "log_level": "warning", "lifespan": "on",
                                    "loop": "asyncio", "http": "h11", "ws": "none", **config})
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="workflow-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_DEADLINE
    while not server.started:
        assert thread.is_alive(), "uvicorn exited while starting"
        assert time.monotonic() < deadline, f"uvicorn did not start within {START_DEADLINE} s"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    access = getattr(app.state, "access", None)
    return Served(server, thread, f"http://127.0.0.1:{port}", port, None if access is None else access.token)
