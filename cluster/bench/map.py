"""Dataset jobs (`opgraph map`) on `sim/`: time against the ideal, rows a second, every process's peak
memory, and a job killed twice (its executor, then its client) and run again.

Owns the benchmark of issue #37. Each job runs in a client process of its own (``CLIENT_SCRIPT``)
on an embedded Ray of its own, so each size starts from fresh processes and a process's peak
resident memory (the kernel's VmHWM) is that job's alone; the client reads the peaks of every
process of its session (itself, the executors, workers and branch stores, Ray's own) before it
exits. The killed job's calls are counted by a provider that writes each row's id to a file per
call (``MarkingProvider``): a row named twice was called twice. Linux only (it reads /proc).

    python -m opgraph.cluster.bench.map [--sizes 100000,1000000] [--concurrency 1000]
        [--kill-rows 100000] [--parts speed,zero,kills] [--json PATH]
    opgraph bench --shapes map [--map-sizes ...]          # the same, handed over by `opgraph bench`

It prints, per size: the run's wall time (the rows fed into the live run, recorded and exported;
Ray's start and the input's check apart), the ideal (rows x latency / concurrency) and their
ratio, rows a second, each process's peak and its CPU a row; then each process's peak at the largest size
over its peak at the smallest; then the killed job's records, distinct ids and rows called twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opgraph.actors.providers import SimulatedProvider

from ..processes import ProcessEndedError, process_table, run_until

__all__ = ["CLIENT_SCRIPT", "MarkingProvider", "cpu_by_role", "main", "session_cpu", "session_peaks", "write_rows"]

JOB_SECONDS = 3600.0  # the longest one client may take (a million rows on a busy machine)
LATENCY_MODEL, INSTANT_MODEL, LATENCY = "sim/default", "sim/instant", 0.05  # sim/default answers in 50 ms
RATIO_TARGET, MEMORY_TARGET = 1.2, 1.2
PROGRESS_STEP = 2000  # the client prints a line each time this many more rows are recorded


class MarkingProvider(SimulatedProvider):
    """``sim/`` that first appends the last user message (a row's prompt, which holds its id) to the
    file ``marks``: one line per model call, written before the call, so a kill cannot hide one."""

    def __init__(self, marks: str, **settings: Any) -> None:
        super().__init__(**settings)
        self.marks = marks

    async def complete(self, request: Any) -> Any:
        text = next((m.get("content") for m in reversed(request.messages) if m.get("role") == "user"), "")
        descriptor = os.open(self.marks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, (str(text).split()[-1] + "\n").encode())
        finally:
            os.close(descriptor)
        return await super().complete(request)


def write_rows(path: str | os.PathLike[str], count: int) -> str:
    """``count`` rows ``{"id": i, "text": "row i"}`` as JSON Lines at ``path``."""
    with open(path, "w", encoding="utf-8") as handle:
        chunk = []
        for index in range(count):
            chunk.append(f'{{"id": {index}, "text": "row {index}"}}\n')
            if len(chunk) == 10_000:
                handle.write("".join(chunk))
                chunk.clear()
        handle.write("".join(chunk))
    return str(path)


def session_peaks(session_id: int | None = None) -> dict[str, float]:
    """Peak resident MiB (VmHWM) of every process of the session ``session_id`` (default: this one's),
    by role: the Ray actor's class (``ray::GraphExecutor``), else the program; the largest of a role."""
    session_id = os.getsid(0) if session_id is None else session_id
    peaks: dict[str, float] = {}
    for pid, info in process_table().items():
        if info.session != session_id or info.state == "Z":
            continue
        peak = _vm_high_water_mib(pid)
        if peak is None:
            continue
        role = _role(pid, info.command)
        peaks[role] = max(peaks.get(role, 0.0), peak)
    return peaks


def session_cpu(session_id: int | None = None) -> dict[int, tuple[str, float]]:
    """CPU seconds (user and system) each live process of the session ``session_id`` (default: this
    one's) has used so far: pid -> (role, seconds). Two readings around a job give its cost by role."""
    session_id = os.getsid(0) if session_id is None else session_id
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[int, tuple[str, float]] = {}
    for pid, info in process_table().items():
        if info.session != session_id or info.state == "Z":
            continue
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[pid] = (_role(pid, info.command), (int(fields[11]) + int(fields[12])) / tick)
    return used


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role used between two ``session_cpu`` readings (a process born between them counts whole)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        spent[role] = spent.get(role, 0.0) + seconds - before.get(pid, (role, 0.0))[1]
    return spent


def _vm_high_water_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _role(pid: int, command: str) -> str:
    if pid == os.getpid():
        return "client (driver)"
    if command.startswith("ray::"):
        return command.split()[0]
    program = command.split()[0] if command else "?"
    words = command.split()
    script = next((Path(word).name for word in words[1:] if word.endswith(".py")), None)
    return script or Path(program).name


# The client: one job on its own embedded Ray. Usage:
#   python -c CLIENT_SCRIPT SPEC_JSON
# SPEC_JSON: {"input", "store", "output", "model", "concurrency", "marks" (or null), "step", "latency",
# "runlog" (the runtime's database, OPGRAPH_DB; absent: the environment's), "warm_up" (a 500-row job first, untimed),
# "batch" (rows an operation; absent: the job's choice)}
CLIENT_SCRIPT = r"""
import asyncio, json, os, sys, time
spec = json.loads(sys.argv[1])
if spec.get("runlog"):
    os.environ["OPGRAPH_DB"] = spec["runlog"]
from opgraph.actors import Session
from opgraph.cluster.bench.map import MarkingProvider, cpu_by_role, session_cpu, session_peaks
from opgraph.cluster.jobs import MapJob, MapSettings, MapSpec

session, ray_seconds = None, 0.0
if spec.get("warm_up"):  # a small job first, untimed: the workers import and ship what every job needs
    from opgraph.cluster.bench.map import write_rows
    warm = write_rows(spec["input"] + ".warm.jsonl", 500)
    began = time.perf_counter()
    session = Session()
    ray_seconds = time.perf_counter() - began
    warmed = asyncio.run(MapJob.prepare(warm, MapSpec("id", "Classify: {text}", model=spec["model"]),
                                        MapSettings(concurrency=spec["concurrency"]), store=spec["store"]))
    asyncio.run(warmed.execute(session))
    warmed.close()
started = time.perf_counter()
job = asyncio.run(MapJob.prepare(spec["input"], MapSpec("id", "Classify: {text}", model=spec["model"]),
                                 MapSettings(concurrency=spec["concurrency"], output=spec["output"],
                                             batch=spec.get("batch")),
                                 store=spec["store"]))
checked = time.perf_counter()
if session is None:
    session = Session()
    ray_seconds = time.perf_counter() - checked
if spec["marks"]:
    provider = MarkingProvider(spec["marks"], latency=spec.get("latency", 0.05))
    session.register_provider(spec["model"].split("/")[0], provider)
stats = session.runtime.executor.statistics.remote()
import ray
print("executor_pid", ray.get(stats)["pid"], flush=True)
printed = 0

def progress(state):
    global printed
    if state.finished - printed >= spec["step"]:
        printed = state.finished
        print("recorded", state.recorded_before + state.finished, flush=True)

cpu_before = session_cpu()
ray_started = time.perf_counter()
summary = asyncio.run(job.execute(session, on_progress=progress))
ended = time.perf_counter()
cpu_spent = cpu_by_role(cpu_before, session_cpu())
job.close()
result = {"summary": summary.as_dict(), "check_seconds": checked - started, "ray_start_seconds": ray_seconds,
          "run_seconds": ended - ray_started, "peaks_mib": session_peaks(), "cpu_seconds": cpu_spent}
print("result " + json.dumps(result), flush=True)
"""


def _client(spec: dict[str, Any]) -> list[str]:
    return [sys.executable, "-c", CLIENT_SCRIPT, json.dumps(spec)]


def _run_client(spec: dict[str, Any], until: Any = None) -> list[str]:
    """The client's output lines, up to its result (or until ``until(lines)``); then its session (it,
    and the Ray it started) is killed, so no process of one job outlives it into the next one's
    figures. Its stderr goes to a file beside its output, and its end into an error that ends early."""
    log = Path(spec["output"]).with_suffix(".client.log")
    with open(log, "a", encoding="utf-8") as handle:
        try:
            return run_until(_client(spec), until or (lambda lines: bool(lines) and lines[-1].startswith("result ")),
                             timeout=JOB_SECONDS, stderr=handle).lines
        except ProcessEndedError as exc:
            raise ProcessEndedError(f"{exc}\n{log}:\n{log.read_text()[-4000:]}", exc.lines) from None


def _result(lines: Sequence[str]) -> dict[str, Any]:
    for line in reversed(lines):
        if line.startswith("result "):
            return json.loads(line[len("result "):])
    raise RuntimeError("the client printed no result:\n" + "\n".join(lines[-30:]))


def run_job(folder: Path, rows: int, model: str, concurrency: int, *, name: str) -> dict[str, Any]:
    """One job of ``rows`` rows in a fresh client; its result (summary, seconds, peaks)."""
    source = folder / f"{name}.jsonl"
    if not source.exists():
        write_rows(source, rows)
    store = str(folder / f"{name}.db")
    spec = {"input": str(source), "store": store, "runlog": store, "output": str(folder / f"{name}.out.jsonl"),
            "model": model, "concurrency": concurrency, "marks": None, "step": max(PROGRESS_STEP, rows // 20),
            "warm_up": True}
    return _result(_run_client(spec))


def killed_twice(folder: Path, rows: int, concurrency: int) -> dict[str, Any]:
    """A job killed at a third (its executor) and two thirds (its client, Ray and all), then run again:
    records, distinct ids, and rows called more than once (each call marked by ``MarkingProvider``)."""
    source = write_rows(folder / "killed.jsonl", rows)
    marks, output = folder / "killed.marks", folder / "killed.out.jsonl"
    store = str(folder / "killed.db")
    spec = {"input": source, "store": store, "runlog": store, "output": str(output), "model": "mark/default",
            "concurrency": concurrency, "marks": str(marks), "latency": LATENCY,
            "step": max(1, min(PROGRESS_STEP, rows // 30))}
    state: dict[str, Any] = {"executor": None, "killed_executor": False}

    def watch(lines: list[str]) -> bool:
        if not lines:
            return False
        last = lines[-1].split()
        if last[:1] == ["executor_pid"]:
            state["executor"] = int(last[1])
        if last[:1] == ["recorded"] and int(last[1]) >= rows // 3 and not state["killed_executor"]:
            os.kill(state["executor"], 9)
            state["killed_executor"] = True
        return last[:1] == ["recorded"] and int(last[1]) >= 2 * rows // 3

    started = time.perf_counter()
    _run_client(spec, watch)
    result = _result(_run_client(spec))
    with open(output, encoding="utf-8") as handle:
        ids = [json.loads(line)["id"] for line in handle if line.strip()]
    calls = Counter(marks.read_text().split())
    twice = sum(1 for count in calls.values() if count > 1)
    return {"rows": rows, "concurrency": concurrency, "kills": 2, "records": len(ids), "distinct_ids": len(set(ids)),
            "rows_called_twice": twice, "extra_calls": sum(calls.values()) - len(calls),
            "rows_called": len(calls), "bound": concurrency * 2, "seconds": time.perf_counter() - started,
            "recoveries_in_rerun": result["summary"].get("recoveries")}


def _print_job(label: str, rows: int, result: dict[str, Any], ideal: float | None) -> dict[str, Any]:
    seconds = result["run_seconds"]
    figures = {"rows": rows, "run_seconds": round(seconds, 2), "check_seconds": round(result["check_seconds"], 2),
               "ray_start_seconds": round(result["ray_start_seconds"], 2),
               "rows_per_second": round(rows / seconds, 1), "ideal_seconds": ideal,
               "ratio_to_ideal": None if ideal is None else round(seconds / ideal, 3),
               "done": result["summary"]["done"], "peaks_mib": {k: round(v, 1) for k, v in result["peaks_mib"].items()}}
    ratio = "" if ideal is None else f", ideal {ideal:.1f} s, {figures['ratio_to_ideal']:.2f}x (target {RATIO_TARGET}x)"
    print(f"{label} {rows:,} rows: {seconds:.1f} s ({figures['rows_per_second']:,.0f} rows/s){ratio}; input check "
          f"{figures['check_seconds']:.1f} s, Ray start {figures['ray_start_seconds']:.1f} s; done {figures['done']:,}",
          flush=True)
    print("  peak MiB: " + ", ".join(f"{role} {mib:,.0f}" for role, mib in sorted(figures["peaks_mib"].items())),
          flush=True)
    spent = result.get("cpu_seconds") or {}
    figures["cpu_us_per_row"] = {role: round(seconds * 1e6 / rows, 1) for role, seconds in spent.items()
                                 if seconds * 1e6 / rows >= 0.5}
    if spent:
        print(f"  CPU us a row: all {sum(spent.values()) * 1e6 / rows:,.0f}; " + ", ".join(
            f"{role} {micros:,.0f}" for role, micros in sorted(figures["cpu_us_per_row"].items(),
                                                               key=lambda item: -item[1])), flush=True)
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.map", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="rows of each job, smallest first (100000,1000000)")
    parser.add_argument("--concurrency", type=int, default=1000, help="model calls in flight (1000)")
    parser.add_argument("--kill-rows", type=int, default=100_000, help="rows of the job killed twice (100000)")
    parser.add_argument("--kill-concurrency", type=int, default=None,
                        help="the killed job's concurrency (default: --concurrency)")
    parser.add_argument("--parts", default="speed,zero,kills",
                        help="speed: each size at 50 ms a call, with each process's peak; zero: the largest at "
                             "0 ms; kills: the job killed twice (default: all)")
    parser.add_argument("--folder", default=None, help="where inputs, stores and outputs go (default: a temp dir)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    folder = Path(args.folder or tempfile.mkdtemp(prefix="opgraph-bench-map-"))
    folder.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"machine_load": os.getloadavg(), "concurrency": args.concurrency}
    status = 0
    print(f"opgraph bench map: concurrency {args.concurrency}, sizes {sizes}, in {folder}; load {os.getloadavg()}",
          flush=True)
    if "speed" in parts:
        speed = [_print_job("50 ms", rows, run_job(folder, rows, LATENCY_MODEL, args.concurrency, name=f"speed-{rows}"),
                            rows * LATENCY / args.concurrency) for rows in sizes]
        figures["speed"] = speed
        if len(speed) > 1:
            small, large = speed[0]["peaks_mib"], speed[-1]["peaks_mib"]
            ratios = {role: round(large[role] / small[role], 3) for role in large if small.get(role)}
            figures["memory_ratio"] = ratios
            worst = max(ratios.values(), default=0.0)
            print(f"peak memory, {sizes[-1]:,} rows over {sizes[0]:,}: " + ", ".join(
                f"{role} {ratio:.2f}x" for role, ratio in sorted(ratios.items())) + f" (target {MEMORY_TARGET}x; "
                f"worst {worst:.2f}x)", flush=True)
        status |= int(any(row["ratio_to_ideal"] > RATIO_TARGET for row in speed[-1:]))
    if "zero" in parts:
        figures["zero"] = _print_job("0 ms", sizes[-1], run_job(folder, sizes[-1], INSTANT_MODEL, args.concurrency,
                                                                name=f"zero-{sizes[-1]}"), None)
    if "kills" in parts:
        killed = killed_twice(folder, args.kill_rows, args.kill_concurrency or args.concurrency)
        figures["kills"] = killed
        print(f"killed twice (executor at a third, client at two thirds), then run again: {killed['records']:,} "
              f"records, {killed['distinct_ids']:,} distinct ids of {killed['rows']:,}; rows called twice "
              f"{killed['rows_called_twice']:,} (at most concurrency x kills = {killed['bound']:,}); "
              f"{killed['seconds']:.0f} s", flush=True)
        status |= int(killed["records"] != killed["rows"] or killed["distinct_ids"] != killed["rows"]
                      or killed["rows_called_twice"] > killed["bound"])
    figures["machine_load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
