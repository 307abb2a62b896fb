"""Tool permissions: which tools a caller may run, and where their path arguments may point.

Owns ``ToolPermissions`` (an allow-list, a deny-list, a working directory and whether
path arguments are confined to it) and the refusal check the tool runner applies to
every call before the tool is invoked. Permissions travel with a turn's call (the
``permissions`` parameter every verb accepts), so they hold on the worker, for every
verb and every engine, whatever the model asks for.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .confinement import check_inside
from .errors import PathEscapeError, ToolPermissionError

__all__ = ["ToolPermissions"]


def _names(value: Any, what: str) -> frozenset[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable) or any(not isinstance(item, str) or not item for item in value):
        raise ToolPermissionError(f"{what} must be tool names, got {value!r}")
    return frozenset(value)


@dataclass(frozen=True, slots=True)
class ToolPermissions:
    """What a caller (an engine's agent) may do with tools.

    - ``allow``: the tool names it may call (None: every tool it is offered);
    - ``deny``: names it may never call, whatever ``allow`` says;
    - ``cwd``: its working directory; with ``secure`` (the default) a tool's declared path
      arguments (``Tool.path_arguments``) must name something inside it, and a secure
      caller without a ``cwd`` may not call a tool that takes paths at all.
    """

    allow: frozenset[str] | None = None
    deny: frozenset[str] = field(default_factory=frozenset)
    cwd: str | None = None
    secure: bool = True

    @classmethod
    def of(cls, permissions: Any = None, *, cwd: str | None = None, secure: bool = True) -> ToolPermissions | None:
        """Permissions from what a caller gave, or None when nothing is restricted.

        ``permissions`` may be None, a ToolPermissions, a sequence of allowed tool names,
        or a mapping with ``allow``, ``deny``, ``cwd`` and ``secure``; ``cwd`` and
        ``secure`` given here apply when the value does not set them itself.
        """
        if isinstance(permissions, ToolPermissions):
            found = permissions
        elif permissions is None:
            found = cls(cwd=cwd, secure=secure)
        elif isinstance(permissions, Mapping):
            unknown = set(permissions) - {"allow", "deny", "cwd", "secure"}
            if unknown:
                raise ToolPermissionError(f"unknown permission keys {sorted(unknown)}; known: allow, deny, cwd, secure")
            allow = permissions.get("allow")
            found = cls(allow=None if allow is None else _names(allow, "allow"),
                        deny=_names(permissions.get("deny") or (), "deny"),
                        cwd=permissions.get("cwd", cwd), secure=bool(permissions.get("secure", secure)))
        else:
            found = cls(allow=_names(permissions, "permissions"), cwd=cwd, secure=secure)
        if found.cwd is not None and not isinstance(found.cwd, str):
            raise ToolPermissionError(f"cwd must be a folder path, got {found.cwd!r}")
        if found.allow is None and not found.deny and found.cwd is None:
            return None  # nothing to enforce: every offered tool, paths unchecked as before
        return found

    def narrow(self, other: ToolPermissions | None) -> ToolPermissions:
        """Permissions that hold only what both allow (``other`` can never widen these)."""
        if other is None:
            return self
        if self.allow is None:
            allow = other.allow
        else:
            allow = self.allow if other.allow is None else self.allow & other.allow
        return ToolPermissions(allow=allow, deny=self.deny | other.deny, cwd=self.cwd or other.cwd,
                               secure=self.secure or other.secure)

    def permits(self, name: str) -> bool:
        """Whether the tool ``name`` may be called at all (its arguments aside)."""
        return name not in self.deny and (self.allow is None or name in self.allow)

    def refusal(self, name: str, path_arguments: Iterable[str] = (),
                arguments: Any = None) -> ToolPermissionError | None:
        """Why the call ``name(arguments)`` is refused, or None when it may run."""
        if not self.permits(name):
            if self.allow is None:
                allowed = "any tool except " + ", ".join(sorted(self.deny))
            else:
                allowed = ", ".join(sorted(self.allow - self.deny)) or "none"
            return ToolPermissionError(f"permission denied: this agent may not call the tool {name!r} "
                                       f"(allowed: {allowed})", tool=name)
        paths = tuple(path_arguments)
        if not paths or not self.secure:
            return None
        if self.cwd is None:
            return ToolPermissionError(f"permission denied: the tool {name!r} takes paths and this agent has no "
                                       "working directory to confine them to", tool=name)
        values = _argument_values(arguments)
        for argument in paths:
            value = values.get(argument)
            if value is None:
                continue
            try:
                check_inside(self.cwd, str(value))
            except PathEscapeError as exc:
                return ToolPermissionError(f"permission denied: {name}({argument}={value!r}): {exc.message}",
                                           tool=name)
        return None


def _argument_values(arguments: Any) -> Mapping[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, Mapping) else {}
