"""A scripted in-test provider and an in-memory branch, for driving the branch verbs without Ray.

``FakeBranch`` stands in for RemoteBranch (history, append, emit, provider_for) and
``FakeProvider`` answers each ChatRequest from a script, recording every request so the
tests can read what the model was shown.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from opgraph.actors.models import ChatRequest, ChatResponse, ToolCall, Usage, parse_model_id

Reply = ChatResponse | str | Callable[[ChatRequest], ChatResponse]


def reply(content: str | None = "", *calls: ToolCall, prompt: int = 10, completion: int = 5) -> ChatResponse:
    return ChatResponse(content=content, tool_calls=list(calls), usage=Usage(prompt, completion),
                        model="model", provider="fake", finish_reason="tool_calls" if calls else "stop")


def call(name: str, call_id: str = "", **arguments: Any) -> ToolCall:
    return ToolCall(call_id, name, arguments)


class FakeProvider:
    """Answers from a script (one reply per call, the last repeating); records requests."""

    name = "fake"

    def __init__(self, *script: Reply) -> None:
        self.script = list(script)
        self.requests: list[ChatRequest] = []

    async def complete(self, request: ChatRequest) -> ChatResponse:
        self.requests.append(request)
        step = self.script[min(len(self.requests), len(self.script)) - 1]
        if callable(step):
            return step(request)
        return reply(step) if isinstance(step, str) else step


class FakeBranch:
    """An in-memory RemoteBranch: the same async surface, no store and no executor."""

    def __init__(self, provider: Any = None, history: list[Any] | None = None,
                 default_model: str | None = "fake/default") -> None:
        self.id = "branch-1"
        self.run_id = "run-1"
        self.node_id = "node-1"
        self.default_model = default_model
        self.provider = provider
        self.history: list[Any] = list(history or [])
        self.emitted: list[Any] = []
        self.models_asked: list[str] = []

    async def messages(self) -> list[Any]:
        return list(self.history)

    async def append(self, *messages: Any) -> int:
        self.history.extend(messages)
        return len(self.history)

    def emit(self, request: Any) -> None:
        self.emitted.append(request)

    def provider_for(self, model: str) -> Any:
        parse_model_id(model)
        self.models_asked.append(model)
        return self.provider


def tool_answers(history: list[Any]) -> dict[str, Any]:
    """What each tool answered in ``history``, by tool name (a JSON object decoded, else the text)."""
    calls = {item["id"]: item["function"]["name"] for message in history if message.get("tool_calls")
             for item in message["tool_calls"]}
    answers = {}
    for message in history:
        if message.get("role") == "tool":
            content = message["content"]
            answers[calls[message["tool_call_id"]]] = json.loads(content) if content.startswith("{") else content
    return answers
