"""Chaos for durable runs: the executor, a branch store and a run's owner killed; a run submitted and left.

Owns the figures of issue 15, run by ``python -m opgraph.cluster.bench.chaos`` beside issue 13's
scenarios. Every runtime here is durable (the default): what is measured is what the run
log and the durable branches keep, against the same run left alone, in the same process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

import ray

from opgraph.actors import RunControl, Session
from opgraph.actors.persistence import RunLog, database_path
from opgraph.kernel import Graph, OperationGraphBuilder, create_operation

from ..processes import run_command, run_until

__all__ = ["OWNER_SCRIPT", "SETTLED_PRINTER", "SettledCounter", "branch_store_messages", "counting_operation",
           "executor_recovery", "kill_pid", "marks_per_node", "owner_resume", "runs_per_node", "submit_and_read",
           "teardown"]

OWNER_DEADLINE = 300.0  # seconds for an owner process to reach the point it is killed at
COMMAND_DEADLINE = 180.0  # seconds a submitting or reading process may take


def counting_operation(marks: str):
    """Each attempt appends its node id to a file of its worker process: what ran, how often."""

    async def counted(branch: Any, seconds: float = 0.2, **parameters: Any) -> list:
        with open(os.path.join(marks, str(os.getpid())), "a") as handle:
            handle.write(branch.node_id + "\n")
        await asyncio.sleep(seconds)
        return list(branch.idempotency_key)

    return counted


def runs_per_node(marks: str) -> Counter[str]:
    """How often each node ran, from the marks files of every worker process in folder ``marks``."""
    counts: Counter[str] = Counter()
    for name in os.listdir(marks):
        counts.update(marks_per_node(os.path.join(marks, name)))
    return counts


def marks_per_node(path: str | os.PathLike[str]) -> Counter[str]:
    """How often each node id stands in the marks file at ``path``."""
    with open(path) as handle:
        return Counter(handle.read().split())


class SettledCounter:
    """An ``on_progress`` callback: counts the completed nodes, and sets ``reached`` once ``target`` have."""

    def __init__(self, target: float) -> None:
        self.target = target
        self.count = 0
        self.reached = asyncio.Event()

    def __call__(self, op_id: str, name: str, status: str, elapsed: float) -> None:
        self.count += status == "completed"
        if self.count >= self.target:
            self.reached.set()


def _fan_out(count: int, seconds: float) -> Graph:
    graph = Graph("durable-fan-out")
    for index in range(count):
        graph.add_node(create_operation("counted", {"instruction": f"n{index}", "seconds": seconds}))
    return graph


def kill_pid(handle: Any) -> None:
    """SIGKILL the process of one of the runtime's actors, as the OOM killer would."""
    os.kill(ray.get(handle.statistics.remote())["pid"], signal.SIGKILL)


def teardown(session: Session) -> None:
    """Kill every actor of ``session``'s runtime (a scenario's own), the spare executor too."""
    session.runtime.kill()


