"""Chaos: kill opgraph's own actors on purpose on the embedded cluster, and print what happened.

Owns the figures of issue 13 (``python -m opgraph.cluster.bench.chaos``). Each scenario runs
on a runtime of its own (a fresh namespace), kills a real process mid-run or while idle
(``ray.kill``, or SIGKILL of its pid), and reports what the caller saw against the
target. A ledger actor records which worker started which node, so nodes that failed
without having started, and nodes that ran twice, are counted, not guessed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import ray

from opgraph.actors import RuntimeLostError, Session
from opgraph.kernel import Graph, OperationGraphBuilder, create_operation

from ..processes import descendants, free_port, http_body, process_table, start_server
from . import chaos_durable
from .chaos_durable import kill_pid, teardown

__all__ = ["main"]

SCENARIO_TIMEOUT = 300.0
SERVE_DEADLINE = 120.0  # seconds for `opgraph serve` to answer
SCENARIOS = ["worker", "idle", "store", "executor", "memory", "serve", "recovery", "branches", "owner", "submit"]


@ray.remote
class Ledger:
    """Which node started on which worker, how often; and which finished."""

    def __init__(self) -> None:
        self.starts: dict[str, list[str]] = {}
        self.finished: set[str] = set()

    def started(self, node_id: str, worker: str) -> None:
        self.starts.setdefault(node_id, []).append(worker)

    def done(self, node_id: str) -> None:
        self.finished.add(node_id)

    def snapshot(self) -> tuple[dict[str, list[str]], set[str]]:
        return self.starts, self.finished


def _timed(ledger: Any):
    async def timed(branch: Any, seconds: float = 0.2, **parameters: Any) -> str:
        await ledger.started.remote(branch.node_id, ray.get_runtime_context().get_actor_id())
        await asyncio.sleep(seconds)
        ledger.done.remote(branch.node_id)
        return "ok"

    return timed


def _fan_out(operation: str, count: int, **parameters: Any) -> Graph:
    graph = Graph(f"{operation}-{count}")
    for index in range(count):
        graph.add_node(create_operation(operation, {"instruction": f"n{index}", **parameters}))
    return graph


def _statistics(session: Session) -> dict[str, Any]:
    return ray.get(session.runtime.executor.statistics.remote())


def _own_session(label: str, **options: Any) -> Session:
    return Session(namespace=f"chaos-{label}-{uuid.uuid4().hex[:6]}", **options)


# -- 1: a worker killed mid-run ------------------------------------------------------------------
async def worker_mid_run(nodes: int, latency: float, concurrency: float, kill_after: float) -> dict[str, Any]:
    session = _own_session("worker")
    ledger = Ledger.remote()
    try:
        session.register_operation("timed", _timed(ledger), record_turn=False)
        victim = session.runtime.workers[0]
        victim_id = victim._actor_id.hex()
        started = time.monotonic()
        flow = asyncio.create_task(session.flow(_fan_out("timed", nodes, seconds=latency),
                                                max_concurrent=int(concurrency)))
        await asyncio.sleep(kill_after)
        starts_at_kill, finished_at_kill = await ledger.snapshot.remote()
        kill_pid(victim)
        envelope = await flow
        elapsed = time.monotonic() - started
        starts, finished = await ledger.snapshot.remote()
        failed = set(envelope["failed_operations"])
        on_victim = {node for node, workers in starts.items() if victim_id in workers}
        in_flight_on_victim = {node for node in on_victim if node not in finished_at_kill}
        never_started_failed = {node for node in failed if node not in starts}
        ran_twice = sorted(node for node, workers in starts.items() if len(workers) > 1)
        after = await session.flow(_fan_out("noop", 200), max_concurrent=200)
        return {
            "nodes": nodes, "failed": len(failed), "in_flight_on_victim_at_kill": len(in_flight_on_victim),
            "failed_among_in_flight_on_victim": len(failed & in_flight_on_victim),
            "never_started_failed": len(never_started_failed), "ran_twice": len(ran_twice),
            "error_types": sorted({envelope["operation_results"][n]["error_type"] for n in failed}),
            "undelivered_redispatched": _statistics(session)["undelivered"],
            "wall_seconds": round(elapsed, 2), "next_run_status": after["status"],
            "targets": {"failed <= in_flight_on_victim": len(failed) <= len(in_flight_on_victim),
                        "never_started_failed == 0": not never_started_failed, "ran_twice == 0": not ran_twice,
                        "next run completes": after["status"] == "completed"},
        }
    finally:
        ray.kill(ledger)
        teardown(session)


# -- 2: a worker killed while idle -----------------------------------------------------------------
async def worker_idle() -> dict[str, Any]:
    session = _own_session("idle")
    try:
        before = _statistics(session)["worker_pool"]
        killed_at = time.monotonic()
        kill_pid(session.runtime.workers[1])
        noticed = replaced = None
        while time.monotonic() - killed_at < 30:
            pool = _statistics(session)["worker_pool"]
            if noticed is None and pool["deaths"] > before["deaths"]:
                noticed = time.monotonic() - killed_at
            if pool["replacements"] > before["replacements"] and pool["alive"] == pool["size"]:
                replaced = time.monotonic() - killed_at
                break
            await asyncio.sleep(0.05)
        envelope = await session.flow(_fan_out("noop", 500), max_concurrent=500)
        return {"noticed_seconds": None if noticed is None else round(noticed, 2),
                "replaced_seconds": None if replaced is None else round(replaced, 2),
                "next_run_status": envelope["status"],
                "targets": {"noticed within 5 s": noticed is not None and noticed <= 5.0,
                            "next run completes": envelope["status"] == "completed"}}
    finally:
        teardown(session)


# -- 3: the branch store killed mid-run ---------------------------------------------------------------
async def store_mid_run(chains: int, length: int) -> dict[str, Any]:
    session = _own_session("store", durable=False)  # issue 13's case: a store that keeps nothing
    try:
        builder = OperationGraphBuilder("chains")
        for chain in range(chains):
            previous = builder.add_operation("chat", depends_on=[], instruction=f"chain {chain} step 0",
                                             model="sim/slow")
            for step in range(1, length):
                previous = builder.add_operation("chat", depends_on=[previous], inherit_context=True,
                                                 instruction=f"chain {chain} step {step}", model="sim/slow")
        flow = asyncio.create_task(session.flow(builder.get_graph(), max_concurrent=chains))
        await asyncio.sleep(1.0)
        kill_pid(session.runtime.stores[0])
        first = await flow
        after_builder = OperationGraphBuilder("after")
        head = after_builder.add_operation("chat", instruction="after the store died")
        after_builder.add_operation("chat", depends_on=[head], instruction="and its dependent")
        after = await session.flow(after_builder.get_graph())
        return {"first_run_status": first["status"], "first_run_failed": len(first["failed_operations"]),
                "first_run_error_types": sorted({first["operation_results"][n].get("error_type")
                                                 for n in first["failed_operations"]}),
                "branches_reported_lost": len(first.get("lost_branches", [])) + len(after.get("lost_branches", [])),
                "next_run_status": after["status"],
                "targets": {"next run completes": after["status"] == "completed"}}
    finally:
        teardown(session)


# -- 4: the executor killed mid-run ---------------------------------------------------------------------
async def executor_mid_run() -> dict[str, Any]:
    session = _own_session("executor", durable=False)  # issue 13's case: nothing to recover from
    try:
        flow = asyncio.create_task(session.flow(_fan_out("sleep", 200, seconds=0.5), max_concurrent=50))
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        kill_pid(session.runtime.executor)
        error = None
        try:
            await flow
        except RuntimeLostError as lost:
            error = lost
        seconds = time.monotonic() - killed_at
        after = await session.flow(_fan_out("noop", 200), max_concurrent=200)
        return {"caller_error": None if error is None else f"{type(error).__name__}: {error}",
                "error_after_seconds": round(seconds, 2), "next_run_status": after["status"],
                "targets": {"typed error within 10 s": error is not None and seconds < 10.0,
                            "next run completes": after["status"] == "completed"}}
    finally:
        teardown(session)


# -- 5: memory over runs on one long-lived runtime ------------------------------------------------------
def _wide(dependents: int) -> Graph:
    builder = OperationGraphBuilder("wide")
    root = builder.add_operation("noop", instruction="root")
    for index in range(dependents):
        builder.add_operation("noop", depends_on=[root], instruction=f"d{index}")
    return builder.get_graph()


async def memory_over_sessions(runs: int, dependents: int) -> dict[str, Any]:
    namespace = f"chaos-memory-{uuid.uuid4().hex[:6]}"
    rows = []
    keeper = Session(namespace=namespace)  # keeps the runtime up between the short-lived Sessions
    try:
        for _ in range(runs):
            async with Session(namespace=namespace) as session:
                envelope = await session.flow(_wide(dependents), max_concurrent=1000)
                assert envelope["status"] == "completed", envelope["status"]
            executor = _statistics(keeper)
            stores = [ray.get(store.statistics.remote()) for store in keeper.runtime.stores]
            rows.append({"executor_rss_mib": round(executor["rss_mib"], 1),
                         "store_rss_mib": round(sum(s["rss_mib"] for s in stores), 1),
                         "branches_held": executor["branches"]["branches"],
                         "store_records": sum(s["branches"] for s in stores)})
        return {"runs": rows, "targets": _flat(rows)}
    finally:
        keeper.close()
        teardown(keeper)


def _flat(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Flat within 10%, from the second run on (the first warms the process's allocator up)."""
    settled = rows[1:] or rows
    result = {}
    for key in ("executor_rss_mib", "store_rss_mib"):
        values = [row[key] for row in settled]
        result[f"{key} flat within 10%"] = max(values) <= 1.10 * min(values)
    return result


