"""Hypothesis drives FlowState through random DAGs and random completion orders.

Each example is a drawn ``FlowSpec``: nodes 0..n-1, edges only from a lower to a higher
index (so the graph is acyclic by construction), per-edge conditions (none, always
true, always false, sync or async), optional ``aggregation_sources``, and a scripted
behaviour per node (complete, fail, write shared-context keys, emit SpawnRequests),
and about one node in five restored: already completed or failed when the run starts.
Half the runs declare a reducer for the shared key "beta".
The driver plays the executor shell: it answers DispatchOperation and
EvaluateConditions instructions in a seeded random order, one to three per
``handle()``, and sometimes toggles pause and backpressure; every ``handle()`` runs
``validate()`` before it returns (tests/kernel/conftest.py). Spawned children always
complete with a response derived from their instruction. Some properties add control events before the start, a
cancel at a random step, or events a live run may receive at any time.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_graphs import CONDITIONS, PASSING_CONDITIONS

from opgraph.kernel import (
    CancelRequested,
    ConditionsEvaluated,
    DispatchHeld,
    DispatchOperation,
    EmitSignal,
    EscalationRequest,
    EscalationRequested,
    EvaluateConditions,
    FinishRun,
    FlowStarted,
    FlowState,
    Graph,
    InjectRequested,
    NodeCompleted,
    NodeFailed,
    NodeSkipped,
    Operation,
    OperationFinished,
    OperatorMessageReceived,
    PauseRequested,
    ResumeRequested,
    SpawnRequest,
    SpawnRequested,
)

# When a property fails, Hypothesis's pytest plugin imports hypothesis.extra._patching,
# which imports libcst, which trips a DeprecationWarning from mypy_extensions. Under
# filterwarnings=error that becomes a pytest INTERNALERROR that ends the session and
# hides the real failure, so import it once here with that one warning ignored.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"libcst\.")
    try:
        import hypothesis.extra._patching  # noqa: F401
    except ImportError:  # libcst not installed: the plugin skips the patch as well
        pass

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None)

MAX_NODES = 25
SHARED_KEYS = ("alpha", "beta")  # few keys, so parallel writers collide
NESTED_KEYS = ("x", "y")
TERMINAL_SIGNALS = (NodeCompleted, NodeFailed, NodeSkipped)
TERMINAL_STATUSES = frozenset({"completed", "failed", "skipped", "cancelled"})
STEP_LIMIT = 10_000




# -- the drawn specification -------------------------------------------------------
@dataclass(frozen=True)
class NodeSpec:
    fails: bool
    writes: tuple[tuple[str, str], ...]  # (shared key, "scalar" or a nested sub-key)
    spawns: tuple[bool, ...]  # one SpawnRequest per entry; the bool is ``independent``
    spawns_via_events: bool  # send SpawnRequested events instead of embedding requests
    aggregation_sources: tuple[int, ...]
    restored: str | None = None  # already "completed" or "failed" when the run starts


@dataclass(frozen=True)
class FlowSpec:
    nodes: tuple[NodeSpec, ...]
    edges: tuple[tuple[int, int, str], ...]  # (head, tail, condition name)
    capacity: int
    reactive: bool
    max_spawn: int
    interruptions: bool = False  # toggle pause and backpressure at random
    reducer: bool = False  # "beta" collects its writes through a declared reducer


def node_id(index: int) -> str:
    # Stable, readable ids: two runs of one spec can then be compared id for id.
    return f"node-{index:02d}"


# Strategies are built once at module level: building them inside the composite for
# every node made generation, not the kernel, the bulk of the run time.
_RAW_NODE = st.tuples(
    st.integers(0, 4),  # 4 means the node fails (one in five)
    st.lists(st.tuples(st.sampled_from(SHARED_KEYS), st.sampled_from(("scalar", *NESTED_KEYS))), max_size=2),
    st.lists(st.booleans(), max_size=2),
    st.booleans(),
    st.lists(st.integers(0, MAX_NODES), max_size=2),  # aggregation sources, taken modulo the index
    st.sampled_from((None,) * 8 + ("completed", "failed")),  # restored: one node in five
)
# Per tail node: up to three incoming edges as (distance back, condition name).
_RAW_IN_EDGES = st.lists(st.tuples(st.integers(0, MAX_NODES), st.sampled_from(tuple(CONDITIONS))), max_size=3)


@st.composite
def flow_specs(draw: st.DrawFn) -> FlowSpec:
    raw_nodes = draw(st.lists(_RAW_NODE, min_size=1, max_size=MAX_NODES))
    count = len(raw_nodes)
    edges: dict[tuple[int, int], str] = {}
    for tail, raw_edges in enumerate(draw(st.lists(_RAW_IN_EDGES, min_size=count - 1, max_size=count - 1)), 1):
        for distance, condition in raw_edges:
            edges.setdefault((tail - 1 - distance % tail, tail), condition)
    nodes = tuple(
        NodeSpec(
            fails=fails == 4,
            writes=tuple(writes),
            spawns=tuple(spawns),
            spawns_via_events=via_events,
            aggregation_sources=tuple(sorted({source % index for source in sources})) if index else (),
            restored=restored,
        )
        for index, (fails, writes, spawns, via_events, sources, restored) in enumerate(raw_nodes)
    )
    return FlowSpec(
        nodes=nodes,
        edges=tuple((head, tail, condition) for (head, tail), condition in sorted(edges.items())),
        capacity=draw(st.integers(1, 4)),
        reactive=draw(st.booleans()),
        max_spawn=draw(st.integers(0, 5)),
        interruptions=draw(st.booleans()),
        reducer=draw(st.booleans()),
    )


def collect(old: Any, new: Any) -> list[Any]:
    """The "beta" reducer: every write, in the order the reducer sees them (rank order)."""
    return [*(old if isinstance(old, list) else []), new]


def build_graph(spec: FlowSpec) -> Graph:
    """A fresh graph per run: FlowState writes status and response onto its Operations."""
    graph = Graph("properties")
    for index, node in enumerate(spec.nodes):
        metadata: dict[str, Any] = {"reference_id": f"n{index}"}
        if node.aggregation_sources:
            metadata["aggregation_sources"] = [node_id(source) for source in node.aggregation_sources]
        operation = Operation(
            id=node_id(index), operation="operate", parameters={"instruction": f"task {index}"}, metadata=metadata
        )
        if node.restored:  # settled by an earlier run: short-circuits without invocation (ADR-0023 D5)
            operation.status = node.restored
            operation.response = {"result": f"restored {index}"} if node.restored == "completed" else None
            operation.error = f"node {index} failed before" if node.restored == "failed" else None
        graph.add_node(operation)
    for head, tail, condition in spec.edges:
        factory = CONDITIONS[condition]
        graph.add_edge(node_id(head), node_id(tail), condition=None if factory is None else factory())
    return graph


def expected_statuses(spec: FlowSpec) -> list[str]:
    """The reference model of ADR-0023 D2: an OR over incoming paths from non-skipped heads.

    A root runs. Otherwise a node runs when some incoming edge from a head that was
    not skipped passes (no condition, or a condition that holds); heads that failed
    while running still count as live paths, heads restored as failed do not (their
    error must not reach a dependent). Aggregation sources delay a node but never gate it.
    """
    statuses: list[str] = []
    for index, node in enumerate(spec.nodes):
        if node.restored:  # settles at the start, whatever its predecessors do
            statuses.append(node.restored)
            continue
        incoming = [(head, condition) for head, tail, condition in spec.edges if tail == index]
        runs = not incoming or any(
            statuses[head] != "skipped" and spec.nodes[head].restored != "failed" and condition in PASSING_CONDITIONS
            for head, condition in incoming
        )
        statuses.append(("failed" if node.fails else "completed") if runs else "skipped")
    return statuses


def requested_spawn_count(spec: FlowSpec) -> int:
    """SpawnRequests the run will see: only completed nodes' responses are read."""
    if not spec.reactive:
        return 0
    statuses = expected_statuses(spec)
    return sum(
        len(node.spawns) for node, status in zip(spec.nodes, statuses, strict=True)
        if status == "completed" and not node.restored
    )


