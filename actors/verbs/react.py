"""The acting verbs: ``act`` (run tool calls) and the ReAct reason/act loop.

Owns executing tool calls against a branch, the bounded ``ReActStream`` generator that
yields each round as it completes, ``ReAct`` (the whole loop as one dict) and the
graph's ReActStream operation, which consumes the rounds into one list (ADR-0023 D1).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..models import ToolCall, Usage
from .conversation import (
    BoundModel,
    assistant_message,
    assistant_tool_call_message,
    check_options,
    model_history,
    system_messages,
    user_turn,
    where,
    with_call_ids,
)
from .errors import VerbParameterError
from .tools import as_tools, emit_tool_requests, offered, permissions_of, run_tool_calls, tool_message

__all__ = ["ReAct", "ReActStream", "act", "react_stream_rounds"]

_REACT_GUIDANCE = ("Work step by step. Call the tools when they help; when you can answer, "
                   "reply with the answer and no tool calls.")
_LAST_ROUND = "This is the last round: answer now, without calling tools."


def _actions_as_calls(actions: Any, branch: Any) -> list[ToolCall]:
    if not isinstance(actions, (list, tuple)):
        raise VerbParameterError(f"act needs actions=[{{'function': name, 'arguments': {{...}}}}], got {actions!r}",
                                 **where(branch))
    calls = []
    for index, action in enumerate(actions, start=1):
        if not isinstance(action, Mapping) or not isinstance(action.get("function"), str):
            raise VerbParameterError(f"act action {index} needs a 'function' name, got {action!r}", **where(branch))
        arguments = action.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                pass  # kept as text: the tool's validation reports it as an observation
        calls.append(ToolCall(f"act_{index}", action["function"], arguments))
    return calls


async def act(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
              tools: Any = None, actions: Any = None, system: str | None = None, permissions: Any = None,
              **options: Any) -> list[dict[str, Any]]:
    """Execute tool calls and return what each produced.

    With ``actions=[{"function": name, "arguments": {...}}, ...]`` the calls run as given,
    without a model. Otherwise the model is shown the instruction and ``tools`` and the
    calls it proposes are run (none proposed: an empty list). Calls run concurrently.
    Returns ``[{"function", "arguments", "output"}]``, or ``"error"`` in place of
    ``"output"`` for an unknown tool, invalid arguments or a tool that raised; a failing
    call never fails the operation. The branch records the instruction, the calls and
    their results, as a model-made tool round would appear. ``permissions`` bounds the
    calls either way: one they exclude is an ``error`` entry typed ``ToolPermissionError``.
    """
    tool_set = as_tools(tools)
    allowed = permissions_of(permissions, branch)
    _, recorded = user_turn(instruction, None)
    turn = [recorded] if recorded else []
    if actions is not None:
        check_options(branch, options, "act")
        calls = _actions_as_calls(actions, branch)
        content = None
    else:
        bound = BoundModel(branch, model, options, "act")
        if not tool_set:
            raise VerbParameterError("act needs tools=[...] for the model to call, or actions=[...]",
                                     **where(branch))
        history = model_history(await branch.messages())
        seen, _ = user_turn(instruction, context, names=bound.result_names)
        conversation = system_messages(system) + history + ([seen] if seen else [])
        response = await bound.complete(conversation,
                                        tools=[item.schema for item in offered(tool_set, allowed).values()] or None)
        if not response.tool_calls:
            await branch.append(*turn, assistant_message(response.content or ""))
            return []
        calls = with_call_ids(response.tool_calls, set())
        content = response.content
    entries = await run_tool_calls(tool_set, calls, allowed)
    emit_tool_requests(branch, entries)
    turn.append(assistant_tool_call_message(content, calls))
    turn.extend(tool_message(call.id, entry) for call, entry in zip(calls, entries, strict=True))
    await branch.append(*turn)
    return entries


def _usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cache_read_tokens": usage.cache_read_tokens,
            "cache_creation_tokens": usage.cache_creation_tokens}


async def ReActStream(branch: Any, instruction: str = "", context: Any = None,  # ADR-0023's name
                      model: str | None = None, *, tools: Any = None, max_rounds: int = 4,
                      system: str | None = None, permissions: Any = None,
                      **options: Any) -> AsyncIterator[dict[str, Any]]:
    """Reason and act in rounds, yielding each round as soon as it completes.

    A round is one model call plus the tool calls it proposed, run and answered:
    ``{"round": n, "thought": text, "actions": [{"function", "arguments", "output"|"error"}],
    "final": bool, "usage": {...}}``. The loop ends with the first reply without tool
    calls (``final=True``, its thought is the answer) or after ``max_rounds`` rounds; the
    last round's request asks the model to answer without tools. Each round is appended
    to the branch as it completes. Tools that fail become observations, never errors;
    so does a call ``permissions`` exclude (typed ``ToolPermissionError``, never run).
    """
    if max_rounds < 1:
        raise VerbParameterError("ReAct needs max_rounds >= 1", **where(branch))
    tool_set = as_tools(tools)
    allowed = permissions_of(permissions, branch)
    schemas = [item.schema for item in offered(tool_set, allowed).values()] or None
    bound = BoundModel(branch, model, options, "ReAct")
    history = model_history(await branch.messages())
    seen, recorded = user_turn(instruction, context, guidance=_REACT_GUIDANCE if tool_set else None,
                               names=bound.result_names)
    conversation = system_messages(system) + history + ([seen] if seen else [])
    if not history and seen is None:
        raise VerbParameterError("ReAct has nothing to do: give an instruction or context", **where(branch))
    unrecorded = [recorded] if recorded else []
    call_ids: set[str] = set()
    for number in range(1, max_rounds + 1):
        last_note = [{"role": "user", "content": _LAST_ROUND}] if tool_set and number == max_rounds else []
        response = await bound.complete(conversation + last_note, tools=schemas)
        thought = response.content or ""
        if not (tool_set and response.tool_calls):
            reply = assistant_message(thought)
            conversation.append(reply)
            await branch.append(*unrecorded, reply)
            yield {"round": number, "thought": thought, "actions": [], "final": True,
                   "usage": _usage(response.usage)}
            return
        calls = with_call_ids(response.tool_calls, call_ids)
        entries = await run_tool_calls(tool_set, calls, allowed)
        emit_tool_requests(branch, entries)
        turn = [assistant_tool_call_message(response.content, calls)]
        turn += [tool_message(call.id, entry) for call, entry in zip(calls, entries, strict=True)]
        conversation.extend(turn)
        await branch.append(*unrecorded, *turn)
        unrecorded = []
        yield {"round": number, "thought": thought, "actions": entries, "final": False,
               "usage": _usage(response.usage)}


async def ReAct(branch: Any, instruction: str = "", context: Any = None,  # ADR-0023's name
                model: str | None = None, *, tools: Any = None, max_rounds: int = 4,
                system: str | None = None, permissions: Any = None, **options: Any) -> dict[str, Any]:
    """Run the bounded reason/act loop of ``ReActStream`` to the end and summarise it.

    Returns ``{"answer": text, "rounds": [...], "stopped": "answered" | "max_rounds",
    "usage": {...}}``: the final reply's text (the last thought when the rounds ran
    out), every round as ``ReActStream`` yields it, why the loop stopped, and token
    usage summed over the rounds.
    """
    rounds = [item async for item in ReActStream(branch, instruction, context, model, tools=tools,
                                                 max_rounds=max_rounds, system=system,
                                                 permissions=permissions, **options)]
    last = rounds[-1]
    usage = {"calls": len(rounds)}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens", "cache_read_tokens", "cache_creation_tokens"):
        usage[key] = sum(item["usage"][key] for item in rounds)
    return {"answer": last["thought"], "rounds": rounds,
            "stopped": "answered" if last["final"] else "max_rounds", "usage": usage}


async def react_stream_rounds(branch: Any, **parameters: Any) -> list[dict[str, Any]]:
    """The graph's ReActStream operation: every round, consumed into one list (ADR-0023 D1)."""
    return [item async for item in ReActStream(branch, **parameters)]
