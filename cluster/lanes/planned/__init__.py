"""The planned reactive flow lane (ADR-0068 D1): a planner's DAG that may grow, live controls, checkpoint replay.

Owns what only this lane has: the ``--reactive`` modes and the ``--max-ops`` spawn cap, the
capability matrix of an invocation, planning through ``PlanningEngine``, the checkpoint read
back from the run store and run log, its replay without a planner call, and the adapter.
``LANE`` is the entry the lane registry loads; surfaces reach the lane only through it.
"""

from ..registry import LaneEntry
from .adapter import PlannedFlowLane, present, refuse_replay
from .checkpoint import Checkpoint, CheckpointRefusedError, branch_history, find_run, read_checkpoint
from .contract import (
    DEFAULT_SPAWN_CAP,
    PLANNED_REACTIVE_FLOW,
    PlannedModeError,
    check_planned_provenance,
    planned_capabilities,
    planned_provenance,
    reactive_roles,
    sha256_of,
    spawn_cap,
)
from .planning import DEFAULT_MAX_ASSIGNMENTS, PlannedGraph, plan_run
from .replay import Replay, build_replay

LANE = LaneEntry(kind=PLANNED_REACTIVE_FLOW, factory=PlannedFlowLane, capabilities=planned_capabilities("all"),
                 replays_ended_runs=True)

__all__ = [
    "DEFAULT_MAX_ASSIGNMENTS",
    "DEFAULT_SPAWN_CAP",
    "LANE",
    "PLANNED_REACTIVE_FLOW",
    "Checkpoint",
    "CheckpointRefusedError",
    "PlannedFlowLane",
    "PlannedGraph",
    "PlannedModeError",
    "Replay",
    "branch_history",
    "build_replay",
    "check_planned_provenance",
    "find_run",
    "plan_run",
    "planned_capabilities",
    "planned_provenance",
    "present",
    "reactive_roles",
    "read_checkpoint",
    "refuse_replay",
    "sha256_of",
    "spawn_cap",
]