def _rss_of(pids: set[int], title: str) -> float:
    """MiB resident in those of ``pids`` whose command line starts with ``title`` (a Ray actor's class)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().decode(errors="replace")
            with open(f"/proc/{pid}/statm") as handle:
                resident = int(handle.read().split()[1])
        except OSError:
            continue
        if command.startswith(title):
            total += resident * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)
    return round(total, 1)


def memory_under_serve(runs: int) -> dict[str, Any]:
    """``opgraph serve`` in its own process; ``runs`` support-triage runs through the HTTP API."""
    from opgraph.cluster.http import ServerClient
    from opgraph.cluster.lanes import FIXED_WORKFLOW, lane_entry

    spec = json.loads(lane_entry(FIXED_WORKFLOW).examples["support-triage"].read_text())
    port = free_port()
    store = tempfile.NamedTemporaryFile(suffix=".db", delete=False).name
    base = f"http://127.0.0.1:{port}"
    token = secrets.token_urlsafe(32)  # the server's, for this bench alone
    signed = {"authorization": f"Bearer {token}"}
    rows = []
    try:
        with start_server([sys.executable, "-m", "opgraph.cluster.cli", "serve", "--port", str(port)],
                          ready=lambda: http_body(f"{base}/api/workflows", headers=signed),
                          timeout=SERVE_DEADLINE, what="opgraph serve",
                          env={**os.environ, "OPGRAPH_DB": store, "OPGRAPH_TOKEN": token},
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as server, \
                ServerClient(base, token=token, timeout=60) as api:
            api.create_workflow("triage", spec)
            for index in range(runs):
                run_id = api.start_workflow("triage", {"ticket": f"ticket {index}: card payments fail",
                                                       "priority": "high"})["run_id"]
                while api.run(run_id)["status"] not in ("completed", "failed", "cancelled"):
                    time.sleep(0.1)
                pids = descendants(process_table(), {server.pid}) - {server.pid}
                rows.append({"run": run_id, "status": api.run(run_id)["status"],
                             "executor_rss_mib": _rss_of(pids, "ray::GraphExecutor"),
                             "store_rss_mib": _rss_of(pids, "ray::BranchStore")})
            server.stop(signal.SIGINT)
        return {"runs": rows, "targets": _flat(rows)}
    finally:
        os.unlink(store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, help="run only these scenarios (default: all)")
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--dependents", type=int, default=20_000)
    arguments = parser.parse_args(argv)
    chosen = set(arguments.only or SCENARIOS)
    # Processes this one starts join its embedded Ray (the submit scenario): no token to hand over.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    main_session = Session()  # the embedded cluster, started once for every scenario
    report: dict[str, Any] = {}

    async def scenarios() -> None:
        if "worker" in chosen:
            report["1 worker killed 0.9 s into 2,000 x 200 ms at 200"] = await worker_mid_run(
                arguments.nodes, 0.2, 200, 0.9)
        if "idle" in chosen:
            report["2 worker killed while idle"] = await worker_idle()
        if "store" in chosen:
            report["3 branch store killed mid-run"] = await store_mid_run(20, 5)
        if "executor" in chosen:
            report["4 executor killed mid-run"] = await executor_mid_run()
        if "memory" in chosen:
            report[f"5a {5} runs of 1 + {arguments.dependents:,} dependents, one Session each"] = \
                await memory_over_sessions(5, arguments.dependents)
        if "recovery" in chosen:
            report["15.1 durable: executor killed at 30% of 10,000 x 200 ms at 1000"] = \
                await chaos_durable.executor_recovery()
        if "branches" in chosen:
            report["15.2 durable: branch store killed mid-run of 60 chains x 5 chat on sim/"] = \
                await chaos_durable.branch_store_messages()
        if "owner" in chosen:
            report["15.3 durable: owner SIGKILLed mid-run of 1,000 nodes, then resumed from the log"] = \
                await chaos_durable.owner_resume(main_session)

    asyncio.run(asyncio.wait_for(scenarios(), SCENARIO_TIMEOUT * 5))
    if "serve" in chosen:
        report["5b 5 fixed-workflow runs through opgraph serve"] = memory_under_serve(5)
    if "submit" in chosen:
        report["15.4 durable: submit() from a process that exits, result() from another"] = \
            chaos_durable.submit_and_read()
    for name, figures in report.items():
        print(f"== {name}")
        print(json.dumps(figures, indent=2, default=str))
    met = all(all(scenario["targets"].values()) for scenario in report.values())
    print("all targets met" if met else "SOME TARGETS MISSED")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
