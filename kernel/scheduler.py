"""The run's scheduler state machine: one object, one mutator, events in, instructions out.

Owns every scheduling decision of ADR-0023 D2-D6 and ADR-0033 D3-D5. Here: validation,
dependency settlement, OR-path gating, pause, hold and cancel, and node stories. In the
mixins FlowState is made of: registration and branch preallocation (registration.py),
reactive admission (admission.py), dispatch through capacity and the pause gate with
context preparation (dispatch.py), and the result envelope (completion.py). It performs
no I/O, reads no clock and imports no async library; the GraphExecutor actor carries
out the instructions and feeds every outcome back through ``handle``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from . import events as ev
from . import signals as sig
from .admission import ReactiveAdmission
from .completion import RunCompletion
from .context import OPERATOR_MESSAGES_KEY, SharedContext, to_mapping
from .contracts import (
    PLAIN_TYPES,
    EscalationRequest,
    SpawnRequest,
    default_node_builder,
    request_sightings,
)
from .dispatch import OperationDispatch
from .errors import OperationError
from .events import new_record as _new_record
from .failures import CANCEL_GRACE_EXPIRED, CONTEXT_UPDATE_ERROR, EDGE_CONDITION_ERROR, RetryPolicy
from .graph import Graph, Operation, condition_is_async, require_graph, validate_condition
from .invariants import InvariantChecks
from .registration import NodeRegistration, plain_roots
from .release import NodeRelease
from .runlog import DurableRecords
from .states import (
    _ALLOWED_FROM,
    _PUBLIC_STATUS,
    CANCELLED,
    COMPLETED,
    EVALUATING,
    FAILED,
    FAST_STEPS,
    IMPLIED_STEPS,
    READY,
    RUNNING,
    SKIPPED,
    TERMINAL,
    TRANSITIONS,
    WAITING,
    illegal_transition,
    implied_story,
)

__all__ = ["DEFAULT_MAX_CONCURRENCY", "FlowState", "TRANSITIONS"]

DEFAULT_MAX_CONCURRENCY = 10_000


class FlowState(NodeRegistration, ReactiveAdmission, OperationDispatch, RunCompletion, DurableRecords,
                NodeRelease, InvariantChecks):
    """All state of one run; change it only through ``handle(*events)``.

    Cost per settlement is O(degree): dependents are found through the reverse
    dependency index and readiness through a counter of unsettled dependencies.
    ``validate()`` states the cross-structure invariants.

    Every attribute is declared below, with what it holds and which code changes it. The
    mixins (registration.py, admission.py, dispatch.py, completion.py, runlog.py,
    invariants.py) keep no state of their own: they change these, and only from a
    handler that ``handle`` called. A node's entry in ``state`` changes only through the
    TRANSITIONS table (``_transition``, ``_transition_batch`` and the FAST_STEPS sites).
    """

    # -- the run's options: set by __init__ and never changed after, unless said ------
    #: The graph being run. Admission (admission.py ``_accept``) adds each admitted child
    #: and its edge; a run finished without write-back swaps it for an empty graph
    #: (completion.py ``_maybe_finish``).
    graph: Graph
    #: The run's id: in every signal, and in the ids of the branches it clones.
    run_id: str
    #: At most this many operations in flight (``max_concurrent``; 1 without ``parallel``).
    capacity: int
    #: Whether the run admits spawns, escalation children and injections (admission.py).
    reactive: bool
    #: The cap on admitted nodes (``spawn_count``).
    max_spawn: int
    #: Routing of a SpawnRequest to the child Operation (or None to drop it), user code.
    node_builder: Callable[[SpawnRequest, Operation | None], Operation | None]
    #: The request type an outcome's spawn requests are found by and validated against.
    spawn_type: type
    #: The flow's default branch: roots without a branch of their own run on it.
    default_branch_id: str | None
    #: The branch that dependent and inheriting nodes are cloned from (ADR-0023 D3).
    clone_source_branch_id: str | None
    #: Operation name -> its RetryPolicy; read by ``_on_finished``.
    retry_policies: dict[str, RetryPolicy]
    #: Branches that exist, or None for "any branch a node names exists". Grows with each
    #: clone (registration.py ``_clone_branch``).
    known_branches: set[str] | None
    #: The shared context. Merged into by ``_settle_completed``; ``_on_operator_message``
    #: appends to its steer queue, and dispatch.py ``_render_steer`` marks entries rendered.
    shared: SharedContext
    #: Whether the finished run writes status, response and error onto its Operations.
    write_back: bool
    #: Whether a finished run let its graph go (completion.py ``_maybe_finish``).
    graph_released: bool
    #: Whether NodeQueued, NodeStarted and NodeSpawned signals are emitted.
    progress_signals: bool
    #: Whether the run stays open with nothing left to run, for admissions its feeder may
    #: still make, until ``CloseRequested`` (release.py) or a cancel.
    keep_open: bool

    # -- per node: changed as nodes are registered, dispatched and settled ------------
    #: Node id -> its internal state (states.py), in registration order. Changed only
    #: through the TRANSITIONS table: ``_transition``, ``_transition_batch`` (registration
    #: of the submitted graph, its roots made ready) and the FAST_STEPS sites (``_register``,
    #: ``_make_ready``, dispatch.py ``_dispatch_ready``, ``_settle_completed``).
    state: dict[str, str]
    #: Node id -> its dependencies: edge heads, then aggregation sources. Written once per
    #: node by registration.py (``_register_initial_nodes``, ``_register``).
    deps: dict[str, Sequence[str]]
    #: Node id -> the nodes that depend on it; only nodes that have dependents. Appended
    #: to by registration.py.
    dependents: dict[str, list[str]]
    #: Node id -> how many of its dependencies have not settled. Set by registration.py,
    #: counted down by ``_release_dependents``.
    unsettled: dict[str, int]
    #: Node id -> dispatches so far (0 or absent: none). Counted up by dispatch.py
    #: ``_dispatch_ready``; each dispatch is a new attempt.
    attempt: dict[str, int]
    #: Node id -> its rank, which orders shared-context writes. Read through ``_ranks()``;
    #: set by registration.py (``_rank_initial_nodes``, ``_ranks``) and by ``_accept``.
    rank: dict[str, tuple[int, ...]]
    #: How many of the graph's first nodes have an insertion-order rank not yet written to
    #: ``rank``: set by ``_rank_initial_nodes``, written out and zeroed by ``_ranks``.
    _deferred_ranks: int
    #: Node id -> the branch it runs on; absent: the default branch. Set by registration.py
    #: (``_preallocate_branch``, ``_clone_branch``).
    branch: dict[str, str | None]
    #: Nodes whose clone takes their primary's history before their first dispatch. Added
    #: by ``_preallocate_branch`` and ``recover``, taken out by ``_inherit_primary_history``.
    pending_inheritance: set[str]
    #: Node id -> its result: a completed node's response, a failed node's error payload,
    #: a restored node's response. Set by ``_settle_completed``, ``_settle_failed``, ``_restore``.
    results: dict[str, Any]
    #: Node id -> the one mapping of its result that its dependents share; filled lazily
    #: by dispatch.py ``_mapped_result``.
    _mapped_results: dict[str, Any]
    #: Node id -> its error message. Set by ``_settle_failed``, ``_restore`` and
    #: ``_on_cancel_grace``.
    errors: dict[str, str]
    #: Nodes restored as FAILED: reported failed, but their payload reaches no dependent
    #: (``_gate``). Added to by ``_restore``.
    restored_failed: set[str]
    #: READY nodes in dispatch order. Appended by ``_make_ready`` and the start, put back
    #: in front by ``_requeue``, popped by ``_dispatch_ready``, cleared by a cancel.
    ready: deque[str]
    #: Operations in flight: node id -> (attempt, node, dependencies), so that settling
    #: reads one small dict. Filled by ``_dispatch_ready``; emptied by ``_on_finished``,
    #: ``_on_undelivered``, ``_requeue`` and ``_on_cancel_grace``.
    running: dict[str, tuple[int, Operation, Sequence[str]]]
    #: Whether a node with a ``weight`` in its metadata was registered (registration.py
    #: ``_index_initial_dependencies``, admission.py ``_accept``): capacity then counts the
    #: weights of the nodes in flight, not the nodes (dispatch.py ``_weighted_room``).
    weighted: bool
    #: Registered nodes not yet terminal. Counted up by registration.py, down by every
    #: terminal step (``_transition``, ``_settle_completed``).
    open_nodes: int
    #: Node id -> its recorded story, for nodes that left the common path (``story``).
    #: Written out by ``_recorded_story`` (also for a stale result, ``_on_finished``),
    #: appended to by ``_transition`` and by the fast steps of ``_dispatch_ready`` and
    #: ``_settle_completed``; dropped when a node is registered afresh (registration.py).
    _stories: dict[str, list[tuple[str, str, str, int]]]

    # -- the run's lifecycle: changed by the control handlers --------------------------
    #: Whether dispatch is paused (``_on_pause``, ``_on_resume``).
    paused: bool
    #: Whether the shell holds dispatch back, for backpressure (``_on_hold``).
    held: bool
    #: Ready nodes announced paused since the last pause or resume (``_announce_pause``).
    _pause_announced: set[str]
    #: Whether the run is being cancelled: set once by ``_on_cancel``, never cleared.
    cancelling: bool
    #: The reason the cancel gave, for every node it cancels (``_on_cancel``).
    _cancel_reason: str
    #: Whether FlowStarted arrived (``_on_started``).
    started: bool
    #: Whether FinishRun went out (completion.py ``_maybe_finish``).
    finished: bool
    #: ``now`` of FlowStarted (``_on_started``).
    start_time: float
    #: The latest ``now`` of any event (``handle``).
    now: float
    #: Seconds since the start, never negative: the signals' elapsed time (``handle``).
    _elapsed: float

    # -- reactive admission (admission.py), restored from the run log by runlog.py ------
    #: Children admitted so far, held at most ``max_spawn`` (``_accept``).
    spawn_count: int
    #: Ids of admitted children in order of admission, as keys (``_accept``); a released
    #: child leaves it (release.py ``_on_release``).
    spawned_ids: dict[str, None]
    #: Emitters of escalation requests, in order (``_on_escalation``, ``_on_restored``).
    escalated_operations: list[str]
    #: The dropped-spawn ledger: one entry per rejected request (``_drop``, ``_on_restored``).
    dropped_spawns: list[dict[str, Any]]
    #: De-duplication keys of requests seen (``_is_duplicate_request``, ``_on_restored``).
    _seen_requests: set[Any]
    #: Emitter id -> children admitted after it, for the children's ranks (``_accept``).
    _children: dict[str, int]
    #: Emitter id -> higher-tier children made for it, for their ids (``_on_escalation``).
    _escalations: dict[str, int]
    #: Injections admitted without an emitter, for their ranks (``_accept``).
    _injected: int

    # -- letting go (release.py) ---------------------------------------------------------
    #: Whether a run kept open was told it will take no more admissions (``_on_close``).
    closed: bool
    #: Public status -> nodes of that status released (``_on_release``): they left every
    #: index above, and are counted here, in ``statistics()`` and the envelope.
    released_by_status: dict[str, int]

    # -- what goes out ---------------------------------------------------------------
    #: Events handled, dispatches, settlements, stale results and re-dispatches, for
    #: ``statistics()``: counted by ``handle``, ``_dispatch_ready``, the terminal steps,
    #: ``_on_finished``, ``_on_undelivered`` and ``_requeue``.
    counters: dict[str, int]
    #: The instructions of the ``handle`` call under way: a new list per call (``handle``),
    #: appended to by every handler.
    _out: list[ev.Instruction]

    # -- the durable run log (runlog.py) ------------------------------------------------
    #: Whether the run records what changes it (set by __init__).
    durable: bool
    #: Whether the state is being rebuilt from its log, so records are not written again
    #: (set and cleared by ``DurableRecords.rebuild``).
    _replaying: bool
    #: Records of the ``handle`` call under way: appended by ``_record``, handed out as one
    #: AppendRecords and emptied by ``handle``.
    _pending_records: list[tuple]

    #: Whether ``handle`` runs ``validate()`` before it returns, as dask's worker state
    #: does with ``validate``. Off for the runtime, which pays for no check per step; the
    #: kernel's tests switch it on for every FlowState (tests/kernel/conftest.py).
    validate_each_step: bool = False

    def __init__(
        self,
        graph: Graph,
        *,
        run_id: str = "",
        context: Mapping[str, Any] | None = None,
        max_concurrent: int | None = 5,
        parallel: bool = True,
        reactive: bool = False,
        max_spawn: int = 50,
        node_builder: Callable[[SpawnRequest, Operation | None], Operation | None] | None = None,
        spawn_type: type | None = None,
        default_branch_id: str | None = None,
        known_branches: Iterable[str] | None = None,
        reducers: Mapping[str, Callable[[Any, Any], Any]] | None = None,
        write_back: bool = True,
        progress_signals: bool = True,
        clone_source_branch_id: str | None = None,
        retry_policies: Mapping[str, RetryPolicy] | None = None,
        durable: bool = False,
        keep_open: bool = False,
    ) -> None:
        """``write_back`` records each node's final status, response and error on its
        Operation when the run finishes (``_write_back``); a shell whose graph is a copy
        that nobody reads afterwards (the GraphExecutor's) turns it off.

        ``progress_signals`` emits NodeQueued and NodeStarted for every node and
        NodeSpawned for every admitted child. They are two or three records per node
        that only a signal subscriber reads, so a shell without one turns them off (the
        GraphExecutor does, unless the run asked for signals). The signals that settle
        something (completed, failed, skipped) and the rare ones (paused, escalated)
        are always emitted.

        ``default_branch_id`` is the flow's default branch: roots without a branch of
        their own run on it. ``clone_source_branch_id`` is the session's default branch,
        which dependent and inheriting nodes are cloned from (ADR-0023 D3); it defaults
        to the flow's. ``retry_policies`` maps an operation name to its RetryPolicy.

        ``durable`` runs record what changes them, one ``AppendRecords`` instruction per
        ``handle()`` (runlog.py); ``FlowState.rebuild`` restores such a run from them.

        ``keep_open`` (a reactive run fed by its caller, such as a dataset job) does not
        finish when nothing is left to run: its feeder may admit more. It ends once
        ``CloseRequested`` arrives (or a cancel) and nothing is open (release.py)."""
        _check_inputs(graph, context, reducers, max_spawn)
        capacity = _capacity(max_concurrent, parallel)
        _check_retry_policies(retry_policies)
        self.graph = graph
        self.run_id = run_id
        self.capacity = capacity
        self.reactive = reactive
        self.max_spawn = max_spawn
        self.node_builder = node_builder or default_node_builder
        self.spawn_type = spawn_type or SpawnRequest
        self.default_branch_id = default_branch_id
        self.clone_source_branch_id = default_branch_id if clone_source_branch_id is None else clone_source_branch_id
        self.retry_policies = dict(retry_policies or {})
        self.known_branches = None if known_branches is None else set(known_branches)
        self.shared = SharedContext(context, reducers)
        self.write_back = write_back
        self.graph_released = False  # set once a finished run let its graph go (write_back off)
        self.progress_signals = progress_signals
        self.keep_open = keep_open
        self.closed = False
        self.released_by_status = {}

        self.state: dict[str, str] = {}
        self.deps: dict[str, Sequence[str]] = {}
        self.dependents: dict[str, list[str]] = {}  # only nodes that have dependents
        self.unsettled: dict[str, int] = {}
        self.attempt: dict[str, int] = {}  # dispatches so far; a node not listed has had none
        self.rank: dict[str, tuple[int, ...]] = {}  # read through ``_ranks()``
        self._deferred_ranks = 0  # initial nodes whose insertion-order ranks are not written yet
        self.branch: dict[str, str | None] = {}  # absent: the default branch
        self.pending_inheritance: set[str] = set()
        self.results: dict[str, Any] = {}
        self._mapped_results: dict[str, Any] = {}  # see ``_mapped_result`` (dispatch.py)
        self.errors: dict[str, str] = {}
        # Nodes restored as FAILED: reported failed, but their payload reaches no dependent.
        self.restored_failed: set[str] = set()
        self.ready: deque[str] = deque()
        # Operations in flight: node id -> (attempt, node, dependencies). The node and its
        # dependencies ride along so that settling reads one small dict, not two big ones.
        self.running: dict[str, tuple[int, Operation, Sequence[str]]] = {}
        self.weighted = False
        self.open_nodes = 0
        # Recorded stories of nodes that left the common path (see ``story``).
        self._stories: dict[str, list[tuple[str, str, str, int]]] = {}
        self.paused = False
        self.held = False
        self._pause_announced: set[str] = set()
        self.cancelling = False
        self._cancel_reason = ""
        self.started = False
        self.finished = False
        self.start_time = 0.0
        self.now = 0.0
        self._elapsed = 0.0

        self.spawn_count = 0
        self.spawned_ids: dict[str, None] = {}
        self.escalated_operations: list[str] = []
        self.dropped_spawns: list[dict[str, Any]] = []
        self._seen_requests: set[Any] = set()
        self._children: dict[str, int] = {}
        self._escalations: dict[str, int] = {}  # higher-tier children per emitter, for their ids
        self._injected = 0
        self.counters = {"events": 0, "dispatched": 0, "settled": 0, "stale_results": 0, "redispatched": 0,
                         "released": 0}
        self._out: list[ev.Instruction] = []
        self.durable = durable
        self._replaying = False
        self._pending_records: list[tuple] = []

    # -- the one mutator --------------------------------------------------------
    def handle(self, *events: ev.Event) -> list[ev.Instruction]:
        """Apply events in order and return the instructions the shell must carry out."""
        out = self._out = []
        handled, handlers = 0, _HANDLERS
        try:
            for event in events:
                handled += 1
                now = event.now
                if now > self.now:
                    self.now = now
                    elapsed = now - self.start_time
                    self._elapsed = elapsed if elapsed > 0.0 else 0.0
                handler = handlers.get(type(event))
                if handler is None:
                    raise OperationError(f"unknown scheduler event {type(event).__name__}")
                handler(self, event)
        finally:
            self.counters["events"] += handled
        self._pump()
        if not self.running and self.open_nodes <= 0:  # what _maybe_finish checks first, inline
            self._maybe_finish()
        self._out = []
        if self._pending_records:
            # First, so the shell makes the batch durable before it acts on anything it decided.
            out.insert(0, ev.AppendRecords(tuple(self._pending_records)))
            self._pending_records = []
        if self.validate_each_step:
            self.validate()
        return out

    # -- queries ----------------------------------------------------------------
    def status_of(self, node_id: str) -> str:
        return _PUBLIC_STATUS[self.state[node_id]]

    def story(self, node_id: str) -> list[tuple[str, str, str, int]]:
        """The node's transitions as (from, to, reason, attempt), oldest first.

        While a node stays on the common path (waiting, ready, running, completed) its
        state implies its story, so nothing is recorded (``IMPLIED_STEPS``); a node
        that leaves the path has its story written out and recorded from then on.
        """
        recorded = self._stories.get(node_id)
        if recorded is not None:
            return list(recorded)
        return implied_story(self.state.get(node_id), self.attempt.get(node_id, 0))

    def statistics(self) -> dict[str, Any]:
        counts = {COMPLETED: 0, FAILED: 0, SKIPPED: 0, CANCELLED: 0}
        for state in self.state.values():
            if state in counts:
                counts[state] += 1
        for status, released in self.released_by_status.items():  # settled, then let go: still settled
            counts[status] += released
        return {
            "run_id": self.run_id,
            "nodes": len(self.state),
            "running": len(self.running),
            "ready": len(self.ready),
            "waiting": self.open_nodes - len(self.running) - len(self.ready),
            "paused": self.paused,
            "capacity": self.capacity,
            "spawned": self.spawn_count,
            "dropped_spawns": len(self.dropped_spawns),
            "settled_by_status": counts,
            "finished": self.finished,
            **self.counters,
        }

    # -- event handlers -----------------------------------------------------------
    def _on_started(self, event: ev.FlowStarted) -> None:
        if self.started:
            raise OperationError("flow already started", node_id=None)
        self.started = True
        self.start_time = event.now
        self._elapsed = 0.0
        graph = self.graph
        # Nodes admitted before the start (a spawn that arrived first) were registered,
        # announced and given their clone then (ADR-0023 D6); the start leaves them be.
        early = set(self.state)
        fresh = not early
        plain = fresh and plain_roots(graph)
        in_order, roots = self._register_initial_nodes(early, plain)
        # One topological pass both ranks the nodes and detects cycles (edges plus
        # aggregation sources); edge conditions are validated before any work.
        self._rank_initial_nodes(in_order)
        for edge in graph.edges.values():
            if edge.condition is not None:
                validate_condition(edge.condition, edge.id)
        restored = self._queue_initial_nodes(early, plain)
        # Restored terminal nodes short-circuit without invocation (ADR-0023 D5). All
        # of them settle before any is released, so no restored node is ever gated.
        for node in restored:
            self._restore(node)
        for node in restored:
            self._release_dependents(node.id)
        if self.cancelling:  # cancelled before it started: nothing runs, and the run ends
            self._cancel_open_nodes(announce=False)
        elif fresh and not restored:
            self._ready_roots(roots)
        else:
            self._ready_unblocked_nodes()

    def _queue_initial_nodes(self, early: set[str], plain: bool) -> list[Operation]:
        """Announce each open node of the submitted graph (NodeQueued) and give it its branch.

        Skips the ``early`` nodes (announced on admission). Returns the nodes that arrived
        terminal, for the start to restore, in graph order.
        """
        graph, restored, progress = self.graph, [], self.progress_signals
        # Plain roots (registration.plain_roots) have no branch to make and none is restored:
        # only their progress signals need this pass over the nodes.
        if plain and not progress:
            return restored
        # Bound once: this loop runs for every node of the submitted graph.
        out, deps, cancelling = self._out, self.deps, self.cancelling
        run_id, elapsed, queued, emit_signal = self.run_id, self._elapsed, sig.NodeQueued, ev.EmitSignal
        # Registration filled ``deps`` in node order when nothing was registered before.
        deps_in_order = deps.values() if not early else [deps[node_id] for node_id in graph.nodes]
        for (node_id, node), node_deps in zip(graph.nodes.items(), deps_in_order, strict=True):
            if early and node_id in early:
                continue
            if node.status in TERMINAL:
                restored.append(node)
            elif not cancelling:  # cancelled before the start: not queued, and no branch to clone
                if progress:
                    out.append(_new_record(emit_signal, (queued, run_id, node, elapsed, node_deps, None)))
                if node.branch_id is not None or node_deps or node.metadata.get("inherit_context"):
                    self._preallocate_branch(node)
                # else the common root: it runs on the default branch, which ``branch`` leaves implicit
        return restored

    def _ready_roots(self, roots: list[str]) -> None:
        """Nothing has settled, so exactly the nodes without dependencies are ready, in
        insertion order: ``_make_ready`` for each, in bulk. No story is recorded yet
        (registration starts them afresh), so the step is implied, as for one node."""
        self._transition_batch(roots, WAITING, READY)
        self.ready.extend(roots)
        if self.paused:
            for node_id in roots:
                self._announce_pause(node_id)

    def _ready_unblocked_nodes(self) -> None:
        """Restored (or early-registered) nodes may have unblocked any node: scan them all."""
        state, unsettled, incoming = self.state, self.unsettled, self.graph._in
        make_ready, gate = self._make_ready, self._gate
        for node_id in self.graph.nodes:
            if state[node_id] == WAITING and unsettled[node_id] == 0:
                # A root has no incoming path to gate on (what _gate would conclude).
                (gate if incoming[node_id] else make_ready)(node_id)

    def _restore(self, node: Operation) -> None:
        """Settle a node that arrived terminal, without invoking it (ADR-0023 D5).

        A completed (or cancelled) node's response is restored as its result. Ideal over
        retrospective: a node restored as FAILED is reported failed, never as completed,
        and its error payload reaches no dependent: it has no result entry, and an edge
        from it counts as a path that did not pass (``_gate``).
        """
        node_id, status = node.id, node.status
        if status == FAILED:
            self.restored_failed.add(node_id)
            self.errors[node_id] = node.error or "failed before restore"
        elif status != SKIPPED and node.response is not None:
            self.results[node_id] = node.response
        self._transition(node_id, status, "restored")

    def _on_finished(self, event: ev.OperationFinished) -> None:
        node_id, status, response = event.node_id, event.status, event.response
        running = self.running
        in_flight = running.get(node_id)  # running holds exactly the nodes in state RUNNING
        if in_flight is None or in_flight[0] != event.attempt:
            self._drop_stale_result(event)
            return
        if self.durable:
            self._record("finished", event.now, node_id, event.attempt, status, response, event.error,
                         event.error_type)
        del running[node_id]
        plain = type(response) in PLAIN_TYPES  # carries no context update and no request objects
        if status == COMPLETED:  # inline, not a method: every settlement of a run comes this way
            if plain:
                update = None
            elif type(response) is dict or isinstance(response, Mapping):
                update = response.get("context")
            else:
                update = None
            if update is not None and not isinstance(update, Mapping):
                # Ideal over retrospective: a bad context update is a failure, not "completed".
                message = f"response context must be a mapping, got {type(update).__name__}"
                self._settle_failed(node_id, message, CONTEXT_UPDATE_ERROR)
            else:
                self._settle_completed(node_id, in_flight, response, update)
        elif status == FAILED:
            self._retry_or_fail(event, in_flight[1])
        elif status == CANCELLED:
            self._cancel_node(node_id, "operation cancelled")
        else:
            raise OperationError(f"unknown operation outcome {event.status!r}", node_id=node_id)
        requests: Iterable[ev.Event] = event.requests
        if not requests and not plain and not event.extracted and status == COMPLETED:
            requests = self._requests_in_response(event)
        for request in requests:
            _HANDLERS[type(request)](self, request)

    def _drop_stale_result(self, event: ev.OperationFinished) -> None:
        """A stale or duplicate result, of an attempt that no longer owns the node: counted,
        and told in the node's story."""
        self.counters["stale_results"] += 1
        current = self.state.get(event.node_id)
        if current is not None:  # an id this run never had gets no story of its own
            self._recorded_story(event.node_id).append((current, current, "stale result dropped", event.attempt))

    def _retry_or_fail(self, event: ev.OperationFinished, node: Operation) -> None:
        """A failed attempt goes back to the queue if the operation's retry policy allows
        another (and the run is not cancelling); else the node settles ``failed``."""
        policy = self.retry_policies.get(node.operation) if self.retry_policies else None
        if policy is not None and not self.cancelling and policy.allows(event.attempt, event.error_type):
            self._requeue(event.node_id, f"retried after {event.error_type} on attempt {event.attempt}")
        else:
            self._settle_failed(event.node_id, event.error or "operation failed", event.error_type)

    def _requests_in_response(self, event: ev.OperationFinished) -> list[ev.Event]:
        """Spawn and escalation requests found in a completed response, as events.

        In-process drivers may hand back live request objects in the response. The
        de-duplication key is durable: the same object seen twice shares the ordinal
        of its first sighting (ADR-0023 D6 identity semantics, without ``id()``).
        """
        node_id = event.node_id
        return [
            (ev.EscalationRequested if isinstance(found, EscalationRequest) else ev.SpawnRequested)(
                now=event.now, emitter_id=node_id, request=found,
                dedupe_key=(node_id, event.attempt, "result", ordinal),
            )
            for found, ordinal in request_sightings(event.response, (self.spawn_type, EscalationRequest))
        ]

    def _on_undelivered(self, event: ev.DispatchUndelivered) -> None:
        node_id = event.node_id
        in_flight = self.running.get(node_id)
        if in_flight is None or in_flight[0] != event.attempt:
            self.counters["stale_results"] += 1
            return
        self._record("undelivered", event.now, node_id, event.attempt, event.reason)
        del self.running[node_id]
        if self._inherits_into_clone(in_flight[1]):
            # Nothing says the attempt's branch took its primary's history: the store write and the
            # log's are not one, and an executor that died in between leaves an empty clone. The
            # next attempt takes it again (ADR-0023 D3). Decided here, where a rebuild replays it
            # too, not only at the recovery that sent the attempt back (issue #32).
            self.pending_inheritance.add(node_id)
        if self.cancelling:
            self._cancel_node(node_id, "cancelled before it started")
        else:
            self._requeue(node_id, f"attempt {event.attempt} never started: {event.reason}"[:200])

    def _requeue(self, node_id: str, reason: str) -> None:
        """A node that left flight without settling goes back to the front of the queue;
        its next dispatch is a new attempt."""
        self.running.pop(node_id, None)
        self._transition(node_id, READY, reason)
        self.counters["redispatched"] += 1
        self.ready.appendleft(node_id)
        if self.paused:
            self._announce_pause(node_id)

    def _on_cancel_grace(self, event: ev.CancelGraceExpired) -> None:
        """Operations that ignored cancellation past the grace period settle ``cancelled``."""
        if not self.cancelling:
            return
        self._record("grace", event.now)
        for node_id in list(self.running):
            del self.running[node_id]
            reason = f"{CANCEL_GRACE_EXPIRED}: the operation ignored cancellation past the grace period"
            self.errors[node_id] = reason
            self._cancel_node(node_id, reason)

    def _on_conditions(self, event: ev.ConditionsEvaluated) -> None:
        node_id = event.node_id
        if self.state.get(node_id) != EVALUATING:
            return
        self._record("conditions", event.now, node_id, event.results, event.error)
        if event.error is not None:
            self._settle_failed(node_id, f"edge condition raised: {event.error}", EDGE_CONDITION_ERROR, from_gate=True)
        elif any(passed for _, passed in event.results):
            self._make_ready(node_id)
        else:
            self._skip(node_id)

    def _on_pause(self, event: ev.PauseRequested) -> None:
        self._record("pause", event.now)
        if not self.paused:
            self.paused = True
            self._pause_announced.clear()
            for node_id in self.ready:
                self._announce_pause(node_id)

    def _on_resume(self, event: ev.ResumeRequested) -> None:
        self._record("resume", event.now)
        self.paused = False
        self._pause_announced.clear()

    def _on_hold(self, event: ev.DispatchHeld) -> None:
        self.held = event.held

    def _on_operator_message(self, event: ev.OperatorMessageReceived) -> None:
        self._record("message", event.now, event.text, event.ts)
        queue = self.shared.data.get(OPERATOR_MESSAGES_KEY)
        if not isinstance(queue, list):
            queue = self.shared.data[OPERATOR_MESSAGES_KEY] = []
        ts = event.ts if event.ts is not None else event.now
        queue.append({"ts": ts, "text": event.text, "rendered_into_op": None})

    def _on_cancel(self, event: ev.CancelRequested) -> None:
        if self.cancelling or self.finished:
            return
        self._record("cancel", event.now, event.reason)
        self.cancelling = True
        self._cancel_reason = event.reason
        self._cancel_open_nodes()

    def _cancel_open_nodes(self, announce: bool = True) -> None:
        """Cancel every node not yet in flight; ask the shell to cancel those that are.

        ``announce``: each node cancelled here gets a NodeCancelled signal; a run cancelled
        before it started announced no node, so it cancels them silently."""
        self.ready.clear()
        for node_id, state in list(self.state.items()):
            if state in (WAITING, EVALUATING, READY):
                if announce:
                    self._cancel_node(node_id, self._cancel_reason)
                else:
                    self._transition(node_id, CANCELLED, self._cancel_reason)
            elif state == RUNNING:
                self._out.append(ev.CancelOperation(node_id, self.attempt[node_id]))

    def _cancel_node(self, node_id: str, reason: str) -> None:
        """Settle one node ``cancelled``, announce it, and release what waits on it."""
        self._transition(node_id, CANCELLED, reason)
        self._emit(sig.NodeCancelled, node_id, {"reason": reason})
        self._release_dependents(node_id)

    # -- transitions --------------------------------------------------------------
    def _transition(self, node_id: str, new: str, reason: str) -> None:
        state = self.state
        old = state[node_id]
        if new not in _ALLOWED_FROM[old]:  # the TRANSITIONS table, keyed by ``old``
            raise illegal_transition(old, new, reason, node_id)
        stories = self._stories
        if node_id in stories:
            stories[node_id].append((old, new, reason, self.attempt.get(node_id, 0)))
        elif IMPLIED_STEPS.get(old) != (new, reason):  # off the common path: write the story out
            self._recorded_story(node_id).append((old, new, reason, self.attempt.get(node_id, 0)))
        state[node_id] = new
        if new in TERMINAL:
            self.open_nodes -= 1
            self.counters["settled"] += 1

    def _transition_batch(self, node_ids: Iterable[str], old: str | None, new: str) -> None:
        """Move every node of ``node_ids`` from ``old`` to ``new``: ``_transition`` in bulk, for
        the start of a run (registering the submitted graph, readying its roots).

        The row is checked against the table once for the whole batch, not per node, so a
        fan-out of a million nodes is registered by one update in C. It must be one of
        ``FAST_STEPS`` and settle nothing: a step that writes no story and moves no
        counter. The caller guarantees what ``_transition`` would check node by node:
        every node is in ``old`` and has no recorded story (``validate()`` holds it to that
        in the tests).
        """
        if (old, new) not in FAST_STEPS or new in TERMINAL:
            raise illegal_transition(old, new, "as a batch")
        self.state.update(dict.fromkeys(node_ids, new))

    def _recorded_story(self, node_id: str) -> list[tuple[str, str, str, int]]:
        """The node's recorded story, written out from its current state the first time."""
        story = self._stories.get(node_id)
        if story is None:
            story = implied_story(self.state.get(node_id), self.attempt.get(node_id, 0))
            self._stories[node_id] = story
        return story

    def _release_dependents(self, node_id: str) -> None:
        dependents = self.dependents.get(node_id)
        if not dependents:
            return
        state, unsettled = self.state, self.unsettled
        for dependent in dependents:
            current = state[dependent]  # read per dependent: gating one may settle another
            if current in TERMINAL:
                continue
            remaining = unsettled[dependent] - 1
            unsettled[dependent] = remaining
            if remaining == 0 and current == WAITING and not self.cancelling:
                self._gate(dependent)

    def _gate(self, node_id: str) -> None:
        """OR of incoming paths: skipped heads are ignored; no passing path means skip."""
        edge_ids = self.graph._in[node_id]
        if not edge_ids:
            self._make_ready(node_id)
            return
        edges = self.graph.edges
        state = self.state
        deferred = None
        restored_failed, blocked_by = self.restored_failed, None
        # Live edges (head not skipped) in order; the first that passes readies the node.
        # With none live, or none passing and none deferred, the node is skipped. A head
        # restored as failed offers no path: its error must not reach the dependent.
        for edge_id in edge_ids:
            edge = edges[edge_id]
            if state[edge.head] == SKIPPED:
                continue
            if restored_failed and edge.head in restored_failed:
                blocked_by = edge.head
                continue
            if edge.condition is None:
                self._make_ready(node_id)
                return
            if condition_is_async(edge.condition):
                if deferred is None:
                    deferred = []
                deferred.append(edge)
                continue
            try:
                passed = bool(edge.condition.apply(self._condition_input(edge.head)))
            except Exception as exc:  # noqa: BLE001 - user condition code: settles the node as failed
                self._settle_failed(
                    node_id,
                    f"edge condition raised {type(exc).__name__}: {exc}",
                    EDGE_CONDITION_ERROR,
                    from_gate=True,
                    edge_id=edge.id,
                )
                return
            if passed:
                self._make_ready(node_id)
                return
        if deferred:
            try:
                request = self._evaluation_request(node_id, deferred)
            except Exception as exc:  # noqa: BLE001 - a head's result that will not convert: as if the condition raised
                self._settle_failed(
                    node_id,
                    f"edge condition input could not be prepared: {type(exc).__name__}: {exc}",
                    EDGE_CONDITION_ERROR,
                    from_gate=True,
                )
                return
            self._transition(node_id, EVALUATING, "awaiting async edge conditions")
            self._out.append(request)
            return
        if blocked_by is not None:
            self._skip(node_id, f"no incoming path passed: dependency {blocked_by} was restored as failed")
        else:
            self._skip(node_id)

    def _evaluation_request(self, node_id: str, deferred: list[Any] | None = None) -> ev.EvaluateConditions:
        """Ask the shell to evaluate the node's async conditions: its live async edges by default."""
        if deferred is None:
            edges, state = self.graph.edges, self.state
            deferred = [edge for edge in (edges[edge_id] for edge_id in self.graph._in[node_id])
                        if state[edge.head] != SKIPPED and edge.head not in self.restored_failed
                        and edge.condition is not None and condition_is_async(edge.condition)]
        inputs = tuple((edge.id, to_mapping(self.results.get(edge.head))) for edge in deferred)
        return ev.EvaluateConditions(node_id, inputs, self.shared.snapshot())

    def _condition_input(self, head: str) -> dict[str, Any]:
        return {"result": to_mapping(self.results.get(head)), "context": self.shared.data}

    def _make_ready(self, node_id: str) -> None:
        if self.state[node_id] == WAITING and node_id not in self._stories:
            # The common path's first step, implied by the story: the fast step (WAITING, READY).
            self.state[node_id] = READY
        else:
            self._transition(node_id, READY, "dependencies settled, path valid")
        self.ready.append(node_id)
        if self.paused:
            self._announce_pause(node_id)

    def _announce_pause(self, node_id: str) -> None:
        if node_id not in self._pause_announced:
            self._pause_announced.add(node_id)
            self._emit(sig.NodePaused, node_id)

    def _skip(self, node_id: str, reason: str = "no incoming path passed") -> None:
        self._transition(node_id, SKIPPED, reason)
        self._emit(sig.NodeSkipped, node_id, {"reason": reason})
        self._release_dependents(node_id)

    def _settle_completed(
        self, node_id: str, in_flight: tuple[int, Operation, Sequence[str]], response: Any,
        update: Mapping[str, Any] | None,
    ) -> None:
        """A running node's operation succeeded: record, merge, settle, release.

        RUNNING -> COMPLETED is the common path's last step. Like READY -> RUNNING in
        ``_dispatch_ready`` (dispatch.py) it is applied inline rather than through
        ``_transition``: both are ``FAST_STEPS``, rows of TRANSITIONS checked at import
        (states.py); the old state is pinned (``running`` holds exactly the RUNNING
        nodes, and the caller found the node there); and the step is implied by the
        story unless that is recorded already.
        """
        if update is not None:
            try:
                self.shared.merge(
                    update,
                    writer=node_id,
                    rank=self._ranks()[node_id],
                    follows=lambda other: self.graph.reaches(other, node_id),
                )
            except OperationError as exc:  # a user reducer raised: the merge was undone whole
                self._settle_failed(node_id, exc.message, CONTEXT_UPDATE_ERROR)
                return
        self.results[node_id] = response
        attempt, node, deps = in_flight
        self.state[node_id] = COMPLETED  # the fast step (RUNNING, COMPLETED)
        stories = self._stories
        if node_id in stories:
            stories[node_id].append((RUNNING, COMPLETED, "operation completed", attempt))
        self.open_nodes -= 1
        self.counters["settled"] += 1
        self._out.append(_new_record(ev.EmitSignal, (sig.NodeCompleted, self.run_id, node, self._elapsed, deps, None)))
        if node_id in self.dependents:
            self._release_dependents(node_id)

    def _settle_failed(
        self,
        node_id: str,
        message: str,
        error_type: str | None,
        *,
        from_gate: bool = False,
        edge_id: str | None = None,
    ) -> None:
        result: dict[str, Any] = {"error": message}
        if error_type:
            result["error_type"] = error_type
        if edge_id:
            result["edge_id"] = edge_id
        self.results[node_id] = result
        self.errors[node_id] = message
        self._transition(node_id, FAILED, message[:200])
        self._emit(sig.NodeFailed, node_id, {"error": message})
        self._release_dependents(node_id)

    # -- signals ------------------------------------------------------------------------
    def _emit(self, kind: type, node_id: str, extra: dict[str, Any] | None = None) -> None:
        node = self.graph.nodes[node_id]
        self._out.append(ev.EmitSignal(kind, self.run_id, node, self._elapsed, self.deps.get(node_id, ()), extra))


def _check_inputs(graph: Any, context: Any, reducers: Mapping[str, Any] | None, max_spawn: Any) -> None:
    """Refuse, before any state exists, a graph, context, reducer or spawn cap a run cannot take."""
    require_graph(graph).check_references()
    if context is not None and not isinstance(context, Mapping):
        raise OperationError(f"context must be a mapping, got {type(context).__name__}")
    for key, reducer in (reducers or {}).items():
        if not callable(reducer):
            raise OperationError(f"the reducer for context key {key!r} is not callable: {type(reducer).__name__}")
    if not isinstance(max_spawn, int) or isinstance(max_spawn, bool) or max_spawn < 0:
        raise OperationError(f"max_spawn must be a whole number of at least 0, got {max_spawn!r}")


def _capacity(max_concurrent: int | None, parallel: bool) -> int:
    """Operations a run may have in flight: ``max_concurrent`` (None: the default bound), 1 without ``parallel``."""
    if max_concurrent is None:
        max_concurrent = DEFAULT_MAX_CONCURRENCY
    if not parallel:
        max_concurrent = 1
    if max_concurrent < 1:
        raise OperationError(f"max_concurrent must be at least 1, got {max_concurrent}")
    return max_concurrent


def _check_retry_policies(retry_policies: Mapping[str, Any] | None) -> None:
    for name, policy in (retry_policies or {}).items():
        if not isinstance(policy, RetryPolicy):
            raise OperationError(f"the retry policy for operation {name!r} is not a RetryPolicy: "
                                 f"{type(policy).__name__}")


_HANDLERS: dict[type, Callable[[FlowState, Any], None]] = {
    ev.FlowStarted: FlowState._on_started,
    ev.OperationFinished: FlowState._on_finished,
    ev.ConditionsEvaluated: FlowState._on_conditions,
    ev.SpawnRequested: FlowState._on_spawn,
    ev.EscalationRequested: FlowState._on_escalation,
    ev.InjectRequested: FlowState._on_inject,
    ev.PauseRequested: FlowState._on_pause,
    ev.ResumeRequested: FlowState._on_resume,
    ev.OperatorMessageReceived: FlowState._on_operator_message,
    ev.DispatchHeld: FlowState._on_hold,
    ev.CancelRequested: FlowState._on_cancel,
    ev.CancelGraceExpired: FlowState._on_cancel_grace,
    ev.DispatchUndelivered: FlowState._on_undelivered,
    ev.Restored: FlowState._on_restored,
    ev.ReleaseRequested: FlowState._on_release,
    ev.CloseRequested: FlowState._on_close,
}
