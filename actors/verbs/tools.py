"""Tools: plain Python callables described to the model by a pydantic-built schema.

Owns turning a callable into an OpenAI function schema, validating the model's
arguments, and running tool calls. A failing tool (bad arguments or an exception) is
returned as an ``{"error": ...}`` observation; it never fails the operation. A call the
caller's ``ToolPermissions`` exclude is refused the same way, typed
(``"error_type": "ToolPermissionError"``), and the tool is never invoked.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from opgraph.kernel import EscalationRequest, SpawnRequest, extract_requests

from ..models import ToolCall
from .conversation import compact_json
from .errors import ToolDefinitionError, ToolPermissionError
from .permissions import ToolPermissions

__all__ = [
    "Tool",
    "as_tools",
    "emit_tool_requests",
    "format_validation_error",
    "offered",
    "permissions_of",
    "run_tool_call",
    "run_tool_calls",
    "tool",
    "tool_message",
]

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def format_validation_error(error: ValidationError, limit: int = 6) -> str:
    """A pydantic error as one short line per problem: ``field: message``."""
    lines = []
    for detail in error.errors()[:limit]:
        location = ".".join(str(part) for part in detail.get("loc", ())) or "(root)"
        lines.append(f"{location}: {detail.get('msg', 'invalid')}")
    if error.error_count() > limit:
        lines.append(f"... and {error.error_count() - limit} more")
    return "; ".join(lines)


@dataclass(eq=False, repr=False)
class Tool:
    """A callable the model may call, with the schema and validator built from its signature.

    ``Tool.from_function(fn)`` (or the ``@tool`` decorator) reads the type hints and
    defaults; ``Annotated[int, Field(description=...)]`` documents a parameter. Calling
    the Tool object calls the function unchanged; ``invoke`` validates first.
    """

    fn: Callable[..., Any]
    name: str
    description: str
    arguments_model: type[BaseModel]
    _positional_only: tuple[str, ...] = ()
    # Arguments that name files: a secure caller's ToolPermissions confine them to its cwd.
    path_arguments: tuple[str, ...] = ()

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None,
                      description: str | None = None, *, paths: tuple[str, ...] | None = None) -> Tool:
        if isinstance(fn, Tool):
            if name is None and description is None and paths is None:
                return fn
            name, description = name or fn.name, description if description is not None else fn.description
            paths = fn.path_arguments if paths is None else paths
            fn = fn.fn
        if not callable(fn):
            raise ToolDefinitionError(f"a tool must be callable, got {type(fn).__name__}")
        name = name or getattr(fn, "__name__", None) or type(fn).__name__
        if not _TOOL_NAME.match(name):
            raise ToolDefinitionError(f"tool name {name!r} must match [A-Za-z0-9_-]{{1,64}}")
        description = description if description is not None else (inspect.getdoc(fn) or "")
        try:
            signature = inspect.signature(fn)
            target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__
            hints = typing.get_type_hints(target, include_extras=True)
        except (NameError, TypeError, ValueError) as exc:
            raise ToolDefinitionError(f"cannot read the signature of tool {name!r}: {exc}") from exc
        fields: dict[str, Any] = {}
        positional_only: list[str] = []
        extra = "forbid"
        for index, parameter in enumerate(signature.parameters.values()):
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
                raise ToolDefinitionError(f"tool {name!r} takes *{parameter.name}; models pass named arguments only")
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                extra = "allow"
                continue
            if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
                positional_only.append(parameter.name)
            annotation = hints.get(parameter.name, Any)
            default = ... if parameter.default is inspect.Parameter.empty else parameter.default
            # Fields get neutral names and the parameter name as alias: a parameter called
            # ``json`` or ``schema`` would otherwise shadow a BaseModel attribute.
            fields[f"argument_{index}"] = (annotation, Field(default, alias=parameter.name))
        try:
            arguments_model = create_model(f"{name}_arguments", __config__=ConfigDict(extra=extra), **fields)
        except (TypeError, ValueError) as exc:  # pydantic cannot build a schema for a hint
            raise ToolDefinitionError(f"cannot build an argument model for tool {name!r}: {exc}") from exc
        paths = tuple(paths or ())
        named = {parameter.name for parameter in signature.parameters.values()}
        if set(paths) - named:
            raise ToolDefinitionError(f"tool {name!r} declares path arguments {sorted(set(paths) - named)} "
                                      "it does not take")
        return cls(fn, name, description, arguments_model, tuple(positional_only), paths)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        # Rebuilt on the receiving side: dynamic pydantic models do not pickle reliably.
        return (_rebuild_tool, (self.fn, self.name, self.description, self.path_arguments))

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry: ``{"type": "function", "function": {...}}``."""
        parameters = self.arguments_model.model_json_schema(by_alias=True)
        parameters.pop("title", None)
        function: dict[str, Any] = {"name": self.name, "parameters": parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def validate(self, arguments: Mapping[str, Any] | str | None) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword arguments for the function; raises ``ValidationError``."""
        if isinstance(arguments, str):
            validated = self.arguments_model.model_validate_json(arguments or "{}")
        else:
            validated = self.arguments_model.model_validate(dict(arguments or {}))
        values = {field.alias or key: getattr(validated, key)
                  for key, field in type(validated).model_fields.items()}
        values.update(validated.model_extra or {})
        args = [values.pop(parameter) for parameter in self._positional_only]
        return args, values

    async def invoke(self, arguments: Mapping[str, Any] | str | None = None) -> Any:
        """Validate ``arguments`` and run the tool; sync tools run in a worker thread.

        A thread, because a blocking tool would otherwise stall every other operation
        sharing the worker actor's event loop.
        """
        args, kwargs = self.validate(arguments)
        # A callable object's async __call__ is a coroutine function too (callable() cannot tell).
        if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(type(self.fn).__call__):
            return await self.fn(*args, **kwargs)
        result = await asyncio.to_thread(self.fn, *args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result


def _rebuild_tool(fn: Callable[..., Any], name: str, description: str, paths: tuple[str, ...]) -> Tool:
    return Tool.from_function(fn, name, description, paths=paths)


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None, paths: tuple[str, ...] | None = None) -> Any:
    """Decorator form of ``Tool.from_function``: ``@tool``, ``@tool(name=...)``, ``@tool(paths=("path",))``.

    ``paths`` names the arguments that are file paths, which a secure caller's
    permissions confine to its working directory.
    """
    if fn is None:
        return lambda inner: Tool.from_function(inner, name=name, description=description, paths=paths)
    return Tool.from_function(fn, name=name, description=description, paths=paths)


def as_tools(tools: Iterable[Any] | Mapping[str, Any] | None) -> dict[str, Tool]:
    """Tools by name from Tools, plain callables, or a ``{name: callable}`` mapping."""
    if tools is None:
        return {}
    if isinstance(tools, Mapping):
        items = [Tool.from_function(fn, name=name) for name, fn in tools.items()]
    elif callable(tools):
        items = [Tool.from_function(tools)]
    else:
        items = [Tool.from_function(item) for item in tools]
    by_name: dict[str, Tool] = {}
    for item in items:
        if item.name in by_name:
            raise ToolDefinitionError(f"two tools are named {item.name!r}; pass name= to tell them apart")
        by_name[item.name] = item
    return by_name


async def run_tool_call(tools: Mapping[str, Tool], name: str, arguments: Any,
                        permissions: ToolPermissions | None = None) -> dict[str, Any]:
    """One tool call as ``{"function", "arguments", "output"}`` or ``{..., "error"}``.

    This is the boundary where a tool's failure becomes an observation for the model:
    an unknown name, invalid arguments or an exception raised by the tool. A call that
    ``permissions`` exclude is refused here, before the tool is looked at or invoked:
    ``{..., "error", "error_type": "ToolPermissionError"}``.
    """
    entry: dict[str, Any] = {"function": name, "arguments": arguments}
    selected = tools.get(name)
    if permissions is not None:
        refused = permissions.refusal(name, selected.path_arguments if selected is not None else (), arguments)
        if refused is not None:
            entry["error"] = refused.message
            entry["error_type"] = type(refused).__name__
            return entry
    if selected is None:
        known = ", ".join(sorted(tools)) or "none"
        entry["error"] = f"unknown tool {name!r}; available tools: {known}"
        return entry
    try:
        entry["output"] = await selected.invoke(arguments)
    except ValidationError as exc:
        entry["error"] = f"invalid arguments for {name}: {format_validation_error(exc)}"
    except Exception as exc:  # noqa: BLE001 - the tool's own failure is the model's observation, by contract
        entry["error"] = f"{type(exc).__name__}: {exc}"
    return entry


async def run_tool_calls(tools: Mapping[str, Tool], calls: Sequence[ToolCall],
                         permissions: ToolPermissions | None = None) -> list[dict[str, Any]]:
    """Run the calls one model turn proposed, concurrently (they are independent by contract).

    Entries keep the calls' order, so ``zip(calls, entries)`` pairs each with its call id.
    ``permissions`` is checked for every call (see ``run_tool_call``).
    """
    return list(await asyncio.gather(*(run_tool_call(tools, call.name, call.arguments, permissions)
                                       for call in calls)))


def offered(tools: Mapping[str, Tool], permissions: ToolPermissions | None) -> dict[str, Tool]:
    """The tools whose schemas are shown to the model: those ``permissions`` let it call.

    A model may still ask for one it was not shown; the call is then refused, typed.
    """
    if permissions is None:
        return dict(tools)
    return {name: item for name, item in tools.items() if permissions.permits(name)}


def permissions_of(value: Any, branch: Any = None) -> ToolPermissions | None:
    """A verb's ``permissions`` parameter as ToolPermissions (None: unrestricted)."""
    try:
        return ToolPermissions.of(value)
    except ToolPermissionError as exc:
        exc.node_id = getattr(branch, "node_id", None)
        exc.branch_id = getattr(branch, "id", None)
        raise


def tool_message(call_id: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A tool result as the ``tool`` message that answers the call ``call_id``."""
    if "error" in entry:
        refusal = {"error_type": entry["error_type"]} if "error_type" in entry else {}
        content = compact_json({"error": entry["error"], **refusal})
    elif isinstance(entry.get("output"), str):
        content = entry["output"]
    else:
        content = compact_json(entry.get("output"))
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def emit_tool_requests(branch: Any, entries: Iterable[Mapping[str, Any]]) -> list[Any]:
    """Send SpawnRequest/EscalationRequest objects that tools returned to the executor.

    A tool's output otherwise reaches only the model, so the live channel is the one way
    such a request can leave the operation; the same objects seen again in the response
    carry the same key, and the executor de-duplicates them.
    """
    found = extract_requests([entry.get("output") for entry in entries], (SpawnRequest, EscalationRequest))
    for request in found:
        branch.emit(request)
    return found
