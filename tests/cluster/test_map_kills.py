"""A dataset job killed mid-way, then run again: every row recorded once, and only rows in flight called twice.

    client (its own embedded Ray) --SIGKILL after 200 recorded--> this process runs the same job again
    this process's job --its executor killed after 200 recorded--> the run rebuilt on a replacement
    this process's job --a worker killed after 200 recorded--> the rows it held retried elsewhere

Each model call is marked (``MarkingProvider``: one line per call, the row's id, written before
the call), so "called twice" is counted, not guessed: at most the rows in flight at the kill,
the concurrency (rows, not operations: the rows go ``BATCH`` an operation, so a kill or a retry
repeats whole batches, and still no more rows than were in flight). The killed client shares
this process's run log (``OPGRAPH_DB``), as processes on one machine do, so the job adopts the
run it left, live in the log.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

import ray

from opgraph.cluster.bench.map import CLIENT_SCRIPT, MarkingProvider, write_rows
from opgraph.cluster.jobs import MapJob, MapSettings, MapSpec
from opgraph.cluster.jobs.output import read_records
from opgraph.cluster.processes import run_until

ROWS, CONCURRENCY, KILL_AT = 600, 20, 200
BATCH = 5  # rows an operation: 4 operations in flight
DEADLINE = 240.0


def calls_per_row(marks) -> Counter:
    return Counter(marks.read_text().split())


def run_job(session, tmp_path, *, on_progress=None):
    """The job of ``tmp_path`` (its rows, store and output) run here to its end; its summary."""
    settings = MapSettings(concurrency=CONCURRENCY, output=str(tmp_path / "out.jsonl"), batch=BATCH)
    spec = MapSpec("id", "Classify: {text}", model="mark/default")

    async def run():
        job = await MapJob.prepare(str(tmp_path / "in.jsonl"), spec, settings, store=str(tmp_path / "store.db"))
        try:
            return await job.execute(session, on_progress=on_progress)
        finally:
            job.close()

    return asyncio.run(asyncio.wait_for(run(), DEADLINE))


def check_every_row_recorded_once(tmp_path) -> None:
    records = read_records(tmp_path / "out.jsonl")
    assert len(records) == ROWS, "the output holds a finished row more than once, or misses one"
    assert {record["id"] for record in records} == {str(index) for index in range(ROWS)}
    assert all(record["status"] == "done" for record in records)


def test_a_client_killed_mid_job_then_run_again_records_every_row_once(session, tmp_path):
    write_rows(tmp_path / "in.jsonl", ROWS)
    marks = tmp_path / "marks"
    spec = {"input": str(tmp_path / "in.jsonl"), "store": str(tmp_path / "store.db"),
            "output": str(tmp_path / "out.jsonl"), "model": "mark/default", "concurrency": CONCURRENCY,
            "marks": str(marks), "latency": 0.05, "step": 20, "batch": BATCH}
    run_until([sys.executable, "-c", CLIENT_SCRIPT, json.dumps(spec)],
              lambda lines: any(line.startswith("recorded") and int(line.split()[1]) >= KILL_AT for line in lines),
              timeout=DEADLINE)
    before = calls_per_row(marks)
    assert KILL_AT <= len(before) < ROWS
    session.register_provider("mark", MarkingProvider(str(marks), latency=0.05))

    summary = run_job(session, tmp_path)

    check_every_row_recorded_once(tmp_path)
    calls = calls_per_row(marks)
    assert set(calls) == {str(index) for index in range(ROWS)}
    twice = [row for row, count in calls.items() if count > 1]
    assert len(twice) <= CONCURRENCY, f"{len(twice)} rows were called twice: more than were in flight"
    assert summary.run_id.endswith("-1")  # the run the dead client fed, adopted from the log


def kill_mid_job(session, tmp_path, kill):
    """The job run here, ``kill()`` called once its KILL_AT-th row is recorded; then every row is
    checked recorded once, and the rows called twice counted. Returns the job's summary."""
    write_rows(tmp_path / "in.jsonl", ROWS)
    marks = tmp_path / "marks"
    session.register_provider("mark", MarkingProvider(str(marks), latency=0.05))
    killed = []

    def on_progress(progress):
        if progress.finished >= KILL_AT and not killed:
            killed.append(kill())

    summary = run_job(session, tmp_path, on_progress=on_progress)

    assert killed
    check_every_row_recorded_once(tmp_path)
    twice = [row for row, count in calls_per_row(marks).items() if count > 1]
    assert len(twice) <= CONCURRENCY
    return summary


def test_a_job_whose_executor_is_killed_finishes_on_the_replacement(session, tmp_path):
    def kill_the_executor():
        ray.kill(session.runtime.executor, no_restart=True)

    summary = kill_mid_job(session, tmp_path, kill_the_executor)
    assert summary.extra["recoveries"] == 1


def test_a_job_whose_worker_is_killed_retries_only_what_that_worker_held(session, tmp_path):
    def kill_a_worker():
        session.runtime.refresh()
        ray.kill(session.runtime.workers[0], no_restart=True)

    summary = kill_mid_job(session, tmp_path, kill_a_worker)
    assert summary.status == "completed"
