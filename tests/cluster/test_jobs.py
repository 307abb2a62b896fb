"""Jobs on a real local head: `opgraph job submit` -> `ray job submit` -> `python -m opgraph.cluster.job`.

    pytest --(subprocess)--> opgraph job submit --(HTTP)--> head's job server
                                                               -> job driver: Session(address="auto")
                                                               -> executor, workers, branch store

Only subprocesses and the job server's HTTP API touch the head; this process never
joins it. Waits poll the job's status against a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import io
import json
import sys
import uuid

from job_server import (
    COMMAND_TIMEOUT,
    REPOSITORY,
    job_client,
    opgraph_command,
    summary_of,
    wait_for_terminal_status,
)

from opgraph.cluster.jobs import EXIT_USAGE, ProgressLog, fanout_graph
from opgraph.cluster.jobs.submission import job_submit_command, ray_cli
from opgraph.cluster.processes import run_command


def test_fanout_job_succeeds_with_progress_in_its_logs(ray_head, tmp_path):
    """fan-out of 200 x 10 ms submitted with --no-wait; the job driver joins the head by RAY_ADDRESS.

    The job also serves /metrics on a free port while it runs and writes the envelope to a file.
    """
    submission_id = f"opgraph-test-{uuid.uuid4().hex[:8]}"
    results = tmp_path / "envelope.json"
    submitted = run_command(
        opgraph_command("job", "submit", "--address", ray_head.dashboard_url, "--working-dir", str(REPOSITORY),
                        "--submission-id", submission_id, "--no-wait", "--",
                        "fanout", "--nodes", "200", "--latency", "0.01", "--max-concurrent", "20",
                        "--progress-interval", "0.2", "--results", str(results), "--metrics-port", "0"),
        env=ray_head.env(), timeout=COMMAND_TIMEOUT, cwd=REPOSITORY)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "ray job submit" in submitted.stderr  # the wrapper shows the command it ran

    status = wait_for_terminal_status(ray_head, submission_id)
    logs = job_client(ray_head).get_job_logs(submission_id)
    assert status == "SUCCEEDED", logs

    progress = [line for line in logs.splitlines() if line.startswith("progress: ")]
    assert len(progress) >= 2, logs
    assert progress[-1].startswith("progress: settled 200/200 (100%), in flight 0, failed 0"), progress[-1]
    summary = summary_of(logs)
    assert summary["status"] == "completed"
    assert summary["nodes"] == 200
    assert summary["by_status"] == {"completed": 200}
    assert f"run_id: {summary['run_id']}" in logs
    assert "metrics: http://127.0.0.1:" in logs  # served for the run's duration
    envelope = json.loads(results.read_text())
    assert envelope["status"] == "completed"
    assert len(envelope["operation_statuses"]) == 200
    assert sorted(envelope["operation_results"].values()) == list(range(200))


def test_failed_run_fails_the_job(ray_head):
    """fan-out of 100 where every 25th node fails; `opgraph job submit` tails the logs and exits 1."""
    submission_id = f"opgraph-test-{uuid.uuid4().hex[:8]}"
    submitted = run_command(
        opgraph_command("job", "submit", "--address", ray_head.dashboard_url, "--working-dir", str(REPOSITORY),
                        "--submission-id", submission_id, "--",
                        "fanout", "--nodes", "100", "--latency", "0.01", "--fail-every", "25"),
        env=ray_head.env(), timeout=COMMAND_TIMEOUT, cwd=REPOSITORY)
    assert submitted.returncode == 1, submitted.stdout + submitted.stderr
    assert wait_for_terminal_status(ray_head, submission_id) == "FAILED"
    summary = summary_of(job_client(ray_head).get_job_logs(submission_id))
    assert summary["status"] == "failed"
    assert summary["by_status"] == {"completed": 96, "failed": 4}
    assert len(summary["failed_operations"]) == 4


def test_workflow_file_job_runs_the_fixed_lane_and_records_the_run(ray_head, tmp_path):
    """`job workflow FILE` on the head: progress in the logs, a summary, the run in the driver's store."""
    from opgraph.cluster.cli.flow import example_workflow_path
    from opgraph.cluster.lanes import open_store

    submission_id = f"opgraph-test-{uuid.uuid4().hex[:8]}"
    store, results = tmp_path / "runs.db", tmp_path / "result.json"
    # Relative to the working dir, as a user types it: the job reads Ray's copy of the file
    # (somewhere under the head's temp dir), and must record the path given here.
    given = str(example_workflow_path().relative_to(REPOSITORY))
    submitted = run_command(
        opgraph_command("job", "submit", "--address", ray_head.dashboard_url, "--working-dir", str(REPOSITORY),
                        "--submission-id", submission_id, "--",
                        "workflow", given, "--input", "ticket=login page is slow",
                        "--input", "priority=low", "--model", "sim/fast", "--store", str(store),
                        "--results", str(results), "--progress-interval", "0.1"),
        env=ray_head.env(), timeout=COMMAND_TIMEOUT, cwd=REPOSITORY)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert wait_for_terminal_status(ray_head, submission_id) == "SUCCEEDED"
    logs = job_client(ray_head).get_job_logs(submission_id)
    summary = summary_of(logs)
    assert summary["status"] == "completed"
    assert summary["statuses"] == {"classify": "completed", "draft_reply": "completed", "escalate": "skipped",
                                   "check": "completed"}
    assert any(line.startswith("progress: settled 4/4") for line in logs.splitlines()), logs
    assert json.loads(results.read_text())["outputs"]["draft_reply"]["model"] == "sim/fast"
    with open_store(store) as opened:
        run = opened.get_run(summary["run_id"])
        assert run.status == "completed" and run.content_hash == summary["content_hash"]
        assert run.source_ref == given and run.provenance["source"]["ref"] == given


