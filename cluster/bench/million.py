"""A million-node fan-out submitted as a Ray job, beside a 100,000-node one (issue #18).

Owns submitting each fan-out through ``opgraph job submit``'s command line as a user does,
to a `ray start --head` of its own (``opgraph.cluster.local_head``: its own temp dir, free
ports, token auth, ``OPGRAPH_DB`` in that dir, so the runs are durable as by default, and
stopped by pid at the end), and sampling the GraphExecutor actor's resident memory while
the job runs. Linux only: it reads memory from /proc.

    python -m opgraph.cluster.bench.million [--sizes 100000,1000000] [--repeat 1] [--max-concurrent 1000]
        [--variant 'LABEL=JOB ARGS' ...]

It prints, per size: the job's own run time (``elapsed_seconds`` of its summary: the
flow, graph shipping included, graph building excluded), the job's wall time, time per
node, and the executor's peak RSS (sampled every 0.1 s, and the kernel's VmHWM reset
before each job); then the time-per-node ratio of each size to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from ..jobs.submission import job_submit_command
from ..local_head import LocalHead, start_local_head
from ..processes import command_line, run_command

__all__ = ["main"]

HEAD_START_SECONDS = 120.0
JOB_SECONDS = 7200.0  # the longest one job (a million nodes) may take
EXECUTOR_PREFIX = "opgraph-executor"
PEAK_TARGET_MIB = 2048.0
RATIO_TARGET = 1.5


class ExecutorMemory:
    """Samples the GraphExecutor actor's RSS while a job runs; its pid comes from Ray's state API."""

    def __init__(self, head: LocalHead, interval: float = 0.1, *, keep_timeline: bool = False) -> None:
        self.head = head
        self.interval = interval
        self.pid: int | None = None
        self.peak_mib = 0.0
        self.peak_doing = ""  # the actor's process title at the peak: which method was running
        self.peak_shared_mib = 0.0  # of the peak, pages shared with Ray's object store (RssShmem)
        self.samples = 0
        self.timeline: list[tuple[float, float, str]] | None = [] if keep_timeline else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="executor-memory", daemon=True)

    def __enter__(self) -> ExecutorMemory:
        if self.pid is not None:
            _reset_high_water_mark(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def high_water_mib(self) -> float | None:
        """The kernel's peak RSS of the executor since the last reset (VmHWM), if readable."""
        return None if self.pid is None else _status_mib(self.pid, "VmHWM:")

    def _sample(self) -> None:
        next_lookup = 0.0
        while not self._stop.is_set():
            if self.pid is None and time.monotonic() >= next_lookup:
                self.pid = find_executor_pid(self.head)
                next_lookup = time.monotonic() + 0.5
                if self.pid is not None:
                    _reset_high_water_mark(self.pid)
            if self.pid is not None:
                rss = _status_mib(self.pid, "VmRSS:")
                shared = _status_mib(self.pid, "RssShmem:") or 0.0
                doing = command_line(self.pid)
                if rss is None:
                    self.pid = None  # gone (replaced): look it up again
                    continue
                self.samples += 1
                if self.timeline is not None:
                    self.timeline.append((time.monotonic(), rss, f"shmem {shared:.0f} {doing}"))
                if rss > self.peak_mib:
                    self.peak_mib, self.peak_doing, self.peak_shared_mib = rss, doing, shared
            self._stop.wait(self.interval)


