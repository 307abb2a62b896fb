"""The runtime's own tables (run log, durable branches) on both backends: SQLite and a real PostgreSQL.

No Ray: the tables are written and read the way the executor and the branch stores do,
from their writer threads, through ``Database``. ``database_target`` runs each test once
per backend (a SQLite file, a new database on the session's PostgreSQL server).
"""

from __future__ import annotations

import multiprocessing

import pytest

from opgraph.actors import BranchTable
from opgraph.actors.persistence import Database, RunLog
from opgraph.actors.persistence.backends import describe, is_postgres, location, postgres_sql, upsert
from opgraph.actors.persistence.branchlog import BranchJournal, load_shard, read_branch, release_branch
from opgraph.actors.persistence.database import DatabaseError


def test_the_run_log_keeps_headers_batches_and_ends(database_target):
    """begin -> append 3 batches (one rewritten) -> finish; resumed (begin again) -> live, records kept."""
    log = RunLog(database_target)
    header = bytes(range(256)) * 4  # binary, every byte value: BLOB / bytea round trip
    log.begin("r1", "executor-0", header, 10.0)
    log.append([("r1", 1, _batch("a")), ("r1", 2, _batch("b"))])
    log.append([("r1", 2, _batch("b2")), ("r1", 3, _batch("c"))])  # a rewritten seq replaces the old one
    assert log.last_seq("r1") == 3
    loaded = log.load("r1")
    assert loaded.header == header and loaded.envelope is None
    assert [batch[0][0] for batch in loaded.batches] == ["a", "b2", "c"]
    assert [entry.run_id for entry in log.runs(status="live", executor="executor-0")] == ["r1"]

    log.finish("r1", "completed", envelope={"status": "completed", "n": 3})
    assert log.entry("r1").status == "completed" and log.envelope("r1") == {"status": "completed", "n": 3}
    log.begin("r1", "executor-1", header, 11.0)  # resumed from its log by another executor
    again = log.load("r1")
    assert (again.entry.status, again.entry.executor, again.envelope) == ("live", "executor-1", None)
    assert len(again.batches) == 3
    log.forget("r1")
    assert log.load("r1").batches == [] and log.last_seq("r1") == 0
    assert log.entry("ghost") is None and log.load("ghost") is None


def test_an_envelope_is_stored_compact_and_read_back_whole_by_another_reader(database_target):
    """Each node id once in the stored envelope (issue #18's million-node peak); any reader gets the
    envelope back equal, and an envelope stored whole before this still reads."""
    from opgraph.actors.persistence.codec import encode

    ids = [f"node-{index:04d}" for index in range(300)]
    envelope = {"completed_operations": ids, "operation_results": {node_id: {"n": i} for i, node_id in
                                                                    enumerate(ids)},
                "final_context": {}, "skipped_operations": [], "failed_operations": [],
                "cancelled_operations": [], "operation_statuses": dict.fromkeys(ids, "completed"),
                "context_collisions": [], "status": "completed", "run_id": "big", "scheduler_messages": 7}
    log = RunLog(database_target)
    log.begin("big", "executor-0", b"h", 1.0)
    written = log.finish("big", "completed", envelope=dict(envelope))
    whole = encode([[envelope]])
    assert written < len(whole) * 0.6  # the ids once, not three times
    assert RunLog(database_target).envelope("big") == envelope
    log.begin("old", "executor-0", b"h", 1.0)
    log.database.transaction([("UPDATE runtime_runs SET status = ?, envelope = ? WHERE run_id = ?",
                               ("completed", whole, "old"))])
    assert RunLog(database_target).load("old").envelope == envelope


