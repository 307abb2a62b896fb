"""The typed errors branch verbs raise; each names the node whose operation failed.

Owns only the error classes. Tool failures are not here: a failing tool becomes an
observation for the model (see ``tools.py``), never an exception; a refused tool call
(``ToolPermissionError``) is such an observation too, typed by its name::

    ExecutionError (opgraph.kernel)
    └── VerbError               a branch verb could not produce its result
        ├── VerbParameterError  a missing or invalid parameter (no choices, unknown option, ...)
        ├── ToolDefinitionError a callable cannot be described as a tool
        ├── ToolPermissionError the caller's permissions exclude this tool call (``tool`` names it)
        ├── ParseError          text could not become the requested model after every retry
        │   └── SelectionError  the model's choice was not among the choices after the retry
        └── SandboxError        a workspace copy or a gate could not do what was asked
            ├── PathEscapeError a path leads outside its root; refused before any write (``path``)
            └── GateError       a gate command could not be started at all
"""

from __future__ import annotations

from opgraph.kernel import ExecutionError

__all__ = [
    "GateError",
    "ParseError",
    "PathEscapeError",
    "SandboxError",
    "SelectionError",
    "ToolDefinitionError",
    "ToolPermissionError",
    "VerbError",
    "VerbParameterError",
]


class VerbError(ExecutionError):
    """A branch verb could not produce its result; ``node_id`` names the operation."""


class VerbParameterError(VerbError):
    """A verb was called with a missing or invalid parameter; the message names the fix."""


class ToolDefinitionError(VerbError):
    """A callable cannot be turned into a tool (bad name, ``*args``, unresolvable hints)."""


class ParseError(VerbError):
    """Text could not be parsed into the requested pydantic model, even after asking again."""


class SelectionError(ParseError):
    """The model kept choosing something that is not one of the offered choices."""


class ToolPermissionError(VerbError):
    """A tool call its caller's permissions exclude (a tool not allowed, or a path argument
    outside the working directory); the tool was never invoked. ``tool`` names it."""

    def __init__(self, message: str, *, tool: str = "", **ids: str | None) -> None:
        super().__init__(message, **ids)
        self.tool = tool


class SandboxError(VerbError):
    """A workspace copy or a gate (a test command run on a worker) could not do what was asked."""


class PathEscapeError(SandboxError):
    """A path that leads outside its root (``..``, an absolute path, a symbolic link); nothing
    was written. ``path`` is the path as given, ``root`` the folder it had to stay in."""

    def __init__(self, message: str, *, path: str = "", root: str = "", **ids: str | None) -> None:
        super().__init__(message, **ids)
        self.path = path
        self.root = root


class GateError(SandboxError):
    """A gate command could not be started (no such program, no shell); nothing ran."""
