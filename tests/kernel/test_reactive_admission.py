"""Reactive admission (ADR-0023 D6, ADR-0033 D3): the one path by which a running graph grows.

Spawn requests (returned in a response or sent live), escalations and injections; the
spawn cap, duplicate and redelivered requests, node builders and routing, and the
dropped-spawn ledger. Each test starts a reactive run through the ``drive`` fixture,
completes the emitter and checks the children, branch clones, signals and ledger entries.
"""

from __future__ import annotations

from types import SimpleNamespace

from kernel_graphs import build, reactive  # tests/support: shared kernel test graphs

from opgraph.kernel import (
    AdmissionDecided,
    CloneBranch,
    DispatchOperation,
    EscalationRequest,
    EscalationRequested,
    Graph,
    InjectRequested,
    OperationFinished,
    SpawnRequest,
    SpawnRequested,
    create_operation,
    role_node_builder,
)


# -- helpers ------------------------------------------------------------------------
def spawned_children(driver) -> list[str]:
    return list(driver.state.spawned_ids)


# -- spawns and the cap ----------------------------------------------------------------
def test_a_spawn_request_in_a_response_admits_a_dependent_child(drive):
    """a (on branch br-a) spawns child: a -[spawn]-> child, child clones br-a."""
    graph, n = build("a")
    graph.nodes[n.a].branch_id = "br-a"
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(n.a, {"text": "more", "requests": [SpawnRequest(instruction="dig deeper")]})
    (child_id,) = spawned_children(driver)
    child = driver.graph.nodes[child_id]
    (edge,) = driver.graph.in_edges(child_id)
    assert (edge.head, edge.label) == (n.a, ["spawn"])
    assert child.metadata["parent_id"] == n.a and child.metadata["spawned"] is True
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "br-a" and clone.reactive is True
    dispatch = driver.dispatched()[child_id]
    assert dispatch.branch_id == clone.branch_id
    assert dispatch.parameters["instruction"] == "dig deeper"
    assert dispatch.parameters["context"][f"{n.a}_result"]["text"] == "more"
    (spawned,) = driver.signals("spawned")
    assert (spawned.op_id, spawned.parent_id, spawned.independent) == (child_id, n.a, False)


def test_a_spawn_admitted_before_the_start_runs_after_its_emitter_and_the_run_finishes(unstarted):
    graph, n = build("a")
    driver = unstarted(graph, reactive=True, default_branch_id="default")
    driver.handle(SpawnRequested(now=0.0, emitter_id=n.a, request=SpawnRequest(instruction="early"), dedupe_key=1))
    (child_id,) = spawned_children(driver)
    driver.start()  # registers the submitted graph around the admitted child, not over it
    assert list(driver.dispatched()) == [n.a]
    driver.complete(n.a, "a done")
    assert driver.dispatched()[child_id].parameters["context"][f"{n.a}_result"] == "a done"
    envelope = driver.run_to_end()
    assert envelope["operation_statuses"] == {n.a: "completed", child_id: "completed"}
    assert envelope["spawned_operations"] == 1
    (clone,) = driver.of_type(CloneBranch)  # its admission clone only, not a second at the start
    assert (clone.node_id, clone.source, clone.reactive) == (child_id, "default", True)
    assert [s.op_id for s in driver.signals("queued")] == [child_id, n.a]  # each announced once


def test_an_independent_spawn_admitted_before_the_start_keeps_its_clone(unstarted):
    graph, n = build("a")
    driver = unstarted(graph, reactive=True, default_branch_id="default")
    request = SpawnRequest(instruction="early", independent=True)
    driver.handle(SpawnRequested(now=0.0, emitter_id=n.a, request=request, dedupe_key=1))
    (child_id,) = spawned_children(driver)
    driver.start()
    (clone,) = driver.of_type(CloneBranch)
    assert driver.dispatched()[child_id].branch_id == clone.branch_id  # ADR-0023 D6: always a clone
    assert driver.dispatched()[n.a].branch_id == "default"
    assert driver.run_to_end()["status"] == "completed"


class Handle:
    """A value no serialiser knows: a request holding one cannot be compared by content."""


