"""The fixed-workflow store: versioned definitions, migrations and run records (ADR-0073, ADR-0068 D4).

No Ray is started. Every store test runs on both backends (``database_target``): a
SQLite file under ``tmp_path``, and a new database on the session's real PostgreSQL
server; a few SQLite-only ones (WAL, a file that is not a database, the default path) use
a file. A fake clock ticks one second per reading, so timestamps and orderings are exact.
The definition used throughout is ``in -> draft`` (a chat node).
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import sqlite3
import threading

import psycopg
import pytest
from workflow_specs import draft_spec

from opgraph.actors.persistence.backends import Connection, open_connection
from opgraph.cluster.lanes import ProvenanceError, open_store
from opgraph.cluster.lanes.fixed import WorkflowValidationError, content_hash, fixed_workflow_provenance
from opgraph.cluster.store import (
    MIGRATIONS,
    RUN_TRANSITIONS,
    SCHEMA_VERSION,
    TERMINAL_RUN_STATUSES,
    Migration,
    RunConflictError,
    RunNotFoundError,
    StoreSchemaError,
    WorkflowNameConflictError,
    WorkflowNotFoundError,
    WorkflowStoreError,
    WorkflowVersionNotFoundError,
    canonical_json,
    default_store_path,
    migrate,
)
from opgraph.cluster.store import schema as schema_module
from opgraph.kernel import OpGraphError


def spec(prompt: str = "Draft") -> dict:
    """in -> draft, on the simulated provider's default model."""
    return draft_spec(prompt, "sim/default")


class Clock:
    """1.0, 2.0, 3.0, ... one tick per reading."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def path(database_target):
    """A SQLite file, or a PostgreSQL database's URL: every test using it runs on both."""
    return database_target


@pytest.fixture
def sqlite_path(tmp_path):
    return tmp_path / "opgraph.db"


@pytest.fixture
def store(path):
    with open_store(path, clock=Clock()) as opened:
        yield opened


def raw(path) -> Connection:
    """A second, plain connection to the same database, in autocommit mode (the test closes it)."""
    return open_connection(path)


INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg.IntegrityError)


def registry_provenance(version) -> dict:
    return fixed_workflow_provenance(ref=version.name, content_hash=version.content_hash,
                                        version=version.version).to_payload()


def file_provenance(ref: str = "/flows/x.json") -> dict:
    return fixed_workflow_provenance(ref=ref, content_hash="sha256:" + "a" * 64,
                                        source_kind="workflow_file").to_payload()


# -- definitions -------------------------------------------------------------------------
def test_create_then_resolve_list_and_versions(store):
    created = store.create_workflow("daily-review", spec(), description="the morning review")
    assert (created.name, created.version, created.ref) == ("daily-review", 1, "daily-review@1")
    assert len(created.workflow_id) == 12 and set(created.workflow_id) <= set("0123456789abcdef")
    assert created.content_hash == content_hash(spec())
    assert created.spec == spec() and created.description == "the morning review"
    assert store.resolve("daily-review") == created == store.resolve(created.workflow_id, 1)
    store.create_workflow("alpha", spec("Other"))
    summaries = store.list_workflows()
    assert [s.name for s in summaries] == ["alpha", "daily-review"]
    review = summaries[1]
    assert (review.id, review.latest_version, review.content_hash, review.description) == (
        created.workflow_id, 1, created.content_hash, "the morning review")
    assert review.created_at == review.updated_at == created.created_at
    assert store.versions("daily-review") == [created]


def test_names_are_trimmed_and_bad_names_are_validation_problems(store):
    assert store.create_workflow("  padded  ", spec()).name == "padded"
    assert store.resolve(" padded ").name == "padded"
    for bad in ("", "   ", "x" * 121):
        with pytest.raises(WorkflowValidationError) as caught:
            store.create_workflow(bad, spec())
        assert caught.value.errors and "name" in caught.value.errors[0]["error"]
    assert [s.name for s in store.list_workflows()] == ["padded"]


