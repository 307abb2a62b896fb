"""Every request body opgraph sends is one the official SDKs' request types accept, field by field.

    ChatRequest (every option opgraph uses) -> provider.request_body -> checked against
    openai.types.chat.CompletionCreateParamsNonStreaming / anthropic MessageCreateParamsNonStreaming

The SDKs are test-only dependencies (pyproject ``test`` extra): their TypedDicts are the
wire contract as the API's own clients state it. ``conforms`` walks a body against one:
an unknown key, a missing required key or a value of the wrong type is a problem, so a
field the API does not take (Anthropic's ``temperature`` here) is caught before it is sent.
"""

from __future__ import annotations

import collections.abc
import types
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import typing_extensions
from anthropic.types.message_create_params import MessageCreateParamsNonStreaming
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from typing_extensions import get_type_hints, is_typeddict

from opgraph.actors.models import ChatRequest, ToolCall
from opgraph.actors.providers import AnthropicProvider, OpenAICompatibleProvider

# typing_extensions' forms, which the SDKs' TypedDicts are written with.
_WRAPPERS = {typing_extensions.Required, typing_extensions.NotRequired, typing_extensions.ReadOnly}
_SEQUENCES = {list, tuple, collections.abc.Iterable, collections.abc.Sequence, collections.abc.Collection}
_MAPPINGS = {dict, collections.abc.Mapping}


def _unwrap(annotation: Any) -> tuple[Any, str | None, bool | None]:
    """The plain type of a TypedDict field, its wire alias (the SDKs' PropertyInfo(alias=...)),
    and whether it is marked Required (True), NotRequired (False) or neither (None)."""
    alias, required = None, None
    while True:
        if get_origin(annotation) is typing_extensions.Annotated:
            for extra in annotation.__metadata__:
                alias = getattr(extra, "alias", None) or alias
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) in _WRAPPERS:
            if get_origin(annotation) is not typing_extensions.ReadOnly:
                required = get_origin(annotation) is typing_extensions.Required
            annotation = get_args(annotation)[0]
        else:
            return annotation, alias, required


def conforms(value: Any, annotation: Any, path: str = "body") -> list[str]:
    """Problems of ``value`` against ``annotation``; [] when the type accepts it."""
    annotation = _unwrap(annotation)[0]
    origin, arguments = get_origin(annotation), get_args(annotation)
    if annotation in (Any, object):
        return []
    if origin in (Union, types.UnionType):
        attempts = [conforms(value, option, path) for option in arguments]
        return [] if any(not attempt for attempt in attempts) else min(attempts, key=len)
    if origin is Literal:
        return [] if value in arguments else [f"{path}: {value!r} is none of {arguments}"]
    if annotation is type(None):
        return [] if value is None else [f"{path}: {value!r} should be null"]
    if is_typeddict(annotation):
        return _typed_dict(value, annotation, path)
    if origin in _SEQUENCES or (origin is not None and getattr(origin, "__name__", "") == "SequenceNotStr"):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__} should be an array"]
        return [problem for index, item in enumerate(value) for problem in conforms(item, arguments[0],
                                                                                     f"{path}[{index}]")]
    if origin in _MAPPINGS:
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__} should be an object"]
        return [problem for key, item in value.items() for problem in conforms(item, arguments[1], f"{path}.{key}")]
    if annotation is bool:
        return [] if isinstance(value, bool) else [f"{path}: {value!r} should be a boolean"]
    if annotation in (int, float):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if number and (annotation is float or isinstance(value, int)) else [f"{path}: {value!r} is no "
                                                                                      f"{annotation.__name__}"]
    if annotation is str:
        return [] if isinstance(value, str) else [f"{path}: {value!r} should be a string"]
    if annotation in (dict, list):
        return [] if isinstance(value, annotation) else [f"{path}: should be a {annotation.__name__}"]
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        # A response model the SDK also takes (its unions hold both); a body built as JSON
        # must match the request TypedDict beside it, which is checked field by field.
        return [f"{path}: matched against {annotation.__name__}, a response model, not a request type"]
    raise TypeError(f"{path}: the checker does not know {annotation!r}; teach it rather than skip it")


