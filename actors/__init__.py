"""opgraph.actors: the Ray processes and the driver-side Session facade.

Owns the GraphExecutor (runs the kernel's state machine), BranchStore shards (copy-on-write
conversation branches), the OperationWorker pool (model and tool calls) and ``Session``.
"""

from .branches import BranchStore, BranchTable, UnknownBranchError
from .executor import GraphExecutor, RunOptions, UnknownRunError
from .runtime import Runtime, connect
from .session import BranchView, EventsDropped, RunControl, RunFinished, RuntimeLostError, Session, flow_stream
from .watchers import UnknownWatcherError, envelope_summary
from .workers import OperationWorker, Outcome, RemoteBranch

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
