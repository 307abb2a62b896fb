"""Compile a validated fixed-workflow definition to a kernel Graph (ADR-0073 D2-D4).

Owns the node and edge compile rules, the engine registry the compiler resolves through,
and coding-``cwd`` containment under the run's ``base_dir``. It must not run the graph,
install a spawn type or node builder, or fall back to a planner: a runner does the running.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from opgraph.actors.models import ModelIdentityError, parse_model_id
from opgraph.kernel import ExpressionCondition, Graph, Operation, UnsafeExpressionError, create_operation

from ..capabilities import LaneCapabilities
from .contract import FIXED_WORKFLOW, FIXED_WORKFLOW_CAPABILITIES
from .spec import (
    WorkflowCompileError,
    WorkflowDefinition,
    WorkflowNode,
    load_definition,
    problem,
)

__all__ = [
    "CHAT_MODEL_OPTIONS",
    "CHAT_OPERATION",
    "ENGINE_KINDS",
    "ENGINE_OPTION_NAMES",
    "ENGINE_REGISTRY",
    "EXECUTABLE_NODE_KINDS",
    "FIXED_FLOW_OPTIONS",
    "CompiledWorkflow",
    "EngineDefinition",
    "compile_workflow",
    "register_engine",
    "resolve_node_cwd",
    "unregister_engine",
]

CHAT_OPERATION = "chat_and_record"
# A chat node's config keys passed to its model call: seconds per attempt, the reply's cap, the
# sequences it stops at, and the JSON Schema its reply must fit (constrained decoding where served).
CHAT_MODEL_OPTIONS: tuple[str, ...] = ("timeout", "max_tokens", "stop", "schema")
EXECUTABLE_NODE_KINDS: frozenset[str] = frozenset({"input", "chat", "engine"})
ENGINE_KINDS: tuple[str, ...] = ("research", "review", "coding", "hypothesis", "planning")
ENGINE_OPTION_NAMES: frozenset[str] = frozenset({"test_cmd", "export_dir"})
ENGINE_BUDGET_RANGE = (1, 100)

# The structural fixed-topology guarantee (ADR-0068 D1/D2): no reactive flag, no spawn
# type, no node builder, so a SpawnRequest emitted by a node can never grow the graph.
FIXED_FLOW_OPTIONS: Mapping[str, Any] = MappingProxyType(
    {"reactive": False, "spawn_type": None, "node_builder": None}
)

# Engine kind -> the registered operation that runs it. Empty until engines exist; a
# runner (or a test) registers them, or passes its own mapping to compile_workflow.
ENGINE_REGISTRY: dict[str, str] = {}

# A conservative option-value grammar: shell-ish words without metacharacters, never
# starting with '-' (so a value cannot smuggle in a flag).
_OPTION_VALUE = re.compile(r"[A-Za-z0-9_.,:/=+@%][A-Za-z0-9_.,:/=+@%-]*( [A-Za-z0-9_.,:/=+@%-]+)*")


def register_engine(kind: str, operation_name: str) -> None:
    """Map an engine kind to the name of the registered operation that runs it."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"engine kind must be a non-empty string, got {kind!r}")
    if not isinstance(operation_name, str) or not operation_name:
        raise ValueError(f"operation name must be a non-empty string, got {operation_name!r}")
    ENGINE_REGISTRY[kind] = operation_name


def unregister_engine(kind: str) -> None:
    ENGINE_REGISTRY.pop(kind, None)


@dataclass(frozen=True, slots=True)
class EngineDefinition:
    """A stored engine definition (ADR-0073 D4), until an engine-definition store exists.

    A node's ``config.engine_def_id`` resolves to one of these by id, then by name;
    node ``options`` overlay these, and non-null node budgets override these.
    """

    id: str
    kind: str
    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    max_depth: int | None = None
    max_agents: int | None = None


