"""opgraph.actors.persistence: what the runtime keeps on disk, so that runs outlive its processes.

Owns the database the runtime writes (SQLite by default, ``OPGRAPH_DB``; or PostgreSQL
when it is a ``postgresql://`` URL), the durable run log the executor appends to and
recovers from, and the durable branches a BranchStore reloads. The cluster's run store
reads the same database; these tables are the runtime's. Names load lazily (PEP 562), so
the run store can use ``backends`` without loading Ray.
"""

from importlib import import_module
from typing import Any

_SOURCES = {
    "database": ("RUNTIME_SCHEMA_VERSION", "Database", "database_exists", "database_path"),
    "runlog": ("LoggedRun", "RunLog", "RunLogEntry"),
    "writer": ("Writer",),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = ["RUNTIME_SCHEMA_VERSION", "Database", "LoggedRun", "RunLog", "RunLogEntry", "Writer", "database_exists",
           "database_path"]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
