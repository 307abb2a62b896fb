"""The fixed-workflow compiler (ADR-0073 D2-D4) and the fixed lane (ADR-0068 D3/D4).

Pure: no Ray is started. Compiled graphs are driven through the kernel ``FlowState`` with
instant completions by a minimal copy of tests/kernel's Driver (test folders don't
import each other). Containment tests use real temporary directories and symlinks.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

from opgraph.cluster.lanes import (
    LaneCapabilities,
    LaneCapabilityError,
    ProvenanceError,
    RunProvenance,
    check_control,
    describe_capabilities,
    validate_provenance,
)
from opgraph.cluster.lanes.fixed import (
    CHAT_OPERATION,
    ENGINE_REGISTRY,
    FIXED_WORKFLOW,
    FIXED_WORKFLOW_CAPABILITIES,
    CompiledWorkflow,
    EngineDefinition,
    WorkflowCompileError,
    WorkflowValidationError,
    compile_workflow,
    content_hash,
    fixed_workflow_provenance,
    load_definition,
    register_engine,
    resolve_node_cwd,
    unregister_engine,
    validate_definition,
)
from opgraph.kernel import (
    DispatchOperation,
    ExpressionCondition,
    FinishRun,
    FlowStarted,
    FlowState,
    OperationFinished,
    SpawnRequest,
)

HASH = "sha256:" + "ab" * 32


def node(node_id: str, kind: str = "chat", **config: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": node_id, "kind": kind, "pos": {"x": 0, "y": 0}}
    if kind == "chat":
        config.setdefault("prompt", f"do {node_id}")
    if config:
        entry["config"] = config
    return entry


def edge(edge_id: str, source: str, target: str, condition: str | None = None, label: str | None = None) -> dict:
    entry: dict[str, Any] = {"id": edge_id, "from": source, "to": target}
    if condition is not None:
        entry["condition"] = condition
    if label is not None:
        entry["label"] = label
    return entry


def definition(nodes: list[dict], edges: list[dict] = ()) -> dict[str, Any]:
    return {"version": 1, "nodes": list(nodes), "edges": list(edges)}


def compile_errors(data: dict, **options: Any) -> list[dict]:
    with pytest.raises(WorkflowCompileError) as caught:
        compile_workflow(data, **options)
    return caught.value.errors


def op(compiled: CompiledWorkflow, spec_id: str):
    return compiled.graph.nodes[compiled.node_ids_by_spec_id[spec_id]]


ENGINES = {"review": "review_engine", "coding": "coding_engine", "research": "research_engine"}


# -- nodes -----------------------------------------------------------------------------------
def test_input_compiles_to_flow_context_and_no_operation():
    """input -> draft"""
    compiled = compile_workflow(
        definition([node("input", "input"), node("draft")], [edge("e1", "input", "draft")]),
        inputs={"topic": "tides"},
    )
    assert list(compiled.node_ids_by_spec_id) == ["draft"]
    assert len(compiled.graph) == 1
    assert dict(compiled.context) == {"topic": "tides"}
    assert compiled.flow_options() == {
        "context": {"topic": "tides"},
        "reactive": False,
        "spawn_type": None,
        "node_builder": None,
    }


def test_a_fixed_run_never_installs_a_spawn_type_or_node_builder():
    compiled = compile_workflow(definition([node("a")]))
    state = FlowState(compiled.graph, **compiled.flow_options())
    assert state.reactive is False
    assert compiled.lane == FIXED_WORKFLOW and compiled.capabilities.reactive_growth is False


def test_a_spawn_request_in_a_result_cannot_grow_a_fixed_graph():
    """a -> b; a answers with a SpawnRequest, and the graph keeps its two nodes"""
    compiled = compile_workflow(definition([node("a"), node("b")], [edge("e1", "a", "b")]))
    envelope = Driver(compiled).run(lambda dispatch: {"text": "x", "spawn": SpawnRequest(instruction="grow")})
    assert len(compiled.graph) == 2
    assert len(envelope["completed_operations"]) == 2


def test_a_chat_node_compiles_to_chat_and_record_with_its_prompt_and_model():
    compiled = compile_workflow(definition([node("draft", prompt="Draft it", model="openai/gpt-4.1-mini")]))
    draft = op(compiled, "draft")
    assert draft.operation == CHAT_OPERATION == "chat_and_record"
    assert draft.parameters == {"instruction": "Draft it", "model": "openai/gpt-4.1-mini"}
    assert draft.reference_id == "draft" and draft.metadata["workflow_node_kind"] == "chat"


def test_a_chat_node_without_a_model_uses_the_run_default():
    compiled = compile_workflow(definition([node("draft", prompt="Draft it")]))
    assert op(compiled, "draft").parameters == {"instruction": "Draft it"}


def test_the_model_override_replaces_every_chat_model():
    data = definition([node("a", model="openai/gpt-4.1-mini"), node("b")])
    compiled = compile_workflow(data, model_override="sim/echo")
    assert [op(compiled, n).parameters["model"] for n in ("a", "b")] == ["sim/echo", "sim/echo"]


def test_a_model_override_without_a_provider_is_a_run_level_error():
    errors = compile_errors(definition([node("a")]), model_override="gpt-4")
    assert len(errors) == 1 and errors[0]["node_id"] is None and errors[0]["edge_id"] is None
    assert "'provider/model'" in errors[0]["error"]


def test_an_invalid_definition_fails_validation_before_compiling():
    with pytest.raises(WorkflowValidationError):
        compile_workflow(definition([node("g", "gate")]))


def test_a_missing_spec_is_a_compile_error():
    with pytest.raises(WorkflowCompileError, match="no spec_json to run"):
        compile_workflow(None)


@pytest.mark.parametrize("kind", ["parse", "fanout"])
def test_parse_and_fanout_nodes_give_node_addressed_compile_errors(kind):
    errors = compile_errors(definition([node("a"), node("x", kind)]))
    assert len(errors) == 1
    assert errors[0]["node_id"] == "x" and errors[0]["edge_id"] is None
    assert f"'{kind}' nodes cannot run in a fixed workflow" in errors[0]["error"]


def test_an_empty_graph_compiles():
    compiled = compile_workflow(definition([node("input", "input")]))
    assert len(compiled.graph) == 0


def test_the_compiled_workflow_carries_the_definition_hash():
    data = definition([node("a")])
    assert compile_workflow(data).content_hash == content_hash(data)
    assert compile_workflow(load_definition(data)).content_hash == content_hash(data)


def test_compile_errors_are_collected_not_fail_fast():
    """input -> a (conditional, rejected); p is parse; b -> input (targets no operation)"""
    data = definition(
        [node("input", "input"), node("a"), node("p", "parse"), node("b")],
        [edge("e1", "input", "a", "context.go"), edge("e2", "b", "input")],
    )
    located = [(e["node_id"], e["edge_id"]) for e in compile_errors(data)]
    assert located == [("p", None), (None, "e1"), (None, "e2")]


# -- engines ---------------------------------------------------------------------------------
def test_an_engine_node_compiles_to_its_registered_operation():
    data = definition([node("check", "engine", engine_def_id="review", max_agents=3, model="openai/o4")])
    check = op(compile_workflow(data, engine_registry=ENGINES), "check")
    assert check.operation == "review_engine"
    assert check.parameters == {
        "engine_def_id": "review",
        "engine_kind": "review",
        "engine_model": "openai/o4",
        "engine_max_depth": None,
        "engine_max_agents": 3,
        "engine_options": {},
    }


def test_register_engine_fills_the_default_registry():
    register_engine("planning", "planning_engine")
    try:
        data = definition([node("plan", "engine", engine_def_id="planning")])
        assert op(compile_workflow(data), "plan").operation == "planning_engine"
    finally:
        unregister_engine("planning")
    assert "planning" not in ENGINE_REGISTRY


def test_an_unknown_engine_is_a_node_addressed_compile_error():
    errors = compile_errors(definition([node("check", "engine", engine_def_id="nope")]), engine_registry=ENGINES)
    assert errors == [
        {
            "error": "unknown engine definition 'nope'; registered engine kinds: coding, research, review",
            "node_id": "check",
            "edge_id": None,
        }
    ]


def test_an_engine_definition_of_an_unregistered_kind_is_a_node_addressed_compile_error():
    stored = {"hyp-1": EngineDefinition(id="hyp-1", kind="hypothesis")}
    errors = compile_errors(
        definition([node("h", "engine", engine_def_id="hyp-1")]), engine_registry=ENGINES, engine_definitions=stored
    )
    assert errors[0]["node_id"] == "h" and "engine kind 'hypothesis' has no registered operation" in errors[0]["error"]


def test_an_engine_node_needs_an_engine_def_id():
    errors = compile_errors(definition([node("e", "engine")]), engine_registry=ENGINES)
    assert errors == [{"error": "an engine node needs a string config.engine_def_id", "node_id": "e", "edge_id": None}]


def test_a_stored_engine_definition_resolves_by_name_and_node_settings_overlay_it():
    stored = {
        "7f3a": EngineDefinition(
            id="7f3a", kind="review", name="review-engine", options={"export_dir": "out"}, max_depth=2, max_agents=4
        )
    }
    data = definition([node("c", "engine", engine_def_id="review-engine", max_agents=9, max_depth=None,
                            options={"export_dir": "reports/today"})])
    params = op(compile_workflow(data, engine_registry=ENGINES, engine_definitions=stored), "c").parameters
    assert (params["engine_kind"], params["engine_max_depth"], params["engine_max_agents"]) == ("review", 2, 9)
    assert params["engine_options"] == {"export_dir": "reports/today"}


@pytest.mark.parametrize("budget", [0, 101, True, "3"])
def test_engine_budgets_are_integers_from_1_to_100(budget):
    errors = compile_errors(definition([node("c", "engine", engine_def_id="review", max_depth=budget)]),
                            engine_registry=ENGINES)
    assert errors[0]["node_id"] == "c" and "max_depth must be an integer from 1 to 100" in errors[0]["error"]


@pytest.mark.parametrize(
    "options",
    [{"retries": "3"}, {"export_dir": "-rf"}, {"export_dir": "out; rm -rf /"}, {"export_dir": 3}],
)
def test_engine_options_admit_only_plain_test_cmd_and_export_dir(options):
    errors = compile_errors(definition([node("c", "engine", engine_def_id="review", options=options)]),
                            engine_registry=ENGINES)
    assert len(errors) == 1 and errors[0]["node_id"] == "c"


def test_a_coding_engine_needs_a_test_command():
    errors = compile_errors(definition([node("c", "engine", engine_def_id="coding")]), engine_registry=ENGINES)
    assert errors == [{"error": "a coding engine needs a non-blank options.test_cmd", "node_id": "c", "edge_id": None}]


def test_an_engine_model_needs_a_provider_prefix():
    errors = compile_errors(definition([node("c", "engine", engine_def_id="review", model="o4")]),
                            engine_registry=ENGINES)
    assert errors[0]["node_id"] == "c" and "'provider/model'" in errors[0]["error"]


# -- edges -----------------------------------------------------------------------------------
def test_only_authored_edges_create_dependencies():
    """a, b, c with only a -> c: b stays an independent root (no auto-chaining)"""
    compiled = compile_workflow(definition([node("a"), node("b"), node("c")], [edge("e1", "a", "c")]))
    ids = compiled.node_ids_by_spec_id
    assert len(compiled.graph.edges) == 1
    assert compiled.graph.heads() == [ids["a"], ids["b"]]
    assert compiled.graph.predecessors(ids["c"]) == [ids["a"]]


def test_an_unconditional_edge_from_input_is_omitted():
    """input -> a"""
    compiled = compile_workflow(definition([node("input", "input"), node("a")], [edge("e1", "input", "a")]))
    assert len(compiled.graph.edges) == 0
    assert compiled.omitted_edge_ids == ("e1",)
    assert compiled.edge_ids_by_spec_id == {}


def test_a_conditional_edge_from_input_is_rejected():
    """input -(context.go)-> a"""
    data = definition([node("input", "input"), node("a")], [edge("e1", "input", "a", "context.go == True")])
    errors = compile_errors(data)
    assert len(errors) == 1 and errors[0]["edge_id"] == "e1" and errors[0]["node_id"] is None
    assert "conditional edge from an input node" in errors[0]["error"]


def test_an_edge_into_input_is_rejected():
    """a -> input"""
    errors = compile_errors(definition([node("input", "input"), node("a")], [edge("e1", "a", "input")]))
    assert errors == [
        {
            "error": "edge targets the 'input' node 'input', which runs no operation; "
            "point it at a chat or engine node",
            "node_id": None,
            "edge_id": "e1",
        }
    ]


def test_an_edge_into_a_non_executable_node_is_rejected():
    """a -> p (parse)"""
    errors = compile_errors(definition([node("a"), node("p", "parse")], [edge("e1", "a", "p")]))
    assert [(e["node_id"], e["edge_id"]) for e in errors] == [("p", None), (None, "e1")]


def test_an_edge_condition_compiles_to_an_expression_condition():
    """a -(result.score > 0.5)-> b"""
    compiled = compile_workflow(definition([node("a"), node("b")], [edge("e1", "a", "b", "result.score > 0.5")]))
    created = compiled.graph.edges[compiled.edge_ids_by_spec_id["e1"]]
    assert created.condition == ExpressionCondition("result.score > 0.5")
    assert created.condition.edge_id == "e1"


@pytest.mark.parametrize(
    "condition",
    [
        "__import__('os')",
        "result.__class__",
        "len(result) > 1",
        "[x for x in result]",
        "secret == 1",
        "not " * 25 + "result",
    ],
)
def test_an_unsafe_edge_expression_is_refused_as_stored_carrying_the_edge_id(condition):
    """a -(condition)-> b: the condition is compiled when the definition is validated, so a
    condition that could never run is refused before it is stored, not when it first runs."""
    data = definition([node("a"), node("b")], [edge("e7", "a", "b", condition)])
    errors = validate_definition(data)
    assert len(errors) == 1 and errors[0]["edge_id"] == "e7" and errors[0]["node_id"] is None
    assert "edge expression" in errors[0]["error"]
    with pytest.raises(WorkflowValidationError) as caught:
        compile_workflow(data)
    assert caught.value.errors == errors


def test_labels_become_zero_or_one_element_lists():
    """a -(label 'approved')-> b, a -> c"""
    compiled = compile_workflow(
        definition([node("a"), node("b"), node("c")], [edge("e1", "a", "b", label="approved"), edge("e2", "a", "c")])
    )
    edges = compiled.graph.edges
    assert edges[compiled.edge_ids_by_spec_id["e1"]].label == ["approved"]
    assert edges[compiled.edge_ids_by_spec_id["e2"]].label == []


def test_a_cycle_is_a_graph_level_compile_error():
    """a -> b -> c -> a, with d hanging off c"""
    data = definition(
        [node("a"), node("b"), node("c"), node("d")],
        [edge("e1", "a", "b"), edge("e2", "b", "c"), edge("e3", "c", "a"), edge("e4", "c", "d")],
    )
    errors = compile_errors(data)
    assert len(errors) == 1 and errors[0]["node_id"] is None and errors[0]["edge_id"] is None
    assert errors[0]["error"].startswith("the workflow graph has a cycle through a, b, c, d")


def test_a_self_loop_is_a_cycle():
    errors = compile_errors(definition([node("a")], [edge("e1", "a", "a")]))
    assert "cycle through a" in errors[0]["error"]


# -- coding cwd containment (ADR-0073 D4, in order) -------------------------------------------
@pytest.fixture
def base(tmp_path):
    """tmp/base/{repo, repo/sub, notes.txt} and tmp/outside"""
    root = tmp_path / "base"
    (root / "repo" / "sub").mkdir(parents=True)
    (root / "notes.txt").write_text("not a directory")
    (tmp_path / "outside").mkdir()
    return root


def test_a_relative_cwd_resolves_inside_the_base(base):
    assert resolve_node_cwd("c", "repo/sub", str(base)) == str((base / "repo" / "sub").resolve())


def test_a_raw_dot_dot_is_rejected_even_when_it_would_resolve_inside(base):
    with pytest.raises(WorkflowCompileError, match=r"contains '\.\.'") as caught:
        resolve_node_cwd("c", "repo/../repo", str(base))
    assert caught.value.node_id == "c"


def test_a_raw_dot_dot_is_rejected_before_the_base_dir_is_required():
    with pytest.raises(WorkflowCompileError, match=r"contains '\.\.'"):
        resolve_node_cwd("c", "..\\elsewhere", None)


def test_a_cwd_needs_a_run_level_base_dir():
    with pytest.raises(WorkflowCompileError, match="needs a run-level base_dir"):
        resolve_node_cwd("c", "repo", None)


def test_a_cwd_must_be_a_non_empty_string(base):
    with pytest.raises(WorkflowCompileError, match="non-empty string"):
        resolve_node_cwd("c", " ", str(base))


def test_an_absolute_cwd_inside_the_base_is_allowed(base):
    assert resolve_node_cwd("c", str(base / "repo"), str(base)) == str((base / "repo").resolve())


def test_an_absolute_cwd_outside_the_base_is_rejected(base, tmp_path):
    with pytest.raises(WorkflowCompileError, match="not an existing directory inside the run's base_dir"):
        resolve_node_cwd("c", str(tmp_path / "outside"), str(base))


def test_a_symlink_pointing_outside_the_base_is_an_escape(base, tmp_path):
    """base/escape -> tmp/outside: lexically inside, really outside; the message shows neither side"""
    os.symlink(tmp_path / "outside", base / "escape")
    with pytest.raises(WorkflowCompileError, match="not an existing directory inside the run's base_dir") as caught:
        resolve_node_cwd("c", "escape", str(base))
    assert str(tmp_path) not in caught.value.message


def test_a_symlinked_base_dir_is_resolved_before_containment(base, tmp_path):
    """tmp/alias -> tmp/base; cwd repo under the alias is inside"""
    os.symlink(base, tmp_path / "alias")
    assert resolve_node_cwd("c", "repo", str(tmp_path / "alias")) == str((base / "repo").resolve())


def test_a_cwd_must_exist(base):
    with pytest.raises(WorkflowCompileError, match="not an existing directory"):
        resolve_node_cwd("c", "missing", str(base))


def test_a_cwd_must_be_a_directory(base):
    with pytest.raises(WorkflowCompileError, match="not an existing directory"):
        resolve_node_cwd("c", "notes.txt", str(base))


def test_a_refused_cwd_does_not_tell_what_exists_on_the_disk(base, tmp_path):
    """Outside the base (existing or not), missing inside it, a file, a link out, a link loop: one
    answer, with no resolved path and no base in it, so a definition's author learns nothing."""
    (tmp_path / "exists-outside").mkdir()
    os.symlink(tmp_path / "exists-outside", base / "link-out")
    os.symlink(base / "loop", base / "loop")
    refusals = set()
    for cwd in (str(tmp_path / "exists-outside"), str(tmp_path / "missing-outside"), "/etc", "/no/such/folder",
                "missing", "notes.txt", "link-out", "loop"):
        with pytest.raises(WorkflowCompileError) as caught:
            resolve_node_cwd("c", cwd, str(base))
        refusals.add(caught.value.message.replace(repr(cwd), "CWD"))
        assert str(base) not in caught.value.message or str(base) in cwd
    assert refusals == {"config.cwd CWD is not an existing directory inside the run's base_dir"}