def test_a_version_2_file_keeps_its_runs_with_their_headers_moved_out_of_the_run_rows(tmp_path):
    """Schema 3 keeps headers in a table of their own (a status change no longer rewrites a
    megabyte): a file written by schema 2 opens migrated, every run readable and resumable,
    once the operator has said its rows can be trusted (schema 4 signs the run log)."""
    import sqlite3

    import pytest

    from opgraph.actors.persistence.database import RUNTIME_SCHEMA_VERSION, DatabaseError

    path = tmp_path / "v2.db"
    connection = sqlite3.connect(path)
    connection.executescript("""
        CREATE TABLE opgraph_runtime_schema (version INTEGER NOT NULL);
        INSERT INTO opgraph_runtime_schema VALUES (2);
        CREATE TABLE runtime_runs (run_id TEXT PRIMARY KEY, executor TEXT NOT NULL, status TEXT NOT NULL,
            started REAL NOT NULL, finished REAL, header BLOB NOT NULL, envelope BLOB, error TEXT);
        CREATE INDEX runtime_runs_live ON runtime_runs (status, executor);
        CREATE TABLE runtime_run_records (run_id TEXT NOT NULL, seq INTEGER NOT NULL, batch BLOB NOT NULL,
            PRIMARY KEY (run_id, seq));
    """)
    connection.execute("INSERT INTO runtime_runs VALUES ('old', 'executor-0', 'live', 5.0, NULL, ?, NULL, NULL)",
                       (b"the old header",))
    connection.execute("INSERT INTO runtime_run_records VALUES ('old', 1, ?)", (_batch("a"),))
    connection.commit()
    connection.close()

    with pytest.raises(DatabaseError, match="opgraph store migrate --trust-existing"):
        RunLog(path)
    log = RunLog(database=Database(path, trust_existing=True))
    assert log.database.query("SELECT version FROM opgraph_runtime_schema") == [(RUNTIME_SCHEMA_VERSION,)]
    loaded = log.load("old")
    assert (loaded.header, loaded.entry.status, loaded.entry.started) == (b"the old header", "live", 5.0)
    assert [batch[0][0] for batch in loaded.batches] == ["a"]
    log.finish("old", "completed", envelope={"status": "completed"})
    assert RunLog(path).envelope("old") == {"status": "completed"}  # opened again: already migrated


def test_branches_reload_from_either_backend_with_clones_and_dropped_records(database_target):
    """root(m1) -> clone c (+c1) -> root dropped: c reloads with m1, c1; root's head is gone."""
    database = Database(database_target)
    journal = BranchJournal(3)
    table = BranchTable(journal)
    table.create("root", ["m1"])
    table.clone("root", "c")
    table.append("c", ["c1"])
    table.drop("root")
    journal.write(database, journal.take())
    journal.write(database, journal.take())  # nothing new: a no-op

    reloaded = BranchTable.loaded(BranchJournal(3), load_shard(database, 3))
    assert reloaded.messages("c") == ["m1", "c1"] and "root" not in reloaded
    assert load_shard(database, 4).records == []  # another shard's rows are its own


def test_an_appends_token_is_written_with_it_and_reloads(database_target):
    """Reloaded (a replacement store), the table still knows the append's token: the same
    append sent again appends nothing; a tuple token comes back as a tuple, not a list."""
    database = Database(database_target)
    journal = BranchJournal(1)
    table = BranchTable(journal)
    table.create("b", ["s"])
    table.append("b", ["q", "a"], token=b"bytes-token")
    table.append("b", ["q2", "a2"], token=("run", "node", 1))
    journal.write(database, journal.take())

    rows = load_shard(database, 1)
    reloaded = BranchTable.loaded(BranchJournal(1, rows.next_id), rows)
    assert reloaded.append("b", ["q", "a"], token=b"bytes-token") == 5
    assert reloaded.append("b", ["q2", "a2"], token=("run", "node", 1)) == 5
    assert reloaded.messages("b") == ["s", "q", "a", "q2", "a2"]
    assert read_branch(database, "b", besides="another owner") == ("", ["s", "q", "a", "q2", "a2"])


def test_another_owners_branch_is_adopted_from_its_newest_head_and_released(database_target):
    """Owners a and b both hold branch x (b wrote later); then a writes x again: a's is the newest.
    Adopted by c, a lets go; a, left with no branch, loses its rows."""
    database = Database(database_target)
    tables = {}
    for owner, words in (("a", ["a1"]), ("b", ["b1", "b2"])):
        journal = BranchJournal(0, owner=owner)
        tables[owner] = BranchTable(journal)
        tables[owner].create("x", words)
        journal.write(database, journal.take())
    assert read_branch(database, "x", besides="c") == ("b", ["b1", "b2"])
    tables["a"].append("x", ["a2"])
    tables["a"].replace_history("x", "x")  # re-points a's head: written again, now the newest
    tables["a"].journal.write(database, tables["a"].journal.take())
    owner, messages = read_branch(database, "x", besides="c")
    assert owner == "a" and messages[:2] == ["a1", "a2"]
    assert read_branch(database, "x", besides="a")[0] == "b"
    release_branch(database, "a", "x")
    assert load_shard(database, 0, owner="a").records == []  # a held nothing else: its rows went
    assert load_shard(database, 0, owner="b").heads == {"x": 1}