def test_a_request_that_will_not_serialise_is_admitted_every_time_it_is_sent(drive):
    from pydantic import BaseModel, ConfigDict

    class OddRequest(BaseModel):
        model_config = ConfigDict(arbitrary_types_allowed=True)
        instruction: str
        handle: Handle

    graph, n = build("a")
    driver = drive(graph, reactive=True, spawn_type=OddRequest, default_branch_id="default",
                   node_builder=lambda request, emitter: create_operation("chat", {"instruction": request.instruction}))
    request = OddRequest(instruction="odd", handle=Handle())
    for _ in range(2):  # no dedupe key, and no content to compare: never taken for a duplicate
        driver.handle(SpawnRequested(emitter_id=n.a, request=request))
    assert len(spawned_children(driver)) == 2
    assert driver.state.dropped_spawns == []


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def test_a_child_whose_instruction_cannot_be_shown_is_admitted_and_announced_with_a_placeholder(drive):
    def builder(request, emitter):
        return create_operation("chat", {"instruction": Unprintable()})

    graph, n = build("a")
    driver = drive(graph, reactive=True, node_builder=builder, default_branch_id="default")
    driver.handle(SpawnRequested(emitter_id=n.a, request=SpawnRequest(instruction="go"), dedupe_key=1))
    (child_id,) = spawned_children(driver)
    (spawned,) = driver.signals("spawned")
    assert spawned.instruction == "<Unprintable that cannot be shown>"
    driver.complete(n.a)
    assert isinstance(driver.dispatched()[child_id].parameters["instruction"], Unprintable)


def test_an_escalation_request_that_is_no_escalation_request_is_dropped_as_invalid(drive):
    """a (running) escalates with a look-alike object: dropped with a reason, nothing scheduled, a goes on."""
    graph, n = build("a")
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.handle(EscalationRequested(emitter_id=n.a, request=SimpleNamespace(route="higher_tier"), dedupe_key=1))
    assert [node for node in driver.dispatched() if node != n.a] == []
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "invalid_request" and "EscalationRequest" in dropped["error"]
    driver.complete(n.a)
    assert driver.envelope["status"] == "completed"


def test_an_escalation_request_built_without_validation_is_dropped_as_invalid(drive):
    """EscalationRequest.model_construct(route=...) has no reason: validated again, dropped, not escalated."""
    graph, n = build("a")
    driver = drive(graph, reactive=True, default_branch_id="default")
    request = EscalationRequest.model_construct(route="higher_tier")
    driver.handle(EscalationRequested(emitter_id=n.a, request=request, dedupe_key=1))
    assert [node for node in driver.dispatched() if node != n.a] == []
    assert driver.state.escalated_operations == []
    assert [entry["reason"] for entry in driver.state.dropped_spawns] == ["invalid_request"]


def test_an_independent_spawn_has_no_edge_and_clones_the_default_branch(drive):
    graph, n = build("a")
    graph.nodes[n.a].branch_id = "br-a"
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="side quest", independent=True)]})
    (child_id,) = spawned_children(driver)
    assert driver.graph.in_edges(child_id) == []
    assert "parent_id" not in driver.graph.nodes[child_id].metadata
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "default"
    driver.complete(child_id)
    assert driver.envelope["spawned_operations"] == 1


def test_spawns_beyond_max_spawn_are_dropped(drive):
    driver, n = reactive(drive, "a", max_spawn=1)
    driver.complete(n.a, [SpawnRequest(instruction="one"), SpawnRequest(instruction="two")])
    assert len(spawned_children(driver)) == 1
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "max_spawn_exceeded" and dropped["emitter_id"] == n.a
    assert "op_id" in dropped


def test_the_spawned_signal_truncates_the_instruction_but_the_child_keeps_it(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a, [SpawnRequest(instruction="y" * 600)])
    (spawned,) = driver.signals("spawned")
    assert spawned.instruction == "y" * 512
    assert driver.graph.nodes[spawned.op_id].parameters["instruction"] == "y" * 600


