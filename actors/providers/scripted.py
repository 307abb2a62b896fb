"""Deterministic replies for tests and examples: ``scripted/...`` models.

Owns turning a script (a callable, or a list consumed in order) into ChatResponses. It
performs no I/O, keeps no global record of calls, and pickles, so it ships to Ray workers.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..models import ChatRequest, ChatResponse, ProviderConfigError, ProviderError, ToolCall, Usage
from .limits import estimate_tokens, record_call, record_failure

__all__ = ["Reply", "ScriptedProvider", "prompt_text"]

# What a script may give for one call: text, a full response, a dict with some of
# content/tool_calls/usage/finish_reason, or a ProviderError to raise.
Reply = str | ChatResponse | dict[str, Any] | ProviderError

_REPLY_KEYS = {"content", "tool_calls", "usage", "finish_reason"}


class ScriptedProvider:
    """Answers from ``script``: a callable ``(ChatRequest) -> Reply`` (sync or async), or a list.

    A list is consumed in order and running past its end is a ProviderConfigError. Each
    worker process gets its own copy of a list script (the provider is pickled into every
    worker), so with several workers the replies are not shared out in one global order:
    prefer a callable that decides from the request for multi-worker runs.
    A reply that is a ProviderError instance is raised, to script failures.
    """

    def __init__(self, script: Callable[[ChatRequest], Any] | Sequence[Reply], *, name: str = "scripted") -> None:
        self.name = name
        if callable(script):
            self._script: Callable[[ChatRequest], Any] | None = script
            self._replies: list[Reply] = []
        elif isinstance(script, (list, tuple)):
            self._script = None
            self._replies = list(script)
        else:
            raise ProviderConfigError(f"script must be a callable or a list of replies, got {type(script).__name__}",
                                      provider=name)
        self._position = 0

    def __repr__(self) -> str:
        kind = "callable" if self._script is not None else f"{len(self._replies)} replies"
        return f"ScriptedProvider(name={self.name!r}, {kind})"

    @property
    def remaining(self) -> int | None:
        """Replies left in a list script in this process; None for a callable script."""
        return None if self._script is not None else len(self._replies) - self._position

    async def complete(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        try:
            reply = await self._next_reply(request)
            if isinstance(reply, ProviderError):
                raise reply
            response = self._response(reply, request)
        except ProviderError:
            record_failure(self.name)
            raise
        record_call(self.name, response.usage, time.perf_counter() - started)
        return response

    async def _next_reply(self, request: ChatRequest) -> Any:
        if self._script is not None:
            reply = self._script(request)
            return await reply if inspect.isawaitable(reply) else reply
        if self._position >= len(self._replies):
            raise ProviderConfigError(
                f"scripted provider {self.name!r} ran out of replies after {len(self._replies)} calls "
                f"(model {request.model!r}); each worker process has its own copy of a list script, "
                "so use a callable script for runs on several workers",
                provider=self.name,
            )
        reply = self._replies[self._position]
        self._position += 1
        return reply

    def _response(self, reply: Any, request: ChatRequest) -> ChatResponse:
        if isinstance(reply, ChatResponse):
            return dataclasses.replace(reply, model=reply.model or request.model,
                                       provider=reply.provider or self.name)
        if isinstance(reply, str):
            reply = {"content": reply}
        if not isinstance(reply, dict):
            raise ProviderConfigError(
                f"scripted reply must be str, dict, ChatResponse or ProviderError, got {type(reply).__name__}",
                provider=self.name,
            )
        unknown = set(reply) - _REPLY_KEYS
        if unknown:
            raise ProviderConfigError(f"scripted reply has unknown keys {sorted(unknown)}; "
                                      f"allowed: {sorted(_REPLY_KEYS)}", provider=self.name)
        content = reply.get("content")
        tool_calls = [self._tool_call(call, index) for index, call in enumerate(reply.get("tool_calls") or [])]
        usage = reply.get("usage")
        if isinstance(usage, dict):
            try:
                usage = Usage(**usage)
            except TypeError as exc:
                raise ProviderConfigError(f"scripted usage {usage!r} must have prompt_tokens/completion_tokens",
                                          provider=self.name) from exc
        elif usage is None:
            usage = Usage(prompt_tokens=estimate_tokens(prompt_text(request)),
                          completion_tokens=estimate_tokens(content or ""))
        return ChatResponse(
            content=content,
            tool_calls=tool_calls,
            usage=usage,
            model=request.model,
            provider=self.name,
            finish_reason=reply.get("finish_reason") or ("tool_calls" if tool_calls else "stop"),
        )

    def _tool_call(self, call: Any, index: int) -> ToolCall:
        if isinstance(call, ToolCall):
            return call
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            return ToolCall(id=str(call.get("id") or f"call_{index}"), name=call["name"],
                            arguments=dict(call.get("arguments") or {}))
        raise ProviderConfigError(f"scripted tool call {index} must be a ToolCall or a dict with a name, got {call!r}",
                                  provider=self.name)


def prompt_text(request: ChatRequest) -> str:
    """All message text of a request, for token estimates."""
    parts = []
    for message in request.messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "\n".join(parts)
