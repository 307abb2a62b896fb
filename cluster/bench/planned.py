"""Figures of the planned lane: plan-to-first-dispatch latency on sim/, and a 200-assignment plan with 500 spawns.

    python -m opgraph.cluster.bench.planned --repeat 3          # both, on the embedded local Ray
    python -m opgraph.cluster.bench.planned --skip-kill          # without the kill-at-50% resume

Latency: from ``prepare`` (the planner's call on ``sim/default``) to the first op started,
beside a one-node ``Session.flow``'s submit-to-start in the same run (the baseline). Large:
a scripted planner returns 200 assignments, the first 100 ask for 5 follow-ups each (500
spawns, ``--max-ops 700``), each op takes ``--latency`` s; wall time end to end, then the
same run in a process killed at 50% settled and ``opgraph o flow --resume`` timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from ..processes import run_command, run_until

__all__ = ["BigPlan", "main"]

ASSIGNMENTS, SPAWNERS, CHILDREN = 200, 100, 5
CONCURRENCY = 100  # ops in flight
OWNER_SECONDS = 600.0  # for the owner to reach half the run, and for the resume to end


ROLES = ("researcher", "analyst", "writer", "critic")


class BigPlan:
    """A scripted model: 200 assignments for the planner (spread over ``roles`` of the roster); ops 1..100
    ask for 5 children; each op sleeps ``latency``."""

    def __init__(self, latency: float, roles: int = 1) -> None:
        self.latency = latency
        self.roles = ROLES[:roles]

    async def __call__(self, request: Any) -> str:
        user = next((str(m.get("content")) for m in reversed(request.messages) if m.get("role") == "user"), "")
        if "Plan the work for this task" in user:
            return json.dumps({"assignments": [{"task": f"part {i}", "assignee": self.roles[i % len(self.roles)],
                                                "depends_on": []} for i in range(1, ASSIGNMENTS + 1)]})
        await asyncio.sleep(self.latency)
        # The instruction is the part after the context preamble: "part N", or a child's "extra K of N".
        instruction = next((part for part in user.split("\n\n")
                            if part.startswith(("part ", "extra "))), "")
        words = instruction.split()
        spawn = ([{"instruction": f"extra {k} of {words[1]}"} for k in range(CHILDREN)]
                 if words[:1] == ["part"] and int(words[1]) <= SPAWNERS else [])
        return json.dumps({"text": f"done {instruction}", "spawn": spawn})


async def _latency(session: Any, store: Any, repeat: int) -> dict[str, float]:
    from opgraph.cluster.lanes import PLANNED_REACTIVE_FLOW, RunHooks, lane_adapter
    from opgraph.kernel import OperationGraphBuilder

    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    planned, baseline, planning = [], [], []
    for _ in range(repeat):
        first: asyncio.Future = asyncio.get_running_loop().create_future()
        started = time.perf_counter()
        prepared = await lane.prepare(lane.invocation("compare three battery chemistries", synthesis=False,
                                                      max_ops=6), session=session)
        planning.append(time.perf_counter() - started)

        def seen(label: str, name: str, status: str, elapsed: float, first: asyncio.Future = first) -> None:
            if status == "started" and not first.done():
                first.set_result(time.perf_counter())

        run = asyncio.ensure_future(lane.execute(prepared, session=session, hooks=RunHooks(on_progress=seen)))
        planned.append(await first - started)
        await run
        builder = OperationGraphBuilder()
        builder.add_operation("operate", instruction="one", model="sim/default")
        start_one = asyncio.get_running_loop().create_future()
        began = time.perf_counter()

        def one(op: str, name: str, status: str, elapsed: float, start_one: asyncio.Future = start_one) -> None:
            if status == "started" and not start_one.done():
                start_one.set_result(time.perf_counter())

        flow = asyncio.ensure_future(session.flow(builder.get_graph(), on_progress=one, isolated=True))
        baseline.append(await start_one - began)
        await flow
    return {"plan_to_first_dispatch_s": statistics.median(planned), "planning_s": statistics.median(planning),
            "flow_submit_to_start_s": statistics.median(baseline)}


def _register_big_plan(session: Any, latency: float, roles: int) -> None:
    from opgraph.actors.providers import ScriptedProvider

    session.register_provider("scripted", ScriptedProvider(BigPlan(latency, roles)))


async def _large(session: Any, store: Any, latency: float, roles: int, *, register: bool = True) -> dict[str, Any]:
    """The big plan once, end to end. ``register=False`` when the caller registered its planner
    already (once per session, as a user's program does: a registration before each timed run
    made the run also wait for the executor's and the workers' fetch of the new provider)."""
    from opgraph.cluster.lanes import PLANNED_REACTIVE_FLOW, lane_adapter

    if register:
        _register_big_plan(session, latency, roles)
    lane = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    started = time.perf_counter()
    prepared = await lane.prepare(lane.invocation("big", model="scripted/big", max_ops=700, synthesis=False,
                                                  roles={role: "does the work" for role in ROLES[:roles]},
                                                  max_concurrent=CONCURRENCY), session=session)
    planned = time.perf_counter()
    result = await lane.execute(prepared, session=session)
    wall = time.perf_counter() - started
    return {"roles": roles, "status": result.status, "ops": len(result.statuses),
            "spawned": (result.envelope or {}).get("spawned_operations"), "wall_s": wall,
            "planning_s": planned - started, "run_s": result.elapsed,
            "ideal_s": ideal_seconds(latency, CONCURRENCY)}


def ideal_seconds(latency: float, concurrency: int) -> float:
    """The big plan's makespan with no overhead: its 700 ops in whole waves of ``concurrency`` (the
    children are ready one wave in, before the assignments run out), and never under its two levels."""
    return max(2, math.ceil((ASSIGNMENTS + SPAWNERS * CHILDREN) / concurrency)) * latency


async def _baseline(session: Any, latency: float) -> float:
    """Wall seconds of a fan-out of as many ``sleep`` nodes through ``Session.flow``, at the same concurrency."""
    from opgraph.kernel import Graph, create_operation

    graph = Graph("planned-baseline")
    for index in range(ASSIGNMENTS + SPAWNERS * CHILDREN):
        graph.add_node(create_operation("sleep", {"seconds": latency, "result": index}))
    started = time.perf_counter()
    envelope = await session.flow(graph, max_concurrent=CONCURRENCY, durable=False)
    if envelope["status"] != "completed":
        raise RuntimeError(f"the baseline fan-out ended {envelope['status']}")
    return time.perf_counter() - started


def large_plan_figures(session: Any, repeat: int, *, latency: float = 0.05,
                       out: Any = print) -> dict[str, Any]:
    """The big plan ``repeat`` times (one role) beside the baseline fan-out, alternating; medians printed."""
    from ray import cloudpickle

    from opgraph.cluster.lanes import open_store

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    store = open_store(os.path.join(tempfile.mkdtemp(prefix="opgraph-bench-planned-"), "runs.db"))
    ideal = ideal_seconds(latency, CONCURRENCY)
    ops = ASSIGNMENTS + SPAWNERS * CHILDREN
    out(f"planned lane: a plan of {ASSIGNMENTS} assignments, {SPAWNERS} of them spawning {CHILDREN} each ({ops} ops "
        f"x {latency * 1000:g} ms @{CONCURRENCY}, one role, run recorded); ideal {ideal:.2f} s")

    async def measure() -> tuple[list[dict[str, Any]], list[float]]:
        _register_big_plan(session, latency, 1)
        await _large(session, store, latency, 1, register=False)  # warm-up, untimed: ships the lane's operations
        runs, baselines = [], []
        for index in range(repeat):
            if index % 2:
                baselines.append(await _baseline(session, latency))
            runs.append(await _large(session, store, latency, 1, register=False))
            if not index % 2:
                baselines.append(await _baseline(session, latency))
            out(f"  run {index + 1}: planned {runs[-1]['wall_s']:.2f} s (planning {runs[-1]['planning_s']:.2f} s), "
                f"flow fan-out {baselines[-1]:.2f} s; load {os.getloadavg()[0]:.2f}")
        return runs, baselines

    runs, baselines = asyncio.run(measure())
    wall = statistics.median(run["wall_s"] for run in runs)
    baseline = statistics.median(baselines)
    status = "completed" if all(run["status"] == "completed" and run["ops"] == ops for run in runs) else "failed"
    figures = {"ops": ops, "latency_s": latency, "concurrency": CONCURRENCY, "ideal_s": ideal, "runs": runs,
               "baseline_s": baselines, "median_wall_s": wall, "median_baseline_s": baseline,
               "ratio_to_ideal": wall / ideal, "baseline_ratio_to_ideal": baseline / ideal,
               "ratio_to_baseline": wall / baseline, "status": status}
    header = ["", "median s", "ratio to ideal", "ratio to the fan-out"]
    rows = [header, [f"planned lane, {ops} ops", f"{wall:.2f}", f"{wall / ideal:.2f}x", f"{wall / baseline:.2f}x"],
            [f"Session.flow fan-out of {ops}", f"{baseline:.2f}", f"{baseline / ideal:.2f}x", "1.00x"]]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        out("  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                      for column, (cell, width) in enumerate(zip(row, widths, strict=True))))
    if status != "completed":
        out(f"planned lane: a run did not complete: {[(run['status'], run['ops']) for run in runs]}")
    return figures


# `opgraph o flow ARGS` in a process of its own, with the big plan's scripted planner registered: the
# benchmark runs the command as a user would, and never imports the CLI (pyproject's import contracts).
# Usage: python -c OWNER LATENCY ARGS...
_OWNER = r"""
import sys
from ray import cloudpickle
from opgraph.actors.providers import ScriptedProvider
from opgraph.cluster.bench import planned
from opgraph.cluster.cli.orchestrate import main_flow

