"""uvicorn in a background thread on a free 127.0.0.1 port, for tests of the workflow HTTP API."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "uvicorn did not stop"


def serve(app: Any) -> Served:
    """Serve ``app`` until ``stop()``; returns once uvicorn listens (after the app's startup)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            loop="asyncio", http="h11", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="workflow-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_DEADLINE
    while not server.started:
        assert thread.is_alive(), "uvicorn exited while starting"
        assert time.monotonic() < deadline, f"uvicorn did not start within {START_DEADLINE} s"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(server, thread, f"http://127.0.0.1:{port}", port)
