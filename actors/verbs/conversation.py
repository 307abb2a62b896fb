"""What every verb shares: the bound model, usage accounting and message shapes.

Owns how a verb resolves its model (``model=`` or the run's default), calls the provider,
tallies token usage, renders the flow context, and shapes OpenAI-style messages. It
performs no I/O of its own beyond the provider call and never writes to a branch.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opgraph.kernel import Graph, to_mapping

from ..models import ChatRequest, ChatResponse, ProviderConfigError, ProviderError, ToolCall, Usage
from ..workers.usage import record_usage
from .errors import VerbParameterError

__all__ = [
    "GRAPH_PARAMETERS",
    "MODEL_OPTIONS",
    "RUNTIME_PARAMETERS",
    "BoundModel",
    "UsageTally",
    "assistant_message",
    "assistant_tool_call_message",
    "check_options",
    "compact_json",
    "model_history",
    "render_context",
    "system_messages",
    "user_turn",
    "where",
    "with_call_ids",
]

# The options every model-calling verb passes straight into the ChatRequest.
MODEL_OPTIONS = ("temperature", "max_tokens", "timeout", "stream", "stop")

# Parameters put on a node by whoever built the graph (``add_aggregation``, the workflow
# compiler, ``name_predecessor_results``), accepted by every verb and never sent to the
# model: ``result_names`` maps a predecessor's node id to the name its result is shown by.
GRAPH_PARAMETERS = ("aggregation_sources", "aggregation_count", "result_names")

# Parameters the runtime carries with a call and enforces on the worker, accepted by every
# verb and never sent to the model: ``permissions`` (ToolPermissions) bounds the tools a
# verb may run for its caller; verbs without tools have nothing to enforce.
RUNTIME_PARAMETERS = ("permissions",)

# The record ``chat_and_record`` returns: in a prompt, only its text is the step's answer.
_RECORD_KEYS = frozenset({"text", "model", "provider", "finish_reason", "usage", "data"})
# Kernel node ids are uuid4 strings; a context key "<uuid>_result" is a predecessor's result.
_NODE_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def where(branch: Any) -> dict[str, Any]:
    """The ids a verb error carries: the node running the verb and its branch."""
    return {"node_id": getattr(branch, "node_id", None), "branch_id": getattr(branch, "id", None)}


def compact_json(value: Any) -> str:
    """``value`` as compact JSON; models and unknown objects degrade to their mapping or str."""
    return json.dumps(to_mapping(value), separators=(",", ":"), ensure_ascii=False, default=str)


@dataclass(slots=True)
class UsageTally:
    """Token usage summed over every model call one verb made."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0

    def add(self, usage: Usage) -> None:
        self.calls += 1
        self.prompt_tokens += usage.prompt_tokens
        self.completion_tokens += usage.completion_tokens
        self.cache_read_tokens += usage.cache_read_tokens
        self.cache_creation_tokens += usage.cache_creation_tokens

    def as_dict(self) -> dict[str, int]:
        """Calls and tokens; ``prompt_tokens`` includes the cached ones the two cache fields break out."""
        return {
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cache_read_tokens": self.cache_read_tokens,
            "cache_creation_tokens": self.cache_creation_tokens,
        }


def check_options(branch: Any, options: Mapping[str, Any], verb: str) -> None:
    """Reject options a verb does not know, so a misspelt parameter never passes silently."""
    unknown = sorted(set(options) - set(MODEL_OPTIONS) - set(GRAPH_PARAMETERS) - set(RUNTIME_PARAMETERS))
    if unknown:
        raise VerbParameterError(
            f"{verb} got unknown parameter(s) {', '.join(unknown)}; model options are {', '.join(MODEL_OPTIONS)}",
            **where(branch),
        )


def with_call_ids(calls: Sequence[ToolCall], taken: set[str]) -> list[ToolCall]:
    """The calls with unique, non-empty ids (some local servers send none); ``taken`` grows."""
    shaped = []
    for call in calls:
        call_id = call.id
        if not call_id or call_id in taken:
            call_id = f"call_{len(taken) + 1}"
            while call_id in taken:
                call_id += "_"
        taken.add(call_id)
        shaped.append(ToolCall(call_id, call.name, call.arguments))
    return shaped


def system_messages(system: str | None) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}] if system else []


