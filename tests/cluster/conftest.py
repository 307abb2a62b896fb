"""Fixtures for the cluster tests: one shared Ray and Session, a live metrics endpoint, a real head.

Ray starts once (``session``); the metrics endpoint (``metrics_server``) is served on a
free loopback port for the whole session; each test module is pickled by value so that
operations defined in it can run inside the worker processes. ``ray_head`` is a separate
`ray start --head` cluster that only subprocesses talk to; it is stopped by process id,
never with `ray stop` (which would also stop the embedded Ray of this pytest process).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator

import pytest

# First: sets the test clusters' Ray options before Ray is imported anywhere.
from ray_session import _pickle_test_module_by_value, _restore_registrations, session  # noqa: F401

from opgraph.cluster.local_head import LocalHead, start_local_head
from opgraph.cluster.metrics import serve_metrics


@pytest.fixture(scope="session")
def metrics_server(session):  # noqa: F811 - the fixture imported above, requested by name
    """``/metrics`` for the shared runtime on 127.0.0.1, any free port."""
    server = serve_metrics(session, port=0, host="127.0.0.1")
    yield server
    server.stop()


# -- a real local head, for jobs and for clients in other processes ----------------------
# The head itself (its own temp dir, free ports, token; stopped by pid) is
# opgraph.cluster.local_head's, shared with the million-node benchmark.
@contextlib.contextmanager
def running_local_head(python: str = sys.executable) -> Iterator[LocalHead]:
    """A head run by ``python`` for the block; then stopped, by pid, and its temp dir removed.
    A process of it that survives SIGKILL fails the test that used it."""
    head = start_local_head(python)
    try:
        yield head
    finally:
        survivors = head.stop()
        shutil.rmtree(head.temp_dir)
        assert not survivors, f"processes of the local head survived SIGKILL: {sorted(survivors)}"


@pytest.fixture(scope="session")
def local_head_starter():
    """``running_local_head`` itself, for a test module that needs a head of its own (another Python)."""
    return running_local_head


@pytest.fixture(scope="session")
def ray_head():
    """A real `ray start --head` on 127.0.0.1 free ports, with token authentication (Ray's
    default), for subprocess clients only: ``ray_head.env()`` carries its token.

    Nothing in this pytest process calls ray.init against it: its ray_current_cluster
    file lives in its own temp dir, so the embedded Ray of ``session`` never finds it.
    """
    with running_local_head() as head:
        yield head