def test_a_coding_engine_gets_its_resolved_workspace(base):
    data = definition([node("code", "engine", engine_def_id="coding", cwd="repo", options={"test_cmd": "pytest -q"})])
    params = op(compile_workflow(data, base_dir=base, engine_registry=ENGINES), "code").parameters
    assert params["engine_workspace"] == str((base / "repo").resolve())
    assert params["engine_options"] == {"test_cmd": "pytest -q"}


def test_only_a_coding_engine_may_set_cwd(base):
    data = definition([node("r", "engine", engine_def_id="research", cwd="repo")])
    errors = compile_errors(data, base_dir=base, engine_registry=ENGINES)
    assert errors == [
        {
            "error": "config.cwd is only allowed on a coding engine, not on a 'research' engine",
            "node_id": "r",
            "edge_id": None,
        }
    ]


def test_the_coding_kind_check_comes_after_containment(base):
    data = definition([node("r", "engine", engine_def_id="research", cwd="../x")])
    errors = compile_errors(data, base_dir=base, engine_registry=ENGINES)
    assert len(errors) == 1 and "contains '..'" in errors[0]["error"]


def test_a_chat_node_may_not_set_cwd(base):
    errors = compile_errors(definition([node("a", cwd="repo")]), base_dir=base)
    assert errors[0]["node_id"] == "a" and "not on a 'chat' node" in errors[0]["error"]


