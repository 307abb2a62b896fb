"""The run store: SQLite by default, or PostgreSQL (``OPGRAPH_DB``), one database for every lane and engine.

Owns the schema and its migrations, versioned definitions, runs of any lane with their
provenance, capabilities, lifecycle signals, per-node results and branch messages, engine
runs and their events, the writer thread, and which process owns a run. It knows nothing
lane-specific: a lane brings its definition rules (``RunStore(validate_definition=...)``)
and checks its own provenance before it asks for a row.
"""

from .database import StoreDatabase
from .definitions import (
    CONTENT_HASH,
    MAX_NAME_LENGTH,
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
from .errors import (
    EngineRunNotFoundError,
    ProvenanceError,
    RunConflictError,
    RunNotFoundError,
    RunNotResumableError,
    StoreSchemaError,
    WorkflowDefinitionError,
    WorkflowNameConflictError,
    WorkflowNotFoundError,
    WorkflowStoreError,
    WorkflowValidationError,
    WorkflowVersionNotFoundError,
    problem,
)
from .owners import ProcessIdentity, current_process, owner_is_alive
from .recorder import MAX_BACKLOG, RunRecorder
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
from .writer import StoreWriter

__all__ = [
    "CONTENT_HASH",
    "ENGINE_RUN_STATUSES",
    "MAX_BACKLOG",
    "MAX_NAME_LENGTH",
    "MAX_VERSION",
    "MIGRATIONS",
    "OWNER_LOST_SIGNAL",
    "OWNER_PROCESS_LOST",
    "REGISTRY_SOURCE",
    "RESUMED_SIGNAL",
    "RUN_STATUSES",
    "RUN_TRANSITIONS",
    "SCHEMA_VERSION",
    "TERMINAL_RUN_STATUSES",
    "DefinitionRules",
    "Definitions",
    "EngineRunNotFoundError",
    "EngineRunRecord",
    "EngineRunStore",
    "Migration",
    "ProcessIdentity",
    "ProvenanceError",
    "RunConflictError",
    "RunNotFoundError",
    "RunNotResumableError",
    "RunRecord",
    "RunRecorder",
    "RunStore",
    "StoreDatabase",
    "StoreSchemaError",
    "StoreWriter",
    "WorkflowDefinitionError",
    "WorkflowNameConflictError",
    "WorkflowNotFoundError",
    "WorkflowStoreError",
    "WorkflowSummary",
    "WorkflowValidationError",
    "WorkflowVersion",
    "WorkflowVersionNotFoundError",
    "canonical_json",
    "current_process",
    "default_store_path",
    "digest",
    "is_unicode_text",
    "migrate",
    "normalise_name",
    "owner_is_alive",
    "parse_ref",
    "problem",
    "provenance_columns",
    "read_definition_file",
    "store_exists",
    "store_location",
    "validate_name",
]
