"""The conversational verbs: chat, chat_and_record, communicate and interpret.

Owns the plain request/reply turns on a branch. Each reads the branch history, asks
the model once (communicate may re-ask to repair a structured reply), and states in
its docstring whether it records the turn. No tools and no emissions here.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from .conversation import BoundModel, model_history, system_messages, user_turn, where
from .errors import VerbParameterError
from .structured import Exchange, converse, json_schema_model, require_model_class, schema_guidance

__all__ = ["chat", "chat_and_record", "communicate", "interpret"]


async def _exchange(branch: Any, instruction: str, context: Any, model: str | None, options: dict[str, Any],
                    *, verb: str, system: str | None = None, guidance: str | None = None,
                    response_format: type[BaseModel] | None = None, parse_retries: int = 0,
                    use_history: bool = True) -> tuple[Exchange, BoundModel]:
    bound = BoundModel(branch, model, options, verb)
    history = model_history(await branch.messages()) if use_history else []
    seen, recorded = user_turn(instruction, context, guidance=guidance, names=bound.result_names)
    conversation = system_messages(system) + history + ([seen] if seen else [])
    if not history and seen is None:
        raise VerbParameterError(f"{verb} has nothing to say: give an instruction or context, "
                                 "or run it on a branch with history", **where(branch))
    exchange = await converse(bound, conversation, recorded=[recorded] if recorded else [], verb=verb,
                              response_format=response_format, parse_retries=parse_retries)
    return exchange, bound


async def chat(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
               system: str | None = None, **options: Any) -> str:
    """Send the instruction to the model in the branch's conversation and return the reply text.

    The model sees an optional ``system`` prompt, the branch history, and a user message
    holding the flow ``context`` (compact JSON, when present) followed by the
    instruction. The branch then records the instruction and the reply; the context is
    not recorded, since every node gets it afresh. ``model`` defaults to the run's
    default model; ``temperature``, ``max_tokens`` and ``timeout`` go to the provider.
    """
    exchange, _ = await _exchange(branch, instruction, context, model, options, verb="chat", system=system)
    await branch.append(*exchange.recorded)
    return exchange.text


async def chat_and_record(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                          system: str | None = None, schema: dict[str, Any] | None = None,
                          **options: Any) -> dict[str, Any]:
    """``chat``, returning a record for persisted workflow runs instead of bare text.

    Returns ``{"text", "model", "provider", "finish_reason", "usage"}``: the reply, the
    ``provider/model`` that answered, why it stopped (``length``: cut off at ``max_tokens``), and
    token usage (``calls``, ``prompt_tokens``, ``completion_tokens``, ``total_tokens``). The turn
    is appended to the branch exactly as ``chat`` does. With ``schema`` (a JSON Schema) the model
    is asked for JSON of that schema (``response_format``: servers that support it constrain their
    decoding to it), the reply is validated and sent back once if it does not fit, and the record
    has the parsed value as ``data``; a reply cut off at ``max_tokens`` is ``ProviderTruncated``.
    """
    model_class = None if schema is None else json_schema_model(json.dumps(schema, sort_keys=True))
    exchange, bound = await _exchange(branch, instruction, context, model, options,
                                      verb="chat_and_record", system=system, response_format=model_class,
                                      parse_retries=1 if model_class is not None else 0)
    await branch.append(*exchange.recorded)
    last = bound.last
    record = {
        "text": exchange.text,
        "model": bound.model_id,
        "provider": last.provider if last is not None else "",
        "finish_reason": last.finish_reason if last is not None else None,
        "usage": bound.usage.as_dict(),
    }
    if exchange.parsed is not None:
        record["data"] = exchange.parsed.model_dump(mode="json")
    return record


async def communicate(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                      response_format: type[BaseModel] | None = None, parse_retries: int = 2,
                      record: bool = True, system: str | None = None, **options: Any) -> Any:
    """Talk to the model and get text back, or a parsed model with ``response_format``.

    The light sibling of ``operate``: no tools and no emissions. With
    ``response_format=<pydantic model>`` the reply is parsed (JSON, fenced or embedded),
    and a reply that does not fit is sent back with the error up to ``parse_retries``
    times before ``ParseError``. ``record=True`` appends the instruction and the final
    reply like ``chat``; ``record=False`` asks a side question that sees the history but
    leaves the branch unchanged.
    """
    model_class = None if response_format is None else require_model_class(response_format, "communicate", branch)
    exchange, _ = await _exchange(
        branch, instruction, context, model, options, verb="communicate", system=system,
        guidance=schema_guidance(model_class) if model_class is not None else None,
        response_format=model_class, parse_retries=parse_retries,
    )
    if record:
        await branch.append(*exchange.recorded)
    return exchange.parsed if model_class is not None else exchange.text


_INTERPRET_SYSTEM = (
    "You rewrite a user's raw request into a clear, precise, self-contained task specification "
    "for another AI model. Keep the user's intent and every concrete detail; state the goal, the "
    "inputs, the constraints and the expected output. Do not answer the request. "
    "Reply with only the rewritten prompt."
)


async def interpret(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                    domain: str | None = None, style: str | None = None, **options: Any) -> str:
    """Rewrite the raw request in ``instruction`` into a clearer, more precise prompt; return it.

    The model sees the branch history (so "do that again" can be resolved) and the
    context, and is told not to answer the request. ``domain`` and ``style`` steer the
    rewrite ("legal", "concise"). The branch is not changed: the rewritten prompt is
    meant to feed another operation, typically as its instruction.
    """
    if not instruction:
        raise VerbParameterError("interpret needs the raw request as its instruction", **where(branch))
    hints = [f"Domain: {domain}." if domain else "", f"Style: {style}." if style else ""]
    guidance = " ".join(hint for hint in hints if hint) or None
    exchange, _ = await _exchange(branch, f"Raw request:\n{instruction}", context, model, options,
                                  verb="interpret", system=_INTERPRET_SYSTEM, guidance=guidance)
    return exchange.text.strip()
