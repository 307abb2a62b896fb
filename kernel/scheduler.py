"""The run's scheduler state machine: one object, one mutator, events in, instructions out.

Owns every scheduling decision of ADR-0023 D2-D6 and ADR-0033 D3-D5: validation,
dependency settlement, OR-path gating, branch preallocation, capacity, the pause gate,
context preparation, reactive admission and the result envelope. It performs no I/O,
reads no clock and imports no async library; the GraphExecutor actor carries out the
instructions and feeds every outcome back through ``handle``.
"""

from __future__ import annotations

import copy
import heapq
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import events as ev
from . import signals as sig
from .admission import ReactiveAdmission
from .context import (
    OPERATOR_MESSAGES_KEY,
    SharedContext,
    render_operator_messages,
    to_mapping,
)
from .contracts import (
    EscalationRequest,
    SpawnRequest,
    default_node_builder,
    extract_requests,
)
from .errors import (
    OperationError,
    StateTransitionError,
)
from .graph import Graph, Operation, condition_is_async, validate_condition
from .invariants import InvariantChecks
from .results import validate_envelope
from .states import (
    _ALLOWED_FROM,
    _PUBLIC_STATUS,
    CANCELLED,
    COMPLETED,
    EVALUATING,
    FAILED,
    READY,
    RUNNING,
    SKIPPED,
    TERMINAL,
    TRANSITIONS,
    WAITING,
)

__all__ = ["DEFAULT_MAX_CONCURRENCY", "FlowState", "TRANSITIONS"]

DEFAULT_MAX_CONCURRENCY = 10_000

