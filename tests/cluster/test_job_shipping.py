"""Jobs that ship opgraph: a head whose Python has Ray and opgraph's dependencies, but not opgraph.

    pytest --(subprocess)--> opgraph job submit (this opgraph, staged as a py_modules folder)
        --(HTTP)--> bare head's job server -> `python -m opgraph.cluster.job` on the bare Python
                                           -> executor, workers, branch store (detached)

The bare Python (the ``bare-python`` component, tests/support/components.py) is a virtual
environment without system site packages holding only ``ray[default]`` and opgraph's runtime
dependencies. ``.ci/run`` builds it before the tests; a machine without it skips this module
and says the command that builds it (about 45 s from pip's cache, minutes from PyPI).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from components import require
from job_server import COMMAND_TIMEOUT, REPOSITORY, job_client, opgraph_command, summary_of, wait_for_terminal_status

from opgraph.cluster.jobs.shipping import PACKAGE_FOLDERS, opgraph_runtime_env
from opgraph.cluster.jobs.submission import job_submit_command, ray_cli
from opgraph.cluster.processes import run_command


@pytest.fixture(scope="session")
def bare_python() -> str:
    return require("bare-python")


@pytest.fixture(scope="module")
def bare_head(bare_python, local_head_starter):
    with local_head_starter(bare_python) as head:
        yield head


def test_the_bare_python_has_ray_and_no_opgraph(bare_python):
    probe = run_command([bare_python, "-c", "import ray, psycopg, pydantic; import opgraph.kernel"],
                        timeout=120)
    assert probe.returncode != 0 and "No module named 'opgraph'" in probe.stderr, probe.stderr


def test_a_job_runs_on_a_head_without_opgraph_because_the_job_ships_it(bare_head, tmp_path):
    """fan-out of 60 x 10 ms: the driver and every actor import the shipped opgraph."""
    submission_id = f"opgraph-ship-{uuid.uuid4().hex[:8]}"
    env = {**bare_head.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    submitted = run_command(
        opgraph_command("job", "submit", "--address", bare_head.dashboard_url, "--working-dir", str(REPOSITORY),
                        "--submission-id", submission_id, "--no-wait", "--",
                        "fanout", "--nodes", "60", "--latency", "0.01", "--max-concurrent", "20"),
        env=env, timeout=COMMAND_TIMEOUT, cwd=REPOSITORY)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert "py_modules" in submitted.stderr  # the command it ran names the shipped folder
    status = wait_for_terminal_status(bare_head, submission_id)
    logs = job_client(bare_head).get_job_logs(submission_id)
    assert status == "SUCCEEDED", logs
    summary = summary_of(logs)
    assert (summary["status"], summary["nodes"], summary["by_status"]) == ("completed", 60, {"completed": 60})
    info = job_client(bare_head).get_job_info(submission_id)
    assert any(module.startswith("gcs://") for module in info.runtime_env["py_modules"])  # uploaded, not installed


def test_without_shipping_the_same_job_fails_for_want_of_opgraph(bare_head):
    submission_id = f"opgraph-noship-{uuid.uuid4().hex[:8]}"
    submitted = run_command(
        opgraph_command("job", "submit", "--no-ship", "--address", bare_head.dashboard_url,
                        "--working-dir", str(REPOSITORY), "--submission-id", submission_id, "--no-wait", "--",
                        "fanout", "--nodes", "5"),
        env=bare_head.env(), timeout=COMMAND_TIMEOUT, cwd=REPOSITORY)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert wait_for_terminal_status(bare_head, submission_id) == "FAILED"
    assert "No module named 'opgraph'" in job_client(bare_head).get_job_logs(submission_id)


def test_the_runtime_env_names_one_staged_opgraph_folder_and_keeps_the_callers(tmp_path):
    env = opgraph_runtime_env({"env_vars": {"A": "1"}, "py_modules": ["/x/mine"]}, root=tmp_path)
    staged = Path(env["py_modules"][-1])
    assert env["env_vars"] == {"A": "1"} and env["py_modules"][0] == "/x/mine"
    assert staged.name == "opgraph" and sorted(p.name for p in staged.iterdir()) == sorted(PACKAGE_FOLDERS)
    assert (staged / "cluster" / "jobs" / "entrypoint.py").is_file()
    assert not list(staged.rglob("__pycache__"))
    assert opgraph_runtime_env(root=tmp_path)["py_modules"] == [str(staged)]  # the same content, staged once
    command = job_submit_command(["fanout"], address="http://h:8265", runtime_env={"pip": ["x"]}, ship=False)
    assert command == [*ray_cli(), "job", "submit", "--address", "http://h:8265", "--working-dir", ".",
                       "--runtime-env-json", '{"pip": ["x"]}', "--", "python", "-m", "opgraph.cluster.job", "fanout"]
