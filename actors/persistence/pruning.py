"""Deleting the runtime's rows of pruned runs: their run log, and the branches that were theirs alone.

Owns delete-by-run-ids over the runtime's tables, inside a transaction the caller opened
(or counting the same rows instead, for a dry run): a run's header, record batches and
end; the branch heads named in a run's own scopes or given by the caller; and, once the
heads are gone, the copy-on-write records (and their messages) no remaining head reaches.
Which runs go, and which branches another run still needs, is the caller's decision (the
run store's retention). Nothing here decodes a row, so it does not depend on their format.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .backends import Connection

__all__ = [
    "BRANCH_TABLES",
    "RUN_LOG_TABLES",
    "BranchHead",
    "BranchSweep",
    "LoggedRunRow",
    "branch_heads",
    "branch_heads_in_scopes",
    "chunks",
    "delete_rows",
    "delete_run_logs",
    "logged_run_rows",
    "placeholders",
    "run_scope_prefixes",
    "runtime_schema_version",
]

# Children before parents: the order their rows are deleted in.
RUN_LOG_TABLES = ("runtime_run_records", "runtime_run_headers", "runtime_runs")
BRANCH_TABLES = ("runtime_branch_heads", "runtime_branch_records", "runtime_branch_messages")
# Ids in one IN (...) list: well under SQLite's and PostgreSQL's limits on parameters.
CHUNK = 500


def chunks(items: Sequence[Any], size: int = CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def placeholders(count: int) -> str:
    """``?, ?, ...``: ``count`` parameters of an IN list."""
    return ", ".join("?" * count)


def run_scope_prefixes(run_id: str) -> tuple[str, ...]:
    """How the branches a run names for itself begin: its isolated default branch
    (``run-ID-default``, actors/driver/session.py) and each clone it made for a node
    (``branch-ID-NODE``, kernel/registration.py). No other run's branch begins so."""
    return f"run-{run_id}-", f"branch-{run_id}-"


def runtime_schema_version(connection: Connection) -> int | None:
    """The version of the runtime's tables in this database; None when it has none."""
    if connection.dialect == "sqlite":
        present = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'opgraph_runtime_schema'").fetchone()
    else:
        present = connection.execute("SELECT to_regclass('opgraph_runtime_schema')").fetchone()[0]
    if not present:
        return None
    row = connection.execute("SELECT version FROM opgraph_runtime_schema").fetchone()
    return None if row is None else int(row[0])


# -- the run log ---------------------------------------------------------------------------
class LoggedRunRow(NamedTuple):
    """One run as the run log keeps it; ``has_header``: the log can rebuild it."""

    run_id: str
    status: str
    started: float
    finished: float | None
    error: str | None
    has_header: bool


def logged_run_rows(connection: Connection, run_ids: Collection[str] | None = None) -> list[LoggedRunRow]:
    """Every run the run log keeps (or those of ``run_ids``)."""
    sql = ("SELECT r.run_id, r.status, r.started, r.finished, r.error, "
           "CASE WHEN h.run_id IS NULL THEN 0 ELSE 1 END FROM runtime_runs r "
           "LEFT JOIN runtime_run_headers h ON h.run_id = r.run_id")
    if run_ids is None:
        return [LoggedRunRow(*row[:5], bool(row[5])) for row in connection.execute(sql).fetchall()]
    found: list[LoggedRunRow] = []
    for part in chunks(list(run_ids)):
        rows = connection.execute(f"{sql} WHERE r.run_id IN ({placeholders(len(part))})", part).fetchall()
        found.extend(LoggedRunRow(*row[:5], bool(row[5])) for row in rows)
    return found


def delete_run_logs(connection: Connection, run_ids: Sequence[str], *, count_only: bool) -> dict[str, int]:
    """Delete (or count) every run-log row of ``run_ids``: rows per table."""
    counts = dict.fromkeys(RUN_LOG_TABLES, 0)
    for part in chunks(run_ids):
        for table in RUN_LOG_TABLES:
            counts[table] += delete_rows(connection, table, f"run_id IN ({placeholders(len(part))})", part,
                                           count_only=count_only)
    return counts


def delete_rows(connection: Connection, table: str, where: str, parameters: Sequence[Any], *,
                count_only: bool) -> int:
    """Delete the rows of ``table`` that match ``where``, or (``count_only``) count them; how many."""
    if count_only:
        return int(connection.execute(f"SELECT COUNT(*) FROM {table} WHERE {where}", parameters).fetchone()[0])
    return max(0, connection.execute(f"DELETE FROM {table} WHERE {where}", parameters).rowcount)


# -- branches ------------------------------------------------------------------------------
class BranchHead(NamedTuple):
    """Where a branch of one owner (a runtime's store) points: a record of one shard."""

    owner: str
    shard: int
    branch_id: str
    record_id: int


_HEADS = "SELECT owner, shard, branch_id, record_id FROM runtime_branch_heads"


