"""The one exception tree: every OpGraphError subclass of every layer is drawn, documented and pickles.

Walks the subclasses after importing every module of every layer (the top layer may
import them all), so an error added anywhere and left out of ``kernel/errors.py``'s tree,
or one that loses its ids crossing a process, fails here.
"""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import opgraph.kernel.errors as errors_module
from opgraph.kernel import OpGraphError

LAYERS = ("opgraph.kernel", "opgraph.actors", "opgraph.engines", "opgraph.cluster")


def _import_everything() -> None:
    for layer in LAYERS:
        package = importlib.import_module(layer)
        for module in pkgutil.walk_packages(package.__path__, prefix=f"{layer}."):
            importlib.import_module(module.name)


def _all_subclasses(root: type) -> list[type]:
    found, stack = [], [root]
    while stack:
        for subclass in stack.pop().__subclasses__():
            if subclass not in found:
                found.append(subclass)
                stack.append(subclass)
    return found


_import_everything()
OPGRAPH_ERRORS = [cls for cls in _all_subclasses(OpGraphError) if cls.__module__.startswith("opgraph.")]


def test_every_layer_defines_errors_and_all_were_found():
    modules = {cls.__module__.split(".")[1] for cls in OPGRAPH_ERRORS}
    assert {"kernel", "actors", "cluster"} <= modules
    assert len(OPGRAPH_ERRORS) >= 40


@pytest.mark.parametrize("cls", OPGRAPH_ERRORS, ids=lambda cls: cls.__name__)
def test_each_error_is_drawn_in_the_one_tree(cls):
    tree = errors_module.__doc__
    assert f" {cls.__name__} " in tree or f" {cls.__name__}\n" in tree or f"── {cls.__name__}" in tree, \
        f"{cls.__module__}.{cls.__name__} is not drawn in kernel/errors.py's tree"


@pytest.mark.parametrize("cls", OPGRAPH_ERRORS, ids=lambda cls: cls.__name__)
def test_each_error_says_what_it_means(cls):
    assert cls.__doc__ and cls.__doc__.strip() and cls.__doc__ != OpGraphError.__doc__


@pytest.mark.parametrize("cls", OPGRAPH_ERRORS, ids=lambda cls: cls.__name__)
def test_each_error_round_trips_through_pickle_with_its_ids(cls):
    error = cls.__new__(cls)
    Exception.__init__(error, "what went wrong")
    error.__dict__.update(message="what went wrong", node_id="node-1", branch_id="branch-2", edge_id="edge-3",
                          run_id="run-4", actor="opgraph-worker-5", detail={"extra": [1, 2]})
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert (copy.message, copy.node_id, copy.branch_id, copy.edge_id, copy.run_id, copy.actor) == \
        ("what went wrong", "node-1", "branch-2", "edge-3", "run-4", "opgraph-worker-5")
    assert copy.detail == {"extra": [1, 2]}
    for label in ("run=run-4", "node=node-1", "actor=opgraph-worker-5"):
        assert label in str(copy)


def test_a_real_error_keeps_its_own_fields_across_pickle():
    from opgraph.actors import TurnError

    error = TurnError("it failed", error_type="WorkerDied", usage={"calls": 2}, run_id="r", node_id="n")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.error_type, copy.usage, copy.run_id, copy.node_id) == ("WorkerDied", {"calls": 2}, "r", "n")
