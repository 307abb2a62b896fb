"""Engine figures: each domain engine on sim/ with a fixed model latency, against the critical path its record implies.

Owns the engines benchmark (``opgraph bench --shapes engines``). Every domain engine runs
on the embedded runtime with the built-in simulated provider answering each call after a
fixed latency (200 ms). From each run's own record (every turn and the turns it came
after; a planned DAG's nodes and their dependencies) it rebuilds the work and schedules
it with the same latency and concurrency and no overhead: that ideal makespan is the
critical path under the semaphore. The figure is wall time over the ideal (target 1.2 or
less). The headline is a research tree of 50 agents at concurrency 5. Driver CPU per turn
is reported too. It tunes nothing and reads only what a run records.

The coding engine runs on a throw-away project made for each run (``calc.py`` whose
``add`` subtracts, and a pytest that says so) with its default bounds (3 fix rounds).
The sim's change never fixes the bug, so every run is the whole chain: plan, implement,
test, then fix and test three times (5 turns, 4 test runs), and no verifier. Its test
runs are real subprocesses on a worker; each is work, not overhead, so the ideal counts
each one at the duration the gate measured and recorded (``TestsRan.duration_s``, from
the command's start to its group's end). A test run comes after the turn recorded last
before it (the turn whose change it tests); a turn recorded after that same turn, and
ended after the test run, comes after the test run too (the chain awaits each gate before
its next turn, whose instruction carries the gate's output). Copying the workspace,
writing each change into the copy, reading the diff and removing the copy are not in the
ideal: they are the runtime's overhead here.

    python -m opgraph.cluster.bench.engines [--engines research,review] [--repeat 3] [--latency 0.2]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENGINE_SHAPES", "EngineShape", "Work", "coding_project", "implied_work", "main", "measure",
           "schedule"]

CODE = '''def load(path):
    data = open(path).read()
    return eval(data)


def total(rows):
    result = 0
    for row in rows:
        result = result + row["amount"]
    return result
'''

# The coding shape's throw-away project: a bug (add subtracts) and the pytest that finds it.
CALC = "def add(a, b):\n    return a - b\n"
CALC_TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# A real pytest, quick to start: no third-party plugins, no cache folder.
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {sys.executable} -m pytest -q -p no:cacheprovider"


def coding_project(folder: str) -> dict[str, Any]:
    """Write the throw-away project into ``folder``; the coding engine's inputs for it."""
    project = Path(folder) / "project"
    project.mkdir()
    (project / "calc.py").write_text(CALC)
    (project / "test_calc.py").write_text(CALC_TEST)
    return {"workspace": str(project), "test_cmd": PYTEST}


@dataclass(frozen=True)
class EngineShape:
    """One engine run of the benchmark: its kind, settings, subject, and how many items the sim gives per list."""

    key: str
    kind: str
    label: str
    settings: dict[str, Any]
    subject: Any
    list_items: int
    inputs: Callable[[str], dict[str, Any]] | None = None  # keyword inputs made in a fresh temporary folder


ENGINE_SHAPES = (
    EngineShape("research", "research", "research tree, 50 agents @5",
                {"max_agents": 50, "max_concurrent": 5}, "solid-state batteries", 2),
    EngineShape("review", "review", "review, 4 dimensions, 20 issues @5", {"max_concurrent": 5}, CODE, 5),
    EngineShape("hypothesis", "hypothesis", "hypothesis, 3 seeds @5", {"max_concurrent": 5},
                ["cells fade in the cold", "anodes swell when charged fast", "separators shrink in heat"], 1),
    EngineShape("planning", "planning", "planning, 6 tasks @5", {"max_concurrent": 5, "reactive": False},
                "plan a small research project on battery recycling", 6),
    EngineShape("coding", "coding", "coding, failing pytest, 3 fix rounds", {"max_concurrent": 5},
                "make add() add its arguments", 1, coding_project),
)


@dataclass
class Work:
    """The work a run's record implies: each item's duration and the items it came after."""

    durations: dict[str, float]
    after: dict[str, list[str]]
    order: list[str]  # the order work was issued in (ties are started in this order)


