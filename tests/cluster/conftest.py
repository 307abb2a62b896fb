"""Fixtures for the cluster tests: one shared Ray and Session, and a live metrics endpoint.

Ray starts once (``session``); the metrics endpoint (``metrics_server``) is served on a
free loopback port for the whole session; each test module is pickled by value so that
operations defined in it can run inside the worker processes.
"""

from __future__ import annotations

import os

# Before Ray is imported anywhere: a local test cluster needs no token, and the warning
# about it would only add noise to every run.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402
import ray  # noqa: E402
from ray import cloudpickle  # noqa: E402

from opgraph.actors import Session  # noqa: E402
from opgraph.cluster.metrics import serve_metrics  # noqa: E402


@pytest.fixture(scope="session")
def session():
    """The one Session (and embedded Ray) shared by every test in tests/cluster."""
    shared = Session()
    yield shared
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_server(session):
    """``/metrics`` for the shared runtime on 127.0.0.1, any free port."""
    server = serve_metrics(session, port=0, host="127.0.0.1")
    yield server
    server.stop()


@pytest.fixture(autouse=True, scope="module")
def _pickle_test_module_by_value(request):
    """Ship this module's operations and helpers to the workers by value.

    Test modules are imported by pytest (``--import-mode=importlib``) under names the
    Ray worker processes cannot import, so pickling them by reference would fail there.
    """
    module = request.module
    cloudpickle.register_pickle_by_value(module)
    yield
    cloudpickle.unregister_pickle_by_value(module)


@pytest.fixture(autouse=True)
def _restore_registrations(request):
    """Tests may replace operations (e.g. ``operate`` for spawned children) on the shared
    session; put the session's registrations back afterwards so modules stay independent."""
    if "session" not in request.fixturenames:
        yield
        return
    shared = request.getfixturevalue("session")
    operations, providers = dict(shared.operations), dict(shared.providers)
    yield
    shared.operations.clear()
    shared.operations.update(operations)
    shared.providers.clear()
    shared.providers.update(providers)
