"""opgraph.actors.persistence: what the runtime keeps on disk, so that runs outlive its processes.

Owns the database the runtime writes (SQLite by default, ``OPGRAPH_DB``), the durable run
log the executor appends to and recovers from, and the durable branches a BranchStore
reloads. The cluster's run store reads the same file; these tables are the runtime's.
"""

from .database import RUNTIME_SCHEMA_VERSION, Database, database_path
from .runlog import LoggedRun, RunLog, RunLogEntry
from .writer import Writer

__all__ = ["RUNTIME_SCHEMA_VERSION", "Database", "LoggedRun", "RunLog", "RunLogEntry", "Writer", "database_path"]