def test_a_failed_write_is_a_typed_error_and_writes_nothing_and_the_database_goes_on(database_target):
    log = RunLog(database_target)
    log.begin("r1", "executor-0", b"h", 1.0)
    with pytest.raises(DatabaseError, match="a write to"):
        log.database.transaction([
            ("INSERT INTO runtime_run_records (run_id, seq, batch) VALUES (?, ?, ?)", ("r1", 1, _batch("kept?"))),
            ("INSERT INTO no_such_table (x) VALUES (?)", (1,)),
        ])
    assert log.last_seq("r1") == 0  # the whole transaction was rolled back
    log.append([("r1", 1, _batch("after"))])
    assert log.load("r1").batches[0][0][0] == "after"


def test_a_lost_postgresql_connection_fails_one_write_and_the_next_reconnects(postgres_server):
    """The server ends the runtime's and the store's sessions (as a restart would): each side's
    next call fails with its typed error, and the one after works on a new connection."""
    import psycopg

    from opgraph.cluster.lanes import open_store
    from opgraph.cluster.store import WorkflowStoreError

    url = postgres_server.database() + "&application_name=opgraph-lost-connection"  # only these are ended
    log, store = RunLog(url), open_store(url)
    log.begin("r1", "executor-0", b"h", 1.0)
    store.create_workflow("kept", {"version": 1, "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}}],
                                   "edges": []})
    with psycopg.connect(url, autocommit=True) as admin:
        ended = admin.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                              "WHERE application_name = 'opgraph-lost-connection' AND pid <> pg_backend_pid()"
                              ).fetchone()[0]
    assert ended == 2
    with pytest.raises(DatabaseError):
        log.append([("r1", 1, _batch("lost"))])
    with pytest.raises(WorkflowStoreError):
        store.list_workflows()
    log.append([("r1", 1, _batch("after"))])
    assert log.load("r1").batches[0][0][0] == "after"
    assert [summary.name for summary in store.list_workflows()] == ["kept"]
    store.close()


def test_two_processes_opening_one_new_database_both_succeed(database_target):
    """Two runtime processes create the tables of one new database at the same time."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        results = pool.map(_open_and_count, [str(database_target)] * 2)
    assert results == [0, 0]


def test_an_unreachable_database_is_a_typed_error_without_its_password():
    with pytest.raises(DatabaseError, match="cannot open the runtime database") as caught:
        Database("postgresql://someone:secret@127.0.0.1:1/nothing")
    assert "secret" not in str(caught.value) and "someone:***@" in str(caught.value)


def test_the_seam_translates_only_what_differs():
    assert is_postgres("postgresql://h/db") and is_postgres("postgres://h/db") and not is_postgres("/tmp/x.db")
    assert location("postgresql://h//db") == "postgresql://h//db"  # a URL is never folded into a Path
    assert str(location("~/x.db")).endswith("/x.db") and "~" not in str(location("~/x.db"))
    assert describe("/tmp/x.db") == "/tmp/x.db"
    assert postgres_sql("SELECT '?', ? WHERE a LIKE 'x%'") == "SELECT '?', %s WHERE a LIKE 'x%%'"
    assert upsert("t", ("a", "b", "c"), ("a",)) == (
        "INSERT INTO t (a, b, c) VALUES (?, ?, ?) ON CONFLICT (a) DO UPDATE SET b = excluded.b, c = excluded.c")


def _batch(tag: str) -> bytes:
    from opgraph.actors.persistence.codec import encode

    return encode([[tag, 1, None]])


def _open_and_count(target: str) -> int:
    return len(RunLog(target).runs())
