"""The run store: SQLite by default (``OPGRAPH_DB``), one file for every lane and engine.

Owns the schema and its migrations, versioned definitions, runs of any lane with their
provenance, capabilities, lifecycle signals, per-node results and branch messages, engine
runs and their events, the writer thread, and which process owns a run. It knows nothing
lane-specific: lanes bring their rules and read their own records back.
"""

from .engine_runs import ENGINE_RUN_STATUSES, EngineRunNotFoundError, EngineRunRecord, EngineRunStore
from .owners import ProcessIdentity, current_process, owner_is_alive
from .recorder import MAX_BACKLOG, RunRecorder
from .runs import (
    MAX_VERSION,
    MIGRATIONS,
    RUN_STATUSES,
    RUN_TRANSITIONS,
    SCHEMA_VERSION,
    TERMINAL_RUN_STATUSES,
    Migration,
    RunConflictError,
    RunNotFoundError,
    RunRecord,
    RunStore,
    StoreSchemaError,
    WorkflowNameConflictError,
    WorkflowNotFoundError,
    WorkflowStoreError,
    WorkflowSummary,
    WorkflowVersion,
    WorkflowVersionNotFoundError,
    default_store_path,
    migrate,
)
from .writer import StoreWriter

__all__ = [
    "ENGINE_RUN_STATUSES",
    "MAX_BACKLOG",
    "MAX_VERSION",
    "MIGRATIONS",
    "RUN_STATUSES",
    "RUN_TRANSITIONS",
    "SCHEMA_VERSION",
    "TERMINAL_RUN_STATUSES",
    "EngineRunNotFoundError",
    "EngineRunRecord",
    "EngineRunStore",
    "Migration",
    "ProcessIdentity",
    "RunConflictError",
    "RunNotFoundError",
    "RunRecord",
    "RunRecorder",
    "RunStore",
    "StoreSchemaError",
    "StoreWriter",
    "WorkflowNameConflictError",
    "WorkflowNotFoundError",
    "WorkflowStoreError",
    "WorkflowSummary",
    "WorkflowVersion",
    "WorkflowVersionNotFoundError",
    "current_process",
    "default_store_path",
    "migrate",
    "owner_is_alive",
]
