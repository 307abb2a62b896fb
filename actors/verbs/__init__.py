"""opgraph.actors.verbs: the branch verbs of ADR-0023 D1, as registered operations.

Owns the public verb surface and ``VERB_OPERATIONS``, the table the Session registers.
Each verb is ``async def verb(branch, instruction="", context=None, model=None, ...)``
and appends its own turns to the branch, so all register with ``record_turn=False``.
Also the worker-side safety pieces tools and engines share: ``ToolPermissions`` (enforced
wherever tools run), path confinement, and gates (commands run in their own process group).
"""

from __future__ import annotations

from opgraph.kernel import Graph

from ..protocol import RegisteredOperation
from .chat import chat, chat_and_record, communicate, interpret
from .confinement import check_inside, delete_confined, list_confined, read_confined, write_confined
from .conversation import MODEL_OPTIONS, UsageTally
from .conversation import name_predecessor_results as _name_predecessor_results
from .errors import (
    GateError,
    ParseError,
    PathEscapeError,
    SandboxError,
    SelectionError,
    ToolDefinitionError,
    ToolPermissionError,
    VerbError,
    VerbParameterError,
)
from .gates import GateResult, gate_environment, is_secret_name, run_gate
from .operate import operate
from .parse import parse, select
from .permissions import ToolPermissions
from .react import ReAct, ReActStream, act, react_stream_rounds
from .structured import json_candidates
from .tools import Tool, tool

__all__ = [
    "MODEL_OPTIONS",
    "VERB_OPERATIONS",
    "GateError",
    "GateResult",
    "ParseError",
    "PathEscapeError",
    "ReAct",
    "ReActStream",
    "SandboxError",
    "SelectionError",
    "Tool",
    "ToolDefinitionError",
    "ToolPermissionError",
    "ToolPermissions",
    "UsageTally",
    "VerbError",
    "VerbParameterError",
    "act",
    "chat",
    "chat_and_record",
    "check_inside",
    "communicate",
    "delete_confined",
    "gate_environment",
    "interpret",
    "is_secret_name",
    "json_candidates",
    "list_confined",
    "name_predecessor_results",
    "operate",
    "parse",
    "react_stream_rounds",
    "read_confined",
    "run_gate",
    "select",
    "tool",
    "write_confined",
]

VERB_OPERATIONS: dict[str, RegisteredOperation] = {
    "chat": RegisteredOperation(chat, record_turn=False),
    "chat_and_record": RegisteredOperation(chat_and_record, record_turn=False),
    "operate": RegisteredOperation(operate, record_turn=False),
    "communicate": RegisteredOperation(communicate, record_turn=False),
    "parse": RegisteredOperation(parse, record_turn=False),
    "ReAct": RegisteredOperation(ReAct, record_turn=False),
    "select": RegisteredOperation(select, record_turn=False),
    "interpret": RegisteredOperation(interpret, record_turn=False),
    "act": RegisteredOperation(act, record_turn=False),
    # The generator itself cannot be awaited; the graph gets its rounds as one list.
    "ReActStream": RegisteredOperation(react_stream_rounds, record_turn=False),
}


def name_predecessor_results(graph: Graph, label: str = "reference_id") -> Graph:
    """Show each verb node's predecessor results to the model by their names (``metadata[label]``,
    the builder's ``node_id=``) instead of node ids; see ``conversation.name_predecessor_results``."""
    return _name_predecessor_results(graph, VERB_OPERATIONS, label)
