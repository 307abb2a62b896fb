"""The job entrypoint: one large run as a Ray job, reported in the job's logs.

Owns what a job driver prints and returns: periodic progress lines, the summary of the
result envelope as the last stdout line (JSON), the full envelope in a file on request,
and an exit status that is non-zero unless the run completed. It builds graphs and
calls ``Session.flow``; it never schedules anything itself.

    ray job submit --working-dir . -- python -m opgraph.cluster.job fanout --nodes 10000 --latency 0.05
    python -m opgraph.cluster.job fanout --nodes 200 --latency 0.01     # embedded local Ray
    ray job submit --working-dir . -- python -m opgraph.cluster.job workflow flow.json --input topic=x
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from opgraph.kernel import Graph, create_operation

from ..connection import EXIT_RUNTIME, RuntimeStartError

__all__ = ["EXIT_RUNTIME", "EXIT_RUN_NOT_COMPLETED", "EXIT_USAGE", "ProgressLog", "fanout_graph", "main"]

EXIT_RUN_NOT_COMPLETED = 1  # the run failed or was cancelled: the job is marked FAILED
EXIT_USAGE = 2  # bad arguments or store, or a workflow definition that does not validate or compile


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


class ProgressLog:
    """The ``on_progress`` callback of a job: counts node lifecycle signals, prints a line
    whenever another ``step`` of the nodes has settled or ``interval`` seconds have passed.

    Settled counts completed, failed and skipped nodes (cancelled nodes send no signal);
    in flight is started minus finished. A line looks like
    ``progress: settled 120/200 (60%), in flight 20, failed 0, 1.4 s``; the last one,
    from the run's result, adds ``cancelled N`` when nodes were cancelled.
    """

    def __init__(self, total: int, *, out: TextIO | None = None, interval: float = 1.0,
                 step: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.out = out if out is not None else sys.stdout
        self.interval = interval
        self.step_nodes = max(1, int(total * step))
        self.clock = clock
        self.started_at = clock()
        self.counts = {"started": 0, "completed": 0, "failed": 0, "skipped": 0, "cancelled": 0}
        self.finished = False
        self.lines = 0
        self._last_line_at = self.started_at
        self._last_line_settled = 0

    @property
    def settled(self) -> int:
        return self.counts["completed"] + self.counts["failed"] + self.counts["skipped"]

    @property
    def in_flight(self) -> int:
        if self.finished:
            return 0
        return max(0, self.counts["started"] - self.counts["completed"] - self.counts["failed"])

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        if status in self.counts:
            self.counts[status] += 1
        now = self.clock()
        if (self.settled - self._last_line_settled >= self.step_nodes
                or now - self._last_line_at >= self.interval):
            self.report(now)

    def close(self, envelope: dict[str, Any] | None = None) -> None:
        """The last line, from the run's result when it is given: a cancelled node sends no
        signal, so counting signals alone left "in flight 96" after a cancel. Once the run
        has ended nothing is in flight, and the line says how many were cancelled."""
        if envelope is not None:
            statuses = list(envelope.get("operation_statuses", {}).values())
            for status in ("completed", "failed", "skipped", "cancelled"):
                self.counts[status] = statuses.count(status)
            self.counts["started"] = self.counts["completed"] + self.counts["failed"]
            self.finished = True
            self.report()
        elif self.lines == 0 or self._last_line_settled != self.settled:
            self.report()

    def report(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        percent = 100.0 * self.settled / self.total if self.total else 100.0
        cancelled = f", cancelled {self.counts['cancelled']}" if self.counts["cancelled"] else ""
        print(f"progress: settled {self.settled}/{self.total} ({percent:.0f}%), in flight {self.in_flight}, "
              f"failed {self.counts['failed']}{cancelled}, {now - self.started_at:.1f} s", file=self.out, flush=True)
        self.lines += 1
        self._last_line_at = now
        self._last_line_settled = self.settled


def _address(arguments: argparse.Namespace) -> str | None:
    """Where to run: --address, else the cluster Ray names for job drivers, else ray.init()'s default."""
    if arguments.address:
        return arguments.address
    if os.environ.get("RAY_ADDRESS"):
        return "auto"  # `ray job submit` sets RAY_ADDRESS for the driver
    return None


