"""The `ray job submit` entrypoints: one run as a Ray job, reported in the job's logs.

``python -m opgraph.cluster.job MODE ...`` (or ``opgraph.cluster.jobs``) runs a fan-out or a
lane's run (a fixed workflow file) on the cluster the job driver joins.
"""

from .driver import EXIT_RUN_NOT_COMPLETED, EXIT_RUNTIME, EXIT_USAGE, ProgressLog, job_address, job_detached
from .entrypoint import build_parser, main
from .fanout import InjectedFailure, fail, fanout_graph

__all__ = ["EXIT_RUNTIME", "EXIT_RUN_NOT_COMPLETED", "EXIT_USAGE", "InjectedFailure", "ProgressLog", "build_parser",
           "fail", "fanout_graph", "job_address", "job_detached", "main"]
