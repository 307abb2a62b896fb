"""opgraph.actors: the Ray processes and the driver-side Session facade.

Owns the GraphExecutor (runs the kernel's state machine), BranchStore shards (copy-on-write
conversation branches), the OperationWorker pool (model and tool calls) and ``Session``.
Names load lazily (PEP 562): importing ``opgraph.actors.models`` for a model id does
not import Ray.
"""

from importlib import import_module
from typing import Any

_SOURCES = {
    "branches": ("BranchStore", "BranchTable"),
    "control": ("EventsDropped", "RunControl", "RunFinished"),
    "errors": ("BranchStoreLostError", "RuntimeLostError", "TurnError", "UnknownBranchError", "UnknownRunError"),
    "executor": ("GraphExecutor",),
    "protocol": ("Outcome", "RegisteredOperation", "RunOptions", "RunResources", "TurnResult"),
    "runtime": ("Runtime", "connect", "find_executors"),
    "session": ("BranchView", "Session", "flow_stream"),
    "watchers": ("UnknownWatcherError", "envelope_summary"),
    "workers": ("OperationWorker", "RemoteBranch"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "BranchStore",
    "BranchStoreLostError",
    "BranchTable",
    "BranchView",
    "EventsDropped",
    "GraphExecutor",
    "OperationWorker",
    "Outcome",
    "RegisteredOperation",
    "RemoteBranch",
    "RunControl",
    "RunFinished",
    "RunOptions",
    "RunResources",
    "Runtime",
    "RuntimeLostError",
    "Session",
    "TurnError",
    "TurnResult",
    "UnknownBranchError",
    "UnknownRunError",
    "UnknownWatcherError",
    "connect",
    "envelope_summary",
    "find_executors",
    "flow_stream",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
