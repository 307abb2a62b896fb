"""The `ray job submit` entrypoints and the dataset jobs: one run as a Ray job, or a prompt over every row.

``python -m opgraph.cluster.job MODE ...`` (or ``opgraph.cluster.jobs``) runs a fan-out, a
lane's run (a fixed workflow file) or a dataset job (``map``) on the cluster the job driver
joins. ``map(rows, prompt=..., session=...)`` is a dataset job for a notebook: an async
iterator of each row's recorded outcome.
"""

from .driver import EXIT_RUN_NOT_COMPLETED, EXIT_RUNTIME, EXIT_USAGE, ProgressLog, job_address, job_detached
from .entrypoint import build_parser, main
from .fanout import InjectedFailure, fail, fanout_graph
from .map import MapJob, MapSettings, MapSpec, MapSummary, dry_run, map_rows
from .rows import MapInputChangedError, MapInputError

map = map_rows  # noqa: A001 - `opgraph.cluster.jobs.map(...)`, the Python form of `opgraph map`

__all__ = ["EXIT_RUNTIME", "EXIT_RUN_NOT_COMPLETED", "EXIT_USAGE", "InjectedFailure", "MapInputChangedError",
           "MapInputError", "MapJob", "MapSettings", "MapSpec", "MapSummary", "ProgressLog", "build_parser",
           "dry_run", "fail", "fanout_graph", "job_address", "job_detached", "main", "map", "map_rows"]
