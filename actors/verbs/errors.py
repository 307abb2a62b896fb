"""The typed errors branch verbs raise; each names the node whose operation failed.

Owns only the error classes. Tool failures are not here: a failing tool becomes an
observation for the model (see ``tools.py``), never an exception::

    ExecutionError (opgraph.kernel)
    └── VerbError               a branch verb could not produce its result
        ├── VerbParameterError  a missing or invalid parameter (no choices, unknown option, ...)
        ├── ToolDefinitionError a callable cannot be described as a tool
        └── ParseError          text could not become the requested model after every retry
            └── SelectionError  the model's choice was not among the choices after the retry
"""

from __future__ import annotations

from opgraph.kernel import ExecutionError

__all__ = ["ParseError", "SelectionError", "ToolDefinitionError", "VerbError", "VerbParameterError"]


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