def restored_ids(spec: FlowSpec) -> set[str]:
    """Nodes that settle at the start without running: they emit no settling signal."""
    return {node_id(index) for index, node in enumerate(spec.nodes) if node.restored}


def expected_spawn_count(spec: FlowSpec) -> int:
    return min(requested_spawn_count(spec), spec.max_spawn)


def children_write_context(spec: FlowSpec) -> bool:
    """Children write shared keys only when the cap drops none of them.

    Which requests the cap drops depends on completion order by design (first come,
    first admitted), so with drops the set of child writers, and hence the final
    context, legitimately varies between orders.
    """
    return requested_spawn_count(spec) <= spec.max_spawn


# -- the driver ----------------------------------------------------------------------
@dataclass
class Run:
    envelope: dict[str, Any]
    terminal_signals: Counter[str] = field(default_factory=Counter)
    dispatches: Counter[str] = field(default_factory=Counter)
    premature_dispatches: list[tuple[str, list[str]]] = field(default_factory=list)
    dispatched_while_gated: list[str] = field(default_factory=list)
    dispatched_after_cancel: list[str] = field(default_factory=list)
    stale_sent: int = 0
    stale_counted: int = 0
    peak_in_flight: int = 0


def _completion(spec: FlowSpec, dispatch: DispatchOperation, now: float) -> OperationFinished:
    """The scripted outcome of one dispatched operation."""
    index = int(dispatch.node_id.removeprefix("node-")) if dispatch.node_id.startswith("node-") else None
    if index is None:  # a spawned child: deterministic, derived from its instruction
        instruction = str(dispatch.parameters.get("instruction"))
        response: dict[str, Any] = {"result": f"done: {instruction}"}
        if children_write_context(spec):
            response["context"] = {SHARED_KEYS[len(instruction) % len(SHARED_KEYS)]: instruction}
        return OperationFinished(now=now, node_id=dispatch.node_id, attempt=dispatch.attempt, response=response)
    node = spec.nodes[index]
    if node.fails:
        return OperationFinished(
            now=now,
            node_id=dispatch.node_id,
            attempt=dispatch.attempt,
            status="failed",
            error=f"node {index} failed",
            error_type="ScriptedFailure",
        )
    response = {"result": f"result {index}"}
    if node.writes:
        update: dict[str, Any] = {}
        for key, shape in node.writes:
            update[key] = index if shape == "scalar" else {shape: index}
        response["context"] = update
    requests = [
        SpawnRequest(instruction=f"child {number} of node {index}", independent=independent)
        for number, independent in enumerate(node.spawns)
    ]
    events: tuple[SpawnRequested, ...] = ()
    if node.spawns_via_events:
        events = tuple(
            SpawnRequested(emitter_id=dispatch.node_id, request=request, dedupe_key=(dispatch.node_id, number))
            for number, request in enumerate(requests)
        )
    elif requests:
        response["spawn_requests"] = requests
    return OperationFinished(
        now=now, node_id=dispatch.node_id, attempt=dispatch.attempt, response=response, requests=events
    )


