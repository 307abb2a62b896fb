"""The `ray job submit` command line that runs opgraph's job entrypoint, with opgraph shipped along.

Owns assembling ``ray job submit ... -- python -m opgraph.cluster.job ARGS``: the job
server's address, the working directory, the runtime environment that takes this opgraph to
the cluster (``shipping``), and the job's own ``--detach``. It runs nothing: ``opgraph job
submit`` runs the command, and the million-node benchmark submits its jobs with it.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from .shipping import opgraph_runtime_env

__all__ = ["job_submit_command", "ray_cli"]


def ray_cli() -> list[str]:
    """``ray`` from PATH, or this interpreter's Ray CLI module when no script is on PATH."""
    return ["ray"] if shutil.which("ray") else [sys.executable, "-m", "ray.scripts.scripts"]


def job_submit_command(entrypoint: Sequence[str], *, address: str | None = None, working_dir: str = ".",
                       no_wait: bool = False, submission_id: str | None = None,
                       python: str = "python", detach: bool = False, runtime_env: dict[str, Any] | None = None,
                       ship: bool = True) -> list[str]:
    """The `ray job submit` command line that runs ``python -m opgraph.cluster.job ENTRYPOINT...``.

    ``ship`` (the default) takes this process's opgraph to the cluster in the job's runtime
    environment (``py_modules``, merged into ``runtime_env``), so nodes need only Ray and
    opgraph's dependencies. ``detach`` adds the job's own ``--detach``: the job ends once its
    run is admitted and durable, and the run goes on on the cluster (``opgraph run result
    RUN_ID`` reads its end).
    """
    command = [*ray_cli(), "job", "submit"]
    if address:
        command += ["--address", address]
    command += ["--working-dir", working_dir]
    environment = opgraph_runtime_env(runtime_env) if ship else runtime_env
    if environment:
        command += ["--runtime-env-json", json.dumps(environment, sort_keys=True)]
    if submission_id:
        command += ["--submission-id", submission_id]
    if no_wait:
        command.append("--no-wait")
    return command + ["--", python, "-m", "opgraph.cluster.job", *entrypoint, *(["--detach"] if detach else [])]
