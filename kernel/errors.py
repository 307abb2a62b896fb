"""The one exception tree of opgraph, drawn here for every layer; each error says what it concerns.

Owns the root error and the kernel's own errors, and draws every ``OpGraphError``
subclass of every layer below (a test walks them all and checks each is drawn and
pickles with its ids). Foreign errors (Ray, httpx, SDKs) are translated into these at
the boundary, so callers never catch a foreign type. ``node_id``, ``branch_id``,
``edge_id``, ``run_id`` and ``actor`` name what an error concerns::

    OpGraphError
    ├── OperationError               graph/operation contract violations (ADR-0023 D1/D2)
    │   ├── GraphCycleError          the graph (or a mutation) would contain a cycle
    │   ├── EdgeConditionError       an edge condition is invalid or raised
    │   ├── UnsafeExpressionError    an edge expression is outside the safe grammar (expressions.py)
    │   └── UnknownNodeError         a referenced node id is not in the graph
    ├── ExecutionError               an operation could not be invoked, or its runtime failed
    │   ├── RuntimeLostError         an opgraph actor died with a call outstanding (actors/errors.py)
    │   ├── BranchStoreLostError     the store holding the branch died (actors/errors.py)
    │   ├── UnknownBranchError       no such branch: never created, dropped, or lost (actors/errors.py)
    │   ├── TurnError                a single Session.turn failed; ``error_type`` says how (actors/errors.py)
    │   ├── VerbError                a branch verb was misused or its answer unusable (actors/verbs/errors.py)
    │   │   ├── VerbParameterError   a verb got parameters it cannot use
    │   │   ├── ToolDefinitionError  a tool cannot be described to a model
    │   │   ├── ToolPermissionError  the caller's permissions exclude a tool call; the tool never ran
    │   │   ├── ParseError           the model's answer does not fit the requested shape
    │   │   │   └── SelectionError   the answer picks no offered choice
    │   │   └── SandboxError         a workspace copy or a gate could not do what was asked
    │   │       ├── PathEscapeError  a path leads outside its root; refused before any write
    │   │       └── GateError        a gate command could not be started at all
    │   └── ProviderError            a model provider failed (actors/models.py)
    │       ├── ModelIdentityError   a model id is not "provider/model"
    │       ├── ProviderConfigError  the provider is missing a key, URL or model
    │       ├── ProviderTimeout      the model call exceeded its timeout
    │       ├── ProviderRateLimited  still 429 after every retry
    │       ├── ProviderUnavailable  unreachable, or still 5xx after every retry
    │       ├── ProviderHTTPError    any other HTTP error status
    │       ├── ProviderResponseError  an answer that cannot be read
    │       │   └── ProviderTruncated  a structured reply cut at max_tokens, not parsed as whole
    │       └── ProviderRefusal      the model declined to answer; ``refusal`` holds its words
    ├── UnknownRunError              no live run with this id on the namespace's executors (actors/errors.py)
    ├── UnknownWatcherError          no such watcher: finished, closed or idle (actors/executor/watchers.py)
    ├── RoutingError (ValueError)    a spawn request cannot be routed (unknown assignee)
    ├── StateTransitionError         an illegal scheduler transition (a kernel bug)
    ├── InvariantViolation           ``FlowState.validate()`` found broken invariants
    ├── CodecError                   a value cannot be encoded or decoded on the wire
    │   └── RunLogIntegrityError     a run-log row is unsigned where it must be, or its signature is wrong;
    │                                nothing of it was read (kernel/codec.py)
    ├── DatabaseError                the runtime's database cannot be opened or written (actors/persistence/)
    ├── EngineError                  an engine run could not do what was asked; ``run_id`` (engines/errors.py)
    │   ├── EngineInputError (ValueError)     bad engine input, refused before any agent is made
    │   ├── EngineBudgetError (RuntimeError)  a hard bound (agents, deadline, tokens, cost) refused work
    │   ├── PlanError                the planner gave no usable plan, even after one retry
    │   ├── EventSinkError           an engine run's events could not be recorded durably
    │   └── WorkspaceConflictError   a coding patch cannot be applied: the workspace changed since
    ├── WorkflowDefinitionError      a workflow definition is bad; ``.errors`` lists them (cluster/store/errors.py)
    │   ├── WorkflowValidationError  it breaks the rules it is stored under
    │   └── WorkflowCompileError     it cannot compile to a fixed graph (cluster/lanes/fixed/spec.py)
    ├── WorkflowStoreError           the run store failed, or is closed (cluster/store/errors.py)
    │   ├── StoreSchemaError         the file's schema is newer than this code knows
    │   ├── WorkflowNameConflictError  a live workflow already has the name
    │   ├── WorkflowVersionLimitError  the workflow has as many versions as the store keeps
    │   ├── WorkflowNotFoundError    no live workflow by that name or id
    │   │   └── WorkflowVersionNotFoundError  the workflow exists, the version does not
    │   ├── RunNotFoundError         no run with that id
    │   ├── RunConflictError         a run with that id already exists
    │   ├── RunNotResumableError     only a run whose owner process died can be resumed
    │   ├── EngineRunNotFoundError   no engine run with that id
    │   ├── MapJobNotFoundError      no dataset job with that id (cluster/store/errors.py)
    │   └── MapJobBusyError          another live process is running the dataset job
    ├── ProvenanceError              provenance breaking the shared shape or its lane's rules (cluster/store/errors.py)
    ├── MapInputError                a dataset job's input, template, schema or output refused before any
    │   │                            model call; ``line`` and ``column`` say where (cluster/jobs/rows.py)
    │   └── MapInputChangedError     the input's content changed since its job ran; ``--new-job`` starts another
    ├── LaneCapabilityError          a control the invocation's capabilities exclude (cluster/lanes/capabilities.py)
    ├── UnknownLaneError             no lane adapter is registered under that kind (cluster/lanes/registry.py)
    ├── PinnedSourceChangedError     a replay found the run's pinned source changed (cluster/lanes/provenance.py)
    ├── CheckpointRefusedError       a planned checkpoint cannot be replayed as asked (cluster/lanes/planned/)
    ├── PlaybookError                a playbook is bad or cannot be used; nothing was planned (cluster/lanes/play/)
    │   └── UnknownPlaybookError     no playbook by that name; ``suggestions`` lists near names
    ├── RunStateConflictError        a run control that its state forbids (cluster/http/problems.py)
    ├── RuntimeUnavailableError      the HTTP API has no runtime to run on (problems.py)
    ├── UnknownNameError             the HTTP API found no playbook by the path's name (problems.py)
    ├── RunCapacityError             the HTTP API already runs as many runs as it admits: 429 (problems.py)
    ├── ServerRequestError           `opgraph serve` answered a client with an error status (cluster/http/client.py)
    ├── ServerTokenError             a server token that cannot be used: a file others read, too short (http/auth.py)
    ├── BindRefusedError             `opgraph serve` will not listen there without an operator's token (http/auth.py)
    ├── ControlError                 the control plane could not do what was asked (cluster/control/errors.py)
    │   ├── ControlInputError (ValueError)  bad schedule or task input, refused before anything is written
    │   │   ├── CronError            a cron expression, interval or time zone that cannot be used
    │   │   ├── BackfillTooLargeError  a backfill range holds more fires than the configured maximum
    │   │   └── UnknownActionKindError  no action adapter for that action_kind
    │   ├── ScheduleNotFoundError    no schedule by that id or name
    │   ├── TaskNotFoundError        no task with that id
    │   ├── TaskStateError           the task's state forbids what was asked
    │   └── LeaseLostError           the worker's lease lapsed or was taken over; its write was refused
    ├── WebhookError                 a webhook endpoint cannot be used as asked; ``endpoint`` names it
    │   │                            (cluster/control/webhooks.py)
    │   ├── WebhookTargetError       the URL is malformed or outside the allow-list; nothing stored or sent
    │   ├── WebhookSecretError       the signing secret's reference is malformed or names no usable secret
    │   ├── WebhookNotFoundError     no webhook endpoint by that name
    │   └── WebhookNameConflictError  a webhook endpoint already has that name
    └── RuntimeStartError            a command could not start or join Ray; no run exists (cluster/connection.py)
        └── ClusterUnreachableError  the address did not answer as a Ray cluster; ``tried`` says how
            └── ClusterAuthenticationError  the cluster refused this process's token, or its lack of one

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
    "RunLogIntegrityError",
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
        self.node_id, self.branch_id, self.edge_id, self.run_id, self.actor = node_id, branch_id, edge_id, run_id, actor

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


class RunLogIntegrityError(CodecError):
    """A row read from the database fails the run log's integrity rule: it holds a pickled value
    without a signature, or its signature does not match the run-log key (``OPGRAPH_RUNLOG_KEY``,
    else ``runlog.key`` in the opgraph home). Nothing of the row was decoded, so nothing in it ran.
    A database copied from another machine needs that machine's key; one written by an older
    opgraph needs ``opgraph store migrate --trust-existing``.
    """
