"""The run store: SQLite by default, or PostgreSQL (``OPGRAPH_DB``), one database for every lane and engine.

Owns the schema and its migrations, versioned definitions, runs of any lane with their
provenance, capabilities, lifecycle signals, per-node results and branch messages, engine
runs and their events, dataset jobs and their rows' answers, the writer thread, which process
owns a run, and retention (pruning old runs and giving their space back). It knows nothing
lane-specific: a lane brings its definition rules (``RunStore(validate_definition=...)``) and
checks its own provenance before it asks for a row.
"""

from . import errors
from .database import StoreDatabase
from .definitions import (
    CONTENT_HASH,
    DEFAULT_MAX_VERSIONS,
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    DefinitionRules,
    Definitions,
    WorkflowSummary,
    WorkflowVersion,
    canonical_json,
    digest,
    is_unicode_text,
    normalise_name,
    parse_ref,
    read_definition_file,
    validate_name,
)
from .engine_runs import ENGINE_RUN_STATUSES, EngineRunRecord, EngineRunStore
from .errors import *  # noqa: F403 - the store's errors, re-exported whole (its __all__)
from .map_jobs import MAP_JOB_STATUSES, MapJobRecord, MapJobStore, RowOutcome
from .owners import ProcessIdentity, current_process, owner_is_alive
from .recorder import MAX_BACKLOG, RunRecorder
from .retention import (
    RETENTION_STATUSES,
    PruneReport,
    RetentionPolicy,
    StoredRun,
    holds_run_log,
    prune_runs,
    select_runs,
    stored_runs,
)
from .runs import (
    OWNER_LOST_SIGNAL,
    OWNER_PROCESS_LOST,
    REGISTRY_SOURCE,
    RESUMED_SIGNAL,
    RunRecord,
    RunStore,
    provenance_columns,
)
from .schema import (
    MAX_VERSION,
    MIGRATIONS,
    RUN_STATUSES,
    RUN_TRANSITIONS,
    SCHEMA_VERSION,
    TERMINAL_RUN_STATUSES,
    Migration,
    default_store_path,
    migrate,
    store_exists,
    store_location,
)
from .space import StoreSize, store_size, vacuum_store
from .writer import StoreWriter

__all__ = [
    "CONTENT_HASH",
    "DEFAULT_MAX_VERSIONS",
    "ENGINE_RUN_STATUSES",
    "MAP_JOB_STATUSES",
    "MAX_BACKLOG",
    "MAX_NAME_LENGTH",
    "MAX_VERSION",
    "MIGRATIONS",
    "NAME_PATTERN",
    "OWNER_LOST_SIGNAL",
    "OWNER_PROCESS_LOST",
    "REGISTRY_SOURCE",
    "RESUMED_SIGNAL",
    "RETENTION_STATUSES",
    "RUN_STATUSES",
    "RUN_TRANSITIONS",
    "SCHEMA_VERSION",
    "TERMINAL_RUN_STATUSES",
    "DefinitionRules",
    "Definitions",
    "EngineRunRecord",
    "EngineRunStore",
    "MapJobRecord",
    "MapJobStore",
    "Migration",
    "ProcessIdentity",
    "PruneReport",
    "RetentionPolicy",
    "RunRecord",
    "RunRecorder",
    "RowOutcome",
    "RunStore",
    "StoreDatabase",
    "StoreSize",
    "StoreWriter",
    "StoredRun",
    "WorkflowSummary",
    "WorkflowVersion",
    "canonical_json",
    "current_process",
    "default_store_path",
    "digest",
    "holds_run_log",
    "is_unicode_text",
    "migrate",
    "normalise_name",
    "owner_is_alive",
    "parse_ref",
    "provenance_columns",
    "prune_runs",
    "read_definition_file",
    "select_runs",
    "store_exists",
    "store_location",
    "store_size",
    "stored_runs",
    "vacuum_store",
    "validate_name",
    *errors.__all__,
]