@dataclass(frozen=True, slots=True)
class CompiledWorkflow:
    """What a runner needs: the graph, the flow context, id maps, lane and hash.

    ``graph`` is fresh and single-use (a run writes node status back into it): compile
    again for another run. Run it with ``session.flow(graph, **flow_options())``.
    """

    graph: Graph
    context: Mapping[str, Any]
    node_ids_by_spec_id: Mapping[str, str]
    edge_ids_by_spec_id: Mapping[str, str]
    omitted_edge_ids: tuple[str, ...]
    content_hash: str
    declared_inputs: tuple[str, ...] = ()
    declared_outputs: tuple[str, ...] = ()
    lane: str = FIXED_WORKFLOW
    capabilities: LaneCapabilities = FIXED_WORKFLOW_CAPABILITIES

    @property
    def spec_ids_by_node_id(self) -> dict[str, str]:
        return {node_id: spec_id for spec_id, node_id in self.node_ids_by_spec_id.items()}

    def flow_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Session.flow``/``FlowState``: the context, never reactive."""
        return {"context": dict(self.context), **FIXED_FLOW_OPTIONS}


def compile_workflow(
    definition: Mapping[str, Any] | WorkflowDefinition | None,
    *,
    inputs: Mapping[str, Any] | None = None,
    model_override: str | None = None,
    base_dir: str | Path | None = None,
    engine_definitions: Mapping[str, EngineDefinition] | None = None,
    engine_registry: Mapping[str, str] | None = None,
    name: str = "workflow",
) -> CompiledWorkflow:
    """Compile ``definition`` for one fixed run, or raise with every problem found.

    A mapping is validated first (``WorkflowValidationError``); then each node and edge
    is compiled and every problem collected into one ``WorkflowCompileError``.
    ``inputs`` become the shared flow context. ``model_override`` (``provider/model``)
    replaces every chat and engine model, authored or not. ``base_dir`` is the run's
    containment root for coding ``cwd``. ``engine_registry`` defaults to
    ``ENGINE_REGISTRY``; an ``engine_def_id`` that is no stored definition but is a
    registered kind compiles as that kind with no stored options.
    """
    spec = definition if isinstance(definition, WorkflowDefinition) else load_definition(definition)
    if inputs is not None and not isinstance(inputs, Mapping):
        raise WorkflowCompileError(f"run inputs must be a mapping, got {type(inputs).__name__}")
    if model_override is not None:
        try:
            parse_model_id(model_override)
        except ModelIdentityError as exc:
            raise WorkflowCompileError(f"model override: {exc.message}") from exc
    compiler = _Compiler(
        spec,
        model_override=model_override,
        base_dir=None if base_dir is None else str(base_dir),
        engine_definitions=engine_definitions or {},
        engine_registry=ENGINE_REGISTRY if engine_registry is None else engine_registry,
        name=name,
    )
    graph = compiler.compile()
    if compiler.errors:
        raise WorkflowCompileError(compiler.errors)
    return CompiledWorkflow(
        graph=graph,
        context=MappingProxyType(dict(inputs or {})),
        node_ids_by_spec_id=MappingProxyType(compiler.node_ids),
        edge_ids_by_spec_id=MappingProxyType(compiler.edge_ids),
        omitted_edge_ids=tuple(compiler.omitted_edges),
        content_hash=spec.content_hash,
        declared_inputs=spec.inputs,
        declared_outputs=spec.outputs,
    )


class _Compiler:
    """One compilation: collects problems instead of stopping at the first."""

    def __init__(
        self,
        spec: WorkflowDefinition,
        *,
        model_override: str | None,
        base_dir: str | None,
        engine_definitions: Mapping[str, EngineDefinition],
        engine_registry: Mapping[str, str],
        name: str,
    ) -> None:
        self.spec = spec
        self.model_override = model_override
        self.base_dir = base_dir
        self.engine_definitions = engine_definitions
        self.engine_registry = engine_registry
        self.graph = Graph(name)
        self.errors: list[dict[str, Any]] = []
        self.node_ids: dict[str, str] = {}
        self.edge_ids: dict[str, str] = {}
        self.omitted_edges: list[str] = []

    def fail(self, error: str, *, node_id: str | None = None, edge_id: str | None = None) -> None:
        self.errors.append(problem(error, node_id=node_id, edge_id=edge_id))

    def compile(self) -> Graph:
        for node in self.spec.nodes:
            operation = self._node(node)
            if operation is not None:
                operation.metadata.update(
                    reference_id=node.id, workflow_node_id=node.id, workflow_node_kind=node.kind
                )
                self.graph.add_node(operation)
                self.node_ids[node.id] = operation.id
        kinds = {node.id: node.kind for node in self.spec.nodes}
        for edge in self.spec.edges:
            self._edge(edge, kinds)
        self._name_results()
        if not self.graph.is_acyclic():
            self.fail(
                "the workflow graph has a cycle through "
                f"{', '.join(self._cycle_members())}; iteration must live inside an operation, "
                "not in authored edges"
            )
        return self.graph

    def _name_results(self) -> None:
        """A chat node shows the model its predecessors' results by their authored ids
        (``result_names``, read by the verbs), never by the graph's uuids."""
        spec_ids = {node_id: spec_id for spec_id, node_id in self.node_ids.items()}
        for node_id in spec_ids:
            operation = self.graph.nodes[node_id]
            if operation.operation != CHAT_OPERATION:
                continue
            names = {predecessor: spec_ids[predecessor] for predecessor in self.graph.predecessors(node_id)
                     if predecessor in spec_ids}
            if names:
                operation.parameters["result_names"] = names

    # -- nodes -------------------------------------------------------------------------
    def _node(self, node: WorkflowNode) -> Operation | None:
        if node.kind == "input":
            return None  # run inputs reach every node through the shared flow context
        if node.kind == "chat":
            return self._chat(node)
        if node.kind == "engine":
            return self._engine(node)
        # parse and fanout are stored but not executable; never emulated or dropped silently.
        self.fail(
            f"{node.kind!r} nodes cannot run in a fixed workflow; executable kinds are "
            f"{', '.join(sorted(EXECUTABLE_NODE_KINDS))}. Remove the node or replace it with a chat node",
            node_id=node.id,
        )
        return None

    def _model(self, node: WorkflowNode) -> str | None:
        return self.model_override or node.config.get("model")

    def _chat(self, node: WorkflowNode) -> Operation | None:
        if node.config.get("cwd") is not None:
            self._check_cwd(node, engine_kind=None)
            return None
        parameters: dict[str, Any] = {"instruction": node.config["prompt"]}
        model = self._model(node)
        if model is not None:
            parameters["model"] = model
        for option in CHAT_MODEL_OPTIONS:  # per node; else the provider's (e.g. OPENAI_TIMEOUT)
            if node.config.get(option) is not None:
                parameters[option] = node.config[option]
        return create_operation(CHAT_OPERATION, parameters)

    def _engine(self, node: WorkflowNode) -> Operation | None:
        config = node.config
        before = len(self.errors)
        engine_def_id = config.get("engine_def_id")
        if not isinstance(engine_def_id, str) or not engine_def_id:
            self.fail("an engine node needs a string config.engine_def_id", node_id=node.id)
            return None
        definition = self._resolve_engine(engine_def_id)
        if definition is None:
            self.fail(
                f"unknown engine definition {engine_def_id!r}; registered engine kinds: "
                f"{', '.join(sorted(self.engine_registry)) or 'none'}",
                node_id=node.id,
            )
            return None
        operation_name = self.engine_registry.get(definition.kind)
        if operation_name is None:
            self.fail(
                f"engine kind {definition.kind!r} has no registered operation; "
                "register_engine(kind, operation_name) before compiling",
                node_id=node.id,
            )
            return None
        options = self._engine_options(node, definition)
        budgets = {key: self._budget(node, definition, key) for key in ("max_depth", "max_agents")}
        if config.get("model") is not None:
            try:
                parse_model_id(config["model"])
            except ModelIdentityError as exc:
                self.fail(f"config.model: {exc.message}", node_id=node.id)
        model = self._model(node)
        workspace = None
        if config.get("cwd") is not None:
            workspace = self._check_cwd(node, engine_kind=definition.kind)
        if len(self.errors) > before:
            return None
        parameters: dict[str, Any] = {
            "engine_def_id": engine_def_id,
            "engine_kind": definition.kind,
            "engine_model": model,
            "engine_max_depth": budgets["max_depth"],
            "engine_max_agents": budgets["max_agents"],
            "engine_options": options,
        }
        if workspace is not None:
            parameters["engine_workspace"] = workspace
        return create_operation(operation_name, parameters)

    def _resolve_engine(self, engine_def_id: str) -> EngineDefinition | None:
        found = self.engine_definitions.get(engine_def_id)
        if found is not None:
            return found
        for candidate in self.engine_definitions.values():
            if candidate.name == engine_def_id:
                return candidate
        if engine_def_id in self.engine_registry:
            return EngineDefinition(id=engine_def_id, kind=engine_def_id)
        return None

    def _engine_options(self, node: WorkflowNode, definition: EngineDefinition) -> dict[str, Any]:
        overlay = node.config.get("options") or {}
        if not isinstance(overlay, Mapping):
            self.fail("an engine node's config.options must be an object", node_id=node.id)
            overlay = {}
        options = {**definition.options, **overlay}
        for key, value in options.items():
            if key not in ENGINE_OPTION_NAMES:
                self.fail(
                    f"unknown engine option {key!r}; allowed: {', '.join(sorted(ENGINE_OPTION_NAMES))}",
                    node_id=node.id,
                )
            elif not isinstance(value, str) or not _OPTION_VALUE.fullmatch(value):
                self.fail(
                    f"engine option {key!r} must be plain words (letters, digits, _.,:/=+@%-), "
                    f"not starting with '-'; got {value!r}",
                    node_id=node.id,
                )
        if definition.kind == "coding" and not str(options.get("test_cmd") or "").strip():
            self.fail("a coding engine needs a non-blank options.test_cmd", node_id=node.id)
        return options

    def _budget(self, node: WorkflowNode, definition: EngineDefinition, key: str) -> int | None:
        value = node.config.get(key)
        if value is None:
            value = getattr(definition, key)
        if value is None:
            return None
        low, high = ENGINE_BUDGET_RANGE
        if type(value) is not int or not low <= value <= high:
            self.fail(f"{key} must be an integer from {low} to {high}, got {value!r}", node_id=node.id)
            return None
        return value

    def _check_cwd(self, node: WorkflowNode, *, engine_kind: str | None) -> str | None:
        try:
            resolved = resolve_node_cwd(node.id, node.config.get("cwd"), self.base_dir)
        except WorkflowCompileError as exc:
            self.errors.extend(exc.errors)
            return None
        # Last in D4's order: only the coding engine's run() accepts a workspace.
        if engine_kind != "coding":
            what = f"a {engine_kind!r} engine" if engine_kind else f"a {node.kind!r} node"
            self.fail(f"config.cwd is only allowed on a coding engine, not on {what}", node_id=node.id)
            return None
        return resolved

    # -- edges -------------------------------------------------------------------------
    def _edge(self, edge: Any, kinds: Mapping[str, str]) -> None:
        source_kind, target_kind = kinds[edge.source], kinds[edge.target]
        if target_kind not in ("chat", "engine"):
            self.fail(
                f"edge targets the {target_kind!r} node {edge.target!r}, which runs no operation; "
                "point it at a chat or engine node",
                edge_id=edge.id,
            )
            return
        if source_kind == "input":
            if edge.condition is not None:
                # Dropping it would run the target unconditionally, ignoring the authored gate.
                self.fail(
                    "a conditional edge from an input node cannot be honoured: input is flow "
                    "context, not an operation with a result. Remove the condition, or gate on "
                    "context in an edge from an operation",
                    edge_id=edge.id,
                )
            else:
                self.omitted_edges.append(edge.id)
            return
        head, tail = self.node_ids.get(edge.source), self.node_ids.get(edge.target)
        condition = None
        if edge.condition is not None:
            try:
                condition = ExpressionCondition(edge.condition, edge_id=edge.id)
            except UnsafeExpressionError as exc:
                self.fail(exc.message, edge_id=edge.id)
                return
        if head is None or tail is None:
            return  # an endpoint failed to compile and already has its node-addressed error
        created = self.graph.add_edge(head, tail, label=[edge.label] if edge.label else [], condition=condition)
        self.edge_ids[edge.id] = created.id

    def _cycle_members(self) -> list[str]:
        """Spec ids left after peeling off every node with no remaining predecessor."""
        graph = self.graph
        indegree = {node_id: len(graph.predecessors(node_id)) for node_id in graph.nodes}
        ready = [node_id for node_id, degree in indegree.items() if degree == 0]
        while ready:
            for successor in graph.successors(ready.pop()):
                indegree[successor] -= 1
                if indegree[successor] == 0:
                    ready.append(successor)
        spec_ids = {node_id: spec_id for spec_id, node_id in self.node_ids.items()}
        return [spec_ids[node_id] for node_id, degree in indegree.items() if degree > 0]


