"""The graph model: Operation nodes, Edges with optional conditions, and the Graph (ADR-0023 D1).

Owns topology only: insertion-ordered nodes, adjacency in both directions, acyclicity
checks and reversible mutation. It must not schedule, invoke or hold a live branch:
an Operation carries a branch *id*, and the branch itself lives in a BranchStore actor.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from itertools import repeat
from operator import attrgetter, is_not, itemgetter, ne
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import EdgeConditionError, GraphCycleError, OperationError, UnknownNodeError

__all__ = [
    "BranchOperations",
    "BRANCH_OPERATIONS",
    "Edge",
    "EdgeCondition",
    "Graph",
    "NodeStatus",
    "Operation",
    "create_operation",
    "require_graph",
    "settle_completed",
]

BranchOperations = Literal[
    "chat",
    "operate",
    "communicate",
    "parse",
    "ReAct",
    "select",
    "interpret",
    "act",
    "ReActStream",
]
BRANCH_OPERATIONS: tuple[str, ...] = BranchOperations.__args__  # type: ignore[attr-defined]

NodeStatus = Literal["pending", "running", "completed", "failed", "skipped", "cancelled"]
TERMINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "skipped", "cancelled"})


# A private generator, seeded once from the OS: ids need uniqueness, not secrecy, and
# os.urandom per id (a system call) cost 1.7 us where this costs 0.7 us. Private, so a
# caller's random.seed() can never make two processes mint the same ids.
_id_bits = random.Random(os.urandom(32)).getrandbits
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62)) & ((1 << 128) - 1)
_UUID4_SET = (0x4 << 76) | (0x2 << 62)  # version 4, RFC 4122 variant


def _new_id() -> str:
    """A random (version 4) UUID string, formatted as ``str(uuid.uuid4())`` would be.

    Built from the bits directly: spawning mints two ids per admission, and going
    through ``uuid.UUID`` costs more than twice as much for the same string.
    """
    digits = "%032x" % ((_id_bits(128) & _UUID4_CLEAR) | _UUID4_SET)
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


def _built(cls: type[BaseModel], fields: dict[str, Any], fields_set: Iterable[str]) -> Any:
    """A model from fields already known valid, in field order: what ``__setstate__`` sets.

    For the kernel's own hot constructions (every edge, plain ``create_operation``
    calls, unpickled graphs), where validation would only re-check what the caller
    just checked; a model with extras or private attributes never comes through here.
    The four slots are set through their descriptors: a third cheaper than
    ``object.__setattr__`` by name, which looks each one up first.
    """
    model = cls.__new__(cls)
    _set_dict(model, fields)
    shared = _SHARED_FIELDS_SETS.get(fields_set)
    if shared is None:
        shared = _shared_fields_set(fields_set)
    _set_fields_set(model, shared)
    _set_extra(model, None)
    _set_private(model, None)
    return model


def _restored(cls: type[BaseModel], fields: dict[str, Any], names: Iterable[str]) -> Any:
    """A model pickled by a kernel ``__reduce_ex__`` as its field dict and set names (see
    ``SpawnRequest``): ``_built``, with a fields-set of its own, for a model that does not
    copy a shared one before an assignment."""
    model = cls.__new__(cls)
    _set_dict(model, fields)
    _set_fields_set(model, set(names))
    _set_extra(model, None)
    _set_private(model, None)
    return model


class _SharedFieldsSet(set):
    """The fields-set of every model ``_built`` alike, one object for all of them.

    A set each cost 232 bytes a node: a fifth of an Operation, 220 MB of a million-node
    run's executor (issue #18). pydantic adds to a model's fields-set only when a field is
    assigned, so ``Operation`` and ``Edge`` give the model a set of its own first
    (``_own_fields_set``); copies (``model_copy``, ``copy``) are sets of their own already.
    A subclass of ``set``, not a frozenset, because pydantic-core reads it as a set.
    """

    __slots__ = ()


_SHARED_FIELDS_SETS: dict[Any, _SharedFieldsSet] = {}  # one per shape: a fields tuple, or a frozenset


def _shared_fields_set(names: Any) -> _SharedFieldsSet:
    """The one fields-set of every model whose set fields are ``names``."""
    shared = _SHARED_FIELDS_SETS.get(names)
    if shared is None:
        shared = _SHARED_FIELDS_SETS[names] = _SharedFieldsSet(names)
    return shared


# id of a shared fields-set -> the shared set of the same shape once settled. Both are sets
# ``_SHARED_FIELDS_SETS`` holds for good, so an id is never reused.
_SETTLED_FIELDS_SETS: dict[int, _SharedFieldsSet] = {}
_SETTLED_FIELDS = frozenset({"status", "response"})


def _own_fields_set(model: BaseModel) -> None:
    """Before an assignment: a model sharing its fields-set gets a copy of its own to add to."""
    fields_set = model.__pydantic_fields_set__
    if type(fields_set) is _SharedFieldsSet:
        _set_fields_set(model, set(fields_set))


def _slot_setter(name: str) -> Any:
    """The ``__set__`` of BaseModel's own descriptor for the slot ``name``."""
    return vars(BaseModel)[name].__set__


