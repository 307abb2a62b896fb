"""Retention (the core of `opgraph runs prune` and the server's policy): what a policy deletes, what goes
with a run, what never goes, and pruning beside a live writer. Once on SQLite, once on PostgreSQL.

Rows are written through opgraph's own write paths (the run store, the run log, the branch
journal: tests/support/stored_run_rows.py), so the prune meets the rows a real run leaves.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from stored_run_rows import TABLES, Clock, RunRows, table_counts

from opgraph.actors.persistence.branchlog import read_branch
from opgraph.cluster.store import (
    RetentionPolicy,
    RunStore,
    StoreDatabase,
    WorkflowStoreError,
    prune_runs,
    stored_runs,
    vacuum_store,
)

PLANNED = "planned_reactive_flow"
REPLAYING = frozenset({PLANNED})
LATER = 5_000_000.0  # a "now" after every run written here


def _prune(target, policy, **options):
    with StoreDatabase(str(target)) as store:
        return prune_runs(store, policy, replaying_lanes=REPLAYING, now=options.pop("now", LATER), pause=0,
                          **options)


def _ids(target) -> set[str]:
    with StoreDatabase(str(target)) as store:
        return {run.run_id for run in stored_runs(store, replaying_lanes=REPLAYING)}


def _heads(target) -> set[str]:
    with RunStore(str(target)) as store, store.transaction() as db:
        return {row[0] for row in db.execute("SELECT branch_id FROM runtime_branch_heads")}


def test_a_dry_run_deletes_nothing_and_counts_what_the_prune_then_deletes(database_target):
    """Old runs of every kind, with signals, node results, recorded branches, run logs, engine events,
    and branch records shared between a pruned run and a kept one; a dry run, then the prune."""
    with RunRows(database_target) as rows:
        old = [rows.lane_run(at=1000.0 + index, nodes=4, branches=[f"lane-run{index}-role"])
               for index in range(5)]
        rows.logged_run(started=1100.0)
        rows.logged_run(status="error", started=1101.0)
        rows.engine_run(status="degraded", at=1102.0)
        parent = rows.branch(f"run-{old[0]}-default", 3)
        rows.branch(f"branch-{old[0]}-n1", 1, parent=parent, parent_len=3)
        for index in range(5):
            rows.branch(f"lane-run{index}-role", 2, shard=1)
        kept = rows.lane_run(at=4000.0)
        rows.branch(f"branch-{kept}-n1", 1, parent=parent, parent_len=2)  # sees two of old[0]'s messages
    before = table_counts(database_target)
    policy = RetentionPolicy(keep_last=1)
    dry = _prune(database_target, policy, dry_run=True)
    assert table_counts(database_target) == before, "a dry run changed the database"
    assert dry.dry_run and dry.runs == 8 and dry.reclaimed_bytes is None
    real = _prune(database_target, policy, batch_size=3)
    assert real.runs == dry.runs and real.batches == 3
    assert real.rows == dry.rows, "the dry run counted other rows than the prune deleted"
    after = table_counts(database_target)
    assert {table: before[table] - after[table] for table in TABLES} == {table: real.rows[table] for table in TABLES}
    assert after["runs"] == 1 and after["runtime_runs"] == 1 and after["engine_runs"] == 0
    # old[0]'s default record stays: the kept run's clone still sees two of its messages.
    assert real.rows["runtime_branch_heads"] == 7 and real.rows["runtime_branch_records"] == 6
    assert _heads(database_target) == {f"branch-{kept}-n1"}


def test_keep_last_keeps_the_most_recent_runs_whatever_their_kind(database_target):
    with RunRows(database_target) as rows:
        lanes = [rows.lane_run(at=1000.0 + index * 10) for index in range(6)]
        engine = rows.engine_run(at=1065.0)
        logged = rows.logged_run(started=1066.0)
    report = _prune(database_target, RetentionPolicy(keep_last=3))
    assert report.matched == 8 and report.kept_recent == 3 and report.runs == 5
    assert _ids(database_target) == {lanes[-1], engine, logged}


def test_older_than_counts_from_when_a_run_ended(database_target):
    """A run made long ago that ended lately is young; an unended one is measured from its start."""
    with RunRows(database_target) as rows:
        old = rows.lane_run(at=1000.0, ended=1001.0)
        ended_lately = rows.lane_run(at=1000.0, ended=4950.0)
        young = rows.lane_run(at=4900.0, ended=4901.0)
    report = _prune(database_target, RetentionPolicy(older_than=3600.0), now=5000.0)
    assert report.runs == 1 and report.kept_young == 2
    assert _ids(database_target) == {ended_lately, young}
    assert old not in _ids(database_target)


def test_status_selects_the_runs_of_those_statuses_only(database_target):
    with RunRows(database_target) as rows:
        completed = rows.lane_run(at=1000.0)
        failed = rows.lane_run(status="failed", at=1001.0)
        cancelled = rows.lane_run(status="cancelled", at=1002.0)
        degraded = rows.engine_run(status="degraded", at=1003.0)
        errored = rows.logged_run(status="error", started=1004.0)  # a run that raised reads as failed
    report = _prune(database_target, RetentionPolicy(statuses=frozenset({"failed", "degraded"})))
    assert report.matched == 3 and report.runs == 3
    assert _ids(database_target) == {completed, cancelled}
    assert {failed, degraded, errored}.isdisjoint(_ids(database_target))


def test_a_run_that_can_still_be_resumed_survives_unless_included(database_target):
    """Orphaned with its log, unended (lane, engine, logged), a replayable planned run: kept. An orphan
    without a log, a failed fixed run, a planned run already replayed or completed: deleted."""
    with RunRows(database_target) as rows:
        resumable = {
            rows.orphaned_run(at=1000.0): "orphaned",
            rows.lane_run(status="running", at=1001.0): "live",
            rows.engine_run(status="running", at=1002.0): "live",
            rows.logged_run(status="live", started=1003.0): "live",
            rows.lane_run(status="failed", lane=PLANNED, at=1004.0): "replayable",
            rows.lane_run(status="cancelled", lane=PLANNED, at=1005.0): "replayable",
        }
        replayed = rows.lane_run(status="failed", lane=PLANNED, at=1006.0)
        rows.lane_run(lane=PLANNED, resumed_from=replayed, at=4990.0)  # its replay: young, kept
        gone = {rows.orphaned_run(durable=False, at=1007.0), rows.lane_run(status="failed", at=1008.0), replayed,
                rows.lane_run(lane=PLANNED, at=1009.0)}
    report = _prune(database_target, RetentionPolicy(older_than=60.0), now=5000.0)
    assert report.runs == len(gone) and report.kept_resumable == len(resumable)
    survivors = _ids(database_target)
    assert set(resumable) <= survivors and gone.isdisjoint(survivors)
    reasons = {run["run_id"]: run["resumable"].split(":")[0] for run in report.resumable}
    assert reasons == resumable
    # Told to, it deletes them too (and a dry run said so first).
    dry = _prune(database_target, RetentionPolicy(older_than=60.0, include_resumable=True), dry_run=True, now=5000.0)
    assert dry.runs == len(resumable) and set(resumable) <= _ids(database_target)
    assert _prune(database_target, RetentionPolicy(older_than=60.0, include_resumable=True), now=5000.0).runs == \
        len(resumable)
    assert set(resumable).isdisjoint(_ids(database_target))


def test_a_branch_another_run_still_needs_survives(database_target):
    """Pruned run A: its own default branch and clone, a role branch it recorded, a Session's branch it
    recorded. Kept run B recorded A's clone (a replay continuing it); kept run C cloned A's default.

        A: run-A-default (3 msgs) <- C: branch-C-n1 sees 2 of them
           branch-A-n1 (recorded by B), lane-A-role (A's alone), session-s-default (the Session's)
    """
    with RunRows(database_target) as rows:
        a = rows.lane_run(at=1000.0, branches=["lane-A-role", "session-s-default"])
        default = rows.branch(f"run-{a}-default", 3)
        rows.branch(f"branch-{a}-n1", 2)
        rows.branch("lane-A-role", 2, shard=1)
        rows.branch("session-s-default", 1, shard=1)
        b = rows.lane_run(at=4000.0, branches=[f"branch-{a}-n1"])
        c = rows.lane_run(at=4001.0)
        rows.branch(f"branch-{c}-n1", 1, parent=default, parent_len=2)
        heads_before = _heads(database_target)
    report = _prune(database_target, RetentionPolicy(keep_last=2))
    assert report.runs == 1 and _ids(database_target) == {b, c}
    assert _heads(database_target) == heads_before - {f"run-{a}-default", "lane-A-role"}
    assert report.rows["runtime_branch_heads"] == 2
    assert report.rows["runtime_branch_records"] == 1  # lane-A-role's; A's default record is C's parent
    with RunRows(database_target) as rows:
        owner, messages = read_branch(rows.database, f"branch-{c}-n1", besides="nobody")
        assert [message["content"] for message in messages] == ["m0", "m1", "m0"]
        assert read_branch(rows.database, f"branch-{a}-n1", besides="nobody")[1]  # B's, whole
    # Once B and C go too, A's default record and the clone go with them.
    report = _prune(database_target, RetentionPolicy(keep_last=0))
    assert report.runs == 2 and _heads(database_target) == {"session-s-default"}
    assert table_counts(database_target)["runtime_branch_records"] == 1


def test_pruning_beside_a_process_that_writes_fails_neither(database_target):
    """Another process writes 20 runs (record, signals, node results, branches, run log) and reads
    each back, while this one prunes to the last 5 again and again (every 50 ms, a busy schedule)."""
    with RunStore(str(database_target)):
        pass  # made before the writer starts, so two processes never make it at once
    script = Path(__file__).parent.parent / "support" / "stored_run_rows.py"
    writer = subprocess.Popen([sys.executable, str(script), str(database_target), "20"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in writer.stdout], daemon=True)
    reader.start()
    try:
        assert lines.get(timeout=60).strip() == "started"
        deleted, prunes = 0, 0
        while writer.poll() is None or prunes == 0:
            deleted += _prune(database_target, RetentionPolicy(keep_last=5), now=time.time() + 60).runs
            prunes += 1
            time.sleep(0.05)  # the writer's turn: a schedule, not a loop that holds the lock
        _, errors = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert writer.returncode == 0, errors
    deleted += _prune(database_target, RetentionPolicy(keep_last=5), now=time.time() + 60).runs
    assert deleted == 15 and prunes > 1, (deleted, prunes)
    counts = table_counts(database_target)
    assert counts["runs"] == 5 and counts["runtime_runs"] == 5 and counts["run_signals"] == 5 * 6


def test_a_new_sqlite_store_gives_the_space_of_pruned_runs_back(tmp_path):
    target = tmp_path / "opgraph.db"
    with RunRows(target) as rows:
        for index in range(60):
            rows.lane_run(at=1000.0 + index, nodes=20)
    report = _prune(target, RetentionPolicy(keep_last=5))
    assert report.before.incremental is True
    assert report.reclaimed_bytes > 0.7 * report.before.bytes, report.to_dict()
    assert os.path.getsize(target) == report.after.bytes and report.after.free_bytes == 0


def test_vacuum_converts_a_file_made_before_incremental_vacuum(tmp_path):
    target = tmp_path / "old.db"
    legacy = sqlite3.connect(target)
    legacy.execute("CREATE TABLE made_by_an_older_opgraph (x)")  # tables first: auto_vacuum stays off
    legacy.close()
    with RunRows(target) as rows:
        for index in range(40):
            rows.lane_run(at=1000.0 + index, nodes=20)
    report = _prune(target, RetentionPolicy(keep_last=5))
    assert report.after.incremental is False and report.after.free_bytes > 0
    with StoreDatabase(str(target)) as store:
        vacuumed = vacuum_store(store)
    assert vacuumed["converted_to_incremental"] is True
    assert vacuumed["reclaimed_bytes"] >= report.after.free_bytes * 0.9, vacuumed
    assert sqlite3.connect(target).execute("PRAGMA auto_vacuum").fetchone()[0] == 2


def test_vacuum_gives_up_while_another_writer_holds_the_database(tmp_path):
    target = tmp_path / "opgraph.db"
    with RunRows(target, clock=Clock()) as rows:
        rows.lane_run()
    writer = sqlite3.connect(target, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with StoreDatabase(str(target)) as store, pytest.raises(WorkflowStoreError, match="locked"):
            vacuum_store(store, wait=0.2)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
