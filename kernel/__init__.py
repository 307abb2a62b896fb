"""opgraph.kernel: the pure, deterministic heart of opgraph.

Owns the graph model, builders, emission contracts, the scheduler state machine, context
materialisation, results, lifecycle signals, the codec and the typed errors. It imports
no ray, asyncio, anyio, HTTP or metrics library and performs no I/O.
"""

from . import events, expressions
from .builder import ExpansionStrategy, OperationGraphBuilder
from .codec import (
    CODEC_SCHEMA_VERSION,
    LOG_SCHEMA_VERSION,
    SIGNED,
    Pickled,
    decode,
    decode_logged,
    decode_records,
    encode,
    encode_logged,
    encode_records,
    register_condition,
    register_model,
)
from .context import SharedContext, render_operator_messages, to_mapping
from .contracts import (
    SPAWN_ALLOWED_OPERATIONS,
    EscalationRequest,
    SpawnRequest,
    TaskAssignment,
    default_node_builder,
    extract_requests,
    request_problem,
    request_sightings,
    role_node_builder,
)
from .dispatch import node_weight
from .errors import (
    CodecError,
    EdgeConditionError,
    ExecutionError,
    GraphCycleError,
    InvariantViolation,
    OperationError,
    OpGraphError,
    RoutingError,
    RunLogIntegrityError,
    StateTransitionError,
    UnknownNodeError,
)
from .events import *  # noqa: F403 - the kernel's events and instructions, re-exported whole (its __all__)
from .expressions import *  # noqa: F403 - the expression language, re-exported whole (its __all__)
from .failures import FAILURE_KINDS, RETRYABLE_KINDS, RetryPolicy
from .graph import (
    BRANCH_OPERATIONS,
    Edge,
    EdgeCondition,
    Graph,
    Operation,
    admitted_operation,
    create_operation,
    require_graph,
    settle_completed,
)
from .invariants import INVARIANTS
from .patterns import build_dag_graph, build_fanout_graph, normalise_dependency_ordinals
from .results import FlowEvent, compact_envelope, expand_envelope
from .scheduler import DEFAULT_MAX_CONCURRENCY, TRANSITIONS, FlowState
from .signals import (
    NODE_PROGRESS_KINDS,
    SIGNAL_SCHEMA_VERSION,
    NodeCancelled,
    NodeCompleted,
    NodeEscalated,
    NodeFailed,
    NodePaused,
    NodeQueued,
    NodeSkipped,
    NodeSpawned,
    NodeStarted,
    Signal,
)

__all__ = [
    "BRANCH_OPERATIONS",
    "CODEC_SCHEMA_VERSION",
    "CodecError",
    "DEFAULT_MAX_CONCURRENCY",
    "Edge",
    "EdgeCondition",
    "EdgeConditionError",
    "EscalationRequest",
    "ExecutionError",
    "ExpansionStrategy",
    "FAILURE_KINDS",
    "FlowEvent",
    "compact_envelope",
    "node_weight",
    "expand_envelope",
    "FlowState",
    "Graph",
    "GraphCycleError",
    "INVARIANTS",
    "InvariantViolation",
    "NODE_PROGRESS_KINDS",
    "NodeCancelled",
    "NodeCompleted",
    "NodeEscalated",
    "NodeFailed",
    "NodePaused",
    "NodeQueued",
    "NodeSkipped",
    "NodeSpawned",
    "NodeStarted",
    "OpGraphError",
    "Operation",
    "OperationError",
    "OperationGraphBuilder",
    "Pickled",
    "RETRYABLE_KINDS",
    "LOG_SCHEMA_VERSION",
    "RetryPolicy",
    "RoutingError",
    "RunLogIntegrityError",
    "SIGNAL_SCHEMA_VERSION",
    "SIGNED",
    "SPAWN_ALLOWED_OPERATIONS",
    "SharedContext",
    "Signal",
    "SpawnRequest",
    "StateTransitionError",
    "TRANSITIONS",
    "TaskAssignment",
    "UnknownNodeError",
    "build_dag_graph",
    "build_fanout_graph",
    "admitted_operation",
    "create_operation",
    "decode",
    "decode_logged",
    "decode_records",
    "default_node_builder",
    "encode",
    "encode_logged",
    "encode_records",
    "extract_requests",
    "normalise_dependency_ordinals",
    "register_condition",
    "register_model",
    "request_problem",
    "request_sightings",
    "render_operator_messages",
    "role_node_builder",
    "require_graph",
    "settle_completed",
    "to_mapping",
    *events.__all__,
    *expressions.__all__,
]