async def executor_recovery(nodes: int = 10_000, seconds: float = 0.2, concurrency: int = 1000,
                            at: float = 0.3) -> dict[str, Any]:
    """The executor SIGKILLed at ``at`` of a fan-out; the same fan-out undisturbed, for the wall time."""
    session = Session(namespace=f"chaos-recovery-{uuid.uuid4().hex[:6]}")
    try:
        with tempfile.TemporaryDirectory() as undisturbed_marks, tempfile.TemporaryDirectory() as marks:
            session.register_operation("counted", counting_operation(undisturbed_marks), record_turn=False)
            started = time.monotonic()
            baseline = await session.flow(_fan_out(nodes, seconds), max_concurrent=concurrency)
            undisturbed = time.monotonic() - started
            session.register_operation("counted", counting_operation(marks), record_turn=False)
            progress = SettledCounter(at * nodes)
            started = time.monotonic()
            flow = asyncio.create_task(session.flow(_fan_out(nodes, seconds), max_concurrent=concurrency,
                                                    on_progress=progress))
            await progress.reached.wait()
            executor = session.runtime.executor
            at_kill = ray.get(executor.statistics.remote())
            kill_pid(executor)
            envelope = await flow
            killed = time.monotonic() - started
            runs = runs_per_node(marks)
        in_flight_at_kill = at_kill["in_flight"]
        twice = {node for node, count in runs.items() if count > 1}
        second_attempts = {node for node, result in envelope["operation_results"].items()
                           if isinstance(result, list) and result[2] == 2}
        return {
            "status": envelope["status"], "nodes": len(envelope["operation_statuses"]),
            "completed": len(envelope["completed_operations"]) - len(envelope["failed_operations"]),
            "settled_at_kill": sum(at_kill["settled_by_status"].values()) if at_kill.get("settled_by_status")
            else progress.count, "in_flight_at_kill": in_flight_at_kill,
            "nodes_run_more_than_once": len(twice), "of_them_attempt_2": len(twice & second_attempts),
            "wall_seconds_killed": round(killed, 2), "wall_seconds_undisturbed": round(undisturbed, 2),
            "ratio": round(killed / undisturbed, 2), "baseline_status": baseline["status"],
            "targets": {"completed, every node": envelope["status"] == "completed"
                        and len(envelope["operation_statuses"]) == nodes,
                        "re-run <= in flight at kill, each as attempt 2": len(twice) <= in_flight_at_kill
                        and twice <= second_attempts,
                        "wall time <= 1.5x undisturbed": killed <= 1.5 * undisturbed},
        }
    finally:
        teardown(session)


async def branch_store_messages(chains: int = 60, length: int = 5, kill_after: float = 1.0) -> dict[str, Any]:
    """60 chains of 5 chat turns on sim/, each node inheriting its predecessor's conversation; the
    branch store is SIGKILLed mid-run. Every chain's last branch must hold all its turns."""
    session = Session(namespace=f"chaos-branches-{uuid.uuid4().hex[:6]}")
    try:
        builder = OperationGraphBuilder("chains")
        last = []
        for chain in range(chains):
            previous = builder.add_operation("chat", depends_on=[], instruction=f"chain {chain} step 0",
                                             model="sim/default", branch=session.new_branch(f"chain-{chain}"))
            for step in range(1, length):
                previous = builder.add_operation("chat", depends_on=[previous], inherit_context=True,
                                                 instruction=f"chain {chain} step {step}", model="sim/default")
            last.append(previous)
        branches: dict[str, str] = {}
        flow = asyncio.create_task(session.flow(builder.get_graph(), max_concurrent=chains,
                                                on_branch_created=lambda view: branches.setdefault(view.node_id,
                                                                                                  view.id)))
        await asyncio.sleep(kill_after)
        kill_pid(session.runtime.stores[0])
        envelope = await flow
        expected = found = 0
        for node in last:
            messages = await session.messages(branches[node])
            expected += 2 * length
            found += len(messages)
        return {"status": envelope["status"], "failed": len(envelope["failed_operations"]),
                "failure_kinds": sorted({envelope["operation_results"][node].get("error_type")
                                         for node in envelope["failed_operations"]}),
                "messages_expected": expected, "messages_found": found, "messages_lost": expected - found,
                "lost_branches_reported": len(envelope.get("lost_branches", [])),
                "store_replacements": ray.get(session.runtime.executor.statistics.remote())["store_pool"][
                    "replacements"],
                "targets": {"messages lost == 0": found == expected, "completed": envelope["status"] == "completed"}}
    finally:
        teardown(session)


# A process that prints "settled N" as each of its nodes completes (``run_until`` waits for one).
SETTLED_PRINTER = r"""
settled = 0

def progress(op_id, name, status, elapsed):
    global settled
    if status == "completed":
        settled += 1
        print("settled", settled, flush=True)
"""

