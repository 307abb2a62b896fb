"""Prometheus metrics for a running opgraph runtime, made from its actors' statistics() snapshots.

Owns the one translation from snapshots to metric families (``RuntimeCollector``) and the
HTTP endpoint that serves them (``serve_metrics``, ``opgraph metrics serve``). It only reads:
it never changes actor state, and no kernel or actor module imports a metrics library.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from opgraph.actors import Runtime, connect, find_executors
from opgraph.actors.calls import BranchStoreStub, ExecutorStub, WorkerStub, answers
from opgraph.actors.statistics import LatencyHistogram
from opgraph.engines import engine_statistics
from opgraph.kernel.results import DROPPED_SPAWN_REASONS

from .control import ControlCollector
from .engines import engine_metric_families
from .webhooks import StoreCollector

__all__ = [
    "DEFAULT_LINGER", "DEFAULT_PORT", "KNOWN_PROVIDERS", "LATENCY_STATUSES", "SETTLED_STATUSES", "MetricsServer",
    "RuntimeCollector", "find_runtime", "serve", "serve_metrics",
]

DEFAULT_PORT = 9464
SCRAPE_TIMEOUT = 2.0  # seconds one scrape waits for all actors' snapshots together
# Seconds a job's endpoint waits, after its run, for one more scrape: above Prometheus's
# default 15 s scrape interval, and the shipped config's 5 s.
DEFAULT_LINGER = 30.0


# Label values every scrape carries, at 0 until something happens: Prometheus's rate()
# cannot see the increase that creates a series, so a series born at N loses N.
SETTLED_STATUSES = ("completed", "failed", "skipped", "cancelled")
LATENCY_STATUSES = ("completed", "failed", "cancelled")  # a skipped node never ran
KNOWN_PROVIDERS = ("openai", "anthropic", "sim")  # the built-in model providers
TOKEN_KINDS = (("prompt", "prompt_tokens"), ("completion", "completion_tokens"),
               ("cache_read", "cache_read_tokens"), ("cache_creation", "cache_creation_tokens"))


@dataclass(frozen=True)
class _Reading:
    """One actor's answer to a scrape: its snapshot, or None when it was dead or too slow."""

    component: str  # executor | worker | branch_store
    index: int
    snapshot: dict[str, Any] | None


class RuntimeCollector(Collector):
    """Polls the executor, workers and branch stores on every scrape and yields metric families.

    All actors are asked at once and waited for together for at most ``timeout``
    seconds. An actor that is dead, raises, or misses the deadline is reported as
    ``opgraph_up 0`` and contributes no other samples; the scrape itself always succeeds.
    """

    def __init__(self, runtime: Runtime, *, timeout: float = SCRAPE_TIMEOUT) -> None:
        self.runtime = runtime
        self.timeout = timeout
        self._lock = threading.Lock()  # concurrent scrapes share the handle lists
        self.scrapes = 0  # answered scrapes, so an endpoint can outlive its run by one more
        self.scraped = threading.Condition()

    # -- polling ------------------------------------------------------------------------
    def _poll(self) -> list[_Reading]:
        with self._lock:
            actors = [("executor", member, ExecutorStub(handle))
                      for member, handle in enumerate(self.runtime.executors)]
            actors += [("worker", index, WorkerStub(handle)) for index, handle in enumerate(self.runtime.workers)]
            actors += [("branch_store", index, BranchStoreStub(handle))
                       for index, handle in enumerate(self.runtime.stores)]
        # Every snapshot asked at once, and waited for together for at most the scrape timeout.
        found = answers([stub for _, _, stub in actors], _statistics, timeout=self.timeout)
        readings = []
        for (component, index, _), answer in zip(actors, found, strict=True):
            if answer.died:
                self._refresh(component, index)
            # Dead, too slow, or alive but its statistics() raised: reported as up 0 below.
            readings.append(_Reading(component, index, answer.value if answer.error is None else None))
        return readings

    def _refresh(self, component: str, index: int) -> None:
        """A dead worker or store is replaced by the executor: read its current handles."""
        (answer,) = answers([ExecutorStub(self.runtime.executor)], ExecutorStub.pool, timeout=self.timeout)
        if answer.error is not None:
            return  # the executor itself is down: reported as up 0; the next scrape tries again
        pool = answer.value
        with self._lock:
            self.runtime.workers[:] = pool["workers"]
            self.runtime.stores[:] = pool["stores"]

    # -- translation --------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        readings = self._poll()
        up = GaugeMetricFamily("opgraph_up", "1 when the actor answered statistics() within the scrape timeout.",
                               labels=["component", "index"])
        memory = GaugeMetricFamily("opgraph_actor_max_rss_bytes", "Peak resident memory of the actor's process.",
                                   labels=["component", "index"])
        for reading in readings:
            labels = [reading.component, str(reading.index)]
            up.add_metric(labels, 0 if reading.snapshot is None else 1)
            if reading.snapshot is not None and "max_rss_mib" in reading.snapshot:
                memory.add_metric(labels, reading.snapshot["max_rss_mib"] * 1024 * 1024)
        yield up
        yield memory
        executors = [r.snapshot for r in readings if r.component == "executor" and r.snapshot is not None]
        yield from _executor_families(_pool_snapshot(executors))
        yield from _worker_families([r for r in readings if r.component == "worker" and r.snapshot is not None])
        yield from _store_families([r for r in readings if r.component == "branch_store" and r.snapshot is not None])
        yield from engine_metric_families(engine_statistics())  # engines that ran in this process
        with self.scraped:
            self.scrapes += 1
            self.scraped.notify_all()


