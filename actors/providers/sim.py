"""Simulated models for load tests and demos: ``sim/...`` with latency, failures and token counts.

Owns the simulation: seeded jitter, failures and malformed replies, deterministic text
derived from the last user message, and JSON that fits a requested schema (any pydantic
``response_format``, engine emission bundles included). It performs no network I/O.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import random
import re
import time
from collections.abc import Callable
from json.encoder import encode_basestring
from typing import Any

from ..models import ChatRequest, ChatResponse, ProviderConfigError, ProviderUnavailable, Usage, parse_model_id
from .limits import estimate_tokens, record_call, record_failure
from .scripted import prompt_text
from .sim_words import plain_reply, topic_of, words_for

__all__ = ["MALFORMED_STYLES", "PRESETS", "SimulatedProvider", "SimulationSettings", "example_from_schema",
           "malformed_reply"]

MALFORMED_STYLES = ("prose", "truncated", "wrong_shape")


@dataclasses.dataclass(frozen=True, slots=True)
class SimulationSettings:
    latency: float = 0.05
    jitter: float = 0.0
    failure_rate: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int = 32
    malformed_rate: float = 0.0
    list_items: int = 1


# ``sim/<preset>`` overrides these fields of the provider's own settings; any other model
# name (``sim/default``, ``sim/planner``) uses the provider's settings unchanged.
PRESETS: dict[str, dict[str, Any]] = {
    "instant": {"latency": 0.0, "jitter": 0.0},
    "fast": {"latency": 0.01, "jitter": 0.0},
    "slow": {"latency": 1.0},
    "flaky": {"failure_rate": 0.25},
    "malformed": {"malformed_rate": 0.25},
}


def _rate(name: str, value: float, provider: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ProviderConfigError(f"{name} must be within [0, 1], got {value!r}", provider=provider)
    return float(value)


class SimulatedProvider:
    """Sleeps ``latency`` (+ up to ``jitter``), fails with ProviderUnavailable at ``failure_rate``.

    Jitter, failures and malformed replies are drawn per call; with ``seed`` they follow
    from the seed, the request's messages and the call count, so a seeded provider
    called in the same order with the same requests behaves the same way. Replies are derived
    from the last user message; with a JSON-schema ``response_format`` the reply is JSON
    fitting the schema, with ``list_items`` items per array. At ``malformed_rate`` a
    structured request gets a broken reply instead (prose, truncated JSON, or JSON of
    the wrong shape), so repair paths can be exercised. ``prompt_tokens`` None
    estimates them from the prompt's length.
    """

    def __init__(self, latency: float = 0.05, jitter: float = 0.0, failure_rate: float = 0.0,
                 prompt_tokens: int | None = None, completion_tokens: int = 32, seed: int | None = None,
                 *, name: str = "sim", malformed_rate: float = 0.0, list_items: int = 1) -> None:
        failure_rate = _rate("failure_rate", failure_rate, name)
        malformed_rate = _rate("malformed_rate", malformed_rate, name)
        if isinstance(list_items, bool) or not isinstance(list_items, int) or list_items < 0:
            raise ProviderConfigError(f"list_items must be an integer >= 0, got {list_items!r}", provider=name)
        self.name = name
        self.settings = SimulationSettings(latency, jitter, failure_rate, prompt_tokens, completion_tokens,
                                           malformed_rate, list_items)
        self._rng = random.Random(seed)
        self._by_model: dict[str, tuple[SimulationSettings, SimulationSettings]] = {}
        self._seed = seed
        self._calls = 0

    def __repr__(self) -> str:
        return f"SimulatedProvider(name={self.name!r}, {self.settings})"

    def settings_for(self, model_name: str) -> SimulationSettings:
        preset = PRESETS.get(model_name)
        return dataclasses.replace(self.settings, **preset) if preset else self.settings

    def _settings_of(self, model_name: str) -> SimulationSettings:
        """``settings_for``, made once a model name (a call's cost, every call, otherwise)."""
        made = self._by_model.get(model_name)
        if made is None or made[0] is not self.settings:
            made = self._by_model[model_name] = (self.settings, self.settings_for(model_name))
        return made[1]

    async def complete(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        _, model_name = parse_model_id(request.model)
        settings = self._settings_of(model_name)
        if settings.jitter or settings.failure_rate or settings.malformed_rate:
            rng = self._draws(request)
            # Draw every number up front so the sequence does not depend on which calls fail.
            delay = settings.latency + (rng.uniform(0.0, settings.jitter) if settings.jitter else 0.0)
            fails = rng.random() < settings.failure_rate
            broken = rng.random() < settings.malformed_rate
            style = MALFORMED_STYLES[rng.randrange(len(MALFORMED_STYLES))]
        else:  # nothing to draw: no number would be used (a seeded call draws from its own sequence)
            self._calls += 1
            delay, fails, broken, style = settings.latency, False, False, MALFORMED_STYLES[0]
        if delay > 0:
            await asyncio.sleep(delay)
        if fails:
            record_failure(self.name)
            raise ProviderUnavailable(
                f"simulated failure of {request.model!r} (failure_rate={settings.failure_rate})",
                provider=self.name, status=503,
            )
        content = self._content(request, model_name, settings.list_items)
        if broken and (request.response_format or {}).get("type") in ("json_schema", "json_object"):
            content = malformed_reply(content, style)
        prompt = prompt_text(request)
        usage = Usage(
            prompt_tokens=estimate_tokens(prompt) if settings.prompt_tokens is None else settings.prompt_tokens,
            completion_tokens=settings.completion_tokens,
        )
        response = ChatResponse(content=content, usage=usage, model=request.model, provider=self.name,
                                finish_reason="stop")
        record_call(self.name, usage, time.perf_counter() - started)
        return response

    def _draws(self, request: ChatRequest) -> random.Random:
        """The call's random numbers. Seeded, they depend on the seed, the messages and the
        call count: a provider is copied into each worker for each run, so a plain seeded
        sequence would restart, and repeat its first draws, in every copy."""
        self._calls += 1
        if self._seed is None:
            return self._rng
        digest = hashlib.sha256(json.dumps(request.messages, sort_keys=True, default=str).encode()).hexdigest()
        return random.Random(f"{self._seed}:{digest}:{self._calls}")

    @staticmethod
    def _content(request: ChatRequest, model_name: str, list_items: int = 1) -> str:
        last_user = next((m.get("content") for m in reversed(request.messages) if m.get("role") == "user"), "")
        last_user = last_user if isinstance(last_user, str) else json.dumps(last_user, sort_keys=True)
        digest = hashlib.sha256(last_user.encode()).hexdigest()[:8]
        response_format = request.response_format or {}
        if response_format.get("type") == "json_schema":
            schema = response_format.get("json_schema", {})
            schema = schema.get("schema", schema)
            return json.dumps(example_from_schema(schema, hint=f"sim-{digest}", list_items=list_items,
                                                  words=functools.partial(words_for, topic=topic_of(last_user))))
        topic = topic_of(last_user)
        if response_format.get("type") == "json_object":
            return json.dumps({"reply": plain_reply(topic, digest), "topic": topic})
        return f"[{model_name} {digest}] simulated reply to {_asked(last_user)}: {plain_reply(topic, digest)}"


def _asked(message: str, limit: int = 60) -> str:
    """The start of what the sim was asked, quoted on one line, so a reader (or a test) can see
    which prompt reached the model: a pinned version's, an edited template's, a row's."""
    flat = " ".join(message.split())
    return encode_basestring(flat if len(flat) <= limit else flat[:limit].rstrip() + "...")  # as json.dumps


# -- schema-valid values -----------------------------------------------------------------------

_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00",
    "email": "sim@example.com",
    "uri": "https://example.com/sim",
    "url": "https://example.com/sim",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
    "duration": "P1D",
}
_CLASS_SAMPLES = {"d": "0", "D": "a", "w": "a", "W": "-", "s": " ", "S": "a"}


def _choice(options: list[Any], hint: str) -> Any:
    """One of ``options``, chosen by the hint's hash: varied across fields, stable per prompt."""
    return options[int(hashlib.sha256(hint.encode()).hexdigest()[:8], 16) % len(options)]


def _fraction(hint: str) -> float:
    return int(hashlib.sha256(hint.encode()).hexdigest()[8:16], 16) / 0xFFFFFFFF


def _from_pattern(pattern: str) -> str | None:
    """A shortest string for a simple regex (literals, classes, \\d\\w\\s, quantifiers); None if too complex."""
    out: list[str] = []
    index = 0
    body = pattern[1:] if pattern.startswith("^") else pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body
    while index < len(body):
        atom = _pattern_atom(body, index)
        if atom is None:
            return None
        sample, index = atom
        quantified = _pattern_repeat(body, index)
        if quantified is None:
            return None
        repeat, index = quantified
        out.append(sample * repeat)
    return "".join(out)


def _pattern_atom(body: str, index: int) -> tuple[str, int] | None:
    """A sample of the atom at ``index`` (an escape, a class, ``.`` or a literal) and the index
    after it; None for a group, an alternation or an unclosed class."""
    char = body[index]
    if char in "()|":
        return None
    if char == "\\" and index + 1 < len(body):
        return _CLASS_SAMPLES.get(body[index + 1], body[index + 1]), index + 2
    if char == "[":
        end = body.find("]", index + 2)
        if end == -1:
            return None
        return _class_sample(body[index + 1:end]), end + 1
    if char == ".":
        return "a", index + 1
    return char, index + 1


def _class_sample(members: str) -> str:
    """A character the bracket class ``[members]`` matches."""
    if members.startswith("^"):
        return "a" if "a" not in members else "_"
    if len(members) >= 3 and members[1] == "-":
        return members[0]
    return members[0] if members[0] != "\\" else _CLASS_SAMPLES.get(members[1:2], members[1:2])


def _pattern_repeat(body: str, index: int) -> tuple[int, int] | None:
    """How often a shortest match repeats the atom before ``index`` (its quantifier's least
    count; 1 without one) and the index after the quantifier; None for a count that is not a number."""
    if index >= len(body) or body[index] not in "*+?{":
        return 1, index
    if body[index] in "*?":
        repeat, index = 0, index + 1
    elif body[index] == "+":
        repeat, index = 1, index + 1
    else:
        end = body.find("}", index)
        if end == -1:
            return None
        low = body[index + 1:end].split(",")[0]
        if not low.isdigit():
            return None
        repeat, index = int(low), end + 1
    if index < len(body) and body[index] in "?+":  # lazy or possessive suffix
        index += 1
    return repeat, index


def _string(schema: dict[str, Any], hint: str, words: Callable[[str], str] | None = None) -> str:
    value = _FORMATS.get(schema.get("format", "")) or (words(hint) if words else hint)
    pattern = schema.get("pattern")
    if pattern is not None and re.search(pattern, value) is None:
        value = _from_pattern(pattern) or value
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if len(value) < low:
        value = value + "x" * (low - len(value))
    if high is not None and len(value) > high:
        value = value[:high]
    return value


def _number(schema: dict[str, Any], hint: str, integer: bool) -> int | float:
    step = 1 if integer else 0.0
    low = schema.get("minimum")
    if "exclusiveMinimum" in schema:
        low = schema["exclusiveMinimum"] + (1 if integer else 1e-6)
    high = schema.get("maximum")
    if "exclusiveMaximum" in schema:
        high = schema["exclusiveMaximum"] - (1 if integer else 1e-6)
    if low is not None and high is not None:
        value = low + (high - low) * _fraction(hint)  # inside a closed range: spread, not pinned
    elif low is not None:
        value = max(low, 1)
    elif high is not None:
        value = min(high, 1)
    else:
        value = 1
    multiple = schema.get("multipleOf")
    if multiple:
        value = math.ceil(value / multiple) * multiple
        if high is not None and value > high:
            value -= multiple
    if integer:
        return int(math.ceil(value)) if low is not None and value < low + step else int(value)
    return float(round(value, 6)) if not multiple else float(value)


def example_from_schema(schema: dict[str, Any], *, hint: str = "example", root: dict[str, Any] | None = None,
                        depth: int = 0, list_items: int = 1, words: Callable[[str], str] | None = None) -> Any:
    """A value that fits a JSON schema (pydantic's: objects, arrays, scalars, enums, $ref, anyOf...).

    Every property is filled, not only the required ones; strings carry ``hint`` (one
    more segment per property and list index, so list items differ). Arrays get
    ``list_items`` items within ``minItems``/``maxItems``; numbers stay within their
    bounds; enum members and bounded numbers vary with the hint. Defaults are used for
    scalars only, so a list field with an empty default still gets items. ``words`` turns a
    string's hint into its text (the sim provider's readable sentences); without it the hint
    is the text.
    """
    return _SchemaExamples(schema if root is None else root, list_items, words).value(schema, hint, depth)


@dataclasses.dataclass(frozen=True, slots=True)
class _SchemaExamples:
    """Values for the parts of one root schema, one method per kind of schema node.

    ``value`` reads a node's reference or combinator first (``$ref``, ``const``, ``enum``,
    ``allOf``, ``anyOf``/``oneOf``), then its type; ``root`` is what ``$ref`` points into."""

    root: dict[str, Any]
    list_items: int
    words: Callable[[str], str] | None = None

    def value(self, schema: dict[str, Any], hint: str, depth: int) -> Any:
        if depth > 16:  # a recursive schema: stop rather than recurse forever
            return None
        if "$ref" in schema:
            return self.value(_referenced(schema["$ref"], self.root), hint, depth + 1)
        if "const" in schema:
            return schema["const"]
        if schema.get("enum"):
            return _choice(list(schema["enum"]), hint)
        if "allOf" in schema:
            return self.all_of(schema, hint, depth)
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                return self.one_of(schema, combinator, hint, depth)
        kind = _type_of(schema)
        if "default" in schema and kind not in ("object", "array"):
            return schema["default"]
        if kind == "object":
            return self.object_value(schema, hint, depth)
        if kind == "array":
            return self.array_value(schema, hint, depth)
        return _scalar_value(schema, kind, hint, self.words)

    def all_of(self, schema: dict[str, Any], hint: str, depth: int) -> Any:
        """``allOf``: the value of its parts merged into one schema, the node's own keys last."""
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(_resolved(part, self.root))
        merged.update({k: v for k, v in schema.items() if k != "allOf"})
        return self.value(merged, hint, depth + 1)

    def one_of(self, schema: dict[str, Any], combinator: str, hint: str, depth: int) -> Any:
        """``anyOf``/``oneOf``: a scalar default if every option is scalar, else the first non-null option's value."""
        options = [s for s in schema[combinator] if s.get("type") != "null"] or schema[combinator]
        if "default" in schema and _scalar(schema, self.root):
            return schema["default"]
        return self.value(options[0], hint, depth + 1)

    def object_value(self, schema: dict[str, Any], hint: str, depth: int) -> dict[str, Any]:
        """Every property filled, plus ``additionalProperties`` values up to ``minProperties``."""
        value = {name: self.value(sub, f"{hint}-{name}", depth + 1)
                 for name, sub in schema.get("properties", {}).items()}
        extra = schema.get("additionalProperties")
        needed = schema.get("minProperties", 0) - len(value)
        if isinstance(extra, dict) and needed > 0:
            for index in range(needed):
                value[f"{hint}-key{index}"] = self.value(extra, f"{hint}-value{index}", depth + 1)
        return value

    def array_value(self, schema: dict[str, Any], hint: str, depth: int) -> list[Any]:
        """``list_items`` items (``prefixItems`` first) within ``minItems``/``maxItems``, unique if asked."""
        prefix = schema.get("prefixItems") or []
        count = max(len(prefix), schema.get("minItems", 0), self.list_items)
        if schema.get("maxItems") is not None:
            count = min(count, schema["maxItems"])
        if schema.get("items") is False:
            count = min(count, len(prefix))
        items = []
        for index in range(count):
            item_schema = prefix[index] if index < len(prefix) else (schema.get("items") or {})
            items.append(self.value(item_schema, f"{hint}-{index}" if index else hint, depth + 1))
        return _unique(items) if schema.get("uniqueItems") else items


def _type_of(schema: dict[str, Any]) -> Any:
    """The node's type: its first non-null ``type``, else object if it has properties, else string."""
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    return kind


def _scalar_value(schema: dict[str, Any], kind: Any, hint: str, words: Callable[[str], str] | None = None) -> Any:
    """A value of a scalar type: integer, number, boolean, null, or else a string."""
    if kind == "integer":
        return _number(schema, hint, integer=True)
    if kind == "number":
        return _number(schema, hint, integer=False)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return _string(schema, hint, words)


def _unique(items: list[Any]) -> list[Any]:
    """``items`` without repeats, first occurrences in order (values may be unhashable)."""
    unique: list[Any] = []
    for item in items:
        if item not in unique:
            unique.append(item)
    return unique


def _referenced(reference: str, root: dict[str, Any]) -> Any:
    """The schema a local ``$ref`` (``#/$defs/Name``) points to inside ``root``."""
    target: Any = root
    for part in reference.lstrip("#/").split("/"):
        target = target[part]
    return target


def _resolved(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    seen = 0
    while "$ref" in schema and seen < 16:
        schema, seen = _referenced(schema["$ref"], root), seen + 1
    return schema


def _scalar(schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """Whether every non-null option of an anyOf/oneOf is a scalar (so its default may be used)."""
    for option in schema.get("anyOf", schema.get("oneOf", [])):
        option = _resolved(option, root)
        if option.get("type") in ("object", "array") or "properties" in option or "items" in option:
            return False
    return True


def malformed_reply(text: str, style: str) -> str:
    """``text`` (a valid JSON reply) broken the way ``style`` says, to exercise parse repair."""
    if style == "prose":
        return "I looked at this carefully and I think it is fine overall; no JSON needed."
    if style == "truncated":
        return text[: max(1, len(text) // 2)]
    return json.dumps({"unexpected": "shape", "note": "fields are missing"})
