"""opgraph.actors: the Ray processes and the driver-side Session facade.

Owns the GraphExecutor (runs the kernel's state machine), BranchStore shards (copy-on-write
conversation branches), the OperationWorker pool (model and tool calls) and ``Session``.
"""

from .branches import BranchStore, BranchTable, UnknownBranchError
from .executor import GraphExecutor, RunOptions, UnknownRunError
from .runtime import Runtime, connect
from .session import BranchView, RunControl, RuntimeLostError, Session, flow_stream
from .workers import OperationWorker, Outcome, RemoteBranch

__all__ = [
    "BranchStore",
    "BranchTable",
    "BranchView",
    "GraphExecutor",
    "OperationWorker",
    "Outcome",
    "RemoteBranch",
    "RunControl",
    "RunOptions",
    "Runtime",
    "RuntimeLostError",
    "Session",
    "UnknownBranchError",
    "UnknownRunError",
    "connect",
    "flow_stream",
]