_set_dict = _slot_setter("__dict__")
_set_fields_set = _slot_setter("__pydantic_fields_set__")
_set_extra = _slot_setter("__pydantic_extra__")
_set_private = _slot_setter("__pydantic_private__")


class Operation(BaseModel):
    """One executable node: an operation name, its parameters and a late-bound branch id.

    Ids are UUID strings, so they cross msgpack and Ray unchanged. ``status``,
    ``response`` and ``error`` are written back by the run that settles the node; a
    node already terminal when a run starts short-circuits (ADR-0023 D5).
    """

    model_config = ConfigDict(validate_assignment=False, arbitrary_types_allowed=True)

    id: str = Field(default_factory=_new_id)
    operation: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    branch_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    status: NodeStatus = "pending"
    response: Any = None
    error: str | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        _own_fields_set(self)
        super().__setattr__(name, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle as the field dict and the names set, rebuilt by ``_built``: what pydantic's
        pickling carries, minus its state wrapper and the fields-set's class. 1,000 spawned
        children cost the run log's encoding 5.4 ms instead of 8.2 ms (and 29% fewer bytes),
        on the path their dispatch waits on (issue #18). A subclass, or a node with extras or
        private attributes, pickles the usual way."""
        if type(self) is not Operation or self.__pydantic_extra__ or self.__pydantic_private__:
            return super().__reduce_ex__(protocol)
        return _built_operation, (self.__dict__, frozenset(self.__pydantic_fields_set__))

    def settle(self, status: NodeStatus, **outcome: Any) -> None:
        """Write a run's outcome back: ``status``, and ``response`` or ``error`` if given.

        What assigning each field does (the value stored, the field marked set), without
        pydantic's assignment path per field: a driver writes back every node of a run,
        and for 10,000 nodes that path cost 22-26 ms of ``flow()`` (issue #18). A subclass
        may guard its fields on assignment: it is assigned to, field by field."""
        if type(self) is not Operation:
            self.status = status
            for name, value in outcome.items():
                setattr(self, name, value)
            return
        _own_fields_set(self)
        fields = self.__dict__
        fields["status"] = status
        fields.update(outcome)
        marked = self.__pydantic_fields_set__
        marked.add("status")
        marked.update(outcome)

    @property
    def request(self) -> dict[str, Any]:
        """The parameters as a plain mapping (ADR-0023 D1 ``request``)."""
        return dict(self.parameters)

    @property
    def reference_id(self) -> str | None:
        """The human reference (builder ``node_id``); presentation only, not identity."""
        return self.metadata.get("reference_id")

    @property
    def display_name(self) -> str:
        return self.metadata.get("reference_id") or self.operation

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def _built_operation(fields: dict[str, Any], names: frozenset[str]) -> Operation:
    """An Operation pickled by ``Operation.__reduce_ex__``."""
    return _built(Operation, fields, names)


def settle_completed(node: Operation, response: Any) -> None:
    """``node.settle("completed", response=response)``, for the outcome most nodes of a run have.

    Inlined, with no keyword dict: 5.7 ms of a 10,000-node write-back where ``settle`` cost
    13 ms (issue #18). A node sharing its fields-set gets the shared set of its settled
    shape, so a write-back allocates no set per node either."""
    if type(node) is not Operation:
        node.settle("completed", response=response)
        return
    fields = node.__dict__
    fields["status"] = "completed"
    fields["response"] = response
    marked = node.__pydantic_fields_set__
    if type(marked) is _SharedFieldsSet:
        settled = _SETTLED_FIELDS_SETS.get(id(marked))
        if settled is None:
            settled = _SETTLED_FIELDS_SETS[id(marked)] = _shared_fields_set(_SETTLED_FIELDS.union(marked))
        _set_fields_set(node, settled)
    else:
        marked.add("status")
        marked.add("response")


def create_operation(
    operation: str,
    parameters: Mapping[str, Any] | BaseModel | None = None,
    **kwargs: Any,
) -> Operation:
    """Build an Operation; a pydantic ``parameters`` model is dumped to a mapping."""
    if not isinstance(operation, str) or not operation:
        raise OperationError(f"operation name must be a non-empty string, got {operation!r}")
    if parameters is None:
        params: dict[str, Any] = {}
    elif isinstance(parameters, BaseModel):
        params = parameters.model_dump()
    elif isinstance(parameters, Mapping):
        params = dict(parameters)
    else:
        raise OperationError(
            f"parameters for {operation!r} must be a mapping or pydantic model, "
            f"got {type(parameters).__name__}"
        )
    if not kwargs and all(type(key) is str for key in params):
        # Nothing left for validation to check: built directly, 4x cheaper (a spawn makes one).
        return _plain_operation(operation, params)
    return Operation(operation=operation, parameters=params, **kwargs)


def _plain_operation(operation: str, params: dict[str, Any]) -> Operation:
    """An Operation with only a name and parameters, both already known valid."""
    fields = {"id": _new_id(), "operation": operation, "parameters": params, "branch_id": None,
              "metadata": {}, "status": "pending", "response": None, "error": None}
    return _built(Operation, fields, _OPERATION_ARGUMENTS)


_OPERATION_ARGUMENTS = ("operation", "parameters")


def admitted_operation(node_id: str, operation: str, parameters: dict[str, Any],
                       metadata: dict[str, Any]) -> Operation:
    """An Operation from the four fields a fed run's feeder sends for it, built without validation:
    the executor builds one per admitted row (a million over a dataset job's life), and each field
    is a plain value its feeder made (checked here for the types validation would enforce)."""
    if type(node_id) is not str or type(operation) is not str or type(parameters) is not dict \
            or type(metadata) is not dict:
        return Operation(id=node_id, operation=operation, parameters=parameters, metadata=metadata)
    fields = {"id": node_id, "operation": operation, "parameters": parameters, "branch_id": None,
              "metadata": metadata, "status": "pending", "response": None, "error": None}
    return _built(Operation, fields, _ADMITTED_FIELDS)


_ADMITTED_FIELDS = ("id", "operation", "parameters", "metadata")


class EdgeCondition:
    """Base class for executable edge gating (ADR-0023 D4).

    Subclasses implement ``apply(input) -> bool`` where ``input`` is
    ``{"result": predecessor_result, "context": shared_context}``. A plain ``apply``
    is evaluated inside the scheduler; an ``async def apply`` is evaluated by the
    executor shell, which reports back with a ``ConditionsEvaluated`` event.
    """

    def apply(self, input: dict[str, Any]) -> bool:  # noqa: A002 - record's name
        raise NotImplementedError


def condition_is_async(condition: Any) -> bool:
    """True when ``condition.apply`` is a coroutine function (flag checked without asyncio)."""
    apply = getattr(condition, "apply", None)
    code = getattr(getattr(apply, "__func__", apply), "__code__", None)
    # CO_COROUTINE = 0x80; read the flag directly so the kernel never imports asyncio.
    return bool(code is not None and code.co_flags & 0x80)


def validate_condition(condition: Any, edge_id: str) -> None:
    """Reject a non-null condition that is not an EdgeCondition (ADR-0023 D2).

    Invalid condition types fail validation before any work starts: an object that
    merely has an ``apply`` method is not a condition the record accepts.
    """
    if condition is None:
        return
    if not isinstance(condition, EdgeCondition):
        raise EdgeConditionError(
            f"edge condition must be an EdgeCondition, got {type(condition).__name__}",
            edge_id=edge_id,
        )
    if not callable(getattr(condition, "apply", None)):
        raise EdgeConditionError(
            f"edge condition {type(condition).__name__} has no callable apply(input)", edge_id=edge_id,
        )


class Edge(BaseModel):
    """A directed edge ``head -> tail`` with descriptive labels and an optional condition."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    id: str = Field(default_factory=_new_id)
    head: str
    tail: str
    label: list[str] = Field(default_factory=list)
    condition: Any = None

    def __setattr__(self, name: str, value: Any) -> None:
        _own_fields_set(self)
        super().__setattr__(name, value)


_EDGE_ARGUMENTS = ("head", "tail", "label", "condition")

# The adjacency entry of a node with no edge on that side, shared by all of them: a fan-out's
# every node has none, and an empty list each cost 72 bytes a node twice over (issue #18's
# million-node run). A node's entry becomes a list of its own with its first edge.
_NO_EDGES: tuple[str, ...] = ()


def _index_edge(index: dict[str, list[str] | tuple[str, ...]], node_id: str, edge_id: str) -> None:
    """Append ``edge_id`` to ``node_id``'s entry in one direction's adjacency index."""
    found = index.get(node_id)
    if type(found) is list:
        found.append(edge_id)
    else:
        index[node_id] = [edge_id]


def _unindex_edge(index: dict[str, list[str] | tuple[str, ...]], node_id: str, edge_id: str) -> None:
    found = index[node_id]
    found.remove(edge_id)
    if not found:
        index[node_id] = _NO_EDGES


class Graph:
    """An insertion-ordered DAG of Operations.

    Adjacency is kept in both directions so predecessor/successor queries are
    O(degree). ``add_edge(check_cycle=True)`` rolls itself back when the edge would
    close a cycle; whole-graph acyclicity is ``is_acyclic()``.
    """

    #: The graph's name, shown in ``repr`` and kept through pickling.
    name: str
    #: Node id -> Operation, in insertion order. Changed by ``add_node`` and ``remove_node``
    #: (for a running flow, by admission: FlowState's ``_accept``).
    nodes: dict[str, Operation]
    #: Edge id -> Edge, in insertion order. Changed by ``add_edge``, ``_attach`` (the codec's
    #: rebuilt graphs) and ``remove_edge``, and so by ``remove_node``.
    edges: dict[str, Edge]
    #: Node id -> ids of its outgoing edges: a list, or the shared read-only empty tuple
    #: when it has none. Kept by the same methods as ``edges``, and ``add_node``.
    _out: dict[str, list[str] | tuple[str, ...]]
    #: Node id -> ids of its incoming edges, kept as ``_out`` is.
    _in: dict[str, list[str] | tuple[str, ...]]

    def __init__(self, name: str = "DynamicGraph") -> None:
        self.name = name
        self.nodes: dict[str, Operation] = {}
        self.edges: dict[str, Edge] = {}
        # node id -> its outgoing / incoming edge ids: a list, or _NO_EDGES (read-only) when none.
        self._out: dict[str, list[str] | tuple[str, ...]] = {}
        self._in: dict[str, list[str] | tuple[str, ...]] = {}

    # -- mutation -------------------------------------------------------------
    def add_node(self, node: Operation) -> Operation:
        if type(node) is not Operation and not isinstance(node, Operation):
            raise OperationError(f"graph nodes must be Operation, got {type(node).__name__}")
        node_id = node.id
        if node_id in self.nodes:
            raise OperationError("node already in graph", node_id=node_id)
        self.nodes[node_id] = node
        self._out[node_id] = _NO_EDGES
        self._in[node_id] = _NO_EDGES
        return node

    def add_edge(
        self,
        head: str | Operation,
        tail: str | Operation,
        *,
        label: Iterable[str] = (),
        condition: Any = None,
        check_cycle: bool = False,
    ) -> Edge:
        # Exact-type checks first: isinstance against a pydantic model class goes through
        # ABCMeta, and reactive admission adds an edge per spawned child.
        head_id = head if type(head) is str or not isinstance(head, Operation) else head.id
        tail_id = tail if type(tail) is str or not isinstance(tail, Operation) else tail.id
        nodes = self.nodes
        if head_id not in nodes or tail_id not in nodes:
            missing = head_id if head_id not in nodes else tail_id
            raise UnknownNodeError("edge endpoint is not in the graph", node_id=missing)
        labels = list(label)
        for text in labels:
            if type(text) is not str:
                edge = Edge(head=head_id, tail=tail_id, label=labels, condition=condition)  # raises the usual error
                break
        else:
            # Endpoints are known node ids and labels strings: nothing left to validate.
            fields = {"id": _new_id(), "head": head_id, "tail": tail_id, "label": labels, "condition": condition}
            edge = _built(Edge, fields, _EDGE_ARGUMENTS)
        edge_id = edge.id
        if condition is not None:
            validate_condition(condition, edge_id)
        if check_cycle and (head_id == tail_id or self.reaches(tail_id, head_id)):
            raise GraphCycleError(
                f"edge {head_id} -> {tail_id} would create a cycle", edge_id=edge_id
            )
        self.edges[edge_id] = edge
        _index_edge(self._out, head_id, edge_id)
        _index_edge(self._in, tail_id, edge_id)
        return edge

    def _attach(self, edge: Edge) -> None:
        """Add an edge known valid (the codec's rebuilt graphs): held and indexed, nothing checked."""
        self.edges[edge.id] = edge
        _index_edge(self._out, edge.head, edge.id)
        _index_edge(self._in, edge.tail, edge.id)

    def remove_edge(self, edge_id: str) -> Edge:
        edge = self.edges.pop(edge_id, None)
        if edge is None:
            raise OperationError("edge is not in the graph", edge_id=edge_id)
        _unindex_edge(self._out, edge.head, edge_id)
        _unindex_edge(self._in, edge.tail, edge_id)
        return edge

    def remove_node(self, node_id: str) -> Operation:
        if node_id not in self.nodes:
            raise UnknownNodeError("node is not in the graph", node_id=node_id)
        for edge_id in [*self._in[node_id], *self._out[node_id]]:
            if edge_id in self.edges:
                self.remove_edge(edge_id)
        del self._in[node_id], self._out[node_id]
        return self.nodes.pop(node_id)

    # -- queries --------------------------------------------------------------
    def in_edges(self, node_id: str) -> list[Edge]:
        return [self.edges[e] for e in self._in[node_id]]

    def out_edges(self, node_id: str) -> list[Edge]:
        return [self.edges[e] for e in self._out[node_id]]

    def predecessors(self, node_id: str) -> list[str]:
        """Distinct predecessor ids, in edge insertion order."""
        edge_ids = self._in[node_id]
        if len(edge_ids) < 2:  # the common case, without building a dict
            return [self.edges[e].head for e in edge_ids]
        return list(dict.fromkeys(self.edges[e].head for e in edge_ids))

    def successors(self, node_id: str) -> list[str]:
        return list(dict.fromkeys(self.edges[e].tail for e in self._out[node_id]))

    def heads(self) -> list[str]:
        """Nodes with no incoming edge (the graph's roots), in insertion order."""
        return [n for n in self.nodes if not self._in[n]]

    def tails(self) -> list[str]:
        """Nodes with no outgoing edge, in insertion order."""
        return [n for n in self.nodes if not self._out[n]]

    def reaches(self, source: str, target: str) -> bool:
        """True when a directed path leads from ``source`` to ``target``."""
        stack, seen = [source], {source}
        while stack:
            current = stack.pop()
            if current == target:
                return True
            for edge_id in self._out[current]:
                nxt = self.edges[edge_id].tail
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        return False

    def check_references(self) -> None:
        """Raise UnknownNodeError for the first edge whose endpoint is not a node of the graph.

        ``add_edge`` refuses such an edge, but ``edges`` is a plain dict a caller can fill
        by hand; a flow checks this before the graph is shipped anywhere.
        """
        nodes = self.nodes
        for edge_id, edge in self.edges.items():
            for endpoint in (edge.head, edge.tail):
                if endpoint not in nodes:
                    raise UnknownNodeError(f"edge {edge_id} refers to a node the graph does not hold",
                                           node_id=endpoint, edge_id=edge_id)

    def is_acyclic(self) -> bool:
        """Kahn's algorithm: O(nodes + edges)."""
        indegree = {n: len(self._in[n]) for n in self.nodes}
        ready = [n for n, d in indegree.items() if d == 0]
        visited = 0
        while ready:
            current = ready.pop()
            visited += 1
            for edge_id in self._out[current]:
                tail = self.edges[edge_id].tail
                indegree[tail] -= 1
                if indegree[tail] == 0:
                    ready.append(tail)
        return visited == len(self.nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, nodes={len(self.nodes)}, edges={len(self.edges)})"

    # -- pickling -------------------------------------------------------------
    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle as rows of plain fields; every submitted graph crosses to the executor so.

        Pickling each pydantic model by its ``__getstate__`` (a dict of four entries plus
        a set per node) and rebuilding it through ``__setstate__`` cost more than the rest
        of a 10,000-node run's admission. Here an Operation or Edge travels as its field
        dict and the index of its fields-set among the few distinct ones, and the
        adjacency is rebuilt from the edges (their order fixes every list's order).
        Subclasses of Operation or Edge travel whole, by their own pickling.

        When every edge is a plain Edge without a condition (a fan-in's 10,000, say), the
        edges travel as columns instead: their ids, heads and tails, and per edge the index
        of its fields-set and label among the few distinct ones. 10,000 edges then cost the
        driver 3 ms less and the executor 6 ms less than as rows (issue #18).

        When every node is a plain Operation, the nodes travel as columns too
        (``_node_columns``): ids, operation names, parameters and fields-sets, plus only
        those of the other fields that some node holds other than at its default. 10,000
        fan-out nodes then cost the driver 13.1 -> 10.3 ms to pickle and the executor
        20.5 -> 16.0 ms to load, and 860 -> 610 KB, on the path every run's first call
        waits on (issue #18).
        """
        shapes: dict[frozenset[str], int] = {}
        shared_shapes: dict[int, int] = {}  # see ``_shape_index``
        nodes = _node_columns(self.nodes, shapes)
        if nodes is None:
            nodes = [_model_row(node, Operation, shapes, shared_shapes) for node in self.nodes.values()]
        edges = _edge_columns(self.edges, shapes)
        if edges is None:
            edges = [_model_row(edge, Edge, shapes, shared_shapes) for edge in self.edges.values()]
        extra = {k: v for k, v in self.__dict__.items() if k not in _GRAPH_ATTRIBUTES}
        return _graph_from_rows, (type(self), self.name, nodes, edges, list(shapes), extra)

    def __copy__(self) -> Graph:
        """A shallow copy shares the nodes and edges, as copying the attributes would."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        return clone


_GRAPH_ATTRIBUTES = frozenset({"name", "nodes", "edges", "_out", "_in"})


def _model_row(model: BaseModel, exact: type[BaseModel], shapes: dict[frozenset[str], int],
               shared_shapes: dict[int, int]) -> Any:
    """(field dict, fields-set index) for an exact ``exact`` without extras; else the model."""
    if type(model) is not exact or model.__pydantic_extra__ or model.__pydantic_private__:
        return model
    return (model.__dict__, _shape_index(model.__pydantic_fields_set__, shapes, shared_shapes))


def _shape_index(marked: set[str], shapes: dict[frozenset[str], int], shared_shapes: dict[int, int]) -> int:
    """The index in ``shapes`` of the fields-set ``marked``, added if new; a shared set's is
    remembered by its id (``shared_shapes``), so the models sharing it cost no frozenset each."""
    shared = type(marked) is _SharedFieldsSet
    shape = shared_shapes.get(id(marked)) if shared else None
    if shape is None:
        names = frozenset(marked)
        shape = shapes.get(names)
        if shape is None:
            shape = shapes[names] = len(shapes)
        if shared:
            shared_shapes[id(marked)] = shape
    return shape


# The fields a node column may leave out when every node holds them at their default: name -> default.
_NODE_DEFAULTS = {"branch_id": None, "metadata": {}, "status": "pending", "response": None, "error": None}
_NODE_FIELDS = ("id", "operation", "parameters", *_NODE_DEFAULTS)
_FIELDS, _FIELDS_SET = attrgetter("__dict__"), attrgetter("__pydantic_fields_set__")
_ID, _OPERATION, _PARAMETERS = itemgetter("id"), itemgetter("operation"), itemgetter("parameters")
# Whether an exact Operation can hold extras or private attributes: no, as it is defined.
_PLAIN_NODES = not Operation.__private_attributes__ and Operation.model_config.get("extra") != "allow"


def _node_columns(nodes: dict[str, Operation], shapes: dict[frozenset[str], int]) -> tuple | None:
    """(ids, operations, parameters, fields-set index per node, the other fields' columns) when
    every node is a plain Operation; None when any is not (a subclass, extras, private attributes).

    The other fields (``_NODE_DEFAULTS``) are a dict of the columns some node holds other than
    at its default; one at its default everywhere is left out and rebuilt. Defaults are told
    by identity (None) or by exact type and equality (the empty dict, the "pending" status), so
    a value with an ``__eq__`` of its own is never compared, and never replaced."""
    values = list(nodes.values())
    # Each check a C-level pass: this runs for every node of every submitted graph. An exact
    # Operation holds no extras and no private attributes (``_PLAIN_NODES``), as it holds
    # exactly its fields (unless one was deleted or forced in: rows then). A graph without
    # nodes sends its (empty) rows.
    if not values or set(map(type, values)) - {Operation} or not _PLAIN_NODES:
        return None
    fields_of = list(map(_FIELDS, values))
    if set(map(len, fields_of)) - {len(_NODE_FIELDS)}:
        return None
    marks = list(map(_FIELDS_SET, values))
    if marks.count(marks[0]) == len(marks):  # one shape (a set's own comparison, in C)
        kinds: Any = _shape_index(marks[0], shapes, {})
    else:
        shared_shapes: dict[int, int] = {}
        kind_of = [_shape_index(marked, shapes, shared_shapes) for marked in marks]
        kinds = bytes(kind_of) if len(shapes) <= 256 else kind_of
    others = {}
    for name, default in _NODE_DEFAULTS.items():
        field = itemgetter(name)
        if default is None:
            at_default = not any(map(is_not, map(field, fields_of), repeat(None)))
        else:
            at_default = (set(map(type, map(field, fields_of))) <= {type(default)}
                          and not any(map(ne, map(field, fields_of), repeat(default))))
        if not at_default:
            others[name] = list(map(field, fields_of))
    return (list(map(_ID, fields_of)), list(map(_OPERATION, fields_of)), list(map(_PARAMETERS, fields_of)),
            kinds, others)


def _nodes_from_columns(columns: tuple, shapes: list[frozenset[str]]) -> dict[str, Operation]:
    """id -> Operation for columns made by ``_node_columns``.

    Each node's field dict is a copy of one template (a C-level copy), in field order; a
    node gets an empty metadata dict of its own unless the metadata travelled."""
    ids, operations, parameters, kinds, others = columns
    table = [_shared_fields_set(shape) for shape in shapes]
    fields_sets = repeat(table[kinds]) if type(kinds) is int else map(table.__getitem__, kinds)
    metadata = others.get("metadata")
    metadata = iter(metadata) if metadata is not None else iter(dict, None)  # iter(dict, None): a new {} each
    template = dict.fromkeys(_NODE_FIELDS)
    template["status"] = _NODE_DEFAULTS["status"]
    copy, new, Op = template.copy, Operation.__new__, Operation
    set_dict, set_fields_set, set_extra, set_private = _set_dict, _set_fields_set, _set_extra, _set_private
    models: dict[str, Operation] = {}
    # Not strict: one shared fields-set, or a new empty metadata dict, is an endless iterator.
    for node_id, operation, params, fields_set, meta in zip(ids, operations, parameters, fields_sets, metadata,
                                                            strict=False):
        fields = copy()
        fields["id"] = node_id
        fields["operation"] = operation
        fields["parameters"] = params
        fields["metadata"] = meta
        model = new(Op)
        set_dict(model, fields)
        set_fields_set(model, fields_set)
        set_extra(model, None)
        set_private(model, None)
        models[node_id] = model
    for name, column in others.items():
        if name != "metadata":
            for model, value in zip(models.values(), column, strict=True):
                model.__dict__[name] = value
    return models


def _edge_columns(edges: dict[str, Edge], shapes: dict[frozenset[str], int]) -> tuple | None:
    """(ids, heads, tails, kind per edge, kinds) when every edge is a plain Edge without a
    condition, a kind being (fields-set index, label tuple); None when any is not."""
    ids: list[str] = []
    heads: list[str] = []
    tails: list[str] = []
    kind_of: list[int] = []
    kinds: dict[tuple[int, tuple[str, ...]], int] = {}
    shared_shapes: dict[int, int] = {}  # id of a shared fields-set -> its index in ``shapes``
    for edge in edges.values():
        if type(edge) is not Edge or edge.__pydantic_extra__ or edge.__pydantic_private__:
            return None
        fields = edge.__dict__
        label = fields["label"]
        if fields["condition"] is not None or type(label) is not list:
            return None
        shape = _shape_index(edge.__pydantic_fields_set__, shapes, shared_shapes)
        key = (shape, tuple(label))
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = len(kinds)
        ids.append(fields["id"])
        heads.append(fields["head"])
        tails.append(fields["tail"])
        kind_of.append(kind)
    return ids, heads, tails, bytes(kind_of) if len(kinds) <= 256 else kind_of, list(kinds)


def _edges_from_columns(columns: tuple, shapes: list[frozenset[str]], outgoing: dict[str, Any],
                        incoming: dict[str, Any]) -> dict[str, Edge]:
    """id -> Edge for columns made by ``_edge_columns``, each indexed in both directions as it comes."""
    ids, heads, tails, kind_of, kinds = columns
    table = [(_shared_fields_set(shapes[shape]), label) for shape, label in kinds]
    new, edges = Edge.__new__, {}
    for edge_id, head, tail, kind in zip(ids, heads, tails, kind_of, strict=True):
        shared, label = table[kind]
        edge = new(Edge)
        _set_dict(edge, {"id": edge_id, "head": head, "tail": tail, "label": list(label), "condition": None})
        _set_fields_set(edge, shared)
        _set_extra(edge, None)
        _set_private(edge, None)
        edges[edge_id] = edge
        found = outgoing.get(head)  # _index_edge, inlined: this loop runs once per edge
        if type(found) is list:
            found.append(edge_id)
        else:
            outgoing[head] = [edge_id]
        found = incoming.get(tail)
        if type(found) is list:
            found.append(edge_id)
        else:
            incoming[tail] = [edge_id]
    return edges


def _models_from_rows(rows: list[Any], exact: type[BaseModel], shapes: list[frozenset[str]]) -> dict[str, Any]:
    """id -> model for rows made by ``_model_row``.

    ``_built`` inlined, each shape's shared fields-set looked up once rather than per row:
    this loop is most of an executor's load of a submitted graph, which every run waits
    for before its first call (13.9 -> 9.7 ms for 10,000 nodes, issue #18)."""
    shared = [_shared_fields_set(shape) for shape in shapes]
    new, set_dict, set_fields_set, set_extra, set_private = (
        exact.__new__, _set_dict, _set_fields_set, _set_extra, _set_private)
    models: dict[str, Any] = {}
    for row in rows:
        if type(row) is tuple:
            fields, index = row
            model = new(exact)
            set_dict(model, fields)
            set_fields_set(model, shared[index])
            set_extra(model, None)
            set_private(model, None)
            models[fields["id"]] = model
        else:
            models[row.id] = row
    return models


def _graph_from_rows(cls: type[Graph], name: str, nodes: list[Any], edges: list[Any],
                     shapes: list[frozenset[str]], extra: dict[str, Any]) -> Graph:
    graph = cls.__new__(cls)
    graph.__dict__.update(extra)
    graph.name = name
    # Columns (``_node_columns``); a header logged before them, or a graph with a subclassed node, holds rows.
    graph.nodes = _nodes_from_columns(nodes, shapes) if type(nodes) is tuple else _models_from_rows(
        nodes, Operation, shapes)
    outgoing = graph._out = dict.fromkeys(graph.nodes, _NO_EDGES)
    incoming = graph._in = dict.fromkeys(graph.nodes, _NO_EDGES)
    if type(edges) is tuple:  # columns (``_edge_columns``); a header logged before them holds rows
        graph.edges = _edges_from_columns(edges, shapes, outgoing, incoming)
        return graph
    graph.edges = _models_from_rows(edges, Edge, shapes)
    for edge_id, edge in graph.edges.items():
        # An edge to a node the graph does not hold is kept, to be refused with
        # UnknownNodeError by ``check_references``: raising here, while unpickling,
        # would reach the caller as a transport error instead.
        _index_edge(outgoing, edge.head, edge_id)
        _index_edge(incoming, edge.tail, edge_id)
    return graph


def require_graph(value: Any) -> Graph:
    """Return ``value`` if it is a Graph, else raise the one typed refusal every flow entry gives.

    Checked first wherever a graph arrives (the driver before it reads or ships anything, the
    scheduler before any state exists), so a builder, a dict or None never surfaces as an
    AttributeError from whichever line touched it first.
    """
    if not isinstance(value, Graph):
        raise OperationError(f"a flow runs a Graph, got {type(value).__name__}")
    return value
