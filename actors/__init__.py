"""opgraph.actors: the Ray processes and the driver-side Session facade.

Owns the GraphExecutor (runs the kernel's state machine), BranchStore shards (copy-on-write
conversation branches), the OperationWorker pool (model and tool calls) and ``Session``.
Names load lazily (PEP 562): importing ``opgraph.actors.models`` for a model id does
not import Ray.
"""

from importlib import import_module
from typing import Any

_SOURCES = {
    "branches": ("BranchStore", "BranchTable", "UnknownBranchError"),
    "executor": ("GraphExecutor", "RunOptions", "UnknownRunError"),
    "runtime": ("Runtime", "connect"),
    "session": ("BranchView", "EventsDropped", "RunControl", "RunFinished", "RuntimeLostError", "Session",
                "flow_stream"),
    "watchers": ("UnknownWatcherError", "envelope_summary"),
    "workers": ("OperationWorker", "Outcome", "RemoteBranch"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "BranchStore",
    "BranchTable",
    "BranchView",
    "EventsDropped",
    "GraphExecutor",
    "OperationWorker",
    "Outcome",
    "RemoteBranch",
    "RunControl",
    "RunFinished",
    "RunOptions",
    "Runtime",
    "RuntimeLostError",
    "Session",
    "UnknownBranchError",
    "UnknownRunError",
    "UnknownWatcherError",
    "connect",
    "envelope_summary",
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
