"""The extraction verbs: ``parse`` (text into a pydantic model) and ``select`` (pick choices).

Owns turning free text into a validated value: direct JSON extraction first, the model
only as a fallback, and choice validation with case-insensitive normalisation. Both
raise a typed ``ParseError`` (``SelectionError``) with the node id when it cannot be done.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError, field_validator

from opgraph.kernel import to_mapping

from .conversation import BoundModel, check_options, compact_json, model_history, system_messages, user_turn, where
from .errors import SelectionError, VerbParameterError
from .structured import converse, require_model_class, schema_guidance, validate_reply

__all__ = ["choice_names", "parse", "select"]

_PARSE_SYSTEM = (
    "You convert text into JSON. Extract the information the schema asks for from the text the "
    "user gives; do not invent values the text does not support. Reply with only the JSON object."
)


def _source(text: Any, instruction: str, context: Any) -> Any:
    """What to parse: ``text``, else the instruction, else the only predecessor result."""
    if text is not None:
        return text
    if instruction:
        return instruction
    if isinstance(context, Mapping):
        results = [value for key, value in context.items() if str(key).endswith("_result")]
        if len(results) == 1:
            return results[0]
    return None


async def parse(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                response_format: type[BaseModel] | None = None, text: Any = None,
                parse_retries: int = 2, **options: Any) -> BaseModel:
    """Turn text into an instance of the pydantic model ``response_format``.

    The text is ``text``, else the instruction, else the single predecessor result in
    ``context``. It is first parsed without a model: the whole text, fenced ```json
    blocks, then the first balanced ``{...}`` object (a mapping or model is validated
    directly). Only if that fails is the model asked to extract the JSON, with up to
    ``parse_retries`` repair attempts. Raises ``ParseError`` (with the node id) when it
    cannot be done. The branch is not changed: parsing is not part of the conversation.
    """
    model_class = require_model_class(response_format, "parse", branch)
    check_options(branch, options, "parse")
    source = _source(text, instruction, context)
    if source is None:
        raise VerbParameterError("parse needs text=..., an instruction, or exactly one predecessor result",
                                 **where(branch))
    if isinstance(source, model_class):
        return source
    if isinstance(source, (Mapping, list, BaseModel)):
        try:
            return model_class.model_validate(to_mapping(source))
        except ValidationError:
            source = compact_json(source)  # not the right shape: let the model map it
    source_text = source if isinstance(source, str) else str(source)
    try:
        return validate_reply(source_text, model_class)
    except ValidationError:
        pass  # the text is not JSON of this shape; the model is the fallback, not a failure
    bound = BoundModel(branch, model, options, "parse")
    conversation = [
        {"role": "system", "content": _PARSE_SYSTEM},
        {"role": "user", "content": f"{schema_guidance(model_class)}\n\nText:\n{source_text}"},
    ]
    exchange = await converse(bound, conversation, recorded=[], verb="parse",
                              response_format=model_class, parse_retries=parse_retries)
    return exchange.parsed


def choice_names(choices: Any) -> list[str]:
    """Choices as strings: a list of strings, or an Enum's (string) values or names."""
    if isinstance(choices, type) and issubclass(choices, enum.Enum):
        return [member.value if isinstance(member.value, str) else member.name for member in choices]
    if isinstance(choices, (list, tuple)) and choices:
        return [choice.value if isinstance(choice, enum.Enum) and isinstance(choice.value, str)
                else choice.name if isinstance(choice, enum.Enum) else str(choice) for choice in choices]
    raise VerbParameterError(f"choices must be a non-empty list of strings or an Enum, got {choices!r}")


def _normalise(choice: str) -> str:
    return choice.strip().strip("\"'`*.").strip().casefold()


def _selection_model(names: list[str], max_choices: int) -> type[BaseModel]:
    lookup = {_normalise(name): name for name in names}

    class Selection(BaseModel):
        selected: list[str]
        reason: str = ""

        @field_validator("selected", mode="before")
        @classmethod
        def _known_choices(cls, value: Any) -> list[str]:
            items = [value] if isinstance(value, str) else list(value or [])
            chosen: list[str] = []
            for item in items:
                name = lookup.get(_normalise(str(item)))
                if name is None:
                    raise ValueError(f"{item!r} is not one of the choices: {', '.join(names)}")
                if name not in chosen:
                    chosen.append(name)
            if not chosen:
                raise ValueError("select at least one choice")
            if len(chosen) > max_choices:
                raise ValueError(f"select at most {max_choices} choice(s), got {len(chosen)}")
            return chosen

    return Selection


async def select(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                 choices: Any = None, max_choices: int = 1, system: str | None = None,
                 **options: Any) -> dict[str, Any]:
    """Choose one (or up to ``max_choices``) of ``choices`` for the instruction, with a reason.

    ``choices`` is a list of strings or an Enum class (whose string values, else names,
    are the choices). The model's answer is matched case-insensitively, ignoring quotes
    and a trailing period; an answer outside the list, or too many, is sent back once
    with the valid choices, then ``SelectionError`` is raised. The branch records the
    instruction and the final answer. Returns ``{"selected": [choice, ...], "reason",
    "usage"}`` with the choices spelt exactly as offered.
    """
    if max_choices < 1:
        raise VerbParameterError("select needs max_choices >= 1", **where(branch))
    try:
        names = choice_names(choices)
    except VerbParameterError as error:
        raise VerbParameterError(error.message, **where(branch)) from error
    selection = _selection_model(names, max_choices)
    bound = BoundModel(branch, model, options, "select")
    history = model_history(await branch.messages())
    quantity = "exactly one" if max_choices == 1 else f"one to {max_choices}"
    guidance = (f"Choose {quantity} of these choices: {compact_json(names)}. Reply with only a JSON object "
                '{"selected": [<choice spelt exactly as offered>, ...], "reason": "<why>"}.')
    seen, recorded = user_turn(instruction, context, guidance=guidance, names=bound.result_names)
    conversation = system_messages(system) + history + [seen]
    exchange = await converse(bound, conversation, recorded=[recorded] if recorded else [], verb="select",
                              response_format=selection, parse_retries=1, failure=SelectionError)
    await branch.append(*exchange.recorded)
    chosen = exchange.parsed
    return {"selected": list(chosen.selected), "reason": chosen.reason, "usage": bound.usage.as_dict()}
