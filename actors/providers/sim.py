"""Simulated models for load tests and demos: ``sim/...`` with latency, failures and token counts.

Owns the simulation: seeded jitter and failures, deterministic text derived from the last
user message, and JSON that fits a requested schema. It performs no network I/O.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import time
from typing import Any

from ..models import ChatRequest, ChatResponse, ProviderConfigError, ProviderUnavailable, Usage, parse_model_id
from .limits import estimate_tokens, record_call, record_failure
from .scripted import prompt_text

__all__ = ["PRESETS", "SimulatedProvider", "SimulationSettings", "example_from_schema"]


@dataclasses.dataclass(frozen=True, slots=True)
class SimulationSettings:
    latency: float = 0.05
    jitter: float = 0.0
    failure_rate: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int = 32


# ``sim/<preset>`` overrides these fields of the provider's own settings; any other model
# name (``sim/default``, ``sim/planner``) uses the provider's settings unchanged.
PRESETS: dict[str, dict[str, Any]] = {
    "instant": {"latency": 0.0, "jitter": 0.0},
    "fast": {"latency": 0.01, "jitter": 0.0},
    "slow": {"latency": 1.0},
    "flaky": {"failure_rate": 0.25},
}


class SimulatedProvider:
    """Sleeps ``latency`` (+ up to ``jitter``), fails with ProviderUnavailable at ``failure_rate``.

    Jitter and failures come from one ``random.Random(seed)``, so a seeded provider called
    in the same order fails on the same calls. Replies are derived from the last user
    message; with a JSON-schema ``response_format`` the reply is JSON fitting the schema.
    ``prompt_tokens`` None estimates them from the prompt's length.
    """

    def __init__(self, latency: float = 0.05, jitter: float = 0.0, failure_rate: float = 0.0,
                 prompt_tokens: int | None = None, completion_tokens: int = 32, seed: int | None = None,
                 *, name: str = "sim") -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ProviderConfigError(f"failure_rate must be within [0, 1], got {failure_rate}", provider=name)
        self.name = name
        self.settings = SimulationSettings(latency, jitter, failure_rate, prompt_tokens, completion_tokens)
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"SimulatedProvider(name={self.name!r}, {self.settings})"

    def settings_for(self, model_name: str) -> SimulationSettings:
        preset = PRESETS.get(model_name)
        return dataclasses.replace(self.settings, **preset) if preset else self.settings

    async def complete(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        _, model_name = parse_model_id(request.model)
        settings = self.settings_for(model_name)
        # Draw both numbers up front so the sequence does not depend on which calls fail.
        delay = settings.latency + (self._rng.uniform(0.0, settings.jitter) if settings.jitter else 0.0)
        fails = self._rng.random() < settings.failure_rate
        if delay > 0:
            await asyncio.sleep(delay)
        if fails:
            record_failure(self.name)
            raise ProviderUnavailable(
                f"simulated failure of {request.model!r} (failure_rate={settings.failure_rate})",
                provider=self.name, status=503,
            )
        prompt = prompt_text(request)
        usage = Usage(
            prompt_tokens=estimate_tokens(prompt) if settings.prompt_tokens is None else settings.prompt_tokens,
            completion_tokens=settings.completion_tokens,
        )
        response = ChatResponse(content=self._content(request, model_name), usage=usage, model=request.model,
                                provider=self.name, finish_reason="stop")
        record_call(self.name, usage, time.perf_counter() - started)
        return response

    @staticmethod
    def _content(request: ChatRequest, model_name: str) -> str:
        last_user = next((m.get("content") for m in reversed(request.messages) if m.get("role") == "user"), "")
        last_user = last_user if isinstance(last_user, str) else json.dumps(last_user, sort_keys=True)
        digest = hashlib.sha256(last_user.encode()).hexdigest()[:8]
        response_format = request.response_format or {}
        if response_format.get("type") == "json_schema":
            schema = response_format.get("json_schema", {})
            schema = schema.get("schema", schema)
            return json.dumps(example_from_schema(schema, hint=f"sim-{digest}"))
        if response_format.get("type") == "json_object":
            return json.dumps({"reply": f"sim-{digest}", "prompt": last_user[:80]})
        snippet = " ".join(last_user.split())[:80]
        return f"[{model_name} {digest}] simulated reply to: {snippet}"


def example_from_schema(schema: dict[str, Any], *, hint: str = "example",
                        root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """A value that fits a JSON schema (objects, arrays, scalars, enums, $ref, anyOf).

    Every property is filled, not only the required ones; strings carry ``hint``.
    """
    root = schema if root is None else root
    if depth > 16:  # a recursive schema: stop rather than recurse forever
        return None
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return example_from_schema(target, hint=hint, root=root, depth=depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for combinator in ("anyOf", "oneOf", "allOf"):
        if combinator in schema:
            options = [s for s in schema[combinator] if s.get("type") != "null"] or schema[combinator]
            return example_from_schema(options[0], hint=hint, root=root, depth=depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        return {name: example_from_schema(sub, hint=f"{hint}-{name}", root=root, depth=depth + 1)
                for name, sub in schema.get("properties", {}).items()}
    if kind == "array":
        count = max(1, schema.get("minItems", 1))
        return [example_from_schema(schema.get("items", {}), hint=hint, root=root, depth=depth + 1)
                for _ in range(count)]
    if kind == "integer":
        return max(1, schema.get("minimum", 1))
    if kind == "number":
        return float(max(1, schema.get("minimum", 1)))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return hint
