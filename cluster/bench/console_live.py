"""The console's live figures (bench/console.py): a live fan-out followed in Chromium, one console and ten.

The run is a real run of the shared seam (``run_prepared``: recorded in the store as the lanes
record one, driven through ``Session.flow`` on the server's own Session) of ``width`` nodes that
each sleep 50 ms, ``CAPACITY`` at a time. Its nodes wait at a gate (a file) until every console
follows the run, so the figures cover the whole fan-out. The console follows it as it follows
any live run: its feed attaches to the run by id and reads the executor's watcher queue. CPU is
this process's (the server, and the driver of the run, which costs the same either way) from the
gate's opening to the run's end, per 1,000 nodes settled. Latency is the time from
a node's ``completed`` signal (the driver's clock, as the executor's event arrives) to the page
applying the change that shows it (the browser's clock: the same machine); a node folded into a
group is shown by the group's completed count.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import resource
import statistics
import tempfile
import threading
import time
import uuid
from typing import Any

from opgraph.kernel import OperationGraphBuilder

from ..lanes import FIXED_WORKFLOW, LaneInvocation, PreparedLaneRun, RunProvenance, lane_adapter, run_prepared

__all__ = ["CAPACITY", "LATENCY", "live_figures"]

LATENCY = 0.05
CAPACITY = 100
SLEEP = "console_bench_sleep"
RUN_DEADLINE = 600.0


async def _sleep(branch: Any, seconds: float = 0.0, gate: str = "", **parameters: Any) -> Any:
    """Wait until ``gate`` exists (the fan-out starts once every console follows the run), then sleep."""
    deadline = time.monotonic() + RUN_DEADLINE
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(seconds)
    return parameters.get("result")


def _prepared(width: int, gate: str, store: Any) -> PreparedLaneRun:
    builder = OperationGraphBuilder()
    labels = {}
    for index in range(width):
        node = builder.add_operation(SLEEP, depends_on=[], seconds=LATENCY, gate=gate, result=index)
        labels[node] = f"row-{index}"
    graph = builder.get_graph()
    run_id = str(uuid.uuid4())
    content_hash = "sha256:" + "d" * 64
    invocation = LaneInvocation(lane=FIXED_WORKFLOW, source_ref="bench/live-fan-out", source_kind="workflow_file",
                                source_content_hash=content_hash, run_id=run_id, max_concurrent=CAPACITY,
                                durable=False)
    # A fixed lane's run, through the registry (the benchmarks reach a lane as the surfaces do).
    provenance = RunProvenance.from_payload({"lane": FIXED_WORKFLOW, "source": {
        "kind": "workflow_file", "ref": "bench/live-fan-out", "version": None, "content_hash": content_hash}})
    capabilities = lane_adapter(FIXED_WORKFLOW, store).capabilities(invocation)
    return PreparedLaneRun(graph=graph, context={}, invocation=invocation, recovery={}, run_id=run_id,
                           provenance=provenance, capabilities=capabilities, labels=labels,
                           label="bench/live-fan-out")


def _present(envelope: Any) -> Any:
    statuses = dict(envelope.get("operation_statuses", {}))
    failed = any(status == "failed" for status in statuses.values())
    return ("failed" if failed else "completed"), {}, {}, statuses


def _start(session: Any, store: Any, width: int, gate: str) -> tuple[str, threading.Thread, list[Any]]:
    prepared = _prepared(width, gate, store)
    outcome: list[Any] = []

    def drive() -> None:
        try:
            outcome.append(asyncio.run(run_prepared(prepared, session=session, store=store, present=_present)))
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            outcome.append(exc)

    thread = threading.Thread(target=drive, name="console-bench-run", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            store.get_run(prepared.run_id)
            return prepared.run_id, thread, outcome
        except Exception:  # noqa: BLE001 - not recorded yet
            if outcome or time.monotonic() > deadline:
                raise RuntimeError(f"the live run did not start: {outcome}") from None
            time.sleep(0.01)


def _follow(browser: Any, url: str, token: str, store: Any, run_id: str, consoles: int,
            gate: str) -> dict[str, Any]:
    """Open ``consoles`` pages on the live run (held at its gate); once every one follows it, open the gate
    and take the server process's CPU until the run ends, per 1,000 nodes settled meanwhile."""
    pages = []
    for _ in range(consoles):
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        page.goto(f"{url}/?token={token}")
        page.goto(f"{url}/runs/{run_id}", wait_until="domcontentloaded")
        pages.append(page)
    for page in pages:  # each has its snapshot: it follows the run (polled: the page's CSP allows no eval)
        deadline = time.monotonic() + RUN_DEADLINE
        while not page.evaluate("(window.opgraphUpdates || []).length"):
            if time.monotonic() > deadline:
                raise RuntimeError("a console never received the live run's first message")
            page.wait_for_timeout(20)
    cpu, settled = _cpu(), _completed(store, run_id)
    with open(gate, "w"):
        pass
    for page in pages:
        page.locator("#run-status", has_text="completed").wait_for(timeout=RUN_DEADLINE * 1000)
    cpu, settled = _cpu() - cpu, _completed(store, run_id) - settled
    updates = pages[0].evaluate("window.opgraphUpdates || []")
    for page in pages:
        page.context.close()
    return {"updates": updates, "cpu_s": cpu, "nodes": settled}


