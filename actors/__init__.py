"""opgraph.actors: the Ray processes and the driver-side Session facade.

Owns the GraphExecutor (runs the kernel's state machine), BranchStore shards (copy-on-write
conversation branches), the OperationWorker pool (model and tool calls) and ``Session``.
Names load lazily (PEP 562): importing ``opgraph.actors.models`` for a model id does
not import Ray.

The rooms, each a folder:

    driver/       Session, RunControl, FedRun and Runtime: the caller's side, in the caller's process
    executor/     the GraphExecutor actor, its shell (instructions out, outcomes in), the
                  durable run log's append path, and watchers of its runs
    branches/     the copy-on-write branch table, the BranchStore actor, the branch registry
    workers/      the OperationWorker actor, its call channel, single turns, usage
                  tallies, and the supervision of both actor pools
    persistence/  the runtime's database: run log, durable branches, SQL backends
    providers/    model providers (openai, anthropic, sim, scripted) and shared rate limits
    verbs/        the branch verbs (chat, operate, communicate, parse, ReAct, ...)

and, beside them, what every room shares: ``calls`` (the one seam for calls between
actors: typed stubs, asks and tells, the replacement policy), ``errors`` (the actor errors
and the one translation of Ray's), ``settings``, ``protocol`` (the wire rows), ``models``
(the model-call contract) and ``statistics`` (histograms and memory for snapshots).
"""

from .lazy_names import lazy_names

_SOURCES = {
    "branches.store": ("BranchStore", "BranchTable"),
    "driver.control": ("EventsDropped", "Reconnected", "RunControl", "RunFinished"),
    "driver.feed": ("FedRun", "HeldState"),
    "errors": ("BranchStoreLostError", "RuntimeLostError", "TurnError", "UnknownBranchError", "UnknownRunError"),
    "executor.actor": ("GraphExecutor",),
    "protocol": ("Outcome", "RegisteredOperation", "RunOptions", "RunResources", "TurnResult"),
    "driver.runtime": ("Runtime", "connect", "find_executors"),
    "driver.session": ("BranchView", "Session", "flow_stream"),
    "executor.watchers": ("UnknownWatcherError", "envelope_summary"),
    "workers.worker": ("OperationWorker", "RemoteBranch"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "BranchStore",
    "BranchStoreLostError",
    "BranchTable",
    "BranchView",
    "EventsDropped",
    "FedRun",
    "GraphExecutor",
    "HeldState",
    "OperationWorker",
    "Outcome",
    "Reconnected",
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


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)