# -- duplicates and redeliveries ------------------------------------------------------
def test_the_same_request_seen_twice_is_recorded_as_a_duplicate(drive):
    """a, running, sends one request live and again (same dedupe key)."""
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once", assignee=None)
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    assert len(spawned_children(driver)) == 1
    assert [d["reason"] for d in driver.state.dropped_spawns] == ["duplicate"]


def test_a_request_sent_live_and_carried_again_under_its_key_is_a_duplicate(drive):
    """a sends a request over the bus, then its outcome carries the same request under the same
    key (the worker keys one object the same way on both routes): admitted once, then a duplicate."""
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once")
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key=(n.a, 1, 0)))
    attempt = driver.dispatched()[n.a].attempt
    driver._outstanding.pop(n.a)
    driver.handle(OperationFinished(
        node_id=n.a, attempt=attempt, response={"requests": [request]}, extracted=True,
        requests=(SpawnRequested(emitter_id=n.a, request=request, dedupe_key=(n.a, 1, 0)),)))
    assert len(spawned_children(driver)) == 1
    assert [d["reason"] for d in driver.state.dropped_spawns] == ["duplicate"]


def test_the_same_request_object_returned_twice_is_admitted_once_then_recorded_duplicate(drive):
    """a returns [r, r] (one object, two sightings): ADR-0023 D6 de-duplicates by identity."""
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once")
    driver.complete(n.a, {"requests": [request, request]})
    assert len(spawned_children(driver)) == 1
    assert [d["reason"] for d in driver.state.dropped_spawns] == ["duplicate"]


def test_equal_but_distinct_request_objects_are_both_admitted(drive):
    """a returns two equal SpawnRequests: distinct objects are not de-duplicated (ADR-0023 D6)."""
    driver, n = reactive(drive, "a")
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="same"), SpawnRequest(instruction="same")]})
    assert len(spawned_children(driver)) == 2
    assert driver.state.dropped_spawns == []


def test_a_shell_redelivery_of_a_request_is_ignored_silently(drive):
    driver, n = reactive(drive, "a")
    request = SpawnRequest(instruction="once")
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k"))
    driver.handle(SpawnRequested(emitter_id=n.a, request=request, dedupe_key="k", redelivery=True))
    assert len(spawned_children(driver)) == 1
    assert driver.state.dropped_spawns == []


def test_equal_but_distinct_request_objects_in_a_list_are_both_admitted(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a, [SpawnRequest(instruction="same"), SpawnRequest(instruction="same")])
    assert len(spawned_children(driver)) == 2


# -- node builders ---------------------------------------------------------------------
def test_a_raising_node_builder_is_recorded_as_builder_error_truncated(drive):
    def builder(request, emitter):
        raise RuntimeError("x" * 1000)

    driver, n = reactive(drive, "a", node_builder=builder)
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="writer")]})
    (dropped,) = driver.envelope["dropped_spawns"]
    assert dropped["reason"] == "builder_error"
    assert dropped["error"] == "x" * 500
    assert (dropped["assignee"], dropped["emitter_id"]) == ("writer", n.a)
    assert driver.envelope["status"] == "completed"


def test_an_unknown_assignee_from_the_role_builder_is_a_builder_error(drive):
    driver, n = reactive(drive, "a", node_builder=role_node_builder({"writer": None}))
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="ghost")]})
    (dropped,) = driver.envelope["dropped_spawns"]
    assert dropped["reason"] == "builder_error" and "ghost" in dropped["error"]


def test_a_role_routed_child_clones_its_role_branch(drive):
    driver, n = reactive(drive, "a", node_builder=role_node_builder({"writer": "br-writer"}))
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go", assignee="writer")]})
    (child_id,) = spawned_children(driver)
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "br-writer"
    assert driver.graph.nodes[child_id].metadata["reference_id"] == "spawn-1"


def test_a_node_builder_returning_none_is_recorded_as_null_child(drive):
    driver, n = reactive(drive, "a", node_builder=lambda request, emitter: None)
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="go")]})
    assert [d["reason"] for d in driver.envelope["dropped_spawns"]] == ["null_child"]


# Cycle rollback in admission cannot be driven through public events: an admitted node
# is always new, and a new node has no out-edges, so ``after -> child`` can never close
# a cycle. The "cycle" ledger reason is therefore unreachable from FlowState today; the
# rollback primitive it would use is covered by
# test_graph_and_builder.py::test_a_cycle_closing_edge_is_refused_and_leaves_the_graph_unchanged.