async def _run_fanout(arguments: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """Run the fan-out; return its envelope and the seconds it took."""
    import ray  # local: `--help` and usage errors must not pay for Ray

    from opgraph.cluster.connection import open_session

    address = _address(arguments)
    detached = arguments.detached if arguments.detached is not None else address is not None
    session = open_session(address, namespace=arguments.namespace, detached=detached)
    session.register_operation("fail", fail, record_turn=False)
    metrics = None
    try:
        if arguments.metrics_port is not None:
            from opgraph.cluster.metrics import serve_metrics  # local: prometheus only when asked

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
        envelope = await session.flow(graph, max_concurrent=arguments.max_concurrent, on_progress=progress,
                                      run_id=run_id, isolated=True)
        progress.close(envelope)
        return envelope, time.monotonic() - progress.started_at
    finally:
        if metrics is not None:
            # The run is over, its final values are in the actors: let one more scrape read them.
            from opgraph.cluster.metrics import DEFAULT_LINGER

            linger = DEFAULT_LINGER if arguments.metrics_linger is None else arguments.metrics_linger
            if await asyncio.to_thread(metrics.linger, linger):
                print("metrics: scraped once more after the run; closing", flush=True)
            metrics.stop()
        # A detached runtime outlives this job: leave none of the job's branches in it.
        await session.aclose()
        ray.shutdown()


def _fanout(arguments: argparse.Namespace) -> int:
    from opgraph.actors import envelope_summary

    envelope, elapsed = asyncio.run(_run_fanout(arguments))
    summary = envelope_summary(envelope)
    summary["elapsed_seconds"] = round(elapsed, 3)
    if arguments.results:
        with open(arguments.results, "w", encoding="utf-8") as handle:
            json.dump(envelope, handle, default=repr)
        summary["results_file"] = os.path.abspath(arguments.results)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if envelope["status"] == "completed" else EXIT_RUN_NOT_COMPLETED


async def _run_workflow(arguments: argparse.Namespace) -> Any:
    """Run a workflow file on the fixed lane; the run is recorded in the driver's SQLite store."""
    import ray  # local, as in _run_fanout

    from opgraph.cluster.cli.flow import parse_inputs
    from opgraph.cluster.connection import open_session
    from opgraph.cluster.lanes.fixed.runner import compile_source, file_source, run_workflow
    from opgraph.cluster.store.runs import RunStore

    inputs = parse_inputs(arguments.input)
    # Under `ray job submit` the file is read from Ray's copy of the working dir; the run
    # records the path the user gave, which means something to them (and to the next job).
    source = file_source(arguments.file, ref=arguments.file)
    compiled = compile_source(source, inputs=inputs, base_dir=arguments.base_dir, model=arguments.model)
    address = _address(arguments)
    detached = arguments.detached if arguments.detached is not None else address is not None
    with RunStore(arguments.store) as store:  # checked before Ray starts: a bad store is a usage error
        session = open_session(address, namespace=arguments.namespace, detached=detached)
        try:
            run_id = arguments.run_id or f"workflow-{uuid.uuid4()}"
            print(f"run_id: {run_id}", flush=True)
            print(f"starting {source.ref} ({source.content_hash}) with {len(compiled.graph.nodes)} operations "
                  f"on {address or 'ray.init() default'}; store {store.path}", flush=True)
            progress = ProgressLog(len(compiled.graph.nodes), interval=arguments.progress_interval)
            result = await run_workflow(session, source, inputs=inputs, base_dir=arguments.base_dir,
                                        model=arguments.model, store=store, run_id=run_id,
                                        max_concurrent=arguments.max_concurrent, compiled=compiled,
                                        on_progress=progress)
            progress.close({"operation_statuses": result.statuses} if result.statuses else None)
            return result
        finally:
            ray.shutdown()


def _workflow(arguments: argparse.Namespace) -> int:
    from opgraph.cluster.lanes.fixed.spec import WorkflowDefinitionError
    from opgraph.kernel import OpGraphError

    try:
        result = asyncio.run(_run_workflow(arguments))
    except WorkflowDefinitionError as exc:
        print(json.dumps({"errors": exc.errors}), file=sys.stderr, flush=True)
        return EXIT_USAGE
    except RuntimeStartError:
        raise  # main() reports it
    except OpGraphError as exc:  # the store, the inputs: nothing ran
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    payload = result.to_dict()
    summary = {key: payload[key] for key in ("run_id", "status", "source", "content_hash", "statuses", "elapsed")}
    summary["failed"] = sorted(payload["errors"])
    if arguments.results:
        with open(arguments.results, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, default=repr)
        summary["results_file"] = os.path.abspath(arguments.results)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if result.status == "completed" else EXIT_RUN_NOT_COMPLETED


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m opgraph.cluster.job",
        description="Run one opgraph run as a Ray job: progress in the logs, the summary as the last line.",
        epilog=f"Exit status: 0 the run completed; {EXIT_RUN_NOT_COMPLETED} it failed or was cancelled; "
               f"{EXIT_USAGE} bad arguments, store or definition (nothing ran); {EXIT_RUNTIME} Ray could not be "
               "started or reached (nothing ran).",
    )
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    fanout = modes.add_parser("fanout", help="N independent nodes of the built-in 'sleep' operation")
    fanout.add_argument("--nodes", type=_positive(int), default=1000, help="number of nodes (1000)")
    fanout.add_argument("--latency", type=float, default=0.05, help="seconds each node sleeps (0.05)")
    fanout.add_argument("--max-concurrent", type=_positive(int), default=100,
                        help="operations in flight at once (100)")
    fanout.add_argument("--fail-every", type=int, default=0, metavar="K",
                        help="make every K-th node fail, to see a failed run (0: none)")
    fanout.add_argument("--results", default=None, metavar="PATH",
                        help="write the full result envelope as JSON to PATH")
    fanout.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus /metrics on PORT during the run (0: any free port)")
    fanout.add_argument("--metrics-host", default="127.0.0.1", help="interface for --metrics-port (127.0.0.1)")
    fanout.add_argument("--metrics-linger", type=float, default=None, metavar="SECONDS",
                        help="after the run, keep --metrics-port open until one more scrape has read the final "
                             "values, at most SECONDS (30; 0: close at once). Nothing scraped: it closes at once")
    _add_runtime_arguments(fanout, run_id_default="fanout-<uuid>")
    fanout.set_defaults(handler=_fanout)
    workflow = modes.add_parser("workflow", help="run a fixed-workflow JSON file (ADR-0073), recorded in SQLite")
    workflow.add_argument("file", metavar="FILE")
    workflow.add_argument("--input", action="append", metavar="KEY=VALUE",
                          help="a run input in the flow context (repeatable; JSON values are parsed)")
    workflow.add_argument("--model", default=None, help="provider/model for every chat node")
    workflow.add_argument("--base-dir", default=None, help="containment root for coding-engine cwd")
    workflow.add_argument("--max-concurrent", type=_positive(int), default=5, help="operations in flight (5)")
    workflow.add_argument("--store", default=None,
                          help="SQLite store on the driver (default: OPGRAPH_DB or ~/.opgraph/opgraph.db)")
    workflow.add_argument("--results", default=None, metavar="PATH",
                          help="write the full run result (outputs, errors, provenance) as JSON to PATH")
    _add_runtime_arguments(workflow, run_id_default="workflow-<uuid>")
    workflow.set_defaults(handler=_workflow)
    return parser


def _add_runtime_arguments(mode: argparse.ArgumentParser, *, run_id_default: str) -> None:
    mode.add_argument("--address", default=None,
                      help='Ray address ("auto", "ray://host:port", "host:port"); default: RAY_ADDRESS '
                           "when set (as under `ray job submit`), else ray.init()'s choice: a cluster "
                           "`ray start` began on this machine, or an embedded local Ray")
    mode.add_argument("--namespace", default="opgraph", help="Ray namespace of the opgraph actors (opgraph)")
    mode.add_argument("--detached", action=argparse.BooleanOptionalAction, default=None,
                      help="keep the opgraph actors alive after this job, shared by later jobs and "
                           "clients (default: yes with --address or RAY_ADDRESS, else no)")
    mode.add_argument("--run-id", default=None,
                      help="name of the run, for `opgraph run ... RUN_ID` from another client "
                           f"(default: {run_id_default}, printed at start)")
    mode.add_argument("--progress-interval", type=float, default=1.0,
                      help="seconds between progress lines at most (1.0); also one line per 5%% settled")


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        return arguments.handler(arguments)
    except RuntimeStartError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_RUNTIME


if __name__ == "__main__":
    raise SystemExit(main())
