"""Talking to a head's job server from the tests: submit through the CLI, wait for a status, read the logs.

Only HTTP (``JobSubmissionClient``) and subprocesses: nothing here calls ``ray.init``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

__all__ = ["COMMAND_TIMEOUT", "JOB_DEADLINE", "REPOSITORY", "TERMINAL", "job_client", "opgraph_command",
           "summary_of", "wait_for_terminal_status"]

REPOSITORY = Path(__file__).resolve().parents[2]  # tests/support -> the repository
JOB_DEADLINE = 150.0  # seconds from submission to a terminal status
COMMAND_TIMEOUT = 180.0
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def job_client(head):
    from ray.job_submission import (
        JobSubmissionClient,  # an HTTP client: it never calls ray.init
    )

    return JobSubmissionClient(head.dashboard_url, headers={"Authorization": f"Bearer {head.token}"})


def wait_for_terminal_status(head, submission_id: str) -> str:
    client = job_client(head)
    deadline = time.monotonic() + JOB_DEADLINE
    while True:
        status = str(client.get_job_status(submission_id).value)
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            logs = client.get_job_logs(submission_id)
            client.stop_job(submission_id)
            pytest.fail(f"job {submission_id} still {status} after {JOB_DEADLINE} s; logs:\n{logs}")
        time.sleep(0.5)


def opgraph_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "opgraph.cluster.cli", *arguments]


def summary_of(logs: str) -> dict:
    """The job's last stdout line is its JSON summary."""
    lines = [line for line in logs.splitlines() if line.startswith("{")]
    assert lines, f"no JSON summary in the job logs:\n{logs}"
    return json.loads(lines[-1])