def test_a_node_without_cwd_ignores_whether_base_dir_was_given(base):
    data = definition([node("a")])
    assert len(compile_workflow(data).graph) == len(compile_workflow(data, base_dir=base / "nope").graph) == 1


# -- the fixed lane (ADR-0068 D3/D4) ----------------------------------------------------------
def test_the_fixed_lane_capability_matrix():
    assert FIXED_WORKFLOW_CAPABILITIES.as_metadata() == {
        "planner": False,
        "reactive_growth": False,
        "live_pause": False,
        "live_message": False,
        "checkpoint_resume": True,  # a logged run is replayed from its pinned source and hash
        "leased_admission": False,
        "cancel": True,
    }
    assert describe_capabilities(FIXED_WORKFLOW_CAPABILITIES).startswith("planner: no, reactive growth (spawns): no")
    assert describe_capabilities(FIXED_WORKFLOW_CAPABILITIES).endswith("cancel: yes")


def test_the_fixed_lane_honours_cancel():
    check_control(FIXED_WORKFLOW, "cancel")


@pytest.mark.parametrize("request_kind", ["message", "pause", "resume", "spawn", "replan"])
def test_the_fixed_lane_rejects_controls_it_cannot_honour(request_kind):
    with pytest.raises(LaneCapabilityError, match="rejected and not queued") as caught:
        check_control(FIXED_WORKFLOW, request_kind)
    assert (caught.value.lane, caught.value.request_kind) == (FIXED_WORKFLOW, request_kind)