# A run's owner, to be SIGKILLed mid-run: NODES nodes on its own embedded Ray, CONCURRENCY at a
# time, each appending its node id to MARKS and sleeping SECONDS.
# Usage: python -c OWNER_SCRIPT MARKS RUN_ID NODES SECONDS CONCURRENCY
OWNER_SCRIPT = r"""
import asyncio, sys
from opgraph.actors import Session
from opgraph.kernel import Graph, create_operation

marks, run_id, nodes, seconds, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), \
    int(sys.argv[5])

async def marked(branch, **parameters):
    with open(marks, "a") as handle:
        handle.write(branch.node_id + "\n")
    await asyncio.sleep(seconds)
    return "done"

session = Session()
session.register_operation("marked", marked, record_turn=False)
graph = Graph("owned")
for index in range(nodes):
    graph.add_node(create_operation("marked", {"instruction": str(index)}))
""" + SETTLED_PRINTER + r"""
asyncio.run(session.flow(graph, max_concurrent=concurrency, run_id=run_id, on_progress=progress))
print("finished", flush=True)
"""


async def owner_resume(session: Session) -> dict[str, Any]:
    """A process running 1,000 nodes on its own embedded Ray is SIGKILLed (Ray and all) half way;
    the run is continued from the log here. Nodes the log shows settled must not run again."""
    run_id = f"chaos-owned-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as folder:
        marks = os.path.join(folder, "marks")
        run_until([sys.executable, "-c", OWNER_SCRIPT, marks, run_id, "1000", "0.02", "20"],
                  lambda lines: "settled 500" in lines, timeout=OWNER_DEADLINE)
        logged = RunLog(database_path()).load(run_id)
        settled = {record[2] for batch in logged.batches for record in batch
                   if record[0] == "finished" and record[4] == "completed"}
        started = time.monotonic()
        envelope = await RunControl.resume_from_log(run_id, session)
        resumed = time.monotonic() - started
        counts = marks_per_node(marks)
    rerun = sorted(node for node in settled if counts.get(node, 0) > 1)
    return {"status": envelope["status"], "nodes": len(envelope["operation_statuses"]),
            "settled_before_kill": len(settled), "completed_nodes_rerun": len(rerun),
            "resume_seconds": round(resumed, 2),
            "targets": {"completed nodes re-run == 0": not rerun, "final status completed":
                        envelope["status"] == "completed" and len(envelope["operation_statuses"]) == 1000}}


_SUBMITTER = r"""
import asyncio, sys
from opgraph.actors import Session
from opgraph.cluster.jobs import fanout_graph
session = Session(address=sys.argv[1])
print(asyncio.run(session.submit(fanout_graph(200, 0.05), max_concurrent=20)), flush=True)
"""

_READER = r"""
import asyncio, json, sys
from opgraph.actors import RunControl
envelope = asyncio.run(RunControl.attach(sys.argv[2], address=sys.argv[1]).result(timeout=120))
print(json.dumps({"status": envelope["status"], "nodes": len(envelope["operation_statuses"])}), flush=True)
"""


def submit_and_read() -> dict[str, Any]:
    """A process submits a run to this process's Ray and exits; another reads the envelope."""
    address = ray.get_runtime_context().gcs_address
    environment = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    submitted = run_command([sys.executable, "-c", _SUBMITTER, address], env=environment, timeout=COMMAND_DEADLINE)
    run_id = submitted.stdout.strip().splitlines()[-1] if submitted.returncode == 0 else None
    if run_id is None:
        return {"error": submitted.stderr[-2000:], "targets": {"submitted": False}}
    read = run_command([sys.executable, "-c", _READER, address, run_id], env=environment, timeout=COMMAND_DEADLINE)
    result = json.loads(read.stdout.strip().splitlines()[-1]) if read.returncode == 0 else {"error": read.stderr}
    return {"run_id": run_id, "submitter_exit": submitted.returncode, **result,
            "targets": {"envelope complete": result.get("status") == "completed" and result.get("nodes") == 200}}