def _dependencies(graph: Graph, node: str) -> list[str]:
    sources = graph.nodes[node].metadata.get("aggregation_sources") or ()
    return [*graph.predecessors(node), *sources]


def run_flow(spec: FlowSpec, choose: Callable[[int], int], prelude: tuple[str, ...] = (),
             cancel_at: int | None = None, noise: bool = False) -> Run:
    """Play the shell until FinishRun; ``choose(n)`` picks which of n outstanding items settles next.

    With ``spec.interruptions`` the shell also toggles pause and backpressure
    (PauseRequested/ResumeRequested, DispatchHeld) at random, and reopens both whenever
    nothing is outstanding, so every run still finishes. ``prelude`` names control
    events the shell hands over before FlowStarted, one ``handle()`` each (see
    ``PRELUDE_EVENTS``). ``cancel_at`` hands over a CancelRequested with the events of
    that step; work in flight then still reports back, as it does from a real shell.
    With ``noise``, about every other step also brings one event that a live run may
    receive at any time (``_noise_event``).
    """
    graph = build_graph(spec)
    state = FlowState(
        graph,
        reducers={"beta": collect} if spec.reducer else None,
        run_id="properties",
        max_concurrent=spec.capacity,
        reactive=spec.reactive,
        max_spawn=spec.max_spawn,
    )
    shell = Shell(spec, graph, choose, settled=restored_ids(spec))
    for index, kind in enumerate(prelude):
        shell.hand_over_before_the_start(kind)
        state.handle(_prelude_event(kind, index))
    events: list[Any] = [FlowStarted(now=0.0)]
    for step in range(1, STEP_LIMIT):
        shell.read(events, state.handle(*events))
        if shell.run.envelope:
            shell.check_nothing_is_left(state)
            return shell.run
        events = shell.next_events(step, cancel_at, noise)
    raise AssertionError(f"no FinishRun after {STEP_LIMIT} steps")