class FlowState(ReactiveAdmission, InvariantChecks):
    """All state of one run; change it only through ``handle(*events)``.

    Cost per settlement is O(degree): dependents are found through the reverse
    dependency index and readiness through a counter of unsettled dependencies.
    ``validate()`` states the cross-structure invariants.
    """

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
    ) -> None:
        if max_concurrent is None:
            max_concurrent = DEFAULT_MAX_CONCURRENCY
        if not parallel:
            max_concurrent = 1
        if max_concurrent < 1:
            raise OperationError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.graph = graph
        self.run_id = run_id
        self.capacity = max_concurrent
        self.reactive = reactive
        self.max_spawn = max_spawn
        self.node_builder = node_builder or default_node_builder
        self.spawn_type = spawn_type or SpawnRequest
        self.default_branch_id = default_branch_id
        self.known_branches = None if known_branches is None else set(known_branches)
        self.shared = SharedContext(context, reducers)

        self.state: dict[str, str] = {}
        self.deps: dict[str, list[str]] = {}
        self.dependents: dict[str, list[str]] = {}
        self.unsettled: dict[str, int] = {}
        self.attempt: dict[str, int] = {}
        self.rank: dict[str, tuple[int, ...]] = {}
        self.branch: dict[str, str | None] = {}
        self.pending_inheritance: set[str] = set()
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.ready: deque[str] = deque()
        self.running: set[str] = set()
        self.open_nodes = 0
        self.history: dict[str, list[tuple[str, str, str, int]]] = {}
        self.paused = False
        self.held = False
        self._pause_announced: set[str] = set()
        self.cancelling = False
        self.started = False
        self.finished = False
        self.start_time = 0.0
        self.now = 0.0
        self._elapsed = 0.0

        self.spawn_count = 0
        self.spawned_ids: list[str] = []
        self.escalated_operations: list[str] = []
        self.dropped_spawns: list[dict[str, Any]] = []
        self._seen_requests: set[Any] = set()
        self._children: dict[str, int] = {}
        self._injected = 0
        self.counters = {"events": 0, "dispatched": 0, "settled": 0, "stale_results": 0}
        self._out: list[ev.Instruction] = []

    # -- the one mutator --------------------------------------------------------
    def handle(self, *events: ev.Event) -> list[ev.Instruction]:
        """Apply events in order and return the instructions the shell must carry out."""
        out = self._out = []
        counters = self.counters
        for event in events:
            counters["events"] += 1
            if event.now > self.now:
                self.now = event.now
                self._elapsed = max(0.0, self.now - self.start_time)
            handler = _HANDLERS.get(type(event))
            if handler is None:
                raise OperationError(f"unknown scheduler event {type(event).__name__}")
            handler(self, event)
        self._pump()
        self._maybe_finish()
        self._out = []
        return out

    # -- queries ----------------------------------------------------------------
    def status_of(self, node_id: str) -> str:
        return _PUBLIC_STATUS[self.state[node_id]]

    def story(self, node_id: str) -> list[tuple[str, str, str, int]]:
        """The node's transitions as (from, to, reason, attempt), oldest first."""
        return list(self.history.get(node_id, ()))

    def statistics(self) -> dict[str, Any]:
        counts = {COMPLETED: 0, FAILED: 0, SKIPPED: 0, CANCELLED: 0}
        for state in self.state.values():
            if state in counts:
                counts[state] += 1
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
        in_order = self._register_initial_nodes()
        # One topological pass both ranks the nodes and detects cycles (edges plus
        # aggregation sources); edge conditions are validated before any work.
        self._rank_initial_nodes(in_order)
        for edge in graph.edges.values():
            if edge.condition is not None:
                validate_condition(edge.condition, edge.id)
        restored = []
        # Bound once: this loop runs for every node of the submitted graph.
        out, deps, branch, default_branch = self._out, self.deps, self.branch, self.default_branch_id
        run_id, elapsed, queued, emit_signal = self.run_id, self._elapsed, sig.NodeQueued, ev.EmitSignal
        for node_id, node in graph.nodes.items():
            if node.status not in TERMINAL:
                node_deps = deps[node_id]
                out.append(emit_signal(queued, run_id, node, elapsed, node_deps, None))
                if node.branch_id is None and not node_deps and not node.metadata.get("inherit_context"):
                    branch[node_id] = default_branch  # the common root: nothing to clone
                else:
                    self._preallocate_branch(node)
            else:
                restored.append(node)
        # Restored terminal nodes short-circuit without invocation (ADR-0023 D5). All
        # of them settle before any is released, so no restored node is ever gated.
        for node in restored:
            if node.response is not None:
                self.results[node.id] = node.response
            elif node.status == FAILED:
                self.results[node.id] = {"error": node.error or "failed before restore"}
            self._transition(node.id, node.status, "restored")
        for node in restored:
            self._release_dependents(node.id)
        state, unsettled, incoming = self.state, self.unsettled, graph._in
        make_ready, gate = self._make_ready, self._gate
        for node_id in graph.nodes:
            if state[node_id] == WAITING and unsettled[node_id] == 0:
                # A root has no incoming path to gate on (what _gate would conclude).
                (gate if incoming[node_id] else make_ready)(node_id)

    def _on_finished(self, event: ev.OperationFinished) -> None:
        node_id = event.node_id
        if (
            self.state.get(node_id) != RUNNING
            or event.attempt != self.attempt[node_id]
        ):
            # Stale or duplicate result of an attempt that no longer owns the node.
            self.counters["stale_results"] += 1
            self.history.setdefault(node_id, []).append(
                (self.state.get(node_id, "?"), self.state.get(node_id, "?"), "stale result dropped", event.attempt)
            )
            return
        self.running.discard(node_id)
        status = event.status
        if status == COMPLETED:
            response = event.response
            response_type = type(response)
            if response_type in _SCALARS:
                update = None
            elif response_type is dict or isinstance(response, Mapping):
                update = response.get("context")
            else:
                update = None
            if update is not None and not isinstance(update, Mapping):
                # Ideal over retrospective: a bad context update is a failure, not "completed".
                message = f"response context must be a mapping, got {type(update).__name__}"
                self._settle_failed(node_id, message, "ContextUpdateError")
            else:
                self.results[node_id] = response
                if update is not None:
                    self.shared.merge(
                        update,
                        writer=node_id,
                        rank=self.rank[node_id],
                        follows=lambda other: self.graph.reaches(other, node_id),
                    )
                self._transition(node_id, COMPLETED, "operation completed")
                self._out.append(
                    ev.EmitSignal(sig.NodeCompleted, self.run_id, self.graph.nodes[node_id], self._elapsed,
                                  self.deps[node_id], None)
                )
                if self.dependents[node_id]:
                    self._release_dependents(node_id)
        elif status == FAILED:
            self._settle_failed(node_id, event.error or "operation failed", event.error_type)
        elif status == CANCELLED:
            self._transition(node_id, CANCELLED, "operation cancelled")
            self._release_dependents(node_id)
        else:
            raise OperationError(f"unknown operation outcome {event.status!r}", node_id=node_id)
        requests: Iterable[ev.Event] = event.requests
        if not requests and not event.extracted and status == COMPLETED and type(event.response) not in _SCALARS:
            # In-process drivers may hand back live request objects in the response.
            requests = [
                (ev.EscalationRequested if isinstance(found, EscalationRequest) else ev.SpawnRequested)(
                    now=event.now, emitter_id=node_id, request=found, dedupe_key=("object", id(found))
                )
                for found in extract_requests(event.response, (self.spawn_type, EscalationRequest))
            ]
        for request in requests:
            _HANDLERS[type(request)](self, request)

    def _on_conditions(self, event: ev.ConditionsEvaluated) -> None:
        node_id = event.node_id
        if self.state.get(node_id) != EVALUATING:
            return
        if event.error is not None:
            self._settle_failed(node_id, f"edge condition raised: {event.error}", "EdgeConditionError", from_gate=True)
        elif any(passed for _, passed in event.results):
            self._make_ready(node_id)
        else:
            self._skip(node_id)

    def _on_pause(self, event: ev.PauseRequested) -> None:
        if not self.paused:
            self.paused = True
            self._pause_announced.clear()
            for node_id in self.ready:
                self._announce_pause(node_id)

    def _on_resume(self, event: ev.ResumeRequested) -> None:
        self.paused = False
        self._pause_announced.clear()

    def _on_hold(self, event: ev.DispatchHeld) -> None:
        self.held = event.held

    def _on_operator_message(self, event: ev.OperatorMessageReceived) -> None:
        queue = self.shared.data.get(OPERATOR_MESSAGES_KEY)
        if not isinstance(queue, list):
            queue = self.shared.data[OPERATOR_MESSAGES_KEY] = []
        ts = event.ts if event.ts is not None else event.now
        queue.append({"ts": ts, "text": event.text, "rendered_into_op": None})

    def _on_cancel(self, event: ev.CancelRequested) -> None:
        if self.cancelling or self.finished:
            return
        self.cancelling = True
        self.ready.clear()
        for node_id, state in list(self.state.items()):
            if state in (WAITING, EVALUATING, READY):
                self._transition(node_id, CANCELLED, event.reason)
            elif state == RUNNING:
                self._out.append(ev.CancelOperation(node_id, self.attempt[node_id]))

    # -- structure ----------------------------------------------------------------
    def _dependencies_of(self, node: Operation) -> list[str]:
        deps = self.graph.predecessors(node.id)
        for source in node.metadata.get("aggregation_sources") or ():
            if source in self.graph and source not in deps and source != node.id:
                deps.append(source)
        return deps

    def _register_initial_nodes(self) -> bool:
        """``_register`` for every node of the submitted graph, in one pass.

        The same bookkeeping, with dependencies read straight from the adjacency and
        every lookup bound once; ranks are left to ``_rank_initial_nodes``, which
        always follows. Returns True when insertion order is already topological
        (every dependency was inserted before its dependent), the usual case for
        built graphs, which lets ranking skip its heap.
        """
        graph = self.graph
        nodes, edges, incoming = graph.nodes, graph.edges, graph._in
        state, history, attempt, all_deps = self.state, self.history, self.attempt, self.deps
        dependents, unsettled = self.dependents, self.unsettled
        in_order = not state  # a node registered before the start (spawned early) may be anywhere
        for node_id, node in nodes.items():
            edge_ids = incoming[node_id]
            if not edge_ids:
                deps = []
            elif len(edge_ids) == 1:
                deps = [edges[edge_ids[0]].head]
            else:
                deps = list(dict.fromkeys([edges[edge_id].head for edge_id in edge_ids]))
            sources = node.metadata.get("aggregation_sources")
            if sources:
                for source in sources:
                    if source in nodes and source not in deps and source != node_id:
                        deps.append(source)
            if node_id not in dependents:
                dependents[node_id] = []
            waiting_on = 0
            for dep in deps:
                if dep in dependents:
                    dependents[dep].append(node_id)
                else:
                    dependents[dep] = [node_id]
                dep_state = state.get(dep)
                if dep_state is None:  # not registered yet: inserted later, or the node itself
                    in_order = False
                    waiting_on += 1
                elif dep_state not in TERMINAL:
                    waiting_on += 1
            state[node_id] = WAITING
            history[node_id] = []
            attempt[node_id] = 0
            all_deps[node_id] = deps
            unsettled[node_id] = waiting_on
        self.open_nodes += len(nodes)
        return in_order

    def _register(self, node: Operation, deps: list[str]) -> None:
        node_id = node.id
        self.state[node_id] = WAITING
        self.history[node_id] = []
        self.rank[node_id] = (len(self.rank),)
        self.attempt[node_id] = 0
        self.deps[node_id] = deps
        self.dependents.setdefault(node_id, [])
        unsettled = 0
        for dep in deps:
            self.dependents.setdefault(dep, []).append(node_id)
            if self.state.get(dep, WAITING) not in TERMINAL:
                unsettled += 1
        self.unsettled[node_id] = unsettled
        self.open_nodes += 1

    def _rank_initial_nodes(self, in_order: bool = False) -> None:
        """Rank = position in the topological order that breaks ties by insertion order.

        Descendants always outrank ancestors, and parallel nodes are ordered by
        insertion, so shared-context collisions resolve the same way every run.
        When insertion order is itself topological (``in_order``), that order *is*
        the tie-broken topological order, and the graph is acyclic: no heap needed.
        """
        deps, dependents, rank = self.deps, self.dependents, self.rank
        if in_order:
            for position, node_id in enumerate(self.graph.nodes):
                rank[node_id] = (position,)
            return
        order = {node_id: index for index, node_id in enumerate(self.graph.nodes)}
        indegree = {node_id: len(deps[node_id]) for node_id in order}
        heap = [order[n] for n, d in indegree.items() if d == 0]
        heapq.heapify(heap)
        names = list(order)
        position = 0
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            node_id = names[pop(heap)]
            rank[node_id] = (position,)
            position += 1
            for dependent in dependents.get(node_id, ()):
                remaining = indegree[dependent] - 1
                indegree[dependent] = remaining
                if remaining == 0:
                    push(heap, order[dependent])
        if position != len(order):
            if not self.graph.is_acyclic():
                raise OperationError("Graph must be acyclic for flow execution")
            stuck = next(n for n, remaining in indegree.items() if remaining > 0)
            raise OperationError(
                "Graph must be acyclic for flow execution (aggregation_sources form a cycle)",
                node_id=stuck,
            )

    def _new_branch_id(self, node_id: str) -> str:
        # Deterministic and unique per (run, node); a plain string is 10x cheaper than uuid5.
        return f"branch-{self.run_id}-{node_id}" if self.run_id else f"branch-{node_id}"

    def _branch_is_known(self, branch_id: str | None) -> bool:
        return branch_id is not None and (self.known_branches is None or branch_id in self.known_branches)

    def _preallocate_branch(self, node: Operation) -> None:
        """ADR-0023 D3: reuse an explicit branch, clone for dependent or inheriting nodes."""
        node_id = node.id
        if self._branch_is_known(node.branch_id):
            self.branch[node_id] = node.branch_id
            return
        inherits = bool(node.metadata.get("inherit_context"))
        if self.deps[node_id] or inherits:
            clone = self._new_branch_id(node_id)
            self.branch[node_id] = clone
            if self.known_branches is not None:
                self.known_branches.add(clone)
            self._out.append(ev.CloneBranch(node_id, clone, self.default_branch_id))
            if inherits and node.metadata.get("primary_dependency"):
                self.pending_inheritance.add(node_id)
        else:
            self.branch[node_id] = self.default_branch_id

    # -- transitions --------------------------------------------------------------
    def _transition(self, node_id: str, new: str, reason: str) -> None:
        state = self.state
        old = state[node_id]
        if new not in _ALLOWED_FROM[old]:  # the TRANSITIONS table, keyed by ``old``
            raise StateTransitionError(f"illegal transition {old} -> {new} ({reason})", node_id=node_id)
        state[node_id] = new
        self.history[node_id].append((old, new, reason, self.attempt[node_id]))
        if new in TERMINAL:
            self.open_nodes -= 1
            self.counters["settled"] += 1

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
        deferred = []
        # Live edges (head not skipped) in order; the first that passes readies the node.
        # With none live, or none passing and none deferred, the node is skipped.
        for edge_id in edge_ids:
            edge = edges[edge_id]
            if state[edge.head] == SKIPPED:
                continue
            if edge.condition is None:
                self._make_ready(node_id)
                return
            if condition_is_async(edge.condition):
                deferred.append(edge)
                continue
            try:
                passed = bool(edge.condition.apply(self._condition_input(edge.head)))
            except Exception as exc:  # user condition code: settles the node as failed
                self._settle_failed(
                    node_id,
                    f"edge condition raised {type(exc).__name__}: {exc}",
                    "EdgeConditionError",
                    from_gate=True,
                    edge_id=edge.id,
                )
                return
            if passed:
                self._make_ready(node_id)
                return
        if deferred:
            self._transition(node_id, EVALUATING, "awaiting async edge conditions")
            self._out.append(
                ev.EvaluateConditions(
                    node_id,
                    tuple((edge.id, to_mapping(self.results.get(edge.head))) for edge in deferred),
                    self.shared.snapshot(),
                )
            )
            return
        self._skip(node_id)

    def _condition_input(self, head: str) -> dict[str, Any]:
        return {"result": to_mapping(self.results.get(head)), "context": self.shared.data}

    def _make_ready(self, node_id: str) -> None:
        self._transition(node_id, READY, "dependencies settled, path valid")
        self.ready.append(node_id)
        if self.paused:
            self._announce_pause(node_id)

    def _announce_pause(self, node_id: str) -> None:
        if node_id not in self._pause_announced:
            self._pause_announced.add(node_id)
            self._emit(sig.NodePaused, node_id)

    def _skip(self, node_id: str) -> None:
        self._transition(node_id, SKIPPED, "no incoming path passed")
        self._emit(sig.NodeSkipped, node_id)
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

    # -- dispatch -------------------------------------------------------------------
    def _pump(self) -> None:
        if self.paused or self.held or self.cancelling or not self.started:
            return
        ready, running, capacity = self.ready, self.running, self.capacity
        if ready and len(running) < capacity:
            dispatch = self._dispatch
            for _ in range(min(len(ready), capacity - len(running))):
                dispatch(ready.popleft())

    def _dispatch(self, node_id: str) -> None:
        node = self.graph.nodes[node_id]
        attempt = self.attempt[node_id] + 1
        self.attempt[node_id] = attempt
        self._transition(node_id, RUNNING, "dispatched")
        self.running.add(node_id)
        branch_id = self.branch.get(node_id, self.default_branch_id)
        if self.pending_inheritance and node_id in self.pending_inheritance:
            self.pending_inheritance.discard(node_id)
            primary = node.metadata.get("primary_dependency")
            if primary in self.results and self.state.get(primary) in (COMPLETED, FAILED):
                source = self.branch.get(primary, self.default_branch_id)
                if source != branch_id:
                    self._out.append(ev.ReplaceHistory(node_id, attempt, branch_id, source))
        parameters = dict(node.parameters)
        own = parameters.get("context")
        shared = self.shared.data
        if own is None and not shared and not self.deps[node_id]:
            parameters["context"] = {}  # a root with nothing to pass on (the common fan-out leaf)
        else:
            parameters["context"] = self._operation_context(node_id, own)
        queue = shared.get(OPERATOR_MESSAGES_KEY)
        if queue and isinstance(queue, list):
            instruction = parameters.get("instruction") or ""
            rendered = render_operator_messages(queue, str(instruction), node_id)
            if rendered != instruction:
                parameters["instruction"] = rendered
        self.counters["dispatched"] += 1
        out = self._out
        out.append(ev.EmitSignal(sig.NodeStarted, self.run_id, node, self._elapsed, self.deps[node_id], None))
        out.append(ev.DispatchOperation(node_id, attempt, node.operation, parameters, branch_id))

    def _operation_context(self, node_id: str, own: Any) -> dict[str, Any]:
        if own is None:
            context = {}
        elif isinstance(own, Mapping):
            context = dict(own)
            # The raw steer queue is control input, never model context (ADR-0023 D4);
            # below, the shared context's copy of it is skipped for the same reason.
            context.pop(OPERATOR_MESSAGES_KEY, None)
        else:
            context = {"original_context": own}
        deps = self.deps[node_id]
        if deps:
            results, state = self.results, self.state
            for dep in deps:
                if dep in results and state[dep] != SKIPPED:
                    result = results[dep]
                    context[f"{dep}_result"] = result if type(result) in _SCALARS else to_mapping(result)
        # Copied, not shared: later merges mutate shared values in place, and an emitted
        # DispatchOperation must keep the context it was prepared with.
        for key, value in self.shared.data.items():
            if key != OPERATOR_MESSAGES_KEY:
                context[key] = value if type(value) in _SCALARS else copy.deepcopy(value)
        return context

    # -- signals and completion -------------------------------------------------------
    def _emit(self, kind: type, node_id: str, extra: dict[str, Any] | None = None) -> None:
        node = self.graph.nodes[node_id]
        self._out.append(ev.EmitSignal(kind, self.run_id, node, self._elapsed, self.deps.get(node_id, ()), extra))

    def _maybe_finish(self) -> None:
        if self.finished or not self.started or self.open_nodes > 0 or self.running:
            return
        self.finished = True
        self._write_back()
        self._out.append(ev.FinishRun(self.envelope()))

    def _write_back(self) -> None:
        """Record final status, response and error on each Operation, once, at the end.

        Done here rather than per transition: pydantic attribute assignment is the
        costliest step of a settlement, and nobody reads node fields mid-run.
        """
        state, results, errors = self.state, self.results, self.errors
        for node_id, node in self.graph.nodes.items():
            fields = node.__dict__
            current = state[node_id]
            fields["status"] = _PUBLIC_STATUS[current]
            if current == COMPLETED and node_id in results:
                fields["response"] = results[node_id]
            if node_id in errors:
                fields["error"] = errors[node_id]

    def envelope(self) -> dict[str, Any]:
        """The result envelope (ADR-0023 D4/D6) plus the truthful additions of DESIGN.md.

        ``completed_operations`` keeps the record's meaning: settled with a result
        entry and not skipped (so failures appear in it). ``failed_operations`` and
        ``operation_statuses`` tell the truth per node.
        """
        results = self.results
        statuses: dict[str, str] = {}
        completed: list[str] = []
        operation_results: dict[str, Any] = {}
        by_state: dict[str, list[str]] = {SKIPPED: [], FAILED: [], CANCELLED: []}
        # One pass in registration order; each list keeps that order.
        for node_id, current in self.state.items():
            statuses[node_id] = _PUBLIC_STATUS[current]
            if node_id in results:
                operation_results[node_id] = results[node_id]
                if current != SKIPPED:
                    completed.append(node_id)
            if current in by_state:
                by_state[current].append(node_id)
        envelope: dict[str, Any] = {
            "completed_operations": completed,
            "operation_results": operation_results,
            "final_context": self.shared.snapshot(),
            "skipped_operations": by_state[SKIPPED],
            "failed_operations": by_state[FAILED],
            "cancelled_operations": by_state[CANCELLED],
            "operation_statuses": statuses,
            "context_collisions": list(self.shared.collisions),
            "status": self._run_status(),
        }
        if self.reactive:
            envelope["spawned_operations"] = self.spawn_count
            envelope["escalated_operations"] = list(self.escalated_operations)
            envelope["dropped_spawns"] = [dict(entry) for entry in self.dropped_spawns]
        validate_envelope(envelope)
        return envelope

    def _run_status(self) -> str:
        if self.cancelling:
            return CANCELLED
        if any(state == FAILED for state in self.state.values()):
            return FAILED
        return COMPLETED

_SCALARS = frozenset({str, int, float, bool, type(None), bytes})

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
}