def test_an_unknown_control_or_undeclared_lane_is_rejected():
    with pytest.raises(LaneCapabilityError, match="unknown control request"):
        check_control(FIXED_WORKFLOW, "reboot")
    with pytest.raises(LaneCapabilityError, match="no declared capability matrix"):
        check_control("no_such_lane", "message")
    check_control("planned_reactive_flow", "message")  # declared now: the planned lane takes messages


def test_an_invocations_own_matrix_can_be_checked():
    live = LaneCapabilities(True, True, True, True, True, False, True)
    check_control(live, "message")


def test_lane_and_provenance_errors_pickle_with_their_ids():
    error = pickle.loads(pickle.dumps(LaneCapabilityError("no", lane=FIXED_WORKFLOW, request_kind="message")))
    assert (error.message, error.lane, error.request_kind) == ("no", FIXED_WORKFLOW, "message")
    assert pickle.loads(pickle.dumps(ProvenanceError("bad"))).message == "bad"


def test_fixed_workflow_provenance_has_the_adr_shape():
    provenance = fixed_workflow_provenance(ref="daily-review", version=4, content_hash=HASH)
    payload = provenance.to_payload()
    assert payload == {
        "lane": "fixed_workflow",
        "source": {"kind": "workflow_def", "ref": "daily-review", "version": 4, "content_hash": HASH},
        "planner": {"used": False},
        "reactive": {"enabled": False, "max_ops": 0},
        "admission": {"task_id": None, "lease_attempt": None},
    }
    assert RunProvenance.from_payload(payload) == provenance