@dataclass
class Shell:
    """The executor's part in ``run_flow``: what is outstanding and what the kernel said.

    ``read`` takes in one ``handle()``'s instructions, one method per kind it answers;
    ``next_events`` makes the events of the next step.
    """

    spec: FlowSpec
    graph: Graph
    choose: Callable[[int], int]
    settled: set[str]  # nodes whose settling signal came out (restored nodes from the start)
    run: Run = field(default_factory=lambda: Run(envelope={}))
    in_flight: dict[str, DispatchOperation] = field(default_factory=dict)
    evaluations: dict[str, EvaluateConditions] = field(default_factory=dict)
    reported: list[OperationFinished] = field(default_factory=list)  # outcomes handed over, for stale copies
    paused: bool = False
    held: bool = False
    cancelled: bool = False

    def hand_over_before_the_start(self, kind: str) -> None:
        """Note a control event of the prelude (``PRELUDE_EVENTS``) that gates dispatch."""
        self.paused = (kind == "pause") if kind in ("pause", "resume") else self.paused
        self.held = (kind == "hold") if kind in ("hold", "release") else self.held

    # -- what the kernel said ------------------------------------------------------------
    def read(self, events: list[Any], instructions: list[Any]) -> None:
        self.cancelled = self.cancelled or any(isinstance(event, CancelRequested) for event in events)
        for instruction in instructions:
            reader = self._READERS.get(type(instruction))
            if reader is not None:
                reader(self, instruction)
        self.run.peak_in_flight = max(self.run.peak_in_flight, len(self.in_flight))

    def _signal(self, instruction: EmitSignal) -> None:
        if instruction.kind in TERMINAL_SIGNALS:
            self.run.terminal_signals[instruction.op_id] += 1
            self.settled.add(instruction.op_id)

    def _dispatch(self, instruction: DispatchOperation) -> None:
        run, node = self.run, instruction.node_id
        run.dispatches[node] += 1
        unsettled = [dep for dep in _dependencies(self.graph, node) if dep not in self.settled]
        if unsettled:
            run.premature_dispatches.append((node, unsettled))
        if self.paused or self.held:
            run.dispatched_while_gated.append(node)
        if self.cancelled:
            run.dispatched_after_cancel.append(node)
        self.in_flight[node] = instruction

    def _evaluate(self, instruction: EvaluateConditions) -> None:
        self.evaluations[instruction.node_id] = instruction

    def _finish(self, instruction: FinishRun) -> None:
        assert not self.run.envelope, "FinishRun emitted twice"
        self.run.envelope = instruction.envelope

    _READERS: ClassVar[dict[type, Callable[[Shell, Any], None]]] = {
        EmitSignal: _signal, DispatchOperation: _dispatch, EvaluateConditions: _evaluate, FinishRun: _finish,
    }

    def check_nothing_is_left(self, state: FlowState) -> None:
        """After FinishRun: no work outstanding, and the stale results the kernel counted."""
        # A cancel settles a node awaiting its async conditions; their verdict is moot.
        moot = self.cancelled and all(state.status_of(node) == "cancelled" for node in self.evaluations)
        assert not self.in_flight and (not self.evaluations or moot), "finished with work outstanding"
        self.run.stale_counted = state.counters["stale_results"]

    # -- what the shell says next --------------------------------------------------------
    def next_events(self, step: int, cancel_at: int | None, noise: bool) -> list[Any]:
        """Settle 1-3 outstanding items, plus the step's noise, cancel and interruption."""
        # Insertion order, not sorted ids: spawned children have random UUIDs, and the
        # choice must replay identically when Hypothesis shrinks.
        outstanding = [("dispatch", key) for key in self.in_flight] + [("conditions", key) for key in self.evaluations]
        if not outstanding:
            assert self.paused or self.held, "stalled: nothing outstanding, dispatch open, and no FinishRun"
            self.paused = self.held = False
            return [ResumeRequested(now=float(step)), DispatchHeld(now=float(step), held=False)]
        events = self._settle(outstanding, step)
        if noise and self.choose(2) == 0:
            event = _noise_event(self.spec, step, self.choose, self.reported)
            self.run.stale_sent += isinstance(event, OperationFinished)
            events.append(event)
        if step == cancel_at:
            events.append(CancelRequested(now=float(step), reason="cancelled mid-run"))
        if self.spec.interruptions and self.choose(3) == 0:
            events.append(self._interruption(step))
        return events

    def _settle(self, outstanding: list[tuple[str, str]], step: int) -> list[Any]:
        """Outcomes or verdicts for 1-3 of the ``outstanding`` items, chosen at random."""
        events: list[Any] = []
        for _ in range(1 + self.choose(min(3, len(outstanding)))):
            kind, key = outstanding.pop(self.choose(len(outstanding)))
            if kind == "dispatch":
                events.append(_completion(self.spec, self.in_flight.pop(key), now=float(step)))
                self.reported.append(events[-1])
            else:
                request = self.evaluations.pop(key)
                results = tuple((edge_id, self.graph.edges[edge_id].condition.verdict) for edge_id, _ in request.edges)
                events.append(ConditionsEvaluated(now=float(step), node_id=key, results=results))
            if not outstanding:
                break
        return events

    def _interruption(self, step: int) -> Any:
        """Toggle pause or backpressure."""
        if self.choose(2):
            self.paused = not self.paused
            return PauseRequested(now=float(step)) if self.paused else ResumeRequested(now=float(step))
        self.held = not self.held
        return DispatchHeld(now=float(step), held=self.held)