def _statistics(stub: Any) -> Any:
    """Any opgraph actor's ``statistics()`` (executor, worker, branch store)."""
    return stub.statistics()


_SUMMED = ("in_flight", "queued", "active_runs", "runs_started", "dispatched", "spawned", "worker_deaths")


def _pool_snapshot(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One statistics() snapshot for a pool of executors: counts summed, runs joined, the worst
    loop lag; a pool of one is its member's snapshot as it is."""
    if len(snapshots) <= 1:
        return snapshots[0] if snapshots else {}
    merged: dict[str, Any] = {key: sum(s.get(key, 0) for s in snapshots) for key in _SUMMED}
    merged["loop_lag_seconds"] = max(s.get("loop_lag_seconds", 0.0) for s in snapshots)
    for key in ("dropped_spawns_by_reason", "settled_by_status"):
        merged[key] = {}
        for snapshot in snapshots:
            for name, count in snapshot.get(key, {}).items():
                merged[key][name] = merged[key].get(name, 0) + count
    merged["runs"] = {run_id: stats for snapshot in snapshots for run_id, stats in snapshot.get("runs", {}).items()}
    latency: dict[str, dict[str, Any]] = {}
    for snapshot in snapshots:
        for status, histogram in snapshot.get("node_latency_seconds", {}).items():
            total = latency.get(status)
            if total is None:
                latency[status] = {"buckets": list(histogram["buckets"]), "sum": histogram["sum"],
                                   "count": histogram.get("count", 0)}
                continue
            total["buckets"] = [(bound, count + other) for (bound, count), (_, other)
                                in zip(total["buckets"], histogram["buckets"], strict=True)]
            total["sum"] += histogram["sum"]
            total["count"] += histogram.get("count", 0)
    merged["node_latency_seconds"] = latency
    return merged


def _executor_families(snapshot: dict[str, Any]) -> Iterator[Metric]:
    """Families from GraphExecutor.statistics(); every family is yielded even without samples."""
    gauges = [
        ("opgraph_operations_in_flight", "Operations dispatched and not yet settled, over unfinished runs.",
         "in_flight"),
        ("opgraph_operations_queued", "Operations ready but held back by capacity or a pause, over unfinished runs.",
         "queued"),
        ("opgraph_runs_active", "Runs started and not yet finished.", "active_runs"),
        ("opgraph_executor_loop_lag_seconds", "How late the executor's event loop woke for a 0.25 s timer.",
         "loop_lag_seconds"),
    ]
    counters = [
        ("opgraph_runs_started_total", "Runs started on the executor.", "runs_started"),
        ("opgraph_operations_dispatched_total", "Operation calls sent to workers.", "dispatched"),
        ("opgraph_spawns_accepted_total", "Spawned operations admitted into reactive runs (spawned_operations).",
         "spawned"),
        ("opgraph_worker_deaths_total", "Operation workers found dead (and replaced) by the executor.",
         "worker_deaths"),
    ]
    for family_type, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
        for name, documentation, key in rows:
            family = family_type(name, documentation)
            if key in snapshot:
                family.add_metric([], snapshot[key])
            yield family
    yield _labelled_counter("opgraph_spawns_dropped_total", "Spawn requests dropped, by dropped_spawns reason.",
                            "reason", _with_zeros(snapshot.get("dropped_spawns_by_reason", {}), DROPPED_SPAWN_REASONS))
    yield _labelled_counter("opgraph_nodes_settled_total", "Nodes that reached a terminal status, by status.",
                            "status", _with_zeros(snapshot.get("settled_by_status", {}), SETTLED_STATUSES))
    latency = HistogramMetricFamily("opgraph_node_latency_seconds",
                                    "Operation duration in the worker, by outcome status.", labels=["status"])
    histograms = {status: LatencyHistogram().snapshot() for status in LATENCY_STATUSES}
    histograms.update(snapshot.get("node_latency_seconds", {}))
    for status, histogram in sorted(histograms.items()):
        buckets = [(floatToGoString(bound), count) for bound, count in histogram["buckets"]]
        latency.add_metric([status], buckets, histogram["sum"])
    yield latency
    yield from _run_families(snapshot.get("runs", {}))


def _run_families(runs: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per-run gauges, for unfinished runs only: a finished run has nothing left to show."""
    live = {run_id: stats for run_id, stats in runs.items() if not stats.get("finished")}
    paused = GaugeMetricFamily("opgraph_runs_paused", "Unfinished runs that are paused.")
    paused.add_metric([], sum(1 for stats in live.values() if stats.get("paused")))
    yield paused
    per_run = [
        ("opgraph_run_operations_in_flight", "Operations of the run dispatched and not yet settled.", "running"),
        ("opgraph_run_operations_queued", "Operations of the run ready but not yet dispatched.", "ready"),
        ("opgraph_run_operations_waiting", "Operations of the run waiting on dependencies.", "waiting"),
        ("opgraph_run_capacity", "The run's limit on operations in flight (max_concurrent).", "capacity"),
        ("opgraph_run_paused", "1 while the run is paused.", "paused"),
    ]
    for name, documentation, key in per_run:
        family = GaugeMetricFamily(name, documentation, labels=["run_id"])
        for run_id, stats in sorted(live.items()):
            value = stats.get(key)
            if value is not None:  # capacity is None for an unlimited run
                family.add_metric([run_id], float(value))
        yield family


def _worker_families(readings: list[_Reading]) -> Iterator[Metric]:
    in_flight = GaugeMetricFamily("opgraph_worker_operations_in_flight", "Operations running in the worker.",
                                  labels=["worker"])
    for reading in readings:
        in_flight.add_metric([str(reading.index)], reading.snapshot.get("in_flight", 0))
    yield in_flight
    # Provider usage is counted per process; model calls run in the workers, so their sum
    # is the runtime's usage. A replaced worker starts again from zero (a counter reset).
    usage: dict[str, dict[str, int]] = {provider: {} for provider in KNOWN_PROVIDERS}
    for reading in readings:
        for provider, totals in reading.snapshot.get("providers", {}).items():
            summed = usage.setdefault(provider, {})
            for key, value in totals.items():
                summed[key] = summed.get(key, 0) + value
    tokens = CounterMetricFamily("opgraph_provider_tokens_total",
                                 "Model tokens used, by provider and kind (prompt includes cache_read and "
                                 "cache_creation, which say how much of it the provider's prompt cache served "
                                 "or stored).", labels=["provider", "kind"])
    for provider, totals in sorted(usage.items()):
        for kind, key in TOKEN_KINDS:
            tokens.add_metric([provider, kind], totals.get(key, 0))
    yield tokens
    model_latency = HistogramMetricFamily("opgraph_model_call_latency_seconds",
                                          "Model-call duration (retries included), by provider.",
                                          labels=["provider"])
    empty = LatencyHistogram().snapshot()
    merged: dict[str, dict[str, Any]] = {provider: {"buckets": dict(empty["buckets"]), "sum": 0.0}
                                         for provider in KNOWN_PROVIDERS}
    for reading in readings:
        for provider, histogram in reading.snapshot.get("provider_latency", {}).items():
            total = merged.setdefault(provider, {"buckets": {}, "sum": 0.0})
            total["sum"] += histogram["sum"]
            for bound, count in histogram["buckets"]:
                total["buckets"][bound] = total["buckets"].get(bound, 0) + count
    for provider, total in sorted(merged.items()):
        buckets = [(floatToGoString(bound), count) for bound, count in sorted(total["buckets"].items())]
        model_latency.add_metric([provider], buckets, total["sum"])
    yield model_latency
    for name, documentation, key in [
        ("opgraph_provider_calls_total", "Successful model calls, by provider.", "calls"),
        ("opgraph_provider_retries_total", "Model-call retries (after a retryable failure), by provider.", "retries"),
        ("opgraph_provider_failures_total", "Model calls that failed for good, by provider.", "failures"),
    ]:
        yield _labelled_counter(name, documentation, "provider",
                                {provider: totals.get(key, 0) for provider, totals in usage.items()})


def _store_families(readings: list[_Reading]) -> Iterator[Metric]:
    for family_type, name, documentation, key in [
        (GaugeMetricFamily, "opgraph_branches", "Branches held by the store shard.", "branches"),
        (GaugeMetricFamily, "opgraph_branch_store_bytes", "Bytes of messages the store shard holds itself "
                                                          "(shared prefixes are counted once).", "bytes"),
        (GaugeMetricFamily, "opgraph_branch_store_messages", "Messages the store shard holds itself.",
         "own_messages"),
        (CounterMetricFamily, "opgraph_branch_clones_total", "Copy-on-write branch clones made by the shard.",
         "clones"),
    ]:
        family = family_type(name, documentation, labels=["store"])
        for reading in readings:
            family.add_metric([str(reading.index)], reading.snapshot.get(key, 0))
        yield family


def _with_zeros(values: dict[str, int], known: Iterable[str]) -> dict[str, int]:
    """``values`` with every known label value present: a series that first appears at N
    makes rate() miss that first increase (a short run showed no throughput at all)."""
    return {**dict.fromkeys(known, 0), **values}


def _labelled_counter(name: str, documentation: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value_label, value in sorted(values.items()):
        family.add_metric([value_label], value)
    return family


# -- the endpoint ---------------------------------------------------------------------------


class MetricsServer:
    """A running metrics endpoint; ``stop()`` (or leaving a ``with`` block) closes it."""

    def __init__(self, server: Any, thread: threading.Thread, registry: CollectorRegistry,
                 collector: RuntimeCollector) -> None:
        self._server = server
        self._thread = thread
        self.registry = registry
        self.collector = collector

    def linger(self, seconds: float = DEFAULT_LINGER) -> bool:
        """Wait until one more scrape has been answered, at most ``seconds``; True when one was.

        For an endpoint about to close because its run ended: the last scrape before the
        close would otherwise miss the run's tail (4,946 of 5,000 nodes were seen settled).
        Without any scrape so far nobody is scraping, and it returns False at once.
        """
        collector = self.collector
        with collector.scraped:
            seen = collector.scrapes
            if seen == 0 or seconds <= 0:
                return False
            return collector.scraped.wait_for(lambda: collector.scrapes > seen, timeout=seconds)

    @property
    def host(self) -> str:
        return self._server.server_address[0]

    @property
    def port(self) -> int:
        """The bound port (the real one when 0 asked for any free port)."""
        return self._server.server_port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def serve_metrics(session_or_runtime: Any, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
                  timeout: float = SCRAPE_TIMEOUT, store: str | None = None) -> MetricsServer:
    """Serve ``/metrics`` for a Session's (or a Runtime's) actors on a background thread.

    ``port=0`` binds any free port (read it back from ``.port``). The registry is the
    server's own, so nothing else registered in this process leaks into the output. The
    webhook deliveries come from the run store at ``store`` (default ``OPGRAPH_DB``).
    """
    runtime = getattr(session_or_runtime, "runtime", session_or_runtime)
    registry = CollectorRegistry(auto_describe=False)
    collector = RuntimeCollector(runtime, timeout=timeout)
    registry.register(collector)
    registry.register(ControlCollector())  # the queue and schedules of OPGRAPH_DB, beside the runtime's
    registry.register(StoreCollector(store))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, registry, collector)


def find_runtime() -> Runtime | None:
    """The runtime of the current Ray namespace (the newest executor of each pool member, and
    member 0's workers and stores); None without an executor."""
    executors = find_executors(ray.get_runtime_context().namespace)
    if not executors:
        return None
    newest: dict[tuple[str, int], tuple[int, str, Any]] = {}  # (runtime, member) -> (generation, name, handle)
    for name, executor in executors:
        base, _, generation = name.partition(".g")
        runtime_name, marker, member = base.rpartition("-m")
        if not (marker and member.isdigit()):
            runtime_name, member = base, "0"
        key = (runtime_name, int(member))
        rank = int(generation) if generation.isdigit() else 0
        (standby,) = answers([ExecutorStub(executor, name)], ExecutorStub.is_standby, timeout=30)
        if standby.error is not None or standby.value:
            continue  # a spare executor standing by is not the runtime's (nor one that does not answer)
        if key not in newest or rank > newest[key][0]:
            newest[key] = (rank, name, executor)
    # The runtime with a member 0 whose name sorts last (as the single executor's did before pools).
    for runtime_name in sorted({key[0] for key in newest if key[1] == 0}, reverse=True):
        members = sorted((member, found) for (owner, member), found in newest.items() if owner == runtime_name)
        (answer,) = answers([ExecutorStub(members[0][1][2], members[0][1][1])], ExecutorStub.pool, timeout=30)
        if answer.error is not None:
            continue
        pool = answer.value
        return Runtime(executors=[found[2] for _, found in members], executor_names=[found[1] for _, found in members],
                       workers=list(pool["workers"]), stores=list(pool["stores"]), pool_size=len(members))
    return None


def serve(address: str | None, port: int = DEFAULT_PORT, host: str = "127.0.0.1", *,
          namespace: str = "opgraph", timeout: float = SCRAPE_TIMEOUT) -> int:
    """``opgraph metrics serve``: join Ray, find (or start) the runtime, serve until Ctrl-C."""
    from ..connection import EXIT_RUNTIME, RuntimeStartError, probe_cluster

    try:
        probe_cluster(address)
    except RuntimeStartError as exc:
        print(f"opgraph metrics serve: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    connect(address, namespace=namespace)
    runtime = find_runtime()
    if runtime is None:
        # Nothing runs in this namespace yet (always so for the embedded local Ray):
        # start the shared actors, so runs started later in this Ray find and share them.
        print(f"no opgraph runtime in namespace {namespace!r}; starting one", file=sys.stderr)
        runtime = Runtime.get_or_start()
    try:
        server = serve_metrics(runtime, port, host, timeout=timeout)
    except OSError as exc:
        print(f"cannot serve metrics on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    print(f"serving opgraph metrics on {server.url} (Ctrl-C to stop)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