def test_file_mode_provenance_needs_a_hash_but_no_version():
    provenance = fixed_workflow_provenance(ref="flows/review.json", content_hash=HASH, source_kind="workflow_file")
    assert provenance.source.version is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"source": {"kind": "workflow_def", "ref": "r", "version": 1}}, "pinned content_hash"),
        ({"source": {"kind": "workflow_def", "ref": "r", "content_hash": HASH}}, "pinned version"),
        ({"source": {"kind": "workflow_def", "ref": "r", "version": 1, "content_hash": "md5:x"}}, "64 hex"),
        ({"planner": {"used": True}}, "never uses a planner"),
        ({"reactive": {"enabled": True, "max_ops": 5}}, "never uses a planner or reactive"),
        ({"source": {"kind": "prompt", "ref": "r", "content_hash": HASH}}, "workflow_def or workflow_file"),
        ({"extra": 1}, "extra"),
    ],
)
def test_malformed_fixed_provenance_is_rejected(change, message):
    payload = fixed_workflow_provenance(ref="r", version=1, content_hash=HASH).to_payload()
    payload.update(change)
    with pytest.raises(ProvenanceError, match=message):
        validate_provenance(payload)  # the shared rules, then the fixed lane's, through the registry


# -- a compiled example, driven through the kernel ---------------------------------------------
class Driver:
    """FlowState + instant completions: ``respond(dispatch)`` answers each operation."""

    def __init__(self, compiled: CompiledWorkflow) -> None:
        self.state = FlowState(compiled.graph, **compiled.flow_options())
        self.outstanding: dict[str, DispatchOperation] = {}
        self.dispatched: list[DispatchOperation] = []
        self.envelope: dict[str, Any] | None = None
        self.handle(FlowStarted(now=0.0))

    def handle(self, *events: Any) -> None:
        for instruction in self.state.handle(*events):
            if isinstance(instruction, DispatchOperation):
                self.outstanding[instruction.node_id] = instruction
                self.dispatched.append(instruction)
            elif isinstance(instruction, FinishRun):
                self.envelope = instruction.envelope
        self.state.validate()

    def run(self, respond) -> dict[str, Any]:
        while self.outstanding:
            node_id, dispatch = next(iter(self.outstanding.items()))
            del self.outstanding[node_id]
            response = respond(dispatch)
            self.handle(OperationFinished(now=0.0, node_id=node_id, attempt=dispatch.attempt, response=response))
        assert self.envelope is not None, "the run did not finish"
        return self.envelope


