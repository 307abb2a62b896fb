"""Every change of a node's state goes through the TRANSITIONS table (kernel/states.py).

The kernel's source is read, not run: each write into a node's state (``state[...] =``,
``state.update(...)``, a ``del`` or a mutating call) must sit in ``_transition``, in its
batch form ``_transition_batch``, or at one of the four sites that write a fast step
inline (states.py ``FAST_STEPS``, rows checked once at import). Then the batch form and
the table refuse what is not a row.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kernel_graphs import build

import opgraph.kernel
from opgraph.kernel import TRANSITIONS, StateTransitionError
from opgraph.kernel.states import (
    _ALLOWED_FROM,
    COMPLETED,
    FAILED,
    FAST_STEPS,
    IMPLIED_STEPS,
    READY,
    RUNNING,
    UNREGISTERED,
    WAITING,
)

KERNEL = Path(opgraph.kernel.__file__).parent
# (module, function) of every place that may write a node's state.
WRITERS = {
    ("scheduler.py", "_transition"),
    ("scheduler.py", "_transition_batch"),
    ("registration.py", "_register"),  # fast step (UNREGISTERED, WAITING)
    ("scheduler.py", "_make_ready"),  # fast step (WAITING, READY)
    ("dispatch.py", "_dispatch_ready"),  # fast step (READY, RUNNING)
    ("scheduler.py", "_settle_completed"),  # fast step (RUNNING, COMPLETED)
    ("release.py", "_on_release"),  # (terminal, UNREGISTERED): a released node leaves the run
}
_MUTATING = frozenset({"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"})


def _is_node_states(expr: ast.expr) -> bool:
    """``self.state`` or a local bound to it (the kernel binds it as ``state``)."""
    return (isinstance(expr, ast.Attribute) and expr.attr == "state") or (isinstance(expr, ast.Name)
                                                                         and expr.id == "state")


def _writes_states(node: ast.AST) -> bool:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
        flat = [item for target in targets for item in (target.elts if isinstance(target, ast.Tuple) else [target])]
        return any(isinstance(target, ast.Subscript) and _is_node_states(target.value) for target in flat)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATING
            and _is_node_states(node.func.value))


def state_writers() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(KERNEL.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef):
                if any(_writes_states(node) for node in ast.walk(function)):
                    found.add((path.name, function.name))
    return found


def test_only_the_transition_methods_and_the_fast_step_sites_write_a_nodes_state():
    assert state_writers() == WRITERS


def test_the_fast_steps_are_rows_of_the_table_and_registration_is_one():
    assert FAST_STEPS <= TRANSITIONS
    assert (UNREGISTERED, WAITING) in FAST_STEPS
    assert {(old, new) for old, (new, _) in IMPLIED_STEPS.items()} <= FAST_STEPS
    assert all(new in _ALLOWED_FROM[old] for old, new in TRANSITIONS)
    assert {(old, new) for old, allowed in _ALLOWED_FROM.items() for new in allowed} == TRANSITIONS


@pytest.mark.parametrize(("old", "new"), [
    (WAITING, COMPLETED),  # a row, but it settles the node: never in bulk
    (READY, FAILED),  # no row at all
    (RUNNING, COMPLETED),  # a fast step, but terminal
    (UNREGISTERED, READY),  # registration enters WAITING only
])
def test_a_batch_takes_only_a_fast_step_that_settles_nothing(unstarted, old, new):
    graph, n = build("a")
    state = unstarted(graph).state
    with pytest.raises(StateTransitionError):
        state._transition_batch([n.a], old, new)
    assert n.a not in state.state


def test_an_illegal_single_transition_names_the_node(drive):
    graph, n = build("a", "b", edges=(("a", "b"),))
    driver = drive(graph)
    with pytest.raises(StateTransitionError) as caught:
        driver.state._transition(n.b, RUNNING, "out of turn")
    assert caught.value.node_id == n.b
    assert driver.state.state[n.b] == WAITING
