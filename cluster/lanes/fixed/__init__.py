"""The fixed workflow lane (ADR-0068 D1, ADR-0073): authored definitions, no planner, no growth.

Owns what only this lane has: the version-1 definition model and its rules, the compiler
to a kernel Graph, source pinning (a registry name at a version, or a file's bytes), the
lane's capability matrix and provenance rules, and its adapter. ``LANE`` is the entry the
lane registry loads; surfaces reach the lane only through the registry.
"""

from pathlib import Path

from ..registry import LaneEntry
from .adapter import FixedWorkflowLane, present, run_workflow
from .compiler import (
    CHAT_OPERATION,
    ENGINE_KINDS,
    ENGINE_OPTION_NAMES,
    ENGINE_REGISTRY,
    EXECUTABLE_NODE_KINDS,
    FIXED_FLOW_OPTIONS,
    CompiledWorkflow,
    EngineDefinition,
    compile_workflow,
    register_engine,
    resolve_node_cwd,
    unregister_engine,
)
from .contract import (
    FIXED_SOURCE_KINDS,
    FIXED_WORKFLOW,
    FIXED_WORKFLOW_CAPABILITIES,
    check_fixed_provenance,
    fixed_workflow_provenance,
)
from .sources import WorkflowSource, compile_source, file_source, is_file_target, registry_source, resolve_source
from .spec import (
    MAX_EDGES,
    MAX_NODES,
    REMOVED_NODE_KINDS,
    SPEC_VERSION,
    STORED_NODE_KINDS,
    WorkflowCompileError,
    WorkflowDefinition,
    WorkflowDefinitionError,
    WorkflowEdge,
    WorkflowNode,
    WorkflowValidationError,
    content_hash,
    load_definition,
    validate_definition,
)

EXAMPLES: dict[str, Path] = {"support-triage": Path(__file__).parent / "examples" / "support-triage.json"}

LANE = LaneEntry(kind=FIXED_WORKFLOW, factory=FixedWorkflowLane, capabilities=FIXED_WORKFLOW_CAPABILITIES,
                 definition_rules=validate_definition, examples=EXAMPLES)

__all__ = [
    "CHAT_OPERATION",
    "ENGINE_KINDS",
    "ENGINE_OPTION_NAMES",
    "ENGINE_REGISTRY",
    "EXAMPLES",
    "EXECUTABLE_NODE_KINDS",
    "FIXED_FLOW_OPTIONS",
    "FIXED_SOURCE_KINDS",
    "FIXED_WORKFLOW",
    "FIXED_WORKFLOW_CAPABILITIES",
    "LANE",
    "MAX_EDGES",
    "MAX_NODES",
    "REMOVED_NODE_KINDS",
    "SPEC_VERSION",
    "STORED_NODE_KINDS",
    "CompiledWorkflow",
    "EngineDefinition",
    "FixedWorkflowLane",
    "WorkflowCompileError",
    "WorkflowDefinition",
    "WorkflowDefinitionError",
    "WorkflowEdge",
    "WorkflowNode",
    "WorkflowSource",
    "WorkflowValidationError",
    "check_fixed_provenance",
    "compile_source",
    "compile_workflow",
    "content_hash",
    "file_source",
    "fixed_workflow_provenance",
    "is_file_target",
    "load_definition",
    "present",
    "register_engine",
    "registry_source",
    "resolve_node_cwd",
    "resolve_source",
    "run_workflow",
    "unregister_engine",
    "validate_definition",
]
