"""Fixtures for the engine tests: the shared Ray session, scripted models and a sink.

Engines run in the test process (the driver); their agents' turns run on the shared
session's OperationWorkers, answered by ``ScriptedProvider`` scripts (engine_scripts.py).
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import engine_scripts
import pytest
from ray import cloudpickle

# The shared Session fixture (ray_session also sets the test clusters' Ray options before Ray starts).
from ray_session import _pickle_test_module_by_value, _restore_registrations, session  # noqa: F401

from opgraph.actors.providers import ScriptedProvider
from opgraph.engines import MemorySink

# Neither module is importable in the workers: their scripts and types travel by value.
cloudpickle.register_pickle_by_value(engine_scripts)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _with_usage(inner: Any, usage: dict[str, int]) -> Any:
    """A script whose text replies report ``usage`` (prompt_tokens, completion_tokens)."""

    def script(request: Any) -> Any:
        reply = inner(request)
        return {"content": reply, "usage": usage} if isinstance(reply, str) else reply

    return script


@pytest.fixture
def model(session):  # noqa: F811 - the fixture imported above, requested by name
    """``model(script)`` registers a scripted provider under a fresh name; returns its model id."""

    def register(script: Any, **usage: int) -> str:
        name = f"scripted{uuid.uuid4().hex[:8]}"
        if usage:
            script = _with_usage(script, dict(usage))
        session.register_provider(name, ScriptedProvider(script, name=name))
        return f"{name}/m"

    return register


@pytest.fixture
def sink():
    return MemorySink()
