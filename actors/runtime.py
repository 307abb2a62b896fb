"""Connecting to Ray and finding (or starting) the long-lived opgraph actors.

Owns actor placement: one executor, a small worker pool and the branch-store shards per
namespace, all named so that every Session in a process (and, with detached lifetime, on
a cluster) shares them. Actors are started once, never per run, node or branch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

from .branches import BranchStore
from .executor import GraphExecutor
from .workers import OperationWorker

__all__ = ["DEFAULT_NAMESPACE", "EXECUTOR_NAME", "Runtime", "connect", "start_worker"]

DEFAULT_NAMESPACE = "opgraph"
EXECUTOR_NAME = "opgraph-executor-0"
WORKER_CONCURRENCY = 100_000
EXECUTOR_CONCURRENCY = 100_000
_AUTH_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"


def connect(address: str | None = None, *, namespace: str = DEFAULT_NAMESPACE) -> None:
    """Join Ray: the embedded local instance by default, or ``address`` ("auto", "ray://...", "host:port")."""
    if ray.is_initialized():
        return
    address = address or os.environ.get("OPGRAPH_RAY_ADDRESS") or None
    options: dict[str, Any] = {"namespace": namespace, "logging_level": "warning", "log_to_driver": True}
    if address is None:
        options.update(include_dashboard=False, configure_logging=True)
        # The embedded instance keeps Ray's default token authentication; Ray's notice
        # that it did so ("set RAY_AUTH_MODE=disabled to opt out") was the first line a
        # new user saw, as a WARNING, on every command. Quiet for this start only.
        notice = logging.getLogger(_AUTH_NOTICE_LOGGER)
        level = notice.level
        notice.setLevel(logging.ERROR)
        try:
            ray.init(address=address, **options)
        finally:
            notice.setLevel(level)
        return
    ray.init(address=address, **options)


def start_worker(stores: list[Any], index: int, *, namespace: str | None = None, detached: bool = False) -> Any:
    return OperationWorker.options(
        name=f"opgraph-worker-{index}",
        namespace=namespace,
        get_if_exists=True,
        max_concurrency=WORKER_CONCURRENCY,
        lifetime="detached" if detached else None,
    ).remote(stores, index)


@dataclass
class Runtime:
    """Handles to the shared actors of one namespace."""

    executor: Any
    workers: list[Any]
    stores: list[Any]

    @classmethod
    def get_or_start(cls, *, workers: int = 2, branch_stores: int = 1, detached: bool = False,
                     namespace: str | None = None) -> Runtime:
        """Find or start the actors of ``namespace`` (default: the job's namespace)."""
        lifetime = "detached" if detached else None
        stores = [
            BranchStore.options(name=f"opgraph-branches-{i}", namespace=namespace, get_if_exists=True,
                                lifetime=lifetime).remote(i)
            for i in range(branch_stores)
        ]
        pool = [start_worker(stores, i, namespace=namespace, detached=detached) for i in range(workers)]
        executor = GraphExecutor.options(
            name=EXECUTOR_NAME,
            namespace=namespace,
            get_if_exists=True,
            max_concurrency=EXECUTOR_CONCURRENCY,
            lifetime=lifetime,
        ).remote(pool, stores, EXECUTOR_NAME, detached, namespace)
        return cls(executor=executor, workers=pool, stores=stores)