def _status_mib(pid: int, field: str) -> float | None:
    """A ``kB`` field of /proc/PID/status (VmHWM, RssShmem...) in MiB, if readable."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def find_executor_pid(head: LocalHead) -> int | None:
    """The pid of the live GraphExecutor actor named ``opgraph-executor...`` on ``head``, if any.

    Asked of the dashboard's state API over HTTP with the head's token (``ray.util.state``
    would read the token mode when Ray is first imported, before this script knows it)."""
    request = urllib.request.Request(f"{head.dashboard_url}/api/v0/actors?limit=10000&detail=false",
                                     headers={"Authorization": f"Bearer {head.token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            actors = json.loads(reply.read())["data"]["result"]["result"]
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, ValueError):
        return None  # the state API may not answer yet: the sampler asks again
    for actor in actors:
        if (actor.get("state") == "ALIVE" and actor.get("class_name") == "GraphExecutor"
                and (actor.get("name") or "").startswith(EXECUTOR_PREFIX) and actor.get("pid")):
            return int(actor["pid"])
    return None


def _reset_high_water_mark(pid: int) -> None:
    """Reset VmHWM (``5`` into clear_refs, Linux 4.0+), so it tells this job's peak; ignored where refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def submit_fanout(head: LocalHead, nodes: int, max_concurrent: int, extra: list[str], workdir: str
                  ) -> dict[str, Any]:
    """``opgraph job submit`` one fan-out of ``nodes`` x 0 s; its summary, wall time and output."""
    entrypoint = ["fanout", "--nodes", str(nodes), "--latency", "0", "--max-concurrent", str(max_concurrent),
                  "--progress-interval", "5", *extra]
    command = job_submit_command(entrypoint, address=head.dashboard_url, working_dir=workdir)
    started = time.perf_counter()
    done = run_command(command, env=head.env(), cwd=workdir, timeout=JOB_SECONDS)
    wall = time.perf_counter() - started
    summary = None
    for line in reversed(done.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"by_status"' in line:
            summary = json.loads(line)
            break
    if done.returncode != 0 or summary is None:
        raise RuntimeError(f"the {nodes}-node job failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                           f"{done.stderr[-4000:]}")
    return {"summary": summary, "wall": wall, "output": done.stdout}


def _write_timeline(folder: str, label: str, size: int, round_index: int,
                    timeline: list[tuple[float, float, str]]) -> None:
    os.makedirs(folder, exist_ok=True)
    start = timeline[0][0] if timeline else 0.0
    with open(os.path.join(folder, f"{label}-{size}-{round_index + 1}.tsv"), "w", encoding="utf-8") as handle:
        for at, rss, doing in timeline:
            handle.write(f"{at - start:.2f}\t{rss:.0f}\t{doing}\n")


def _variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``LABEL=ARGS`` (ARGS split as a shell would) into (label, job arguments); none: the default job."""
    if not specs:
        return [("default", [])]
    variants = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        variants.append((label, shlex.split(rest)))
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.million", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="comma-separated node counts; the first is the "
                                                                  "baseline of the ratios (100000,1000000)")
    parser.add_argument("--repeat", type=int, default=1, help="jobs per size and variant, interleaved; medians (1)")
    parser.add_argument("--max-concurrent", type=int, default=1000)
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                        help="run every size also as LABEL, with ARGS added to the job's command line (repeatable), "
                             "e.g. --variant 'signals=--progress-from signals'; the first variant is the baseline")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--timeline", default=None, metavar="DIR",
                        help="write each job's executor RSS samples (seconds, MiB, process title) to DIR")
    arguments = parser.parse_args(argv)
    sizes = [int(size) for size in arguments.sizes.split(",")]
    variants = _variants(arguments.variant)
    head = start_local_head(own_database=True, timeout=HEAD_START_SECONDS)
    workdir = tempfile.mkdtemp(prefix="ogm-job-")
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {(label, size): [] for label, _ in variants for size in sizes}
    try:
        print(f"head up at {head.dashboard_url} (temp dir {head.temp_dir}, OPGRAPH_DB {head.database})", flush=True)
        pid = None
        for round_index in range(arguments.repeat):
            for size in sizes:
                for label, extra in variants:
                    sampler = ExecutorMemory(head, keep_timeline=arguments.timeline is not None)
                    sampler.pid = pid
                    with sampler:
                        job = submit_fanout(head, size, arguments.max_concurrent, extra, workdir)
                    pid = sampler.pid
                    elapsed = job["summary"]["elapsed_seconds"]
                    row = {"nodes": size, "variant": label, "elapsed": elapsed, "wall": job["wall"],
                           "per_node_us": elapsed / size * 1e6, "peak_rss_mib": sampler.peak_mib,
                           "vmhwm_mib": sampler.high_water_mib, "samples": sampler.samples,
                           "status": job["summary"]["status"], "messages": job["summary"].get("scheduler_messages"),
                           "peak_during": sampler.peak_doing, "peak_shared_mib": sampler.peak_shared_mib}
                    if sampler.timeline is not None:
                        _write_timeline(arguments.timeline, label, size, round_index, sampler.timeline)
                    rows[(label, size)].append(row)
                    print(f"round {round_index + 1} {label}: {size:>9,} nodes  run {elapsed:8.2f} s  job wall "
                          f"{job['wall']:8.2f} s  {row['per_node_us']:7.1f} us/node  executor peak RSS "
                          f"{row['peak_rss_mib']:7.0f} MiB (VmHWM {row['vmhwm_mib'] or float('nan'):.0f})  "
                          f"[{row['samples']} samples; at the peak {sampler.peak_shared_mib or 0:.0f} MiB shared "
                          f"with the object store, running {sampler.peak_doing.strip()}]", flush=True)
    finally:
        survivors = head.stop()
        if survivors:
            print(f"warning: processes of the head survived: {sorted(survivors)}", file=sys.stderr)
        else:
            shutil.rmtree(head.temp_dir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    figures = _report(rows, sizes, variants)
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=2)
    return 0


def _report(rows: dict[tuple[str, int], list[dict[str, Any]]], sizes: list[int],
            variants: list[tuple[str, list[str]]]) -> list[dict[str, Any]]:
    """The table (medians; peaks are the highest seen), each variant's ratio to its first size and to the
    first variant, and the targets for the last size of each variant."""
    first_label = variants[0][0]
    median = {key: statistics.median(row["per_node_us"] for row in found) for key, found in rows.items()}
    print(f"\n{'variant':>10}  {'nodes':>10}  {'run s':>8}  {'us/node':>8}  {'vs ' + format(sizes[0], ','):>10}  "
          f"{'vs ' + first_label:>12}  {'peak MiB':>9}  {'VmHWM MiB':>9}")
    figures = []
    for label, _ in variants:
        for size in sizes:
            found = rows[(label, size)]
            per_node = median[(label, size)]
            peak = max(row["peak_rss_mib"] for row in found)
            high = [row["vmhwm_mib"] for row in found if row["vmhwm_mib"] is not None]
            figure = {"variant": label, "nodes": size, "per_node_us": per_node,
                      "ratio_to_first_size": per_node / median[(label, sizes[0])],
                      "ratio_to_first_variant": per_node / median[(first_label, size)],
                      "peak_rss_mib": max([peak, *high]), "runs": found}
            figures.append(figure)
            print(f"{label:>10}  {size:>10,}  {statistics.median(row['elapsed'] for row in found):8.2f}  "
                  f"{per_node:8.1f}  {figure['ratio_to_first_size']:9.2f}x  {figure['ratio_to_first_variant']:11.2f}x"
                  f"  {peak:9.0f}  {max(high) if high else float('nan'):9.0f}")
    for label, _ in variants:
        last = next(figure for figure in reversed(figures) if figure["variant"] == label)
        completed = all(row["status"] == "completed" for row in last["runs"])
        print(f"{label}: {last['nodes']:,} nodes completed: {'yes' if completed else 'NO'}; executor peak "
              f"{last['peak_rss_mib']:.0f} MiB, under {PEAK_TARGET_MIB:.0f}: "
              f"{'met' if last['peak_rss_mib'] < PEAK_TARGET_MIB else 'NOT met'}; time per node "
              f"{last['ratio_to_first_size']:.2f}x the {sizes[0]:,}-node run's, within {RATIO_TARGET}x: "
              f"{'met' if last['ratio_to_first_size'] <= RATIO_TARGET else 'NOT met'}")
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