def _completed(store: Any, run_id: str) -> int:
    return sum(1 for signal in store.run_signals(run_id) if signal["kind"] == "completed")


def _latencies(store: Any, run_id: str, updates: list[Any]) -> list[float]:
    """Per node completed after the console subscribed: when its change showed minus when it completed."""
    completions = sorted(signal["at"] for signal in store.run_signals(run_id) if signal["kind"] == "completed"
                         and signal["node_id"] != run_id)
    shown = [(when / 1000.0, counts.get("completed", 0)) for _, when, *rest in updates for counts in rest[:1]
             if isinstance(counts, dict)]
    if not shown:
        return []
    subscribed = shown[0][0]
    times = [when for when, _ in shown]
    reached = [count for _, count in shown]
    # The running maximum: the k-th completion is shown by the first update whose count reaches k.
    for index in range(1, len(reached)):
        reached[index] = max(reached[index], reached[index - 1])
    latencies = []
    for k, completed_at in enumerate(completions, start=1):
        if completed_at < subscribed:
            continue
        position = bisect.bisect_left(reached, k)
        if position < len(times):
            latencies.append(times[position] - completed_at)
    return latencies


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def live_figures(browser: Any, url: str, token: str, app: Any, store: Any, width: int,
                 consoles: int) -> dict[str, Any]:
    """Latency p50/p95 with one console, then the server process's CPU with one console and with ``consoles``."""
    session = app.state.bench_session
    session.register_operation(SLEEP, _sleep, record_turn=False)
    gates = tempfile.mkdtemp(prefix="opgraph-console-gate-")
    figures: dict[str, Any] = {"live_width": width, "live_capacity": CAPACITY, "consoles": consoles}
    for count in (1, consoles):
        started = time.perf_counter()
        gate = os.path.join(gates, f"open-{count}")
        run_id, thread, outcome = _start(session, store, width, gate)
        followed = _follow(browser, url, token, store, run_id, count, gate)
        thread.join(RUN_DEADLINE)
        if not outcome or isinstance(outcome[0], BaseException):
            raise RuntimeError(f"the live run failed: {outcome}")
        figures[f"run_s_{count}_consoles"] = round(time.perf_counter() - started, 2)
        figures[f"nodes_followed_{count}_consoles"] = followed["nodes"]
        figures[f"cpu_ms_per_1000_nodes_{count}_consoles"] = (
            round(1000 * followed["cpu_s"] / followed["nodes"] * 1000, 1) if followed["nodes"] else None)
        if count == 1:
            updates = followed["updates"]
            latencies = sorted(_latencies(store, run_id, updates))
            if latencies:
                figures["live_nodes_measured"] = len(latencies)
                figures["live_latency_p50_ms"] = round(statistics.median(latencies) * 1000, 1)
                figures["live_latency_p95_ms"] = round(latencies[int(0.95 * (len(latencies) - 1))] * 1000, 1)
            figures["live_updates_received"] = len(updates)
    one, many = (figures[f"cpu_ms_per_1000_nodes_{count}_consoles"] for count in (1, consoles))
    figures[f"cpu_extra_{consoles}_vs_1_percent"] = round(100 * (many - one) / one, 1) if one and many else None
    return figures