PRELUDE_EVENTS = ("pause", "resume", "hold", "release", "spawn", "independent spawn", "orphan spawn", "message",
                  "cancel")


def _prelude_event(kind: str, index: int) -> Any:
    """One control event that may reach a run before it starts."""
    if kind in ("pause", "resume"):
        return PauseRequested(now=0.0) if kind == "pause" else ResumeRequested(now=0.0)
    if kind in ("hold", "release"):
        return DispatchHeld(now=0.0, held=kind == "hold")
    if kind == "message":
        return OperatorMessageReceived(now=0.0, text=f"steer {index}")
    if kind == "cancel":
        return CancelRequested(now=0.0, reason="cancelled before the start")
    emitter = "nobody" if kind == "orphan spawn" else node_id(0)
    request = SpawnRequest(instruction=f"early {index}", independent=kind == "independent spawn")
    return SpawnRequested(now=0.0, emitter_id=emitter, request=request, dedupe_key=("early", index))


def _noise_event(spec: FlowSpec, step: int, choose: Callable[[int], int], reported: list[OperationFinished]) -> Any:
    """A second copy of an outcome already reported (stale), a steer message, an
    injected operation after a random node (or on its own), or an escalation from one."""
    kind = choose(4)
    if kind == 0 and reported:
        return reported[choose(len(reported))]._replace(now=float(step))
    if kind == 1:
        return OperatorMessageReceived(now=float(step), text=f"steer at step {step}")
    some_node = node_id(choose(len(spec.nodes)))
    if kind == 2:
        operation = Operation(operation="operate", parameters={"instruction": f"injected at step {step}"})
        return InjectRequested(now=float(step), operation=operation, after=some_node if choose(2) else None,
                               independent=choose(3) == 0, token=step)
    route = "higher_tier" if choose(2) else "human"
    return EscalationRequested(now=float(step), emitter_id=some_node,
                               request=EscalationRequest(reason=f"noise {step}", route=route), dedupe_key=("esc", step))


