"""The `ray job submit` entrypoints: one run as a Ray job, reported in the job's logs.

``python -m opgraph.cluster.job MODE ...`` (or ``opgraph.cluster.jobs``) runs a fan-out or a
lane's run (a fixed workflow file) on the cluster the job driver joins.
"""

from .entrypoint import EXIT_RUN_NOT_COMPLETED, EXIT_RUNTIME, EXIT_USAGE, ProgressLog, build_parser, fanout_graph, main

__all__ = ["EXIT_RUNTIME", "EXIT_RUN_NOT_COMPLETED", "EXIT_USAGE", "ProgressLog", "build_parser", "fanout_graph",
           "main"]