EXAMPLE = {
    "version": 1,
    "nodes": [
        {"id": "input", "kind": "input", "pos": {"x": 0, "y": 0}},
        {"id": "draft", "kind": "chat", "pos": {"x": 200, "y": 0}, "config": {"prompt": "Draft a note on the topic"}},
        {"id": "review", "kind": "chat", "pos": {"x": 400, "y": 0},
         "config": {"prompt": "Reply APPROVE or REVISE", "model": "sim/echo"}},
        {"id": "publish", "kind": "chat", "pos": {"x": 600, "y": -100}, "config": {"prompt": "Write the final note"}},
        {"id": "revise", "kind": "chat", "pos": {"x": 600, "y": 100}, "config": {"prompt": "Revise the draft"}},
    ],
    "edges": [
        {"id": "e1", "from": "input", "to": "draft"},
        {"id": "e2", "from": "draft", "to": "review"},
        {"id": "e3", "from": "review", "to": "publish", "condition": "'APPROVE' in result.text", "label": "approved"},
        {"id": "e4", "from": "review", "to": "revise",
         "condition": "'APPROVE' not in result.text and context.allow_revision == True"},
    ],
    "inputs": ["topic", "allow_revision"],
    "outputs": ["publish"],
}


def chat_reply(verdict: str):
    """A chat_and_record-shaped record; the review node answers ``verdict``."""

    def respond(dispatch: DispatchOperation) -> dict[str, Any]:
        assert dispatch.operation == "chat_and_record"
        text = verdict if dispatch.parameters["instruction"].startswith("Reply") else "some text"
        return {"text": text, "model": dispatch.parameters.get("model", "sim/default"), "provider": "sim",
                "finish_reason": "stop", "usage": {}}

    return respond


