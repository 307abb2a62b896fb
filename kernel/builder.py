"""OperationGraphBuilder: incremental construction of an operation graph (ADR-0023 D1).

Owns graph construction only. It never runs a flow, binds a live branch or invokes an
operation; ``get_graph()`` hands the built Graph to a Session.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

from pydantic import BaseModel

from .errors import OperationError
from .graph import Graph, Operation, create_operation

__all__ = ["ExpansionStrategy", "OperationGraphBuilder"]


class ExpansionStrategy(Enum):
    CONCURRENT = "concurrent"
    SEQUENTIAL = "sequential"
    SEQUENTIAL_CONCURRENT_CHUNK = "sequential_concurrent_chunk"
    CONCURRENT_SEQUENTIAL_CHUNK = "concurrent_sequential_chunk"


def _branch_id(branch: Any) -> str | None:
    """Normalise a branch reference (id string, UUID, or object with ``.id``)."""
    if branch is None:
        return None
    return str(getattr(branch, "id", branch))


class OperationGraphBuilder:
    """Build a Graph step by step, tracking the current heads.

    Ideal over retrospective (ADR-0033 P3, delta 1): ``depends_on=None`` chains the new
    node after the current heads, while ``depends_on=[]`` makes an independent root.
    The record could not tell the two apart, which serialised fan-outs by accident.
    """

    #: The name given to the graph.
    name: str
    #: The graph being built; every ``add_*`` and ``expand_from_result`` adds to it.
    graph: Graph
    #: The nodes a next ``add_operation(depends_on=None)`` chains after. Replaced by each
    #: ``add_*`` call and ``expand_from_result``; read through ``current_heads``.
    _current_heads: list[str]

    def __init__(self, name: str = "DynamicGraph") -> None:
        self.name = name
        self.graph = Graph(name)
        self._current_heads: list[str] = []

    @property
    def current_heads(self) -> list[str]:
        return list(self._current_heads)

    def _node(
        self,
        operation: str,
        node_id: str | None,
        branch: Any,
        parameters: dict[str, Any],
    ) -> Operation:
        node = create_operation(operation, parameters, branch_id=_branch_id(branch))
        if node_id is not None:
            node.metadata["reference_id"] = node_id
        self.graph.add_node(node)
        return node

    def add_operation(
        self,
        operation: str,
        node_id: str | None = None,
        depends_on: list[str] | None = None,
        inherit_context: bool = False,
        branch: Any = None,
        **parameters: Any,
    ) -> str:
        """Add one operation and return its UUID.

        ``depends_on`` ids unknown to this builder are ignored (ADR-0023 D1). With
        ``inherit_context=True`` and dependencies, the first dependency becomes the
        ``primary_dependency`` whose conversation the node inherits.
        """
        _refuse_one_id(depends_on, "depends_on")
        node = self._node(operation, node_id, branch, parameters)
        if depends_on is None:
            for head in self._current_heads:
                self.graph.add_edge(head, node.id, label=["sequential"])
        else:
            known = [dep for dep in depends_on if dep in self.graph]
            for dep in known:
                self.graph.add_edge(dep, node.id, label=["depends_on"])
            if inherit_context and known:
                node.metadata["inherit_context"] = True
                node.metadata["primary_dependency"] = known[0]
        self._current_heads = [node.id]
        return node.id

    def expand_from_result(
        self,
        items: list[Any],
        source_node_id: str,
        operation: str,
        strategy: ExpansionStrategy = ExpansionStrategy.CONCURRENT,
        inherit_context: bool = False,
        chain_context: bool = False,
        **shared_params: Any,
    ) -> list[str]:
        """Add one child per item, each with an expansion edge from the source.

        Strategy is recorded, not enforced: no edges are added between children.
        ``chain_context`` moves the primary inheritance source of sequential children
        after the first to the previous child.
        """
        if source_node_id not in self.graph:
            raise OperationError("expansion source is not in the graph", node_id=source_node_id)
        if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
            # A string would expand into one child per character.
            raise OperationError(f"items must be a list of items to expand, got {type(items).__name__}",
                                 node_id=source_node_id)
        strategy = ExpansionStrategy(strategy)
        children: list[str] = []
        for index, item in enumerate(items):
            params = dict(shared_params)
            if isinstance(item, BaseModel):
                params.update(item.model_dump())
            else:
                params["item_index"] = index
                params["item"] = str(item)
            params["expansion_strategy"] = strategy.value
            node = self._node(operation, None, None, params)
            node.metadata["expansion_source"] = source_node_id
            node.metadata["expansion_strategy"] = strategy.value
            self.graph.add_edge(source_node_id, node.id, label=["expansion", strategy.value])
            if inherit_context:
                primary = source_node_id
                if chain_context and strategy is ExpansionStrategy.SEQUENTIAL and children:
                    primary = children[-1]
                node.metadata["inherit_context"] = True
                node.metadata["primary_dependency"] = primary
            children.append(node.id)
        self._current_heads = list(children)
        return children

    def add_aggregation(
        self,
        operation: str,
        node_id: str | None = None,
        source_node_ids: list[str] | None = None,
        inherit_context: bool = False,
        inherit_from_source: int = 0,
        branch: Any = None,
        **parameters: Any,
    ) -> str:
        """Add a node that waits for every source (explicit, or else the current heads)."""
        _refuse_one_id(source_node_ids, "source_node_ids")
        sources = list(source_node_ids or self._current_heads)
        if not sources:
            raise OperationError("aggregation needs source_node_ids or existing heads")
        for source in sources:
            if source not in self.graph:
                raise OperationError("aggregation source is not in the graph", node_id=source)
        parameters = dict(parameters)
        parameters["aggregation_sources"] = sources
        parameters["aggregation_count"] = len(sources)
        node = self._node(operation, node_id, branch, parameters)
        node.metadata["aggregation_sources"] = sources
        for source in sources:
            self.graph.add_edge(source, node.id, label=["aggregate"])
        if inherit_context:
            index = max(0, min(inherit_from_source, len(sources) - 1))
            node.metadata["inherit_context"] = True
            node.metadata["primary_dependency"] = sources[index]
        self._current_heads = [node.id]
        return node.id

    def add_conditional_branch(
        self,
        condition_check_op: str,
        true_op: str,
        false_op: str | None = None,
        **check_params: Any,
    ) -> dict[str, str]:
        """Add a check node with labelled ``if_true``/``if_false`` successors.

        Labels are descriptive only; gating needs an EdgeCondition on the edge.
        """
        check_id = self.add_operation(condition_check_op, **check_params)
        result = {"check": check_id}
        true_node = self._node(true_op, None, None, {})
        self.graph.add_edge(check_id, true_node.id, label=["if_true"])
        result["true"] = true_node.id
        heads = [true_node.id]
        if false_op is not None:
            false_node = self._node(false_op, None, None, {})
            self.graph.add_edge(check_id, false_node.id, label=["if_false"])
            result["false"] = false_node.id
            heads.append(false_node.id)
        self._current_heads = heads
        return result

    def get_graph(self) -> Graph:
        return self.graph


def _refuse_one_id(ids: Any, name: str) -> None:
    """A list of node ids given as one string would be read character by character
    (each unknown, so silently ignored by ``depends_on``): refuse it instead."""
    if isinstance(ids, (str, bytes)):
        raise OperationError(f"{name} must be a list of node ids, got the string {ids!r}; wrap it in a list")
