"""OpenAI-compatible chat completions: OpenAI itself and local servers (vLLM, Ollama, llama.cpp).

Owns the chat-completions wire format: building the request body from a ChatRequest and
reading choices, tool calls, usage and finish reason back into a ChatResponse. HTTP,
retries and error translation belong to ``http.py``.
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
from .http import DEFAULT_TIMEOUT, HTTPChatProvider, ProviderHTTPClient, RetryPolicy, check_max_tokens

__all__ = ["DEFAULT_OPENAI_BASE_URL", "OpenAICompatibleProvider"]

DEFAULT_OPENAI_BASE_URL = "https://api.openai.com/v1"


class OpenAICompatibleProvider(HTTPChatProvider):
    """POSTs to ``{base_url}/chat/completions``; the model name is the part after ``provider/``.

    ``base_url`` and ``api_key`` default to ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``. A
    key is required only for the default OpenAI URL: local servers need none.
    ``timeout`` bounds each attempt (default 600 s, as the openai SDK: a local model may
    generate for minutes); ``max_tokens`` is sent when a request names none (default: the
    server's own limit). A node's ``timeout=``/``max_tokens=`` wins over both.
    ``max_retries`` retries follow the first attempt; ``backoff`` and ``max_delay`` shape
    the waits (see ``RetryPolicy``); ``concurrency`` caps calls in flight cluster-wide.
    ``adaptive`` (default) learns the server's rate limit from its 429s and ``Retry-After``,
    shared by every worker; ``requests_per_minute``/``tokens_per_minute`` set a budget that
    admission spends from the start (see ``adaptive.py``).
    The built-in ``openai/`` provider reads all of these from the environment
    (``provider_from_environment``).
    """

    kind = "openai"
    endpoint = "/chat/completions"
    streams = True

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, name: str = "openai",
                 timeout: float = DEFAULT_TIMEOUT, max_tokens: int | None = None, max_retries: int = 3,
                 backoff: float = 0.5, max_delay: float = 20.0, concurrency: int | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, adaptive: bool = True,
                 requests_per_minute: float | None = None, tokens_per_minute: float | None = None,
                 rate_limit_patience: float = 600.0) -> None:
        base_url = base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_OPENAI_BASE_URL
        api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not api_key and base_url.rstrip("/") == DEFAULT_OPENAI_BASE_URL:
            raise ProviderConfigError(
                f"provider {name!r}: no API key for {DEFAULT_OPENAI_BASE_URL}; set OPENAI_API_KEY, "
                "or set OPENAI_BASE_URL to a local OpenAI-compatible server (vLLM, Ollama, llama.cpp)",
                provider=name,
            )
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.max_tokens = check_max_tokens(max_tokens, name)
        self.settings = {"timeout": timeout, "max_tokens": max_tokens, "max_retries": max_retries, "backoff": backoff,
                         "max_delay": max_delay, "concurrency": concurrency, "adaptive": adaptive,
                         "requests_per_minute": requests_per_minute, "tokens_per_minute": tokens_per_minute,
                         "rate_limit_patience": rate_limit_patience}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = ProviderHTTPClient(
            name, self.base_url, headers, timeout=timeout, transport=transport, concurrency=concurrency,
            adaptive=adaptive, budget=RateBudget(requests_per_minute, tokens_per_minute),
            retry=RetryPolicy(max_retries=max_retries, backoff=backoff, max_delay=max_delay,
                              rate_limit_patience=rate_limit_patience),
        )

    def request_body(self, request: ChatRequest, model_name: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model_name, "messages": [_wire_message(m) for m in request.messages]}
        if request.tools:
            body["tools"] = [_wire_tool(tool) for tool in request.tools]
        if request.response_format is not None:
            body["response_format"] = request.response_format
        if request.temperature is not None:
            body["temperature"] = request.temperature
        max_tokens = request.max_tokens if request.max_tokens is not None else self.max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if request.stop:
            body["stop"] = list(request.stop)
        return body

    def parse_events(self, events: list[Any], request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        """A streamed chat completion (``chat.completion.chunk`` events) read back as the whole body
        ``parse_body`` reads: the deltas' text and tool-call pieces joined, the last finish reason and usage."""
        text: list[str] = []
        refusal: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        finish_reason, usage, saw_choice = None, None, False
        for event in events:
            if not isinstance(event, dict):
                return self.parse_body(event, request, status=status)  # reported as malformed there
            if "error" in event and "choices" not in event:
                return self.parse_body(event, request, status=status)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                saw_choice = True
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    text.append(delta["content"])
                if isinstance(delta.get("refusal"), str):
                    refusal.append(delta["refusal"])
                for piece in delta.get("tool_calls") or ():
                    call = calls.setdefault(piece.get("index", len(calls)),
                                            {"id": None, "function": {"name": "", "arguments": ""}})
                    call["id"] = piece.get("id") or call["id"]
                    function = piece.get("function") or {}
                    call["function"]["name"] += function.get("name") or ""
                    call["function"]["arguments"] += function.get("arguments") or ""
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
        if calls:
            message["tool_calls"] = [calls[index] for index in sorted(calls)]
        if refusal:
            message["refusal"] = "".join(refusal)
        body = {"choices": [{"message": message, "finish_reason": finish_reason}] if saw_choice else [],
                "usage": usage}
        return self.parse_body(body, request, status=status)

    def parse_body(self, body: Any, request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        """Read a chat-completions body; anything malformed is a ProviderResponseError."""

        def malformed(what: str) -> ProviderResponseError:
            return ProviderResponseError(f"{self.name}: malformed chat-completions body ({what}): {body!r:.300}",
                                         provider=self.name, status=status)

        if not isinstance(body, dict):
            raise malformed("not a JSON object")
        if "error" in body and "choices" not in body:
            raise malformed(f"error object instead of choices: {body['error']!r:.200}")
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise malformed("no choices")
        message = choices[0].get("message")
        if not isinstance(message, dict):
            raise malformed("choices[0] has no message")
        refusal = message.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise malformed("refusal is not text")
        if refusal:
            # The answer is the refusal (content is null beside it): a typed error that
            # carries the model's words, not an empty reply for chat or a ParseError for operate.
            raise ProviderRefusal(f"{self.name}: {request.model} refused: {refusal!r:.500}", refusal=refusal,
                                  provider=self.name, status=status)
        raw_calls = message.get("tool_calls") or []
        tool_calls = [self._tool_call(raw, index, malformed) for index, raw in enumerate(raw_calls)]
        usage = body.get("usage") or {}
        if not isinstance(usage, dict):
            raise malformed("usage is not an object")
        details = usage.get("prompt_tokens_details") or {}
        if not isinstance(details, dict):
            raise malformed("usage.prompt_tokens_details is not an object")
        return ChatResponse(
            content=_text(message.get("content"), malformed),
            tool_calls=tool_calls,
            usage=Usage(prompt_tokens=_count(usage.get("prompt_tokens"), malformed),
                        completion_tokens=_count(usage.get("completion_tokens"), malformed),
                        cache_read_tokens=_count(details.get("cached_tokens"), malformed)),
            model=request.model,
            provider=self.name,
            finish_reason=choices[0].get("finish_reason"),
        )

    @staticmethod
    def _tool_call(raw: Any, index: int, malformed: Any) -> ToolCall:
        function = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise malformed(f"tool call {index} has no function name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise malformed(f"tool call {function['name']!r} arguments are not JSON: {arguments!r:.200}") from exc
        elif arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise malformed(f"tool call {function['name']!r} arguments are not a JSON object")
        return ToolCall(id=str(raw.get("id") or f"call_{index}"), name=function["name"], arguments=arguments)


def _count(value: Any, malformed: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise malformed(f"token count {value!r} is not an integer")


def _text(content: Any, malformed: Any) -> str | None:
    """Message content: a string, None, or (some servers) a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise malformed("message content is neither text nor parts")


def _wire_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """OpenAI function schema; a bare {name, description, parameters} is wrapped."""
    if tool.get("type") == "function" and "function" in tool:
        return tool
    return {"type": "function", "function": tool}


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message as OpenAI expects it: content as text (or parts), tool-call arguments as JSON strings."""
    content = message.get("content")
    if content is not None and not isinstance(content, (str, list)):
        message = {**message, "content": json.dumps(content, default=str)}  # a tool's dict result, say
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        return message
    wired = []
    for call in tool_calls:
        if isinstance(call, ToolCall):
            call = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        function = dict(call.get("function", {}))
        if not isinstance(function.get("arguments"), str):
            function["arguments"] = json.dumps(function.get("arguments") or {})
        wired.append({**call, "type": call.get("type", "function"), "function": function})
    return {**message, "tool_calls": wired}