@pytest.mark.parametrize("verdict, ran, skipped", [("APPROVE", "publish", "revise"), ("REVISE", "revise", "publish")])
def test_the_example_workflows_conditional_edges_gate_the_run(verdict, ran, skipped):
    """input -> draft -> review -(APPROVE)-> publish ; review -(not APPROVE, context allows)-> revise"""
    compiled = compile_workflow(EXAMPLE, inputs={"topic": "tides", "allow_revision": True})
    ids = compiled.node_ids_by_spec_id
    driver = Driver(compiled)
    envelope = driver.run(chat_reply(verdict))
    order = [compiled.spec_ids_by_node_id[d.node_id] for d in driver.dispatched]
    assert order == ["draft", "review", ran]
    assert envelope["skipped_operations"] == [ids[skipped]]
    assert envelope["operation_statuses"][ids[ran]] == "completed"
    assert envelope["final_context"]["topic"] == "tides"


def test_the_example_gates_on_flow_context_too():
    """with allow_revision false, a REVISE verdict opens neither branch"""
    compiled = compile_workflow(EXAMPLE, inputs={"topic": "tides", "allow_revision": False})
    ids = compiled.node_ids_by_spec_id
    envelope = Driver(compiled).run(chat_reply("REVISE"))
    assert envelope["skipped_operations"] == [ids["publish"], ids["revise"]]