def implied_work(run: Any, latency: float) -> Work:
    """Every turn of ``run`` (``latency`` each) after the turns it records; a planned DAG's nodes
    (``latency`` each) after the planner's turn and their plan dependencies, and before the
    turn that follows the DAG; each recorded test run (``TestsRan``, its measured duration)
    after the turn recorded last before it, and before the turns after that turn that ended
    after it."""
    durations: dict[str, float] = {}
    after: dict[str, list[str]] = {}
    order: list[str] = []
    turns = sorted((record for record in run.events.notifications()
                    if record.type in ("turn_completed", "agent_error") and "turn" in record.data),
                   key=lambda record: record.data["turn"])
    for record in turns:
        key = f"t{record.data['turn']}"
        durations[key], after[key] = latency, [f"t{turn}" for turn in record.data.get("after", [])]
        order.append(key)
    _add_gates(run, turns, durations, after, order)
    plans = [record.payload for record in run.events.events() if record.type == "PlanProposed"]
    planners = [f"t{record.data['turn']}" for record in turns if record.agent == "orchestrator"]
    if plans and planners:
        nodes = [f"d{index}" for index in range(1, len(plans[-1].assignments) + 1)]
        for index, assignment in enumerate(plans[-1].assignments, start=1):
            ordinals = [int(ref) for ref in assignment.depends_on if str(ref).strip().isdigit()]
            durations[f"d{index}"] = latency
            after[f"d{index}"] = [planners[-1]] + [f"d{ordinal}" for ordinal in ordinals if 0 < ordinal < index]
        later = [f"t{record.data['turn']}" for record in turns if record.agent != "orchestrator"]
        for key in later:  # the turns after the DAG (the synthesis) wait for all of it
            after[key] = sorted(set(after[key]) | set(nodes))
        order = [key for key in order if key not in later] + nodes + later
    return Work(durations, after, order)


def _add_gates(run: Any, turns: list[Any], durations: dict[str, float], after: dict[str, list[str]],
               order: list[str]) -> None:
    """The run's test runs (coding's gates) into the work: each at its recorded duration, after
    the turn whose record precedes it, and before the turns that the record puts after that
    turn and that ended after it (the chain awaited the gate: the next turn reads its output)."""
    gates = sorted((record for record in run.events.events() if record.type == "TestsRan"),
                   key=lambda record: record.seq)
    for index, gate in enumerate(gates, start=1):
        key = f"g{index}"
        durations[key] = float(gate.data.get("duration_s", 0.0))
        before = [record for record in turns if record.seq < gate.seq]
        if not before:
            order.insert(0, key)
            after[key] = []
            continue
        cause = f"t{before[-1].data['turn']}"
        after[key] = [cause]
        order.insert(order.index(cause) + 1 + sum(1 for other in order if other.startswith("g")
                                                  and after.get(other) == [cause]), key)
        for record in turns:
            turn = f"t{record.data['turn']}"
            if record.seq > gate.seq and cause in after[turn]:
                after[turn] = sorted(set(after[turn]) | {key})