# -- coding cwd containment --------------------------------------------------------------
def resolve_node_cwd(node_id: str, raw_cwd: Any, base_dir: str | Path | None) -> str:
    """Resolve a node's ``cwd`` under the run's ``base_dir``, in ADR-0073 D4's order.

    1. a non-empty string; 2. no raw ``..`` segment, even one that would resolve back
    inside; 3. a run-level ``base_dir`` is required; 4. relative joins the base,
    absolute must land inside it; 5. both sides resolve symlinks before containment;
    6. the result exists and is a directory. (7, coding kind only, is the caller's.)

    A refusal names the ``cwd`` as written and nothing the disk said: a path outside the
    base, one that does not exist, one that is a file and one that cannot be resolved (a
    symlink loop) get the same message, which shows neither the base nor where a link led.
    The author of a definition may be a remote client (`opgraph serve`), and an answer that
    differed by case would tell them what exists on the server's disk.
    """

    def reject(error: str) -> WorkflowCompileError:
        return WorkflowCompileError(error, node_id=node_id)

    if not isinstance(raw_cwd, str) or not raw_cwd.strip():
        raise reject(f"config.cwd must be a non-empty string, got {raw_cwd!r}")
    if ".." in re.split(r"[\\/]", raw_cwd):
        raise reject(f"config.cwd {raw_cwd!r} contains '..'; give a path inside the run's base_dir")
    if base_dir is None or not str(base_dir).strip():
        raise reject(
            "config.cwd needs a run-level base_dir to contain it (`opgraph flow run --base-dir`, or the "
            "server's `opgraph serve --workflow-root`); a definition cannot choose its own root"
        )
    not_inside = reject(f"config.cwd {raw_cwd!r} is not an existing directory inside the run's base_dir")
    try:
        base = Path(base_dir).resolve()
        candidate = Path(raw_cwd)
        resolved = (candidate if candidate.is_absolute() else base / candidate).resolve()
    except (OSError, ValueError, RuntimeError):  # null bytes, symlink loops
        raise not_inside from None
    if not resolved.is_relative_to(base) or not resolved.is_dir():
        raise not_inside
    return str(resolved)