cloudpickle.register_pickle_by_value(planned)
sys.exit(main_flow(sys.argv[2:], providers={"scripted": ScriptedProvider(planned.BigPlan(float(sys.argv[1])))}))
"""


def _kill_and_resume(store_path: str, latency: float) -> dict[str, Any]:
    command = [sys.executable, "-c", _OWNER, str(latency)]
    flow = ["big", "--model", "scripted/big", "--max-ops", "700", "--no-synthesis", "--roles", "researcher",
            "--max-concurrent", "100", f"--store={store_path}", "--plain"]

    def half_settled(lines: list[str]) -> bool:
        return sum(" completed " in line or " failed " in line for line in lines) >= (
            ASSIGNMENTS + SPAWNERS * CHILDREN) // 2

    lines = run_until(command + flow, half_settled, stream="stderr", timeout=OWNER_SECONDS).lines
    run_id = next(line.split()[1] for line in lines if line.startswith("run_id: "))
    started = time.perf_counter()
    resumed = run_command(command + ["--resume", run_id, f"--store={store_path}", "--json", "--plain",
                                     "--max-concurrent", "100"], timeout=OWNER_SECONDS)
    total = time.perf_counter() - started
    printed = json.loads(resumed.stdout[resumed.stdout.index("{"):])
    return {"killed_after_settled": sum(" completed " in line or " failed " in line for line in lines),
            "resume_status": printed["status"], "ops": len(printed["statuses"]),
            "resume_command_s": total, "resume_run_s": printed["elapsed"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.planned")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds each op of the large plan takes")
    parser.add_argument("--skip-kill", action="store_true")
    arguments = parser.parse_args(argv)
    from ray import cloudpickle

    from opgraph.actors import Session
    from opgraph.cluster.lanes import open_store

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    folder = tempfile.mkdtemp(prefix="opgraph-bench-planned-")
    store = open_store(os.path.join(folder, "runs.db"))
    session = Session()
    latency = asyncio.run(_latency(session, store, arguments.repeat))
    print(json.dumps({"latency": {k: round(v, 4) for k, v in latency.items()},
                      "ratio_vs_flow": round(latency["plan_to_first_dispatch_s"]
                                             / latency["flow_submit_to_start_s"], 2)}))
    for roles in (1, len(ROLES)):
        large = asyncio.run(_large(session, store, arguments.latency, roles))
        print(json.dumps({"large": {k: round(v, 3) if isinstance(v, float) else v for k, v in large.items()}}))
    if not arguments.skip_kill:
        print(json.dumps({"kill_at_50": _kill_and_resume(store.path, arguments.latency)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
