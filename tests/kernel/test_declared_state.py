"""The kernel's stateful classes declare every attribute, dask worker-state style.

Each attribute an instance holds is annotated at class level, with a ``#:`` comment just
above it that says what it holds and what changes it. Checked on instances that have
run (a flow driven to its end, a graph built and edited), so an attribute added in a
handler and never declared is caught as well as one added in ``__init__``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from kernel_graphs import build

from opgraph.kernel import (
    ExpressionCondition,
    FlowState,
    Graph,
    OperationGraphBuilder,
    SharedContext,
    create_operation,
)
from opgraph.kernel.expressions import CompiledExpression, parse_expression


def commented_declarations(cls: type) -> dict[str, bool]:
    """Attribute name -> whether a ``#:`` comment stands right above its annotation in ``cls``."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    (body,) = ast.parse(source).body
    return {
        node.target.id: lines[node.lineno - 2].strip().startswith("#:")
        for node in body.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def a_finished_run(drive) -> FlowState:
    graph, n = build("a", "b", "c", edges=(("a", "b"),))
    driver = drive(graph, reactive=True, durable=True, write_back=False, context={"k": 1})
    driver.complete(n.a, {"context": {"k": 2}})
    driver.fail(n.c)
    driver.run_to_end()
    return driver.state


def an_edited_graph() -> Graph:
    builder = OperationGraphBuilder("edited")
    first = builder.add_operation("chat", instruction="one")
    builder.add_operation("chat", instruction="two")
    graph = builder.graph
    extra = graph.add_node(create_operation("chat", {"instruction": "three"}))
    graph.remove_edge(graph.add_edge(first, extra).id)
    return graph


def a_merged_context() -> SharedContext:
    shared = SharedContext({"x": 1}, {"total": lambda old, new: (old or 0) + new})
    shared.merge({"x": {"y": 2}, "total": 1}, writer="a", rank=(0,))
    shared.merge({"x": 3, "total": 2}, writer="b", rank=(1,))
    return shared


@pytest.mark.parametrize("make", ["flow", "graph", "builder", "context", "condition"])
def test_every_attribute_an_instance_holds_is_declared_with_a_comment(drive, make):
    instance = {
        "flow": lambda: a_finished_run(drive),
        "graph": an_edited_graph,
        "builder": lambda: OperationGraphBuilder("b"),
        "context": a_merged_context,
        "condition": lambda: ExpressionCondition("result == 1"),
    }[make]()
    declared: dict[str, bool] = {}
    for cls in reversed(type(instance).__mro__):
        if cls.__module__.startswith("opgraph.kernel"):
            declared.update(commented_declarations(cls))
    assert set(vars(instance)) - set(declared) == set(), "held but not declared"
    assert [name for name, commented in declared.items() if not commented] == []


def test_a_slotted_expression_declares_exactly_its_slots():
    declared = commented_declarations(CompiledExpression)
    assert set(declared) == set(CompiledExpression.__slots__)
    assert all(declared.values())
    compiled = parse_expression("1 < 2")
    assert all(hasattr(compiled, name) for name in CompiledExpression.__slots__)


def test_flow_state_declares_its_59_attributes_and_the_validation_switch():
    declared = commented_declarations(FlowState)
    assert len(declared) == 60
    assert FlowState.validate_each_step is True  # switched on for the kernel tests (conftest.py)
    assert "validate_each_step" in declared
