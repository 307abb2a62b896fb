"""Agents and their emissions: the agent handle, role profiles, emission bundles and repair text.

Owns what an agent is on the driver side (a branch id in the BranchStore, its role,
model, profile and tool permissions; its turns run on workers), the structured-output
model that asks a turn for typed emissions (an "emission bundle"), and the wording of a
repair prompt. Nothing here calls the runtime.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, Field, create_model

from opgraph.actors.verbs import ToolPermissions

from .events import EngineEvent

__all__ = [
    "Agent",
    "agent_permissions",
    "emission_bundle",
    "emission_key",
    "repair_instruction",
    "role_profile",
]

_WORD_BOUNDARY = re.compile(r"(?<!^)(?=[A-Z])")


@dataclass(frozen=True)
class Agent:
    """One engine agent: a branch with a role profile and a model (ADR-0034 D2 ``make_agent``).

    ``id`` is the branch id (so an Agent can be passed wherever a branch is).
    ``permissions`` (tool names it may call, a ``{"allow", "deny"}`` mapping, or
    ToolPermissions), ``cwd`` and ``secure`` are enforced by the runtime: every turn
    carries them to the worker, where a tool call they exclude is refused, typed, and the
    tool never runs; with ``secure`` a tool's path arguments must stay inside ``cwd``.
    ``mcp_servers`` is kept for engines that connect to such servers; no verb reads it.
    """

    id: str
    name: str
    role: str
    model: str | None = None
    modes: tuple[str, ...] = ()
    tools: tuple[Any, ...] = ()
    emits: tuple[type[EngineEvent], ...] = ()
    exempt: bool = False
    permissions: Any = None
    cwd: str | None = None
    secure: bool = True
    mcp_servers: tuple[str, ...] = ()
    extra_prompt: str | None = None
    profile: str = field(default="", repr=False)


def agent_permissions(agent: Agent, narrower: Any = None) -> ToolPermissions | None:
    """What ``agent`` may do with tools, as the worker enforces it; None when unrestricted.

    ``narrower`` (a turn's own ``permissions`` parameter) can only take away: the
    result allows what both allow.
    """
    own = ToolPermissions.of(agent.permissions, cwd=agent.cwd, secure=agent.secure)
    extra = ToolPermissions.of(narrower) if narrower is not None else None
    if own is None:
        return extra
    return own.narrow(extra)


def role_profile(role: str, *, name: str, modes: tuple[str, ...] = (), extra_prompt: str | None = None,
                 emits: tuple[type[EngineEvent], ...] = ()) -> str:
    """The system message an agent's branch starts with."""
    lines = [f"You are {name}, acting as the {role} of an engine run."]
    if modes:
        lines.append(f"Work in these modes: {', '.join(modes)}.")
    if emits:
        lines.append("Report your results as typed emissions: " + ", ".join(kind.__name__ for kind in emits) + ".")
    if extra_prompt:
        lines.append(extra_prompt)
    return "\n".join(lines)


def emission_key(kind: type[BaseModel]) -> str:
    """The bundle field that carries ``kind``: ``IssueFound`` -> ``issue_found``."""
    return _WORD_BOUNDARY.sub("_", kind.__name__).lower()


@lru_cache(maxsize=256)
def emission_bundle(emits: tuple[type[EngineEvent], ...]) -> type[BaseModel]:
    """A structured-output model asking for lists of each emitted type (the capability bundle).

    ``IssueFound`` and ``VerifyResult`` give ``{"issue_found": [...], "verify_result": [...]}``;
    ``by_type()`` returns the items, never the bundle. Cached, so a type set has one bundle.
    """
    if not emits:
        raise ValueError("an emission bundle needs at least one EngineEvent type")
    fields: dict[str, Any] = {}
    for kind in emits:
        if not (isinstance(kind, type) and issubclass(kind, EngineEvent)):
            raise TypeError(f"emits must be EngineEvent subclasses, got {kind!r}")
        fields[emission_key(kind)] = (list[kind], Field(default_factory=list))
    name = "Emissions" + "".join(kind.__name__ for kind in emits)
    bundle = create_model(name[:64], __base__=_Bundle, **fields)
    if all(kind.__module__.startswith("opgraph.") for kind in emits):
        # Of importable types only: pickled by reference (a name this module resolves in
        # __getattr__), so a worker rebuilds the class once, not on every turn it is sent.
        bundle.__module__ = __name__
        bundle.__qualname__ = _BUNDLE_PREFIX + _SEPARATOR.join(
            f"{kind.__module__}:{kind.__qualname__}".replace(".", _DOT) for kind in emits)
    return bundle


_BUNDLE_PREFIX = "emission_bundle__"
_SEPARATOR = "__"
_DOT = "\N{MIDDLE DOT}"  # a qualified name's dot: pickle splits a qualname on "."


class _Bundle(BaseModel):
    """The base of emission bundles: the JSON schema is made once per bundle (a worker asks
    for it on every structured turn) and each caller gets its own copy."""

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        key = (cls, args, tuple(sorted(kwargs.items())))
        cached = _SCHEMAS.get(key)
        if cached is None:
            cached = _SCHEMAS[key] = super().model_json_schema(*args, **kwargs)
        return copy.deepcopy(cached)


_SCHEMAS: dict[Any, dict[str, Any]] = {}


def __getattr__(name: str) -> Any:
    """An emission bundle by its pickled name (see ``emission_bundle``), made in this process."""
    if not name.startswith(_BUNDLE_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    kinds = []
    for part in name[len(_BUNDLE_PREFIX):].split(_SEPARATOR):
        module, _, qualname = part.replace(_DOT, ".").partition(":")
        kinds.append(getattr(importlib.import_module(module), qualname))
    return emission_bundle(tuple(kinds))


def _example(kind: type[BaseModel]) -> dict[str, Any]:
    """A small example of ``kind`` from its required fields (the record's fenced-JSON example)."""
    example: dict[str, Any] = {}
    for name, info in kind.model_fields.items():
        if not info.is_required():
            continue
        annotation = info.annotation
        example[name] = {bool: True, int: 1, float: 0.5}.get(annotation, f"<{name}>")
    return example


def repair_instruction(original: str, emits: tuple[type[EngineEvent], ...]) -> str:
    """Ask again for the emissions, self-contained (a failed turn may not be in the branch).

    It names the expected top-level keys and shows an example built from required
    fields; it asks the model to emit and never supplies the event itself.
    """
    keys = {emission_key(kind): [_example(kind)] for kind in emits}
    return (f"{original}\n\nYour previous reply did not contain the expected emissions. Reply again with only a "
            f"JSON object whose top-level keys are {', '.join(keys)}, each a list of objects matching the "
            f"schema, for example:\n```json\n{json.dumps(keys, indent=2)}\n```")