def seeded_order(seed: int) -> Callable[[int], int]:
    return random.Random(seed).randrange


# -- properties ------------------------------------------------------------------------
@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32))
def test_every_node_settles_exactly_once_and_the_envelope_is_all_terminal(spec, seed):
    run = run_flow(spec, seeded_order(seed))
    statuses = run.envelope["operation_statuses"]
    assert set(run.terminal_signals) == set(statuses) - restored_ids(spec)
    assert all(count == 1 for count in run.terminal_signals.values()), run.terminal_signals
    assert all(status in TERMINAL_STATUSES for status in statuses.values()), statuses
    assert all(count == 1 for count in run.dispatches.values()), run.dispatches
    skipped = set(run.envelope["skipped_operations"])
    assert not skipped & set(run.dispatches), "a skipped node was dispatched"
    assert not restored_ids(spec) & set(run.dispatches), "a restored node was dispatched"


# Invariants of one run, each checked on flows of its own: what breaks it, empty when it holds.
RUN_INVARIANTS: dict[str, Callable[[FlowSpec, Any], Any]] = {
    "no node is dispatched before its predecessors and aggregation sources settle":
        lambda spec, run: run.premature_dispatches,
    "operations in flight never exceed capacity":
        lambda spec, run: [run.peak_in_flight] if run.peak_in_flight > spec.capacity else [],
    "a paused or held flow dispatches nothing":
        lambda spec, run: run.dispatched_while_gated,
    "completed and skipped operations are disjoint":
        lambda spec, run: set(run.envelope["completed_operations"]) & set(run.envelope["skipped_operations"]),
}


@pytest.mark.parametrize("invariant", RUN_INVARIANTS)
@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32))
def test_every_run_keeps_the_invariant(invariant, spec, seed):
    run = run_flow(spec, seeded_order(seed))
    broken = RUN_INVARIANTS[invariant](spec, run)
    assert not broken, f"{invariant}: {broken}"


@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32))
def test_initial_node_statuses_and_spawn_count_match_the_reference_model(spec, seed):
    """root -> ... : OR of live incoming paths decides run or skip; spawns are capped."""
    run = run_flow(spec, seeded_order(seed))
    statuses = run.envelope["operation_statuses"]
    assert [statuses[node_id(index)] for index in range(len(spec.nodes))] == expected_statuses(spec)
    assert run.envelope.get("spawned_operations", 0) == expected_spawn_count(spec)
    children = [node for node in statuses if not node.startswith("node-")]
    assert len(children) == expected_spawn_count(spec)
    assert all(statuses[child] == "completed" for child in children)


@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32), prelude=st.lists(st.sampled_from(PRELUDE_EVENTS), max_size=4))
def test_control_events_before_the_start_never_leave_a_run_open(spec, seed, prelude):
    """Pause, hold, steer, spawns or a cancel may reach a run before FlowStarted.

    Whatever arrives, the run finishes; a cancelled one dispatches nothing and cancels
    every node, and otherwise each node settles once, after its dependencies.
    """
    run = run_flow(spec, seeded_order(seed), tuple(prelude))
    statuses = run.envelope["operation_statuses"]
    assert all(status in TERMINAL_STATUSES for status in statuses.values()), statuses
    if "cancel" in prelude:
        assert run.envelope["status"] == "cancelled"
        assert run.dispatches == Counter()
        assert {status for node, status in statuses.items() if node not in restored_ids(spec)} <= {"cancelled"}
        return
    assert set(run.terminal_signals) == set(statuses) - restored_ids(spec)
    assert all(count == 1 for count in run.terminal_signals.values()), run.terminal_signals
    assert all(count == 1 for count in run.dispatches.values()), run.dispatches
    assert run.premature_dispatches == []
    early = sum(kind.endswith("spawn") for kind in prelude) if spec.reactive else 0
    assert run.envelope.get("spawned_operations", 0) == min(early + requested_spawn_count(spec), spec.max_spawn)