# -- injection -------------------------------------------------------------------------
def test_an_injected_operation_after_a_node_is_admitted(drive):
    driver, n = reactive(drive, "a")
    extra = create_operation("chat", {"instruction": "injected"})
    driver.handle(InjectRequested(operation=extra, after=n.a, token="t-1"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision == AdmissionDecided("t-1", True, extra.id, None)
    assert driver.graph.predecessors(extra.id) == [n.a]
    assert extra.id not in driver.dispatched()
    driver.complete(n.a)
    assert extra.id in driver.dispatched()


def test_reinjecting_an_existing_operation_is_a_duplicate_and_not_dispatched_twice(drive):
    driver, n = reactive(drive, "a", "b")
    driver.handle(InjectRequested(operation=driver.graph.nodes[n.b], after=n.a, token="again"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert (decision.accepted, decision.reason) == (False, "duplicate")
    assert driver.state.dropped_spawns[-1]["reason"] == "duplicate"
    driver.run_to_end()
    assert [d.node_id for d in driver.of_type(DispatchOperation)].count(n.b) == 1
    assert driver.envelope["spawned_operations"] == 0


def test_injecting_into_a_non_reactive_run_is_refused(drive):
    graph, n = build("a")
    driver = drive(graph)
    driver.handle(InjectRequested(operation=create_operation("chat"), token="t"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision.accepted is False and decision.token == "t"


def test_injecting_after_the_run_finished_is_refused(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a)
    driver.handle(InjectRequested(operation=create_operation("chat"), token="late"))
    (decision,) = driver.of_type(AdmissionDecided)
    assert decision.accepted is False


# -- escalation ------------------------------------------------------------------------
def test_a_higher_tier_escalation_reruns_the_operation_independently(drive):
    """a escalates: a new independent node runs a's operation with a notice."""
    graph = Graph()
    a = graph.add_node(create_operation("operate", {"instruction": "solve it", "context": {"x": 1}, "tools": True}))
    driver = drive(graph, reactive=True, default_branch_id="default")
    driver.complete(a.id, {"requests": [EscalationRequest(reason="too hard")]})
    (child_id,) = spawned_children(driver)
    child = driver.graph.nodes[child_id]
    assert child.operation == "operate"
    assert child.parameters == {
        "instruction": "[ESCALATION] The previous attempt escalated this task to a higher tier. "
        "Reason: too hard\n\nsolve it",
        "tools": True,
    }
    assert driver.graph.in_edges(child_id) == []
    assert child.metadata["escalated_from"] == a.id
    (escalated,) = driver.signals("escalated")
    assert (escalated.op_id, escalated.route, escalated.child_id) == (a.id, "higher_tier", child_id)
    driver.complete(child_id)
    assert driver.envelope["escalated_operations"] == [a.id]


def test_other_escalation_routes_are_only_recorded(drive):
    driver, n = reactive(drive, "a")
    driver.handle(EscalationRequested(emitter_id=n.a, request=EscalationRequest(reason="ask", route="human")))
    assert spawned_children(driver) == []
    (escalated,) = driver.signals("escalated")
    assert escalated.child_id is None and escalated.route == "human"
    driver.complete(n.a)
    assert driver.envelope["escalated_operations"] == [n.a]
    assert driver.envelope["spawned_operations"] == 0


# -- malformed requests are validated, dropped with a reason, never admitted --------------
class Flaky:
    """A spawn type that is no pydantic model; reading ``assignee`` (or ``instruction``) raises."""

    operation = "chat"

    def __init__(self, instruction_raises: bool = False) -> None:
        self.instruction_raises = instruction_raises

    @property
    def assignee(self):
        raise RuntimeError("assignee exploded")

    @property
    def instruction(self):
        if self.instruction_raises:
            raise RuntimeError("instruction exploded")
        return "from a flaky request"


def test_a_spawn_request_built_without_validation_is_dropped_as_invalid(drive):
    """a spawns SpawnRequest.model_construct(instruction=None): never admitted; the run goes on."""
    driver, n = reactive(drive, "a")
    driver.complete(n.a, {"requests": [SpawnRequest.model_construct(instruction=None)]})
    assert spawned_children(driver) == []
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "invalid_request" and "instruction" in dropped["error"]
    assert driver.envelope["status"] == "completed"


def test_a_megabyte_instruction_is_dropped_as_invalid(drive):
    driver, n = reactive(drive, "a")
    driver.complete(n.a, {"requests": [SpawnRequest.model_construct(instruction="x" * 1_000_000)]})
    assert spawned_children(driver) == []
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "invalid_request" and "1,000,000 characters" in dropped["error"]


def test_requests_whose_attributes_raise_never_abort_the_run(drive):
    """a spawns two Flaky requests: the first (assignee raises) is admitted without an assignee,
    the second (instruction raises too) is a builder_error; a completes and the run goes on."""
    driver, n = reactive(drive, "a", spawn_type=Flaky)
    driver.handle(SpawnRequested(emitter_id=n.a, request=Flaky(), dedupe_key=1),
                  SpawnRequested(emitter_id=n.a, request=Flaky(instruction_raises=True), dedupe_key=2))
    (child_id,) = spawned_children(driver)
    assert driver.graph.nodes[child_id].parameters["instruction"] == "from a flaky request"
    (dropped,) = driver.state.dropped_spawns
    assert dropped["reason"] == "builder_error" and "instruction exploded" in dropped["error"]
    driver.run_to_end()
    assert driver.envelope["status"] == "completed"


def test_a_request_of_another_type_than_the_runs_spawn_type_is_dropped(drive):
    class Custom(SpawnRequest):
        pass

    driver, n = reactive(drive, "a", spawn_type=Custom)
    driver.handle(SpawnRequested(emitter_id=n.a, request=SpawnRequest(instruction="plain"), dedupe_key=1))
    assert spawned_children(driver) == []
    assert driver.state.dropped_spawns[0]["reason"] == "invalid_request"


# -- injected operations that are already settled -------------------------------------------
def test_an_injected_operation_that_is_already_cancelled_short_circuits(drive):
    """inject x (status cancelled) after a: admitted, settled cancelled, never dispatched."""
    driver, n = reactive(drive, "a")
    injected = create_operation("chat", {"instruction": "never run me"})
    injected.status = "cancelled"
    driver.handle(InjectRequested(operation=injected, after=n.a, token=1))
    assert driver.of_type(AdmissionDecided, last=True) == [AdmissionDecided(1, True, injected.id, None)]
    driver.complete(n.a)
    assert injected.id not in [d.node_id for d in driver.of_type(DispatchOperation)]
    assert driver.envelope["operation_statuses"][injected.id] == "cancelled"


def test_an_injected_operation_that_is_already_completed_restores_its_response(drive):
    driver, n = reactive(drive, "a")
    injected = create_operation("chat", {"instruction": "done elsewhere"})
    injected.status, injected.response = "completed", "from before"
    driver.handle(InjectRequested(operation=injected, independent=True, token=2))
    driver.complete(n.a)
    assert injected.id not in [d.node_id for d in driver.of_type(DispatchOperation)]
    assert driver.envelope["operation_results"][injected.id] == "from before"


# -- where clones come from (ADR-0023 D3, D6) ---------------------------------------------------
def test_independent_children_clone_the_session_default_not_the_flow_default(drive):
    """flow default "flow-root", session default "session": an independent child clones "session"."""
    driver, n = reactive(drive, "a", default_branch_id="flow-root", clone_source_branch_id="session")
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="side", independent=True)]})
    (child_id,) = spawned_children(driver)
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "session"


def test_a_dependent_child_clones_its_emitters_branch_which_is_the_flow_default_for_a_root(drive):
    driver, n = reactive(drive, "a", default_branch_id="flow-root", clone_source_branch_id="session")
    driver.complete(n.a, {"requests": [SpawnRequest(instruction="follow up")]})
    (child_id,) = spawned_children(driver)
    (clone,) = [c for c in driver.of_type(CloneBranch) if c.node_id == child_id]
    assert clone.source == "flow-root"