def schedule(work: Work, capacity: int) -> dict[str, float]:
    """The makespan of ``work`` with at most ``capacity`` items at once and no overhead (list
    scheduling in issue order), its critical path (no capacity limit) and its total work."""
    rank = {key: index for index, key in enumerate(work.order)}
    waiting = {key: {dep for dep in work.after.get(key, []) if dep in work.durations} for key in work.order}
    dependents: dict[str, list[str]] = {key: [] for key in work.order}
    for key, deps in waiting.items():
        for dep in deps:
            dependents[dep].append(key)
    ready = [(rank[key], key) for key, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    running: list[tuple[float, int, str]] = []
    now = 0.0
    finished: dict[str, float] = {}
    while ready or running:
        while ready and len(running) < capacity:
            _, key = heapq.heappop(ready)
            heapq.heappush(running, (now + work.durations[key], rank[key], key))
        now, _, key = heapq.heappop(running)
        finished[key] = now
        for dependent in dependents[key]:
            waiting[dependent].discard(key)
            if not waiting[dependent]:
                heapq.heappush(ready, (rank[dependent], dependent))
    longest: dict[str, float] = {}
    for key in work.order:  # issue order respects dependencies
        longest[key] = work.durations[key] + max((longest[dep] for dep in work.after.get(key, [])
                                                  if dep in longest), default=0.0)
    return {"ideal_s": now, "critical_path_s": max(longest.values(), default=0.0),
            "work_s": sum(work.durations.values()), "items": len(work.order)}


async def _one(session: Any, shape: EngineShape, latency: float) -> dict[str, Any]:
    from opgraph.actors.providers import SimulatedProvider
    from opgraph.engines import engine_for

    session.register_provider("sim", SimulatedProvider(latency=latency, list_items=shape.list_items, seed=7))
    engine = engine_for(shape.kind, **shape.settings)
    fresh = engine.new_run(session=session)
    with tempfile.TemporaryDirectory(prefix=f"opgraph-bench-{shape.key}-") as folder:
        inputs = shape.inputs(folder) if shape.inputs is not None else {}
        cpu, wall = time.process_time(), time.perf_counter()
        result = await engine.execute(fresh, shape.subject, **inputs)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    work = implied_work(fresh, latency)
    ideal = schedule(work, engine.max_concurrent)
    turns = len(fresh.events.notifications("turn_completed"))
    gates = [duration for key, duration in work.durations.items() if key.startswith("g")]
    return {"wall_s": wall, **ideal, "ratio": wall / ideal["ideal_s"] if ideal["ideal_s"] else None,
            "agents": fresh.agents_made, "turns": turns, "gates": len(gates), "gate_s": sum(gates),
            "driver_cpu_s_per_turn": cpu / max(1, turns), "status": fresh.status,
            "degrade_reason": getattr(result, "degrade_reason", "")}


def measure(shapes: Sequence[EngineShape] = ENGINE_SHAPES, repeat: int = 3, latency: float = 0.2,
            session: Any = None) -> list[dict[str, Any]]:
    """Per shape, the run with the median ratio of ``repeat`` (after one unmeasured warm-up run)."""
    from opgraph.actors import Session

    own = session is None
    session = Session() if own else session
    try:
        figures = []
        for shape in shapes:
            asyncio.run(_one(session, shape, latency))  # warm-up: imports, workers, first branches
            samples = sorted((asyncio.run(_one(session, shape, latency)) for _ in range(repeat)),
                             key=lambda sample: sample["ratio"] or 0.0)
            chosen = samples[len(samples) // 2]
            figures.append({"shape": shape.key, "label": shape.label, "repeat": repeat, "latency_s": latency,
                            **{key: round(value, 4) if isinstance(value, float) else value
                               for key, value in chosen.items()},
                            "ratios": [round(sample["ratio"] or 0.0, 3) for sample in samples]})
            print(f"measured {shape.label}: wall {chosen['wall_s']:.2f} s, ideal {chosen['ideal_s']:.2f} s, "
                  f"ratio {chosen['ratio']:.2f}", file=sys.stderr, flush=True)
        return figures
    finally:
        if own:
            session.close()


def table(figures: list[dict[str, Any]]) -> list[str]:
    header = ["engine run", "agents", "turns", "test runs (s)", "critical s", "ideal s", "wall s", "wall/ideal",
              "status", "cpu ms/turn"]
    rows = [header]
    for item in figures:
        status = item["status"] + (f" ({item['degrade_reason']})" if item["degrade_reason"] else "")
        tests = f"{item['gates']} ({item['gate_s']:.2f})" if item.get("gates") else "-"
        rows.append([item["label"], str(item["agents"]), str(item["turns"]), tests, f"{item['critical_path_s']:.2f}",
                     f"{item['ideal_s']:.2f}", f"{item['wall_s']:.2f}", f"{item['ratio']:.2f}x", status,
                     f"{1000 * item['driver_cpu_s_per_turn']:.1f}"])
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return ["  ".join(cell.ljust(width) if column == 0 else cell.rjust(width)
                      for column, (cell, width) in enumerate(zip(row, widths, strict=True))) for row in rows]


def main(argv: Sequence[str] | None = None, *, session: Any = None) -> int:
    parser = argparse.ArgumentParser(prog="opgraph bench --shapes engines",
                                     description="Each domain engine on sim/ with a fixed latency per model call: "
                                                 "wall time against the critical path its own record implies.")
    keys = [shape.key for shape in ENGINE_SHAPES]
    parser.add_argument("--engines", default=",".join(keys), help=f"comma-separated subset of {', '.join(keys)}")
    parser.add_argument("--repeat", type=int, default=3, help="measured runs per engine; the median is shown (3)")
    parser.add_argument("--latency", type=float, default=0.2, help="sim/ seconds per model call (0.2)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    arguments = parser.parse_args(argv)
    wanted = [key.strip() for key in arguments.engines.split(",") if key.strip()]
    unknown = [key for key in wanted if key not in keys]
    if unknown or not wanted or arguments.repeat < 1 or arguments.latency <= 0:
        parser.error(f"choose engines from {', '.join(keys)} (got {', '.join(unknown) or 'none'}); "
                     "--repeat >= 1 and --latency > 0")
    shapes = [shape for shape in ENGINE_SHAPES if shape.key in wanted]
    print(f"opgraph bench engines: sim/ at {arguments.latency * 1000:g} ms a call; median of {arguments.repeat} "
          f"run(s); ideal = the run's own recorded work scheduled at its concurrency with no overhead "
          f"(test runs at their measured durations)")
    figures = measure(shapes, arguments.repeat, arguments.latency, session=session)
    print("\n".join(table(figures)))
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump({"latency_s": arguments.latency, "engines": figures}, handle, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