@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32), cancel_at=st.integers(1, 12))
def test_a_cancel_at_any_step_ends_the_run_and_dispatches_nothing_more(spec, seed, cancel_at):
    run = run_flow(spec, seeded_order(seed), cancel_at=cancel_at)
    statuses = run.envelope["operation_statuses"]
    assert all(status in TERMINAL_STATUSES for status in statuses.values()), statuses
    assert run.dispatched_after_cancel == []
    assert all(count == 1 for count in run.dispatches.values()), run.dispatches
    cancelled = [node for node, status in statuses.items() if status == "cancelled"]
    assert run.envelope["cancelled_operations"] == cancelled
    if cancelled:
        assert run.envelope["status"] == "cancelled"
        assert not set(cancelled) & set(run.terminal_signals)  # cancelled, never also completed or failed


@PROPERTY_SETTINGS
@given(spec=flow_specs(), seed=st.integers(0, 2**32))
def test_stale_copies_steer_injections_and_escalations_mid_run_keep_every_invariant(spec, seed):
    run = run_flow(spec, seeded_order(seed), noise=True)
    statuses = run.envelope["operation_statuses"]
    assert all(status in TERMINAL_STATUSES for status in statuses.values()), statuses
    assert set(run.terminal_signals) == set(statuses) - restored_ids(spec)
    assert all(count == 1 for count in run.terminal_signals.values()), run.terminal_signals
    assert all(count == 1 for count in run.dispatches.values()), run.dispatches
    assert run.premature_dispatches == []
    assert run.stale_counted == run.stale_sent  # every second copy dropped, and counted


# Regression: three parallel roots write one key, n0 {"alpha": {"x": 0}}, n1
# {"alpha": 1}, n2 {"alpha": {"x": 2}}, ranked n0 < n1 < n2, so the rank-order result
# is {"alpha": {"x": 2}}. Seed 2 finishes them n0, n2, n1; per-leaf ownership once let
# n1's scalar win there, because it was compared only with the owner of ("alpha",)
# (still n0) and not with n2, which owned ("alpha", "x").
NESTED_AND_SCALAR_WRITERS = FlowSpec(
    nodes=(
        NodeSpec(fails=False, writes=(("alpha", "x"),), spawns=(), spawns_via_events=False, aggregation_sources=()),
        NodeSpec(fails=False, writes=(("alpha", "scalar"),), spawns=(), spawns_via_events=False,
                 aggregation_sources=()),
        NodeSpec(fails=False, writes=(("alpha", "x"),), spawns=(), spawns_via_events=False, aggregation_sources=()),
    ),
    edges=(),
    capacity=3,
    reactive=False,
    max_spawn=0,
)


@PROPERTY_SETTINGS
@given(spec=flow_specs(), first_seed=st.integers(0, 2**32), second_seed=st.integers(0, 2**32))
@example(spec=NESTED_AND_SCALAR_WRITERS, first_seed=0, second_seed=2)
def test_two_completion_orders_give_the_same_final_context_and_statuses(spec, first_seed, second_seed):
    """Shared-context collisions resolve by rank, so completion timing must not matter.

    n0 .. n(k) with random edges; compare only initial nodes (children get fresh UUIDs).
    """
    first = run_flow(spec, seeded_order(first_seed))
    second = run_flow(spec, seeded_order(second_seed))
    initial = [node_id(index) for index in range(len(spec.nodes))]
    assert first.envelope["final_context"] == second.envelope["final_context"]
    assert [first.envelope["operation_statuses"][n] for n in initial] == [
        second.envelope["operation_statuses"][n] for n in initial
    ]
    assert first.envelope.get("spawned_operations") == second.envelope.get("spawned_operations")
