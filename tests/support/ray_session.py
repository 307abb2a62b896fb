"""Fixtures shared by the Ray test trees (tests/actors, tests/cluster), imported by their conftests.

One Session (and embedded Ray) per test session; every test module pickled by value so
that operations defined in it can run inside the worker processes; the shared session's
registrations restored after each test. tests/ has no packages (importlib import mode):
this folder is on the path through pytest's ``pythonpath`` setting (pyproject.toml).
"""

from __future__ import annotations

import os

# Before Ray is imported anywhere: a local test cluster needs no token, and the warning
# about it would only add noise to every run.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import ray
from ray import cloudpickle

from opgraph.actors import Session

__all__ = ["_pickle_test_module_by_value", "_restore_registrations", "session"]


@pytest.fixture(scope="session")
def session():
    """The one Session (and embedded Ray) shared by every test of the tree."""
    shared = Session()
    yield shared
    ray.shutdown()


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