class BoundModel:
    """The model one verb call talks to, with its request options and usage tally.

    ``model`` wins over the run's ``branch.default_model``; options other than
    ``MODEL_OPTIONS`` are a typed error, so a misspelt parameter never passes silently.
    """

    def __init__(self, branch: Any, model: str | None, options: Mapping[str, Any], verb: str) -> None:
        check_options(branch, options, verb)
        model_id = model or getattr(branch, "default_model", None)
        if not model_id:
            raise ProviderConfigError(
                f"{verb} has no model: pass model='provider/model' on the node or set "
                "Session(default_model=...)",
                node_id=getattr(branch, "node_id", None),
            )
        self.branch = branch
        self.model_id: str = model_id
        self.result_names: Mapping[str, str] = dict(options.get("result_names") or {})
        self.provider = branch.provider_for(model_id)
        self.options = {key: value for key, value in options.items() if key in MODEL_OPTIONS}
        self.usage = UsageTally()
        self.last: ChatResponse | None = None

    async def complete(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                       response_format: dict[str, Any] | None = None) -> ChatResponse:
        request = ChatRequest(model=self.model_id, messages=list(messages), tools=tools or None,
                              response_format=response_format, **self.options)
        try:
            response = await self.provider.complete(request)
        except ProviderError as error:
            # Providers do not know which node called them; the verb does.
            if error.node_id is None:
                error.node_id = getattr(self.branch, "node_id", None)
            raise
        self.usage.add(response.usage)
        record_usage(self.model_id, response.usage.prompt_tokens, response.usage.completion_tokens)
        self.last = response
        return response


def render_context(context: Any, names: Mapping[str, str] | None = None) -> str | None:
    """The flow context as a compact preamble, or None when there is nothing to say.

    Predecessor results (the ``<node id>_result`` keys of ADR-0023, which stay as they are
    for code) are shown apart, each by the name ``names`` gives its node (the authored
    node id, or the builder's reference id), else as "step N"; a ``chat_and_record``
    record shows only its text, never its bookkeeping (model, provider, usage). The
    rest is shown as shared context. Both as JSON, so the model sees structure.
    """
    if context is None or (isinstance(context, (Mapping, Sequence, str)) and len(context) == 0):
        return None
    if not isinstance(context, Mapping):
        return "Context:\n" + compact_json(context)
    names = names or {}
    results: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    for key, value in context.items():
        node_id = key[:-len("_result")] if isinstance(key, str) and key.endswith("_result") else None
        if node_id is not None and (node_id in names or _NODE_ID.fullmatch(node_id)):
            results[names.get(node_id) or f"step {len(results) + 1}"] = _answer(value)
        else:
            shared[key] = value
    parts = []
    if results:
        parts.append("Results of earlier steps:\n" + compact_json(results))
    if shared:
        parts.append("Shared context:\n" + compact_json(shared))
    return "\n\n".join(parts)


def _answer(value: Any) -> Any:
    """What a step answered: a chat record's text, anything else as it is."""
    if isinstance(value, Mapping) and "text" in value and set(value) <= _RECORD_KEYS:
        return value["text"]
    return value


def name_predecessor_results(graph: Graph, operations: Collection[str], label: str = "reference_id") -> Graph:
    """Give every node of ``graph`` that runs one of ``operations`` (verbs: they take the
    parameter) the names its predecessors' results are shown by.

    Such a node whose predecessors carry ``metadata[label]`` (the builder's ``node_id=``,
    the compiler's authored id) gets ``result_names`` {predecessor id: that name} among
    its parameters, so the model reads "plan" where the context key is "<uuid>_result".
    Returns ``graph``.
    """
    for node_id, node in graph.nodes.items():
        if node.operation not in operations:
            continue
        names = {}
        for predecessor in graph.predecessors(node_id):
            name = graph.nodes[predecessor].metadata.get(label)
            if isinstance(name, str) and name:
                names[predecessor] = name
        if names:
            node.parameters["result_names"] = names
    return graph


def user_turn(instruction: str, context: Any, *, guidance: str | None = None,
              names: Mapping[str, str] | None = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The user message the model sees, and the one the branch records.

    The model sees the context preamble (predecessor results by ``names``), the
    instruction and any verb guidance in one message (one user turn suits every
    provider). The branch records the instruction alone: context is rebuilt for every
    node from the flow, so copying it into history would repeat predecessor results in
    every descendant's conversation.
    """
    parts = [part for part in (render_context(context, names), instruction or None, guidance) if part]
    seen = {"role": "user", "content": "\n\n".join(parts)} if parts else None
    recorded = {"role": "user", "content": instruction} if instruction else None
    return seen, recorded


_PLAIN_CONTENT = (str, type(None))


def model_history(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Branch messages as OpenAI-shaped dicts; non-text content becomes JSON text."""
    history: list[dict[str, Any]] = []
    for message in messages:
        if type(message) is dict and "role" in message and type(message.get("content")) in _PLAIN_CONTENT:
            history.append(dict(message))  # the common case, without the ABC checks below (once per message per turn)
        elif isinstance(message, Mapping) and "role" in message:
            shaped = dict(message)
            content = shaped.get("content")
            if content is not None and not isinstance(content, str):
                shaped["content"] = compact_json(content)
            history.append(shaped)
        elif isinstance(message, str):
            history.append({"role": "user", "content": message})
        else:
            history.append({"role": "user", "content": compact_json(message)})
    return history


def assistant_message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def assistant_tool_call_message(content: str | None, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The assistant turn that proposed ``calls``; tool results must follow it in history."""
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name,
                          "arguments": call.arguments if isinstance(call.arguments, str)
                          else compact_json(call.arguments)}}
            for call in calls
        ],
    }