def test_an_invalid_definition_reports_every_problem_and_writes_nothing(store):
    bad = spec()
    bad["nodes"].append({"id": "g", "kind": "gate", "pos": {"x": 2, "y": 0}})
    bad["edges"].append({"id": "e2", "from": "draft", "to": "nowhere"})
    with pytest.raises(WorkflowValidationError) as caught:
        store.create_workflow("", bad, description=7)
    problems = caught.value.errors
    assert any("name" in p["error"] for p in problems)
    assert any("description" in p["error"] for p in problems)
    assert {"node_id": "g", "edge_id": None} == {k: v for k, v in problems[2].items() if k != "error"}
    assert any(p["edge_id"] == "e2" for p in problems)
    assert store.list_workflows() == []
    store.create_workflow("ok", spec())
    with pytest.raises(WorkflowValidationError):
        store.add_version("ok", bad)
    assert [v.version for v in store.versions("ok")] == [1]


def test_a_definition_without_a_spec_is_stored_and_hashed(store):
    empty = store.create_workflow("later", None)
    assert empty.spec is None
    assert empty.content_hash == content_hash(None)
    assert store.resolve("later").spec is None


def test_a_duplicate_live_name_is_a_typed_conflict(store):
    store.create_workflow("dup", spec())
    with pytest.raises(WorkflowNameConflictError) as caught:
        store.create_workflow(" dup ", spec("different"))
    assert caught.value.name == "dup" and "dup" in str(caught.value)
    assert len(store.list_workflows()) == 1