def branch_heads_in_scopes(connection: Connection, prefixes: Sequence[str]) -> list[BranchHead]:
    """Every head, of any owner, whose branch id begins with one of ``prefixes``.

    Exact and case-sensitive on both databases: a byte range in SQLite (its default
    collation compares bytes, and the branch-id index serves it), ``starts_with`` in
    PostgreSQL (whose collation may not order text by bytes)."""
    found: list[BranchHead] = []
    for part in chunks(prefixes, 200):
        if connection.dialect == "sqlite":
            where = " OR ".join(["(branch_id >= ? AND branch_id < ?)"] * len(part))
            parameters = [bound for prefix in part for bound in (prefix, _after_every_extension(prefix))]
        else:
            where = " OR ".join(["starts_with(branch_id, ?)"] * len(part))
            parameters = list(part)
        found.extend(BranchHead(*row) for row in connection.execute(f"{_HEADS} WHERE {where}", parameters))
    return found


def _after_every_extension(prefix: str) -> str:
    """The least string above every string that begins with ``prefix`` (its last character, plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def branch_heads(connection: Connection, branch_ids: Collection[str]) -> list[BranchHead]:
    """Every head, of any owner, of the branches ``branch_ids``."""
    found: list[BranchHead] = []
    for part in chunks(sorted(branch_ids)):
        found.extend(BranchHead(*row) for row in connection.execute(
            f"{_HEADS} WHERE branch_id IN ({placeholders(len(part))})", part))
    return found


@dataclass
class BranchSweep:
    """The branch heads a prune takes away, then the records only they reached.

    ``drop(connection, heads)`` deletes (or counts) heads in the caller's transaction and
    remembers which records they pointed at; ``collect(connection, owner, shard)``, once the
    batches are done, deletes (or counts) the records of those chains that no remaining head
    reaches, with their messages. A record another branch still sees (a clone's parent) stays.
    The same calls serve a dry run: heads counted are treated as gone, so what ``collect``
    counts is what a real prune would delete.
    """

    count_only: bool = False
    gone: set[tuple[str, str]] = field(default_factory=set)  # (owner, branch id) of heads taken away
    seeds: dict[tuple[str, int], set[int]] = field(default_factory=dict)  # (owner, shard) -> their records
    collected: set[tuple[str, int, int]] = field(default_factory=set)  # records counted (dry run)

    def drop(self, connection: Connection, heads: Iterable[BranchHead]) -> int:
        """Delete (or count) ``heads`` not taken already; how many."""
        fresh = [head for head in heads if (head.owner, head.branch_id) not in self.gone]
        fresh = list({(head.owner, head.branch_id): head for head in fresh}.values())
        for head in fresh:
            self.gone.add((head.owner, head.branch_id))
            self.seeds.setdefault((head.owner, head.shard), set()).add(head.record_id)
        if not self.count_only:
            for head in fresh:
                connection.execute("DELETE FROM runtime_branch_heads WHERE owner = ? AND branch_id = ?",
                                   (head.owner, head.branch_id))
        return len(fresh)

    def shards(self) -> list[tuple[str, int]]:
        return sorted(self.seeds)

    def collect(self, connection: Connection, owner: str, shard: int) -> dict[str, int]:
        """Delete (or count) the records of ``owner``'s ``shard`` that only taken heads reached."""
        parents = dict(connection.execute("SELECT record_id, parent_id FROM runtime_branch_records "
                                          "WHERE owner = ? AND shard = ?", (owner, shard)).fetchall())
        reachable: set[int] = set()
        for branch_id, record_id in connection.execute(
                "SELECT branch_id, record_id FROM runtime_branch_heads WHERE owner = ? AND shard = ?", (owner, shard)):
            if (owner, branch_id) in self.gone:  # counted in a dry run: gone, as a real prune leaves it
                continue
            while record_id is not None and record_id not in reachable:
                reachable.add(record_id)
                record_id = parents.get(record_id)
        doomed: set[int] = set()
        for record_id in self.seeds.get((owner, shard), ()):
            while record_id in parents and record_id not in doomed and record_id not in reachable:
                doomed.add(record_id)
                record_id = parents[record_id]
        doomed = {record_id for record_id in doomed if (owner, shard, record_id) not in self.collected}
        counts = {"runtime_branch_records": 0, "runtime_branch_messages": 0}
        for part in chunks(sorted(doomed)):
            where = f"owner = ? AND shard = ? AND record_id IN ({placeholders(len(part))})"
            parameters = (owner, shard, *part)
            counts["runtime_branch_messages"] += delete_rows(connection, "runtime_branch_messages", where,
                                                               parameters, count_only=self.count_only)
            counts["runtime_branch_records"] += delete_rows(connection, "runtime_branch_records", where,
                                                              parameters, count_only=self.count_only)
        if self.count_only:
            self.collected.update((owner, shard, record_id) for record_id in doomed)
        return counts
