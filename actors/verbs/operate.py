"""The ``operate`` verb: a turn with structured output, tools and typed emissions.

Owns operate's contract: the tool loop and parse retries (via ``structured.converse``),
and how SpawnRequest/EscalationRequest objects in the result leave the operation — in
the response always, and also live through ``branch.emit`` when ``emit_live=True``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from opgraph.kernel import EscalationRequest, SpawnRequest, extract_requests

from .conversation import BoundModel, model_history, system_messages, user_turn, where
from .errors import VerbParameterError
from .structured import converse, require_model_class, schema_guidance
from .tools import as_tools, permissions_of

__all__ = ["operate"]


async def operate(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                  response_format: type[BaseModel] | None = None, tools: Any = None,
                  max_tool_rounds: int = 8, parse_retries: int = 2, emit_live: bool = False,
                  system: str | None = None, permissions: Any = None, **options: Any) -> Any:
    """Run one task turn: optional tools, optional structured output, typed emissions.

    - ``tools``: Tools or plain callables the model may call. Calls are run (concurrently
      within a turn) and their results, or ``{"error": ...}`` observations, are sent back
      until the model answers without tool calls, for at most ``max_tool_rounds`` rounds.
    - ``permissions`` (ToolPermissions, a list of tool names, or a mapping): the tools the
      caller may run; only those are offered, and a call to any other is refused with a
      typed ``ToolPermissionError`` observation, the tool never invoked.
    - ``response_format``: a pydantic model class. The model is asked for JSON matching
      its schema; a reply that does not validate is returned to the model with the
      error up to ``parse_retries`` times, then ``ParseError`` is raised.
    - Emissions: SpawnRequest/EscalationRequest objects inside the parsed result (say a
      ``spawn: list[SpawnRequest]`` field) stay in the response, where the worker finds
      them; ``emit_live=True`` also sends them to the executor at once (it de-duplicates).
      Requests returned by a tool are always sent live, since they are not in the response.

    The branch records the instruction, each tool round, and the final reply. Returns
    the pydantic instance, or the reply text without ``response_format``.
    """
    if max_tool_rounds < 0 or parse_retries < 0:
        raise VerbParameterError("operate needs max_tool_rounds >= 0 and parse_retries >= 0", **where(branch))
    model_class = None if response_format is None else require_model_class(response_format, "operate", branch)
    tool_set = as_tools(tools)
    allowed = permissions_of(permissions, branch)
    bound = BoundModel(branch, model, options, "operate")
    history = model_history(await branch.messages())
    guidance = schema_guidance(model_class) if model_class is not None else None
    seen, recorded = user_turn(instruction, context, guidance=guidance, names=bound.result_names)
    conversation = system_messages(system) + history + ([seen] if seen else [])
    if not history and seen is None:
        raise VerbParameterError("operate has nothing to do: give an instruction or context", **where(branch))
    exchange = await converse(bound, conversation, recorded=[recorded] if recorded else [], verb="operate",
                              response_format=model_class, tools=tool_set, max_tool_rounds=max_tool_rounds,
                              parse_retries=parse_retries, permissions=allowed)
    await branch.append(*exchange.recorded)
    if model_class is None:
        return exchange.text
    if emit_live:
        # The very objects in the response: the live and the returned sighting share a
        # key, which is how the executor recognises the second one as a duplicate.
        for request in extract_requests(exchange.parsed, (SpawnRequest, EscalationRequest)):
            branch.emit(request)
    return exchange.parsed