def test_adding_the_same_content_again_returns_the_latest_version_unchanged(store):
    first = store.create_workflow("same", spec(), description="v1 words")
    reordered = json.loads(json.dumps(spec()), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    assert list(reordered) != list(spec())  # different key order, same canonical content
    assert store.add_version("same", reordered, description="only the words changed") == first
    assert store.versions("same") == [first]
    second = store.add_version("same", spec("Draft again"))
    assert (second.version, second.description) == (2, "v1 words")  # the description carries forward
    assert store.add_version(first.workflow_id, spec("Draft again")) == second


def test_a_pinned_version_never_changes(store):
    """v1 is pinned; v2 is added; v1 reads back byte-identical, and callers cannot mutate it."""
    store.create_workflow("pinned", spec("first prompt"))
    pinned = store.resolve("pinned")
    second = store.add_version("pinned", spec("second prompt"), description="edited")
    assert store.resolve("pinned") == second and second.version == 2
    assert store.resolve("pinned", 1) == pinned
    assert pinned.spec["nodes"][1]["config"]["prompt"] == "first prompt"
    pinned.spec["nodes"][1]["config"]["prompt"] = "mutated by a caller"
    assert store.resolve("pinned", 1).spec == spec("first prompt")
    assert [v.ref for v in store.versions("pinned")] == ["pinned@1", "pinned@2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pinned.version = 3


def test_unknown_workflows_and_versions_are_typed_errors(store):
    with pytest.raises(WorkflowNotFoundError) as caught:
        store.resolve("ghost")
    assert caught.value.name == "ghost" and "ghost" in str(caught.value)
    store.create_workflow("real", spec())
    with pytest.raises(WorkflowVersionNotFoundError) as caught:
        store.resolve("real", 9)
    assert (caught.value.name, caught.value.version) == ("real", 9)
    assert isinstance(caught.value, WorkflowNotFoundError)  # a 404 either way
    with pytest.raises(ValueError, match="integer from 1"):
        store.resolve("real", 0)
    for call in (lambda: store.add_version("ghost", spec()), lambda: store.versions("ghost"),
                 lambda: store.delete_workflow("ghost")):
        with pytest.raises(WorkflowNotFoundError):
            call()


def test_versions_are_immutable_in_the_database_itself(store, path):
    created = store.create_workflow("locked", spec())
    connection = raw(path)
    try:
        with pytest.raises(INTEGRITY_ERRORS, match="immutable"):
            connection.execute("UPDATE workflow_versions SET spec_json = '{}' WHERE version = 1")
        with pytest.raises(INTEGRITY_ERRORS, match="immutable"):
            connection.execute("DELETE FROM workflow_versions")
        stored = connection.execute("SELECT spec_json, content_hash FROM workflow_versions").fetchone()
    finally:
        connection.close()
    assert tuple(stored) == (canonical_json(spec()).decode(), created.content_hash)
    assert store.resolve("locked") == created
    with pytest.raises(WorkflowStoreError, match="immutable"):  # through the store, typed
        with store._transaction(write=True) as db:
            db.execute("DELETE FROM workflow_versions")


def test_soft_delete_frees_the_name_and_keeps_the_versions(store):
    old = store.create_workflow("reused", spec("old"))
    store.add_version("reused", spec("old, edited"))
    store.delete_workflow("reused")
    with pytest.raises(WorkflowNotFoundError):
        store.resolve("reused")
    with pytest.raises(WorkflowNotFoundError):
        store.resolve(old.workflow_id)  # deleted workflows need include_deleted=True
    assert store.list_workflows() == []
    new = store.create_workflow("reused", spec("new"))
    assert new.workflow_id != old.workflow_id and new.version == 1
    assert store.resolve("reused") == new
    assert store.resolve(old.workflow_id, 1, include_deleted=True) == old
    assert [v.version for v in store.versions(old.workflow_id, include_deleted=True)] == [1, 2]
    # By name, include_deleted still finds only the live workflow: names of deleted ones may repeat.
    assert store.resolve("reused", include_deleted=True) == new
    store.delete_workflow(new.workflow_id)
    with pytest.raises(WorkflowNotFoundError):
        store.delete_workflow("reused")


# -- schema ------------------------------------------------------------------------------
def test_migrations_are_numbered_steps_ending_at_the_schema_version():
    assert [m.version for m in MIGRATIONS] == list(range(1, len(MIGRATIONS) + 1))
    assert SCHEMA_VERSION == MIGRATIONS[-1].version >= 2


def test_a_v1_database_with_data_upgrades_without_loss(path):
    connection = raw(path)
    try:
        assert migrate(connection, target=1) == 1
        digest = content_hash(spec())
        connection.execute("INSERT INTO workflows VALUES ('0123456789ab', 'legacy', 'from v1', 5.0, NULL)")
        connection.execute("INSERT INTO workflow_versions VALUES ('0123456789ab', 1, ?, ?, 'from v1', 5.0)",
                           (digest, canonical_json(spec()).decode()))
        assert connection.user_version() == 1
        with pytest.raises(connection.errors):  # no runs table before step 2
            connection.execute("SELECT 1 FROM runs")
    finally:
        connection.close()
    with open_store(path, clock=Clock()) as store:
        assert store.schema_version() == SCHEMA_VERSION
        legacy = store.resolve("legacy")
        assert (legacy.workflow_id, legacy.spec, legacy.content_hash, legacy.created_at) == (
            "0123456789ab", spec(), digest, 5.0)
        assert store.add_version("legacy", spec("v2")).version == 2
        run = store.create_run("r1", session_id="s1", provenance=registry_provenance(legacy), inputs={},
                               workflow=legacy)
        assert run.workflow_id == "0123456789ab"
    with open_store(path) as reopened:  # already current: nothing to apply
        assert reopened.schema_version() == SCHEMA_VERSION
        assert [v.version for v in reopened.versions("legacy")] == [1, 2]


def test_a_failing_migration_step_is_rolled_back_whole(path, monkeypatch):
    broken = Migration(SCHEMA_VERSION + 1, "broken on purpose",
                       ("CREATE TABLE half_done (x TEXT)", "CREATE TABLE no_such_syntax ((("))
    monkeypatch.setattr(schema_module, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(schema_module, "SCHEMA_VERSION", broken.version)
    connection = raw(path)
    try:
        with pytest.raises(connection.errors):
            migrate(connection, target=broken.version)
        assert connection.user_version() == SCHEMA_VERSION
        with pytest.raises(connection.errors):
            connection.execute("SELECT 1 FROM half_done")
    finally:
        connection.close()


def test_a_failing_migration_step_on_a_raw_sqlite_connection_raises_the_driver_error(sqlite_path, monkeypatch):
    broken = Migration(SCHEMA_VERSION + 1, "broken on purpose", ("CREATE TABLE no_such_syntax (((",))
    monkeypatch.setattr(schema_module, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(schema_module, "SCHEMA_VERSION", broken.version)
    connection = sqlite3.connect(sqlite_path, isolation_level=None)
    try:
        with pytest.raises(sqlite3.OperationalError):
            migrate(connection, target=broken.version)
        assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        connection.close()


def test_a_newer_database_is_refused_with_a_typed_error(path):
    connection = raw(path)
    connection.set_user_version(SCHEMA_VERSION + 5)
    connection.close()
    with pytest.raises(StoreSchemaError) as caught:
        open_store(path)
    assert (caught.value.found, caught.value.supported) == (SCHEMA_VERSION + 5, SCHEMA_VERSION)
    assert str(path) in str(caught.value)


def test_a_file_that_is_not_a_database_is_a_store_error(tmp_path):
    bogus = tmp_path / "not.db"
    bogus.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(WorkflowStoreError, match="cannot open"):
        open_store(bogus)


def test_files_use_wal_and_memory_stores_work(sqlite_path):
    open_store(sqlite_path).close()
    connection = sqlite3.connect(sqlite_path)
    try:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        connection.close()
    with open_store(":memory:") as memory:
        assert memory.create_workflow("m", spec()).version == 1
        assert memory.schema_version() == SCHEMA_VERSION


def test_the_default_path_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OPGRAPH_DB", raising=False)
    monkeypatch.delenv("OPGRAPH_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_path() == tmp_path / "home" / ".opgraph" / "opgraph.db"
    monkeypatch.setenv("OPGRAPH_HOME", str(tmp_path / "opg-home"))
    assert default_store_path() == tmp_path / "opg-home" / "opgraph.db"
    target = tmp_path / "nested" / "deeper" / "chosen.db"
    monkeypatch.setenv("OPGRAPH_DB", str(target))
    assert default_store_path() == target
    with open_store() as store:  # creates the missing parent folders
        assert store.path == str(target)
        store.create_workflow("here", spec())
    assert target.is_file()


def test_a_closed_store_says_so(path):
    store = open_store(path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(WorkflowStoreError, match="closed"):
        store.list_workflows()


# -- runs --------------------------------------------------------------------------------
def test_a_run_goes_admitted_running_completed_and_stays_there(store):
    pinned = store.create_workflow("flow", spec())
    provenance = registry_provenance(pinned)
    run = store.create_run("run-1", session_id="session-1", provenance=provenance, inputs={"topic": "x"},
                           workflow=pinned)
    assert (run.status, run.lane, run.source_kind, run.source_ref) == (
        "admitted", "fixed_workflow", "workflow_def", "flow")
    assert (run.workflow_id, run.workflow_name, run.version, run.content_hash) == (
        pinned.workflow_id, "flow", 1, pinned.content_hash)
    assert run.provenance == provenance and run.inputs == {"topic": "x"}
    assert run.started_at is None and run.finished_at is None
    assert store.mark_running("run-1") is True
    assert store.mark_running("run-1") is False  # already running
    running = store.get_run("run-1")
    assert running.status == "running" and running.started_at is not None
    outputs = {"draft": {"text": "hello", "at": {1, 2}}}  # a set is no JSON value: stored as its str()
    assert store.finish_run("run-1", "completed", outputs=outputs) is True
    done = store.get_run("run-1")
    assert done.status == "completed" and done.terminal
    assert done.outputs == {"draft": {"text": "hello", "at": "{1, 2}"}} and done.error is None
    assert done.finished_at > done.started_at > done.created_at
    assert store.finish_run("run-1", "failed", error={"error": "late"}) is False
    assert store.get_run("run-1") == done


def test_a_cancelled_run_stays_cancelled(store):
    store.create_run("c", session_id="s", provenance=file_provenance(), inputs=None)
    assert store.get_run("c").inputs == {}
    assert store.finish_run("c", "cancelled", error={"error": "the run was cancelled"}) is True
    cancelled = store.get_run("c")
    assert store.mark_running("c") is False
    assert store.finish_run("c", "completed", outputs={"x": 1}) is False
    assert store.get_run("c") == cancelled
    assert cancelled.started_at is None and cancelled.error == {"error": "the run was cancelled"}


def test_the_transition_table_makes_terminal_statuses_final():
    for status in TERMINAL_RUN_STATUSES:
        assert RUN_TRANSITIONS[status] == frozenset()
    assert RUN_TRANSITIONS["running"] == TERMINAL_RUN_STATUSES
    assert "running" in RUN_TRANSITIONS["admitted"]


def test_bad_statuses_unknown_and_duplicate_runs(store):
    with pytest.raises(ValueError, match="allowed: admitted, running"):
        store.create_run("x", session_id="s", provenance=file_provenance(), inputs={}, status="completed")
    store.create_run("x", session_id="s", provenance=file_provenance(), inputs={}, status="running")
    assert store.get_run("x").started_at is not None
    with pytest.raises(ValueError, match="completed, failed"):
        store.finish_run("x", "done")
    with pytest.raises(ValueError, match="admitted"):
        store.list_runs(status="finished")
    with pytest.raises(RunConflictError) as caught:
        store.create_run("x", session_id="s", provenance=file_provenance(), inputs={})
    assert caught.value.run_id == "x"
    calls = [lambda: store.get_run("nope"), lambda: store.mark_running("nope"),
             lambda: store.finish_run("nope", "failed"), lambda: store.record_signals("nope", []),
             lambda: store.run_signals("nope"), lambda: store.record_branch("nope", "b", messages=[]),
             lambda: store.run_branches("nope")]
    for call in calls:
        with pytest.raises(RunNotFoundError) as caught:
            call()
        assert caught.value.run_id == "nope"


def test_provenance_is_validated_and_must_match_the_pinned_version(store):
    pinned = store.create_workflow("flow", spec())
    later = store.add_version("flow", spec("v2"))
    with pytest.raises(ProvenanceError):
        store.create_run("r", session_id="s", provenance={"lane": "fixed_workflow"}, inputs={})
    with pytest.raises(ProvenanceError, match="needs"):
        store.create_run("r", session_id="s", provenance=registry_provenance(pinned), inputs={})
    with pytest.raises(ProvenanceError, match="takes no"):
        store.create_run("r", session_id="s", provenance=file_provenance(), inputs={}, workflow=pinned)
    with pytest.raises(ProvenanceError, match="flow@1"):
        store.create_run("r", session_id="s", provenance=registry_provenance(pinned), inputs={}, workflow=later)
    with open_store(":memory:") as other:  # a version this store never held
        foreign = other.create_workflow("flow", spec())
    with pytest.raises(WorkflowVersionNotFoundError):
        store.create_run("r", session_id="s", provenance=registry_provenance(foreign), inputs={}, workflow=foreign)
    assert store.list_runs() == []
    run = store.create_run("r", session_id="s", provenance=file_provenance("/flows/a.json"), inputs={})
    assert (run.workflow_id, run.workflow_name, run.version, run.source_ref) == (None, None, None, "/flows/a.json")


def test_list_runs_is_newest_first_and_filters(store):
    first = store.create_workflow("one", spec())
    second = store.create_workflow("two", spec("two"))
    for run_id, pinned in (("a", first), ("b", second), ("c", first)):
        store.create_run(run_id, session_id="s", provenance=registry_provenance(pinned), inputs={}, workflow=pinned)
    store.create_run("f", session_id="s", provenance=file_provenance("/flows/f.json"), inputs={})
    store.finish_run("c", "failed", error={"error": "boom"})
    assert [r.run_id for r in store.list_runs()] == ["f", "c", "b", "a"]
    assert [r.run_id for r in store.list_runs(workflow="one")] == ["c", "a"]
    assert [r.run_id for r in store.list_runs(workflow=second.workflow_id)] == ["b"]
    assert [r.run_id for r in store.list_runs(workflow="/flows/f.json")] == ["f"]
    assert [r.run_id for r in store.list_runs(status="failed")] == ["c"]
    assert [r.run_id for r in store.list_runs(workflow="one", status="admitted")] == ["a"]
    assert [r.run_id for r in store.list_runs(limit=2)] == ["f", "c"]
    with pytest.raises(ValueError, match="limit"):
        store.list_runs(limit=0)


def test_signals_get_increasing_seqs_and_page_by_after_seq(store):
    store.create_run("r", session_id="s", provenance=file_provenance(), inputs={})
    assert store.record_signals("r", [
        {"node_id": "op-1", "spec_node_id": "draft", "kind": "queued", "elapsed": 0.0, "at": 10.0},
        {"node_id": "op-1", "spec_node_id": "draft", "kind": "started", "elapsed": 0.1, "at": 10.1},
    ]) == 2
    assert store.record_signals("r", [{"node_id": "op-1", "kind": "completed"}]) == 3
    assert store.record_signals("r", []) == 3
    signals = store.run_signals("r")
    assert [(s["seq"], s["kind"]) for s in signals] == [(1, "queued"), (2, "started"), (3, "completed")]
    assert signals[0] == {"seq": 1, "node_id": "op-1", "spec_node_id": "draft", "kind": "queued",
                          "elapsed": 0.0, "at": 10.0}
    assert signals[2]["spec_node_id"] is None and signals[2]["at"] > 0
    assert [s["seq"] for s in store.run_signals("r", after_seq=2)] == [3]
    assert store.run_signals("r", after_seq=3) == []
    with pytest.raises(ValueError, match="signal 1"):
        store.record_signals("r", [{"node_id": "ok", "kind": "queued"}, {"node_id": "no kind"}])
    assert len(store.run_signals("r")) == 3  # the bad batch wrote nothing


def test_branches_upsert_and_keep_their_first_order(store):
    store.create_run("r", session_id="s", provenance=file_provenance(), inputs={})
    store.record_branch("r", "main", messages=[{"role": "user", "content": "hi"}])
    store.record_branch("r", "clone", node_id="draft", messages=[])
    store.record_branch("r", "main", messages=[{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}])
    store.record_branch("r", "clone", messages=[{"role": "assistant", "content": "x"}])
    branches = store.run_branches("r")
    assert [b["branch_id"] for b in branches] == ["main", "clone"]
    assert len(branches[0]["messages"]) == 2 and branches[0]["node_id"] is None
    assert branches[1] == {"branch_id": "clone", "node_id": "draft",
                           "messages": [{"role": "assistant", "content": "x"}]}


def test_clones_are_written_as_prefixes_and_read_back_whole(store):
    """A run's clones of one long branch go in as its messages once and a tail each; they read back as
    lists, a row written before the prefix form existed too, and replacing a row a prefix names keeps
    what the rows continuing it held."""
    store.create_run("r", session_id="s", provenance=file_provenance(), inputs={})
    role = [{"role": "user", "content": f"part {i}"} for i in range(40)]
    tail = [{"role": "assistant", "content": True}]  # equal to 1, not the same JSON: never shared
    clones = [("default", None, role[:30])] + [(f"c{k}", f"n{k}", role[:20 + k] + [{"content": k}])
                                               for k in range(10)]
    clones.append(("other", "n-other", [{"role": "assistant", "content": 1}] + tail))
    store.record_branches("r", clones)
    store.record_branch("r", "old", messages=role[:3])  # a plain list, as every row was written before
    with store._transaction() as db:
        columns = {row["branch_id"]: json.loads(row["messages"])
                   for row in db.execute("SELECT branch_id, messages FROM run_branches WHERE run_id = 'r'")}
    assert columns["c0"] == {"from": "default", "take": 20, "then": [{"content": 0}]}
    assert columns["c5"] == {"from": "c4", "take": 24, "then": role[24:25] + [{"content": 5}]}
    assert isinstance(columns["default"], list) and isinstance(columns["other"], list)
    expected = {branch_id: messages for branch_id, _, messages in clones} | {"old": role[:3]}
    read = store.run_branches("r")
    assert [row["branch_id"] for row in read] == [branch_id for branch_id, _, _ in clones] + ["old"]
    assert {row["branch_id"]: row["messages"] for row in read} == expected
    assert read[1]["node_id"] == "n0"
    store.record_branch("r", "c4", messages=[{"role": "user", "content": "replaced"}])
    expected["c4"] = [{"role": "user", "content": "replaced"}]
    assert {row["branch_id"]: row["messages"] for row in store.run_branches("r")} == expected
    with store._transaction(write=True) as db:
        db.execute("UPDATE run_branches SET messages = ? WHERE branch_id = 'c5'",
                   (json.dumps({"from": "gone", "take": 1, "then": []}),))
    with pytest.raises(WorkflowStoreError, match="branch c5 cannot be read: it continues branch gone"):
        store.run_branches("r")


def test_threads_writing_signals_concurrently_get_unique_contiguous_seqs(store):
    """4 threads x 25 batches of 2 signals, on the one shared connection."""
    store.create_run("r", session_id="s", provenance=file_provenance(), inputs={})
    failures: list[BaseException] = []

    def write(worker: int) -> None:
        try:
            for batch in range(25):
                store.record_signals("r", [{"node_id": f"w{worker}", "kind": f"{batch}.{half}"} for half in (0, 1)])
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread's assert
            failures.append(exc)

    threads = [threading.Thread(target=write, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads) and failures == []
    signals = store.run_signals("r")
    assert [s["seq"] for s in signals] == list(range(1, 201))
    for worker in range(4):
        kinds = [s["kind"] for s in signals if s["node_id"] == f"w{worker}"]
        assert kinds == [f"{batch}.{half}" for batch in range(25) for half in (0, 1)]  # batches stay whole


# -- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("error", [
    WorkflowStoreError("the disk is full"),
    StoreSchemaError("/tmp/x.db", 9, 2),
    WorkflowNameConflictError("dup"),
    WorkflowNotFoundError("ghost"),
    WorkflowVersionNotFoundError("real", 4),
    RunNotFoundError("r-1"),
    RunConflictError("r-2"),
], ids=lambda error: type(error).__name__)
def test_store_errors_pickle_with_their_fields(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and isinstance(copy, OpGraphError)
    assert str(copy) == str(error) and copy.message == error.message
    assert vars(copy) == vars(error)


def test_a_workflow_keeps_at_most_max_versions_and_the_setting_reads_its_environment(tmp_path, monkeypatch):
    """Issue #32, finding 7: versions per workflow were unbounded. Past the cap the store refuses the
    new version and writes nothing; an identical spec is still the existing version."""
    from opgraph.cluster.store import DEFAULT_MAX_VERSIONS, WorkflowVersionLimitError

    with open_store(tmp_path / "capped.db", max_versions=2) as store:
        store.create_workflow("capped", spec("v1"))
        assert store.add_version("capped", spec("v2")).version == 2
        assert store.add_version("capped", spec("v2")).version == 2  # the same hash: no new version
        with pytest.raises(WorkflowVersionLimitError) as refused:
            store.add_version("capped", spec("v3"))
        assert (refused.value.name, refused.value.limit) == ("capped", 2)
        assert pickle.loads(pickle.dumps(refused.value)).limit == 2
        assert [version.version for version in store.versions("capped")] == [1, 2]
    monkeypatch.delenv("OPGRAPH_MAX_VERSIONS", raising=False)
    with open_store(tmp_path / "default.db") as store:
        assert store.max_versions == DEFAULT_MAX_VERSIONS == 1000
    monkeypatch.setenv("OPGRAPH_MAX_VERSIONS", "5")
    with open_store(tmp_path / "from-env.db") as store:
        assert store.max_versions == 5
    monkeypatch.setenv("OPGRAPH_MAX_VERSIONS", "many")
    with pytest.raises(ValueError, match="OPGRAPH_MAX_VERSIONS"):
        open_store(tmp_path / "bad.db")
