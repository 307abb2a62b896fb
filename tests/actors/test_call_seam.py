"""The call seam (actors/calls.py) holds: calls to other actors are sent from it, and its stubs are
the actors' remote surfaces.

Pure: no Ray instance is started. ``.ci/run`` checks the first point with the same grep.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REMOTE_CALL = re.compile(r"(?<!ray)\.remote\(")  # a call or an actor start; ``@ray.remote(...)`` is neither
MOST_FILES_WITH_REMOTE = 2


def test_at_most_two_files_outside_the_benchmarks_send_a_remote_call():
    """Every call to another actor goes through the seam: a new ``.remote(`` elsewhere is a call
    that skips its translation of errors and its one replacement policy."""
    found = sorted(str(path.relative_to(ROOT)) for folder in ("actors", "cluster", "engines")
                   for path in (ROOT / folder).rglob("*.py")
                   if not path.relative_to(ROOT).is_relative_to("cluster/bench")
                   and REMOTE_CALL.search(path.read_text(encoding="utf-8")))
    assert len(found) <= MOST_FILES_WITH_REMOTE, f"files with .remote( outside cluster/bench: {found}"
    assert "actors/calls.py" in found


def _stubs_and_actors():
    from opgraph.actors.branches.store import BranchStore
    from opgraph.actors.calls import BranchStoreStub, ExecutorStub, ProviderLimiterStub, WorkerStub
    from opgraph.actors.executor.actor import GraphExecutor
    from opgraph.actors.providers.limits import ProviderLimiter
    from opgraph.actors.workers.worker import OperationWorker

    return [(ExecutorStub, GraphExecutor), (WorkerStub, OperationWorker), (BranchStoreStub, BranchStore),
            (ProviderLimiterStub, ProviderLimiter)]


# Public methods of an actor class its own process calls, never another: no stub method.
IN_PROCESS = {"OperationWorker": {"batches", "replacement_store", "start_one", "store", "with_shared_results"}}


def _parameters(function) -> list[tuple]:
    """Names, kinds and defaults; Ray adds ``_ray_trace_ctx`` to an actor class's methods."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()
            if p.name != "_ray_trace_ctx"]


@pytest.mark.parametrize("pair", range(4), ids=["executor", "worker", "branch-store", "provider-limiter"])
def test_a_stub_has_one_method_per_remote_method_with_the_same_parameters(pair):
    stub, actor = _stubs_and_actors()[pair]
    actor_class = actor.__ray_actor_class__
    remote = {name for name, member in vars(actor_class).items()
              if inspect.isfunction(member) and not name.startswith("_")}
    remote -= IN_PROCESS.get(actor_class.__name__, set())
    declared = {name for name in dir(stub) if not name.startswith("_") and inspect.isfunction(getattr(stub, name))}
    assert declared == remote
    for name in sorted(remote):
        assert _parameters(getattr(stub, name)) == _parameters(getattr(actor_class, name)), name


def test_only_asks_are_sent_again_and_tells_answer_nothing():
    """A tell returns None (its failure goes to the supervisor, not to the sender); a call the
    policy resends is an ask, whose answer someone waits for."""
    from opgraph.actors.calls import SAFE_TO_RESEND

    tells = set()
    for stub, _ in _stubs_and_actors():
        for name, member in vars(stub).items():
            if inspect.isfunction(member) and not name.startswith("_") and member.__annotations__["return"] == "None":
                tells.add(member)
    assert {f"{tell.__qualname__}" for tell in tells} == {
        "ExecutorStub.receive_requests", "WorkerStub.forget", "WorkerStub.cancel",
        "ProviderLimiterStub.release", "ProviderLimiterStub.settle"}
    assert not tells & SAFE_TO_RESEND
