"""Anthropic messages API: translating the OpenAI-shaped ChatRequest to ``/v1/messages`` and back.

Owns that wire format only: system prompt extraction, tool schemas, tool-use and
tool-result blocks, usage and stop reasons. HTTP, retries and error translation belong
to ``http.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from ..models import (
    ChatRequest,
    ChatResponse,
    ProviderConfigError,
    ProviderRefusal,
    ProviderResponseError,
    ToolCall,
    Usage,
)
from .adaptive import RateBudget
from .http import (
    DEFAULT_TIMEOUT,
    RETRYABLE_STATUSES,
    HTTPChatProvider,
    ProviderHTTPClient,
    RetryPolicy,
    check_max_tokens,
)

__all__ = ["ANTHROPIC_VERSION", "DEFAULT_ANTHROPIC_BASE_URL", "AnthropicProvider"]

DEFAULT_ANTHROPIC_BASE_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_MAX_TOKENS = 4096  # the messages API requires max_tokens on every request
OVERLOADED = 529  # Anthropic's "overloaded": as retryable as a 503

# Stop reasons in the OpenAI vocabulary the rest of opgraph reads.
_FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls", "max_tokens": "length"}


class AnthropicProvider(HTTPChatProvider):
    """POSTs to ``{base_url}/v1/messages`` with ``x-api-key`` and ``anthropic-version``.

    ``api_key`` and ``base_url`` default to ``ANTHROPIC_API_KEY`` and ``ANTHROPIC_BASE_URL``;
    a key is required for the default URL. ``response_format`` has no API counterpart, so a
    JSON schema becomes an instruction appended to the system prompt. ``timeout`` bounds
    each attempt (600 s, as the anthropic SDK); ``max_tokens`` (4096) is sent when a request
    names none, since the API requires it. ``temperature`` is not sent (the API's request
    type no longer has it); empty turns in the history are left out (the API refuses them).
    """

    kind = "anthropic"
    endpoint = "/v1/messages"

    def __init__(self, api_key: str | None = None, base_url: str | None = None, *, name: str = "anthropic",
                 timeout: float = DEFAULT_TIMEOUT, max_tokens: int = DEFAULT_MAX_TOKENS, max_retries: int = 3,
                 backoff: float = 0.5, max_delay: float = 20.0, concurrency: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, adaptive: bool = True,
                 requests_per_minute: float | None = None, tokens_per_minute: float | None = None,
                 rate_limit_patience: float = 600.0) -> None:
        base_url = (base_url or os.environ.get("ANTHROPIC_BASE_URL") or DEFAULT_ANTHROPIC_BASE_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("ANTHROPIC_API_KEY")
        if not api_key and base_url == DEFAULT_ANTHROPIC_BASE_URL:
            raise ProviderConfigError(
                f"provider {name!r}: no API key; set ANTHROPIC_API_KEY or pass api_key=", provider=name
            )
        self.name = name
        self.base_url = base_url
        self.max_tokens = check_max_tokens(max_tokens, name) or DEFAULT_MAX_TOKENS
        self.settings = {"timeout": timeout, "max_tokens": max_tokens, "max_retries": max_retries, "backoff": backoff,
                         "max_delay": max_delay, "concurrency": concurrency, "adaptive": adaptive,
                         "requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
                         "rate_limit_patience": rate_limit_patience}
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        self._http = ProviderHTTPClient(
            name, base_url, headers, timeout=timeout, transport=transport, concurrency=concurrency,
            adaptive=adaptive, budget=RateBudget(requests_per_minute, tokens_per_minute),
            retry=RetryPolicy(max_retries=max_retries, backoff=backoff, max_delay=max_delay,
                              rate_limit_patience=rate_limit_patience,
                              statuses=RETRYABLE_STATUSES | {OVERLOADED}),
        )

    def request_body(self, request: ChatRequest, model_name: str) -> dict[str, Any]:
        system: list[str] = []
        messages: list[dict[str, Any]] = []
        for message in request.messages:
            role = message.get("role")
            if role == "system":
                system.append(_plain_text(message.get("content")))
                continue
            wire_role, blocks = _blocks(message)
            if not blocks:
                # An empty turn (a reply that said nothing, recorded on the branch): the API
                # refuses a message without content, and replaying it adds nothing.
                continue
            if messages and messages[-1]["role"] == wire_role:
                messages[-1]["content"].extend(blocks)  # the API wants user/assistant turns to alternate
            else:
                messages.append({"role": wire_role, "content": blocks})
        instruction = _format_instruction(request.response_format)
        if instruction:
            system.append(instruction)
        body: dict[str, Any] = {
            "model": model_name,
            "max_tokens": request.max_tokens or self.max_tokens,
            "messages": messages,
        }
        if system:
            body["system"] = "\n\n".join(part for part in system if part)
        if request.tools:
            body["tools"] = [_wire_tool(tool) for tool in request.tools]
        if request.stop:
            body["stop_sequences"] = list(request.stop)
        # ``temperature`` is not sent: the Messages API's request type (anthropic SDK
        # MessageCreateParams) no longer takes it, and a field it does not take is refused.
        return body

    def parse_body(self, body: Any, request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        """Read a messages-API body; anything malformed is a ProviderResponseError."""

        def malformed(what: str) -> ProviderResponseError:
            return ProviderResponseError(f"{self.name}: malformed messages body ({what}): {body!r:.300}",
                                         provider=self.name, status=status)

        if not isinstance(body, dict) or not isinstance(body.get("content"), list):
            raise malformed("no content list")
        texts: list[str] = []
        tool_calls: list[ToolCall] = []
        for index, block in enumerate(body["content"]):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                arguments = block.get("input") or {}
                if not isinstance(block.get("name"), str) or not isinstance(arguments, dict):
                    raise malformed(f"tool_use block {index} needs a name and an input object")
                tool_calls.append(ToolCall(id=str(block.get("id") or f"toolu_{index}"), name=block["name"],
                                           arguments=arguments))
            elif kind is None:
                raise malformed(f"content block {index} has no type")
            # Other block kinds (thinking, ...) carry nothing a ChatResponse holds.
        usage = body.get("usage") or {}
        if not isinstance(usage, dict):
            raise malformed("usage is not an object")
        fresh, output, cache_read, cache_creation = (
            usage.get(key) or 0 for key in ("input_tokens", "output_tokens", "cache_read_input_tokens",
                                             "cache_creation_input_tokens"))
        if not all(type(count) is int for count in (fresh, output, cache_read, cache_creation)):
            raise malformed("token counts are not integers")
        stop_reason = body.get("stop_reason")
        if stop_reason == "refusal":
            said = "".join(texts)
            raise ProviderRefusal(f"{self.name}: {request.model} refused" + (f": {said!r:.500}" if said else ""),
                                  refusal=said, provider=self.name, status=status)
        return ChatResponse(
            content="".join(texts) if texts else None,
            tool_calls=tool_calls,
            # input_tokens counts only what the cache did not serve: the prompt is all three.
            usage=Usage(prompt_tokens=fresh + cache_read + cache_creation, completion_tokens=output,
                        cache_read_tokens=cache_read, cache_creation_tokens=cache_creation),
            model=request.model,
            provider=self.name,
            finish_reason=_FINISH_REASONS.get(stop_reason, stop_reason),
        )


def _plain_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _blocks(message: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """One OpenAI-shaped message as (anthropic role, content blocks)."""
    role = message.get("role")
    content = message.get("content")
    if role == "tool":
        result = json.dumps(content) if isinstance(content, dict) else _plain_text(content)
        return "user", [{"type": "tool_result", "tool_use_id": str(message.get("tool_call_id", "")),
                         "content": result}]
    blocks: list[dict[str, Any]] = []
    text = _plain_text(content)
    if text.strip():  # the API refuses empty and whitespace-only text blocks
        blocks.append({"type": "text", "text": text})
    if role == "assistant":
        for call in message.get("tool_calls") or []:
            if isinstance(call, ToolCall):
                blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
                continue
            function = call.get("function", {})
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError as exc:
                    raise ProviderConfigError(
                        f"message history holds a tool call whose arguments are not JSON: {arguments!r:.200}"
                    ) from exc
            blocks.append({"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""),
                           "input": arguments})
        return "assistant", blocks
    return "user", blocks


def _wire_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function schema (wrapped or bare) as Anthropic's {name, description, input_schema}."""
    function = tool["function"] if tool.get("type") == "function" and "function" in tool else tool
    wired = {"name": function["name"], "input_schema": function.get("parameters") or {"type": "object"}}
    if function.get("description"):
        wired["description"] = function["description"]
    return wired


def _format_instruction(response_format: dict[str, Any] | None) -> str:
    if not response_format:
        return ""
    if response_format.get("type") == "json_schema":
        schema = response_format.get("json_schema", {})
        schema = schema.get("schema", schema)
        return ("Answer with one JSON object that matches this JSON schema, and nothing else:\n"
                + json.dumps(schema, sort_keys=True))
    if response_format.get("type") == "json_object":
        return "Answer with one JSON object, and nothing else."
    return ""
