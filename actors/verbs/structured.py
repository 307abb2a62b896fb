"""Structured replies: JSON extraction, schema guidance, and the model exchange loop.

Owns how a reply becomes a pydantic instance (direct JSON, fenced blocks, the first
balanced object) and the loop shared by operate, communicate and select: tool rounds,
then parse retries with the validation error as feedback. It never writes to a branch.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, RootModel, ValidationError, model_validator

from ..models import ProviderTruncated
from .conversation import (
    BoundModel,
    assistant_message,
    assistant_tool_call_message,
    compact_json,
    where,
    with_call_ids,
)
from .errors import ParseError, VerbParameterError
from .permissions import ToolPermissions
from .tools import Tool, emit_tool_requests, format_validation_error, offered, run_tool_calls, tool_message

__all__ = [
    "Exchange",
    "converse",
    "json_candidates",
    "require_model_class",
    "response_format_for",
    "schema_guidance",
    "validate_reply",
]

_FENCED = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
_SCHEMA_NAME = re.compile(r"[^A-Za-z0-9_-]")


def require_model_class(response_format: Any, verb: str, branch: Any) -> type[BaseModel]:
    if isinstance(response_format, type) and issubclass(response_format, BaseModel):
        return response_format
    raise VerbParameterError(
        f"{verb} needs response_format=<a pydantic BaseModel subclass>, got {response_format!r}",
        **where(branch),
    )


# A model class's JSON schema, as compact JSON: pydantic builds it anew on every call (about
# 1 ms for a small model), and every structured turn asked for it twice.
_schemas: weakref.WeakKeyDictionary[type[BaseModel], str] = weakref.WeakKeyDictionary()


def _schema_text(model_class: type[BaseModel]) -> str:
    text = _schemas.get(model_class)
    if text is None:
        text = _schemas[model_class] = compact_json(model_class.model_json_schema())
    return text


def response_format_for(model_class: type[BaseModel]) -> dict[str, Any]:
    """The OpenAI ``json_schema`` response_format for ``model_class`` (a fresh dict each call)."""
    name = _SCHEMA_NAME.sub("_", model_class.__name__)[:64] or "response"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": json.loads(_schema_text(model_class))}}


@functools.lru_cache(maxsize=32)
def json_schema_model(schema_text: str) -> type[BaseModel]:
    """A pydantic model whose JSON Schema is ``schema_text`` (a JSON Schema as JSON text) and whose
    validation is jsonschema's, so a schema given as data takes the path a pydantic class takes:
    ``response_format`` sent to the model, the reply validated, a misfit sent back. Made once per
    process and schema."""
    import jsonschema

    schema = json.loads(schema_text)
    validator = jsonschema.validators.validator_for(schema)(schema)

    class Answer(RootModel[Any]):
        @model_validator(mode="after")
        def _fits_the_schema(self) -> Answer:
            problems = sorted(validator.iter_errors(self.root), key=lambda error: list(error.path))
            if problems:
                raise ValueError("; ".join(f"{'/'.join(str(p) for p in error.path) or '(root)'}: {error.message}"
                                           for error in problems[:5]))
            return self

        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return schema

    return Answer


def schema_guidance(model_class: type[BaseModel]) -> str:
    """The schema repeated in the prompt, for providers that ignore ``response_format``."""
    return "Reply with only a JSON object that matches this JSON schema:\n" + _schema_text(model_class)


def _balanced_end(text: str, start: int) -> int | None:
    """The index after the ``}`` closing the object opened at ``start``, minding strings."""
    depth = 0
    in_string = False
    escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def json_candidates(text: str, max_objects: int = 8) -> list[str]:
    """Substrings of ``text`` that may be the intended JSON, most explicit first.

    The whole text, then fenced ```json blocks, then balanced ``{...}`` objects that
    parse as JSON (the first one found first).
    """
    candidates: list[str] = []

    def add(candidate: str) -> None:
        candidate = candidate.strip()
        if candidate and candidate not in candidates:
            candidates.append(candidate)

    add(text)
    for block in _FENCED.findall(text):
        add(block)
    start = text.find("{")
    found = 0
    while start != -1 and found < max_objects:
        end = _balanced_end(text, start)
        if end is not None:
            try:
                json.loads(text[start:end])
            except json.JSONDecodeError:
                end = None
        if end is None:
            start = text.find("{", start + 1)
            continue
        add(text[start:end])
        found += 1
        start = text.find("{", end)
    return candidates


def _is_syntax_error(error: ValidationError) -> bool:
    return any(detail.get("type") == "json_invalid" for detail in error.errors())


def validate_reply(text: str, model_class: type[BaseModel]) -> BaseModel:
    """``text`` as a ``model_class`` instance; raises the most telling ``ValidationError``.

    A candidate that is valid JSON but fails the schema explains more than "invalid
    JSON" on the surrounding prose, so its error is the one raised.
    """
    errors: list[ValidationError] = []
    for candidate in json_candidates(text or ""):
        try:
            return model_class.model_validate_json(candidate)
        except ValidationError as error:
            errors.append(error)
    if not errors:
        # Empty text: let pydantic word the error.
        return model_class.model_validate_json(text or "")
    telling = [error for error in errors if not _is_syntax_error(error)]
    raise (telling or errors)[0]


@dataclass(slots=True)
class Exchange:
    """One verb's conversation with the model: final text, parsed value, what to record."""

    text: str = ""
    parsed: BaseModel | None = None
    recorded: list[dict[str, Any]] = field(default_factory=list)
    tool_entries: list[dict[str, Any]] = field(default_factory=list)
    tool_rounds: int = 0
    parse_failures: int = 0


async def converse(bound: BoundModel, conversation: list[dict[str, Any]], *,
                   recorded: list[dict[str, Any]], verb: str,
                   response_format: type[BaseModel] | None = None,
                   tools: Mapping[str, Tool] | None = None, max_tool_rounds: int = 0,
                   parse_retries: int = 0, failure: type[ParseError] = ParseError,
                   permissions: ToolPermissions | None = None) -> Exchange:
    """Call the model until it gives a final reply that parses.

    Tool calls are run and answered for up to ``max_tool_rounds`` rounds; after that a
    note asks for an answer and further tool calls are ignored. Only the tools
    ``permissions`` allow are offered, and a call to any other is refused, typed, without
    running it (see ``run_tool_call``). A reply that does not
    parse into ``response_format`` is sent back with the validation error, at most
    ``parse_retries`` times, then ``failure`` is raised.

    ``recorded`` (the messages for the branch) gets the tool rounds and the final reply;
    rejected replies and feedback are repair chatter and stay out of history.
    """
    exchange = Exchange(recorded=recorded)
    tools = tools or {}
    schemas = [item.schema for item in offered(tools, permissions).values()] or None
    format_request = response_format_for(response_format) if response_format is not None else None
    call_ids: set[str] = set()
    while True:
        response = await bound.complete(conversation, tools=schemas, response_format=format_request)
        if tools and response.tool_calls and exchange.tool_rounds < max_tool_rounds:
            exchange.tool_rounds += 1
            calls = with_call_ids(response.tool_calls, call_ids)
            entries = await run_tool_calls(tools, calls, permissions)
            emit_tool_requests(bound.branch, entries)
            turn = [assistant_tool_call_message(response.content, calls)]
            turn += [tool_message(call.id, entry) for call, entry in zip(calls, entries, strict=True)]
            conversation.extend(turn)
            exchange.recorded.extend(turn)
            exchange.tool_entries.extend(entries)
            if exchange.tool_rounds == max_tool_rounds:
                conversation.append({"role": "user", "content": (
                    f"You have used all {max_tool_rounds} tool rounds. Answer now without calling tools.")})
            continue
        text = response.content or ""
        if response_format is not None and response.finish_reason == "length":
            # Cut off at max_tokens: the JSON is not whole, and repairing would be cut off again.
            raise ProviderTruncated(
                f"{verb}: the reply for {response_format.__name__} was cut off at max_tokens "
                f"(finish_reason 'length'; {response.usage.completion_tokens} tokens) and is not parsed; "
                f"raise max_tokens or ask for less. It began {text[:200]!r}",
                provider=response.provider or None, **where(bound.branch))
        if response_format is None:
            exchange.text = text
            exchange.recorded.append(assistant_message(text))
            return exchange
        try:
            exchange.parsed = validate_reply(text, response_format)
        except ValidationError as error:
            exchange.parse_failures += 1
            problem = format_validation_error(error)
            if exchange.parse_failures > parse_retries:
                raise failure(
                    f"{verb}: the reply could not be parsed into {response_format.__name__} after "
                    f"{exchange.parse_failures} attempt(s): {problem}; last reply began {text[:200]!r}",
                    **where(bound.branch),
                ) from error
            conversation.append(assistant_message(text))
            conversation.append({"role": "user", "content": (
                f"Your reply could not be parsed into {response_format.__name__}: {problem}. "
                "Reply again with only a JSON object that matches the schema.")})
            continue
        exchange.text = text
        exchange.recorded.append(assistant_message(text))
        return exchange