def _typed_dict(value: Any, annotation: Any, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: {type(value).__name__} should be an object ({annotation.__name__})"]
    fields, required = {}, set()
    for name, hint in get_type_hints(annotation, include_extras=True).items():
        field_type, alias, marked = _unwrap(hint)
        fields[alias or name] = field_type
        # The SDKs' modules postpone annotations, so __required_keys__ misses Required[...]:
        # read the markers, and the class's totality where there is none.
        if marked or (marked is None and annotation.__total__):
            required.add(alias or name)
    problems = [f"{path}.{key}: {annotation.__name__} has no such field" for key in value if key not in fields]
    problems += [f"{path}.{key}: required by {annotation.__name__}, missing" for key in sorted(required - set(value))]
    for key, item in value.items():
        if key in fields:
            problems += conforms(item, fields[key], f"{path}.{key}")
    return problems


TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look something up.",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
HISTORY = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "find the tide"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "lookup", "arguments": '{"q": "tide"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "high at 6"},
    {"role": "assistant", "content": "", "tool_calls": [ToolCall("call_2", "lookup", {"q": "moon"})]},
    {"role": "tool", "tool_call_id": "call_2", "content": {"phase": "full"}},
    {"role": "assistant", "content": "It is high at 6."},
    {"role": "user", "content": "and tomorrow?"},
]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}

# Every option a verb puts on a ChatRequest, alone and together.
REQUESTS = {
    "plain": ChatRequest("p/m", HISTORY[:2]),
    "history with tool rounds": ChatRequest("p/m", HISTORY),
    "tools": ChatRequest("p/m", HISTORY, tools=[TOOL, TOOL["function"] | {"name": "bare"}]),
    "json schema": ChatRequest("p/m", HISTORY[:2], response_format=SCHEMA),
    "json object": ChatRequest("p/m", HISTORY[:2], response_format={"type": "json_object"}),
    "temperature and max_tokens": ChatRequest("p/m", HISTORY[:2], temperature=0.7, max_tokens=64),
    "everything": ChatRequest("p/m", HISTORY, tools=[TOOL], response_format=SCHEMA, temperature=0.0, max_tokens=9,
                              timeout=5.0),
}


@pytest.mark.parametrize("label", REQUESTS)
def test_openai_request_bodies_fit_the_sdks_request_type(label):
    provider = OpenAICompatibleProvider("http://127.0.0.1:1/v1", api_key="k", max_tokens=128)
    body = provider.request_body(REQUESTS[label], "gpt-test")
    assert conforms(body, CompletionCreateParamsNonStreaming) == []


@pytest.mark.parametrize("label", REQUESTS)
def test_anthropic_request_bodies_fit_the_sdks_request_type(label):
    provider = AnthropicProvider("ak", "https://anthropic.test")
    body = provider.request_body(REQUESTS[label], "claude-test")
    assert conforms(body, MessageCreateParamsNonStreaming) == []


def test_the_checker_catches_what_the_api_does_not_take():
    """So a passing test means something: unknown fields, missing ones and wrong types are found."""
    good = {"model": "claude-test", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert conforms(good, MessageCreateParamsNonStreaming) == []
    assert conforms({**good, "colour": "red"}, MessageCreateParamsNonStreaming)[0].startswith(
        "body.colour: MessageCreateParams")
    assert conforms({"model": "m", "messages": []}, MessageCreateParamsNonStreaming) == [
        "body.max_tokens: required by MessageCreateParamsNonStreaming, missing"]
    bad_block = {**good, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}
    assert conforms(bad_block, MessageCreateParamsNonStreaming)
    assert conforms({"model": "m", "messages": [{"role": "nobody", "content": "x"}]},
                    CompletionCreateParamsNonStreaming)
