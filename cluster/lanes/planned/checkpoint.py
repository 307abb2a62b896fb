"""A planned run's checkpoint read back: its record, the plan as submitted, what settled and spawned, its branches.

Owns reading what a planned (or play) run left behind, from the run store (its record,
recovery data and recorded branch messages) and the runtime's run log and branch log in
``OPGRAPH_DB`` (the graph as submitted, each settled node's outcome, every admitted spawn
with its parent, and every branch's durable messages). Nothing here plans, runs or
writes a run; ``retire_logged_run`` only marks the log of a run a replay supersedes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opgraph.kernel import Graph, Operation, OpGraphError

from ...store import RunNotFoundError, RunRecord, RunStore

__all__ = ["Checkpoint", "CheckpointRefusedError", "SettledNode", "SpawnedNode", "branch_history", "find_run",
           "read_checkpoint", "replayed_as", "retire_logged_run"]


class CheckpointRefusedError(OpGraphError):
    """A planned run's checkpoint cannot be replayed as asked (failed ops without ``--retry-failed``,
    a branch history missing without ``--allow-degraded-context``, a run that completed or that the
    run log does not keep, an id prefix that is not unique); ``run_id`` names it. Nothing ran."""


@dataclass(frozen=True)
class SettledNode:
    status: str
    response: Any = None
    error: str | None = None


@dataclass(frozen=True)
class SpawnedNode:
    """A child the run admitted: the operation as admitted, the node it follows and who asked."""

    operation: Operation
    after: str | None
    emitter_id: str | None


@dataclass
class Checkpoint:
    record: RunRecord
    graph: Graph  # the plan as submitted: planned nodes only, pending
    settled: dict[str, SettledNode] = field(default_factory=dict)
    spawned: list[SpawnedNode] = field(default_factory=list)
    log_status: str = "live"


def find_run(store: RunStore, run_id: str) -> RunRecord:
    """The run recorded under ``run_id``, or the one run whose id starts with it."""
    try:
        return store.get_run(run_id)
    except RunNotFoundError:
        pass
    matches = [record for record in store.list_runs(limit=100_000) if record.run_id.startswith(run_id)]
    if not matches:
        raise RunNotFoundError(run_id)
    if len(matches) > 1:
        raise CheckpointRefusedError(f"run id prefix {run_id!r} matches {len(matches)} runs ("
                                     f"{', '.join(record.run_id for record in matches[:5])}); give more of it")
    return store.get_run(matches[0].run_id)


def _operation(value: Any) -> Operation:
    return value if isinstance(value, Operation) else Operation.model_validate(value)


def read_checkpoint(record: RunRecord) -> Checkpoint:
    """What the run log keeps of ``record``'s run (``CheckpointRefusedError`` when it keeps nothing)."""
    from opgraph.actors.persistence import RunLog, database_exists, database_path
    from opgraph.actors.persistence.headers import read_header  # local: only a replay reads the log

    path = database_path()
    logged = RunLog(path).load(record.run_id) if database_exists(path) else None
    if logged is None:
        raise CheckpointRefusedError(f"run {record.run_id} is not in the run log at {path}: it cannot be replayed "
                                     "(was it run with durable=False, or on another OPGRAPH_DB?)",
                                     run_id=record.run_id)
    graph = read_header(logged.header).graph  # the graph alone: the replay runs on this process's options
    checkpoint = Checkpoint(record, graph, log_status=logged.entry.status)
    for batch in logged.batches:
        for item in batch:
            kind = item[0]
            if kind == "finished":
                _, _, node_id, _attempt, status, response, error, _error_type = item
                checkpoint.settled[node_id] = SettledNode(status, response, error)
            elif kind == "admitted":
                _, _, operation, after, emitter_id, _assignee, _independent = item
                checkpoint.spawned.append(SpawnedNode(_operation(operation), after, emitter_id))
    return checkpoint


_SUPERSEDED = "superseded: replayed as run "


def retire_logged_run(run_id: str, successor: str) -> None:
    """Mark a run in the run log as superseded by ``successor``: a live (orphaned) one ends, so it is not
    continued in place as well (``opgraph run resume``), and no run is replayed twice."""
    from opgraph.actors.persistence import RunLog, database_path

    log = RunLog(database_path())
    entry = log.entry(run_id)
    if entry is not None:
        log.finish(run_id, "failed" if entry.status == "live" else entry.status,
                   envelope=log.envelope(run_id), error=f"{_SUPERSEDED}{successor} (opgraph o flow --resume)")


def replayed_as(run_id: str) -> str | None:
    """The run that replayed ``run_id``, if one did (the run log says so)."""
    from opgraph.actors.persistence import RunLog, database_exists, database_path

    if not database_exists(database_path()):
        return None
    entry = RunLog(database_path()).entry(run_id)
    if entry is None or not (entry.error or "").startswith(_SUPERSEDED):
        return None
    return entry.error[len(_SUPERSEDED):].split()[0]


def branch_history(branch_id: str, recorded: Mapping[str, list[Any]]) -> list[Any] | None:
    """A branch's messages: as the run store recorded them when the run ended, else as the runtime's
    branch log keeps them (every acknowledged message, even after a kill); None when neither has it."""
    if branch_id in recorded:
        return list(recorded[branch_id])
    from opgraph.actors.persistence import Database, database_exists, database_path
    from opgraph.actors.persistence.branchlog import read_branch

    path = database_path()
    if not database_exists(path):
        return None
    # Whichever runtime wrote it (the killed run's, owned by a process that is gone): no owner is excluded.
    found = read_branch(Database(path), branch_id, besides="\x00")
    return None if found is None else list(found[1])
