"""The one exception tree of opgraph; every error says which node, branch or edge it concerns.

Owns the typed errors raised by every layer. Foreign errors (Ray, httpx, SDKs) are
translated into these at the boundary, so callers never catch a foreign type::

    OpGraphError
    ├── OperationError            graph/operation contract violations (ADR-0023 D1/D2)
    │   ├── GraphCycleError       the graph (or a mutation) would contain a cycle
    │   ├── EdgeConditionError    an edge condition is invalid or raised
    │   ├── UnsafeExpressionError an edge expression is outside the safe grammar (expressions.py)
    │   └── UnknownNodeError      a referenced node id is not in the graph
    ├── ExecutionError            an operation could not be invoked (no branch, ...)
    │   └── TurnError (actors/errors.py) a single turn (``Session.turn``) failed; ``error_type``, ``usage``
    ├── RoutingError (ValueError) a spawn request cannot be routed (unknown assignee)
    ├── StateTransitionError      an illegal scheduler transition (a kernel bug)
    ├── InvariantViolation        ``FlowState.validate()`` found broken invariants
    ├── CodecError                a value cannot be encoded or decoded on the wire
    └── EngineError (engines/errors.py)     an engine run could not do what was asked; ``run_id``
        ├── EngineInputError (ValueError)   bad engine input, refused before any agent is made
        ├── EngineBudgetError (RuntimeError) a hard bound (agents, deadline, tokens, cost) refused work
        ├── PlanError                       the planner gave no usable plan, even after one retry
        └── EventSinkError                  an engine run's events could not be recorded durably

Every class pickles with its ids intact, because Ray ships exceptions between processes.
"""

from __future__ import annotations

__all__ = [
    "CodecError",
    "EdgeConditionError",
    "ExecutionError",
    "GraphCycleError",
    "InvariantViolation",
    "OpGraphError",
    "OperationError",
    "RoutingError",
    "StateTransitionError",
    "UnknownNodeError",
]


class OpGraphError(Exception):
    """Root of every opgraph error.

    ``node_id``, ``branch_id``, ``edge_id``, ``run_id`` and ``actor`` (the name of an
    opgraph actor, such as ``opgraph-worker-1``) name what the error concerns, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        node_id: str | None = None,
        branch_id: str | None = None,
        edge_id: str | None = None,
        run_id: str | None = None,
        actor: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.node_id = node_id
        self.branch_id = branch_id
        self.edge_id = edge_id
        self.run_id = run_id
        self.actor = actor

    def __reduce__(self):
        # Exception pickling replays only ``args``; keyword ids (and any attributes a
        # subclass added) would be lost, so the whole instance dict travels too.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def __str__(self) -> str:
        where = [
            f"{label}={value}"
            for label, value in (
                ("run", self.run_id),
                ("node", self.node_id),
                ("branch", self.branch_id),
                ("edge", self.edge_id),
                ("actor", self.actor),
            )
            if value is not None
        ]
        return f"{self.message} [{', '.join(where)}]" if where else self.message


def _rebuild(cls, message, fields):
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(fields)
    return error


class OperationError(OpGraphError):
    """The graph or an operation breaks the operation-graph contract."""


class GraphCycleError(OperationError):
    """The graph, or a proposed mutation of it, contains a cycle."""


class EdgeConditionError(OperationError):
    """An edge condition is not a valid condition, or raised while evaluated."""


class UnknownNodeError(OperationError):
    """A node id was referenced that the graph does not hold."""


class ExecutionError(OpGraphError):
    """An operation could not be invoked (for example it has no branch)."""


class RoutingError(OpGraphError, ValueError):
    """A spawn request cannot become a candidate operation (unknown assignee).

    Subclasses ``ValueError`` because ADR-0033 D3 specifies ``ValueError`` here.
    """


class StateTransitionError(OpGraphError):
    """The scheduler was asked for a transition its table does not allow: a kernel bug."""


class InvariantViolation(OpGraphError):
    """``FlowState.validate()`` found a broken cross-structure invariant."""


class CodecError(OpGraphError):
    """A value cannot be encoded to, or decoded from, the msgpack wire format."""
