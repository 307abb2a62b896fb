"""The ``fanout`` job: N independent nodes of the built-in ``sleep`` operation, every K-th one failing.

Owns the fan-out graph, the ``fail`` operation that shows a failed run, serving metrics
during the run, and the envelope's summary as the last stdout line. It builds the graph
and calls ``Session.flow``; it never schedules anything itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

from opgraph.kernel import Graph, OpGraphError, create_operation

from .driver import EXIT_RUN_NOT_COMPLETED, EXIT_USAGE, ProgressLog, detach_problem, job_address, job_detached

__all__ = ["InjectedFailure", "fail", "fanout_graph", "run_fanout_job"]


class InjectedFailure(RuntimeError):
    """Raised by the ``fail`` operation that ``--fail-every`` places in a fan-out."""


async def fail(branch: Any, **parameters: Any) -> Any:
    """An operation that always fails: lets a job show what a failed run looks like."""
    raise InjectedFailure(f"injected failure (node {parameters.get('index')})")


def fanout_graph(nodes: int, latency: float, *, fail_every: int = 0) -> Graph:
    """``nodes`` independent roots; each sleeps ``latency`` s (every ``fail_every``-th one fails)."""
    graph = Graph("fanout")
    for index in range(nodes):
        if fail_every and (index + 1) % fail_every == 0:
            graph.add_node(create_operation("fail", {"index": index}))
        else:
            graph.add_node(create_operation("sleep", {"seconds": latency, "result": index}))
    return graph


async def _run_fanout(arguments: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """Run the fan-out; return its envelope and the seconds it took."""
    import ray  # local: `--help` and usage errors must not pay for Ray

    from ..connection import open_session

    address = job_address(arguments)
    detached = job_detached(arguments, address)
    session = open_session(address, namespace=arguments.namespace, detached=detached)
    session.register_operation("fail", fail, record_turn=False)
    metrics = None
    try:
        if arguments.metrics_port is not None:
            from ..metrics import serve_metrics  # local: prometheus only when asked

            metrics = serve_metrics(session, arguments.metrics_port, arguments.metrics_host)
            print(f"metrics: {metrics.url}", flush=True)
        graph = fanout_graph(arguments.nodes, arguments.latency, fail_every=arguments.fail_every)
        run_id = arguments.run_id or f"fanout-{uuid.uuid4()}"
        where = address or "ray.init() default"
        print(f"run_id: {run_id}", flush=True)
        print(f"starting fan-out of {arguments.nodes} x {arguments.latency} s at max_concurrent="
              f"{arguments.max_concurrent} on {where} (namespace {arguments.namespace!r}, "
              f"{'detached' if detached else 'job-owned'} actors)", flush=True)
        progress = ProgressLog(len(graph.nodes), interval=arguments.progress_interval)
        if arguments.progress_from == "signals":
            envelope = await session.flow(graph, max_concurrent=arguments.max_concurrent, on_progress=progress,
                                          run_id=run_id, isolated=True)
        else:
            control: dict[str, Any] = {}
            poller = asyncio.ensure_future(_poll_progress(control, progress, min(arguments.progress_interval, 1.0)))
            try:
                envelope = await session.flow(graph, max_concurrent=arguments.max_concurrent, executor_ref=control,
                                              run_id=run_id, isolated=True)
            finally:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
        progress.close(envelope)
        return envelope, time.monotonic() - progress.started_at
    finally:
        if metrics is not None:
            # The run is over, its final values are in the actors: let one more scrape read them.
            from ..metrics import DEFAULT_LINGER

            linger = DEFAULT_LINGER if arguments.metrics_linger is None else arguments.metrics_linger
            if await asyncio.to_thread(metrics.linger, linger):
                print("metrics: scraped once more after the run; closing", flush=True)
            metrics.stop()
        # A detached runtime outlives this job: leave none of the job's branches in it.
        await session.aclose()
        ray.shutdown()


async def _poll_progress(control: dict[str, Any], progress: ProgressLog, period: float) -> None:
    """Feed ``progress`` from the run's status every ``period`` seconds, from its admission on.

    Polled rather than subscribed: a signal per node lifecycle step is three messages a
    node, built, pickled and read one by one, which for a million nodes cost the executor
    and this driver more than the run itself (issue #18). A status is one message of
    counters whatever the run's size. A line is printed once the run is admitted."""
    while "executor" not in control:
        await asyncio.sleep(min(period, 0.05))
    run = control["executor"]
    progress.report()
    while True:
        await asyncio.sleep(period)
        try:
            status = await run.status()
        except OpGraphError:
            # Settled and forgotten (flow() is returning, and cancels this), or between an
            # executor and its replacement (flow() follows the run there, and so does ``run``).
            continue
        progress.observe(status)


async def _submit_fanout(arguments: argparse.Namespace, address: str) -> str:
    """Admit the fan-out detached (``Session.submit``); its id once it is durable."""
    import ray  # local, as in _run_fanout

    from ..connection import open_session

    session = open_session(address, namespace=arguments.namespace, detached=True)
    try:
        graph = fanout_graph(arguments.nodes, arguments.latency, fail_every=arguments.fail_every)
        return await session.submit(graph, run_id=arguments.run_id or f"fanout-{uuid.uuid4()}",
                                    max_concurrent=arguments.max_concurrent)
    finally:
        await session.aclose()  # the run's branches are its own: closing the Session leaves them
        ray.shutdown()


def run_fanout_job(arguments: argparse.Namespace) -> int:
    from opgraph.actors import envelope_summary

    address = job_address(arguments)
    problem = detach_problem(arguments, address)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    if arguments.detach:
        run_id = asyncio.run(_submit_fanout(arguments, address))
        print(f"run_id: {run_id}", flush=True)
        print(json.dumps({"run_id": run_id, "status": "submitted", "nodes": arguments.nodes}, sort_keys=True),
              flush=True)
        return 0
    envelope, elapsed = asyncio.run(_run_fanout(arguments))
    summary = envelope_summary(envelope)
    summary["elapsed_seconds"] = round(elapsed, 3)
    if arguments.results:
        with open(arguments.results, "w", encoding="utf-8") as handle:
            json.dump(envelope, handle, default=repr)
        summary["results_file"] = os.path.abspath(arguments.results)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if envelope["status"] == "completed" else EXIT_RUN_NOT_COMPLETED


