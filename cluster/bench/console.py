"""`opgraph bench --shapes console`: the run console in Chromium (Playwright), against a real `opgraph serve` app.

Three figures:

- a finished 10,000-node fan-out served from SQLite: first paint (``first-contentful-paint``) and
  interactive (``domInteractive`` of the navigation, and the first node panel opened by a click);
- a live fan-out of ``--live-width`` x 50 ms nodes: the time from a node's completion in the
  executor (the ``completed`` signal's time, taken where the executor's event arrives) to its change
  on the page, p50 and p95 (a node folded into a group changes the group's counts);
- the server's CPU while 10 consoles follow the same live run, against one console.

Needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``OPGRAPH_CHROMIUM``) and the ``playwright``
package (the test extra); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CHROMIUM_ARGS", "chromium_path", "launch_chromium", "main", "record_fanout", "serve_app"]

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
_PROVENANCE = {"lane": "fixed_workflow", "source": {"kind": "workflow_file", "ref": "bench/fan-out.json",
                                                    "content_hash": "sha256:" + "b" * 64}}


def chromium_path() -> str:
    return os.environ.get("OPGRAPH_CHROMIUM", "/usr/bin/chromium")


def launch_chromium(playwright: Any) -> Any:
    """Debian's Chromium, headless, asking nothing of the network."""
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


def record_fanout(store: Any, run_id: str, width: int, *, failed: int = 0) -> None:
    """Record a finished fan-out run in ``store`` as a real run records one: ``split`` -> ``width`` x ``work``
    -> ``join``, each node queued, started and settled, with a result and usage."""
    now = time.time()
    store.create_run(run_id, session_id="bench", provenance=_PROVENANCE, inputs={"rows": width})
    nodes = [["split", "split", "split"]] + [[f"w{i}", f"row-{i}", "work"] for i in range(width)] + \
        [["join", "join", "join"]]
    edges = [["split", f"w{i}"] for i in range(width)] + [[f"w{i}", "join"] for i in range(width)]
    store.record_outline(run_id, {"nodes": nodes, "edges": edges})
    store.mark_running(run_id)
    for start in range(0, len(nodes), 2000):
        part = nodes[start:start + 2000]
        signals, settled = [], []
        for index, (node_id, name, _) in enumerate(part, start=start):
            status = "failed" if 1 <= index <= failed else "completed"
            signals += [{"node_id": node_id, "spec_node_id": name, "kind": kind, "at": now + index * 0.001,
                         "elapsed": 0.05 if kind == status else None} for kind in ("queued", "started", status)]
            settled.append({"node_id": node_id, "spec_node_id": name, "status": status,
                            "result": {"text": f"answer {index}", "usage": {"total_tokens": 30, "prompt_tokens": 20,
                                                                            "completion_tokens": 10, "calls": 1}}})
        store.record_progress(run_id, signals=signals, nodes=settled)
    store.finish_run(run_id, "failed" if failed else "completed", outputs={"join": "done"})


class _Server:
    def __init__(self, server: Any, thread: threading.Thread, url: str) -> None:
        self.server, self.thread, self.url = server, thread, url


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port, in a thread; yields its URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", loop="asyncio",
                            http="h11", ws="none")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="console-bench", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the console's server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _signed_in(browser: Any, url: str, token: str) -> Any:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(f"{url}/?token={token}")
    return page


def finished_figures(browser: Any, url: str, token: str, run_id: str, rounds: int = 5) -> dict[str, float]:
    """First paint, interactive and first panel of the finished fan-out's page (medians of ``rounds``)."""
    paint, interactive, panel = [], [], []
    page = _signed_in(browser, url, token)
    for _ in range(rounds + 1):  # the first load fills the server's caches: not counted
        page.goto(f"{url}/runs/{run_id}", wait_until="load")
        timing = page.evaluate("""() => {
            const nav = performance.getEntriesByType('navigation')[0];
            const fcp = performance.getEntriesByName('first-contentful-paint')[0];
            return {paint: fcp ? fcp.startTime : null, interactive: nav.domInteractive};
        }""")
        started = time.perf_counter()
        page.locator("svg.graph a.group").first.click()
        page.locator("#panel .node-panel").wait_for()
        panel.append((time.perf_counter() - started) * 1000)
        if timing["paint"] is not None:
            paint.append(timing["paint"])
        interactive.append(timing["interactive"])
    page.context.close()
    return {"first_paint_ms": statistics.median(paint[1:] or paint),
            "interactive_ms": statistics.median(interactive[1:]),
            "first_panel_ms": statistics.median(panel[1:])}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="opgraph bench --shapes console", description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=10_000, help="nodes of the finished fan-out")
    parser.add_argument("--live-width", type=int, default=10_000, help="nodes of the live fan-out (0: skip)")
    parser.add_argument("--consoles", type=int, default=10, help="consoles following the live run at once (10)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    arguments = parser.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from ..http import AccessPolicy, create_app
    from ..lanes import open_store

    token = "bench-" + "t" * 40
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="opgraph-console-bench-") as folder:
        with open_store(Path(folder) / "opgraph.db") as store:
            started = time.perf_counter()
            record_fanout(store, "fanout-finished", arguments.width)
            figures["record_s"] = round(time.perf_counter() - started, 2)
            live = arguments.live_width > 0
            session = None
            if live:
                from opgraph.actors import Session  # Ray: only for the live figures

                session = Session()
            app = create_app(store, access=AccessPolicy(token), start_runtime=live,
                             session_factory=lambda: session)
            app.state.bench_session = session
            with contextlib.ExitStack() as closing:
                if session is not None:
                    closing.callback(session.close)
                url = closing.enter_context(serve_app(app))
                playwright = closing.enter_context(sync_playwright())
                browser = launch_chromium(playwright)
                try:
                    figures.update({key: round(value, 1) for key, value in
                                    finished_figures(browser, url, token, "fanout-finished").items()})
                    if live:
                        from .console_live import live_figures  # Ray: only for the live figures

                        figures.update(live_figures(browser, url, token, app, store, arguments.live_width,
                                                    arguments.consoles))
                finally:
                    browser.close()
    figures["width"] = arguments.width
    print(json.dumps(figures, indent=2, sort_keys=True))
    if arguments.json:
        Path(arguments.json).write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