def test_workflow_job_with_a_bad_definition_exits_with_usage_and_structured_errors(tmp_path):
    """Compile errors are printed before any Ray starts; the job would be marked FAILED."""
    spec = {"version": 1, "nodes": [{"id": "p", "kind": "parse", "pos": {"x": 0, "y": 0}}], "edges": []}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    finished = run_command([sys.executable, "-m", "opgraph.cluster.job", "workflow", str(path)],
                           timeout=60)
    assert finished.returncode == EXIT_USAGE
    errors = json.loads(finished.stderr.strip().splitlines()[-1])["errors"]
    assert [problem["node_id"] for problem in errors] == ["p"]


def test_job_submit_command_is_ray_job_submit_of_the_entrypoint(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shipped = job_submit_command(["fanout"], address="http://127.0.0.1:8265")
    assert shipped[shipped.index("--runtime-env-json") + 1] == json.dumps(
        {"py_modules": [str(next(tmp_path.glob("opgraph/runtime-env/*/opgraph")))]})
    command = job_submit_command(["fanout", "--nodes", "10"], address="http://127.0.0.1:8265", no_wait=True,
                                 submission_id="nightly", ship=False)
    assert command == [*ray_cli(), "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".",
                       "--submission-id", "nightly", "--no-wait", "--",
                       "python", "-m", "opgraph.cluster.job", "fanout", "--nodes", "10"]


def test_progress_log_prints_every_step_and_at_most_every_interval():
    """10 nodes, step 20%: a line per 2 settled nodes; the clock alone also forces a line."""
    now = [0.0]
    out = io.StringIO()
    progress = ProgressLog(10, out=out, interval=5.0, step=0.2, clock=lambda: now[0])
    for index in range(4):
        progress(f"n{index}", "sleep", "started", 0.0)
    progress("n0", "sleep", "completed", 0.1)
    assert progress.lines == 0
    progress("n1", "sleep", "failed", 0.1)
    assert out.getvalue().splitlines() == ["progress: settled 2/10 (20%), in flight 2, failed 1, 0.0 s"]
    now[0] = 6.0
    progress("n4", "sleep", "started", 0.0)
    assert out.getvalue().splitlines()[-1] == "progress: settled 2/10 (20%), in flight 3, failed 1, 6.0 s"
    progress.close()  # nothing settled since the last line
    assert progress.lines == 2


def test_progress_log_takes_a_polled_status_as_the_run_counts_it():
    """A status snapshot sets the counts (running is in flight); a line per 20% or per 5 s, as with signals."""
    now = [0.0]
    out = io.StringIO()
    progress = ProgressLog(10, out=out, interval=5.0, step=0.2, clock=lambda: now[0])
    progress.observe({"settled_by_status": {"completed": 1, "failed": 0, "skipped": 0, "cancelled": 0},
                      "running": 3})
    assert progress.lines == 0
    progress.observe({"settled_by_status": {"completed": 2, "failed": 1}, "running": 4})
    assert out.getvalue().splitlines() == ["progress: settled 3/10 (30%), in flight 4, failed 1, 0.0 s"]
    now[0] = 6.0
    progress.observe({"settled_by_status": {"completed": 3, "failed": 1}, "running": 2})
    assert out.getvalue().splitlines()[-1] == "progress: settled 4/10 (40%), in flight 2, failed 1, 6.0 s"


def test_fanout_graph_places_failing_nodes():
    graph = fanout_graph(10, 0.0, fail_every=5)
    assert [node.operation for node in graph.nodes.values()].count("fail") == 2


def test_the_last_progress_line_after_a_cancel_counts_nothing_in_flight():
    """100 started, 4 completed, then a cancel: cancelled nodes send no signal, so the
    signals alone say "in flight 96"; the last line comes from the run's result."""
    out = io.StringIO()
    progress = ProgressLog(100, out=out, interval=1e9, step=1.0, clock=lambda: 0.0)
    for index in range(100):
        progress(f"n{index}", "sleep", "started", 0.0)
    for index in range(4):
        progress(f"n{index}", "sleep", "completed", 0.1)
    statuses = {f"n{index}": "completed" if index < 4 else "cancelled" for index in range(100)}
    progress.close({"status": "cancelled", "operation_statuses": statuses})
    assert out.getvalue().splitlines()[-1] == \
        "progress: settled 4/100 (4%), in flight 0, failed 0, cancelled 96, 0.0 s"
