"""Helpers for the engine tests (tests/engines): scripts for scripted models, a test event, a test engine.

Scripts choose a reply by the agent whose profile opens the request. This module travels
to the Ray workers by value (registered by tests/engines/conftest.py), so its scripts and
event types work there.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from opgraph.engines import Engine, EngineEvent, MemorySink

__all__ = ["HANG", "ByAgent", "Note", "ScriptEngine", "agent_of", "hang", "js", "kinds", "last_user"]

_PROFILE = re.compile(r"You are (\S+), acting as")


class Note(EngineEvent):
    """A test emission."""

    text: str


def js(value: Any) -> str:
    """A reply that is this value as JSON text."""
    return json.dumps(value)


def agent_of(request: Any) -> str:
    """The name of the agent whose branch made this request ("" for none)."""
    for message in request.messages:
        if message.get("role") == "system":
            found = _PROFILE.match(str(message.get("content", "")))
            if found:
                return found.group(1)
    return ""


def last_user(request: Any) -> str:
    return next((str(m.get("content")) for m in reversed(request.messages) if m.get("role") == "user"), "")


async def hang() -> str:
    """A reply that never comes: the call waits until it is cancelled."""
    await asyncio.Event().wait()
    return "unreachable"


HANG = "<hang>"


class ByAgent:
    """A script: ``replies[agent name]`` (or ``default``), a str, a ProviderError, a callable or HANG.

    A list of replies is used in turn per agent (each worker keeps its own position,
    so lists suit agents whose turns land on one worker; tests with repeat turns of one
    agent pass a callable of the request instead).
    """

    def __init__(self, replies: dict[str, Any] | None = None, default: Any = "ok") -> None:
        self.replies = dict(replies or {})
        self.default = default

    def __call__(self, request: Any) -> Any:
        name = agent_of(request)
        reply = self.replies.get(name, self.replies.get(name.rsplit("-", 1)[0], self.default))
        if callable(reply) and not isinstance(reply, type):
            reply = reply(request)
        if reply == HANG:
            return hang()
        return reply


class ScriptEngine(Engine):
    """An engine whose domain topology is the test's ``body(run, *args)``; ``export`` is its partial export."""

    kind = "script"

    def __init__(self, body: Any, *, export: Any = None, **settings: Any) -> None:
        super().__init__(**settings)
        self.body = body
        self.export = export

    async def _run(self, run: Any, *args: Any, **kwargs: Any) -> Any:
        return await self.body(run, *args, **kwargs)

    async def _partial_export(self, run: Any) -> str | None:
        return None if self.export is None else await self.export(run)


def kinds(sink: MemorySink, run: Any, kind: str) -> list[Any]:
    """The sink's records of ``run`` of one type."""
    return [record for record in sink.records.get(run.run_id, []) if record.type == kind]
