"""A run whose process died is settled as failed, not left ``running`` forever.

Pure SQLite and plain subprocesses: no Ray. The "owner" of a run is the process that
created it; the child processes here create a run and exit without settling it.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import textwrap

import pytest

from opgraph.cluster.lanes import open_store
from opgraph.cluster.lanes.fixed import fixed_workflow_provenance
from opgraph.cluster.processes import run_command
from opgraph.cluster.store import RunStore, migrate, owners
from opgraph.cluster.store.owners import ProcessIdentity, current_process, owner_is_alive


def file_provenance() -> dict:
    return fixed_workflow_provenance(ref="/flows/x.json", content_hash="sha256:" + "a" * 64,
                                        source_kind="workflow_file").to_payload()


def start_and_abandon(path, run_id: str, status: str = "running") -> int:
    """Create a run in a child process that then exits without settling it; return its pid."""
    script = textwrap.dedent(f"""
        import os
        from opgraph.cluster.lanes import open_store
        from opgraph.cluster.lanes.fixed import fixed_workflow_provenance
        provenance = fixed_workflow_provenance(ref="/flows/x.json", content_hash="sha256:" + "a" * 64,
                                               source_kind="workflow_file").to_payload()
        store = open_store({str(path)!r})
        store.create_run({run_id!r}, session_id="s", provenance=provenance, inputs={{}}, status={status!r})
        print(os.getpid())
        os._exit(0)  # gone, as after a crash: nothing settles the run
    """)
    done = run_command([sys.executable, "-c", script], timeout=60)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


@pytest.fixture
def path(tmp_path):
    return tmp_path / "opgraph.db"


def test_reading_a_run_whose_process_died_settles_it_as_failed(path):
    pid = start_and_abandon(path, "orphan")
    with open_store(path) as store:
        run = store.get_run("orphan")
        assert run.status == "failed"
        assert run.error["error_type"] == "OwnerProcessLost"
        assert f"pid {pid}" in run.error["error"]
        assert run.finished_at is not None
        assert store.reap_orphaned_runs() == []  # already settled: nothing more to do


def test_listing_settles_orphans_and_leaves_this_processes_runs_running(path):
    start_and_abandon(path, "gone-admitted", status="admitted")
    start_and_abandon(path, "gone-running")
    with open_store(path) as store:
        store.create_run("mine", session_id="s", provenance=file_provenance(), inputs={}, status="running")
        statuses = {run.run_id: run.status for run in store.list_runs()}
        assert statuses == {"gone-admitted": "failed", "gone-running": "failed", "mine": "running"}
        assert [run.run_id for run in store.list_runs(status="running")] == ["mine"]
        mine = store.get_run("mine")
        assert (mine.owner_host, mine.owner_pid) == (current_process().host, os.getpid())


def test_reap_settles_every_orphan_at_once(path):
    start_and_abandon(path, "a")
    start_and_abandon(path, "b")
    with open_store(path) as store:
        assert sorted(store.reap_orphaned_runs()) == ["a", "b"]
        assert {store.get_run(r).status for r in ("a", "b")} == {"failed"}


def test_a_run_owned_on_another_host_or_before_owners_were_recorded_is_left_alone(path):
    with open_store(path) as store:
        for run_id in ("elsewhere", "legacy"):
            store.create_run(run_id, session_id="s", provenance=file_provenance(), inputs={}, status="running")
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        connection.execute("UPDATE runs SET owner_host = 'another-host', owner_pid = 1 WHERE run_id = 'elsewhere'")
        connection.execute("UPDATE runs SET owner_host = NULL, owner_pid = NULL, owner_start = NULL"
                           " WHERE run_id = 'legacy'")
    finally:
        connection.close()
    with open_store(path) as store:
        assert store.reap_orphaned_runs() == []
        assert {store.get_run(r).status for r in ("elsewhere", "legacy")} == {"running"}


def test_a_reused_pid_is_not_mistaken_for_the_owner(monkeypatch):
    # Start tokens as /proc gives them, made stable: a live pid with another token is a new process.
    monkeypatch.setattr(owners, "_start_token", lambda pid: f"boot:{pid}:1")
    here = owners.current_process()
    parent = os.getppid()
    assert owner_is_alive(here, here) is True
    assert owner_is_alive(ProcessIdentity(here.host, here.pid, "boot:earlier"), here) is False
    assert owner_is_alive(ProcessIdentity(here.host, parent, f"boot:{parent}:1"), here) is True
    assert owner_is_alive(ProcessIdentity(here.host, parent, "boot:earlier"), here) is False
    assert owner_is_alive(ProcessIdentity(here.host, parent, None), here) is True  # no token: pid alone
    assert owner_is_alive(ProcessIdentity("another-host", here.pid, here.start), here) is None


def test_a_v2_database_gains_owner_columns_and_keeps_its_runs(path):
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        assert migrate(connection, target=2) == 2
        connection.execute(
            "INSERT INTO runs (run_id, session_id, lane, content_hash, source_kind, source_ref, provenance,"
            " inputs, status, created_at) VALUES ('old', 's', 'fixed_workflow', 'sha256:x', 'workflow_file',"
            " '/f.json', '{}', '{}', 'running', 1.0)")
    finally:
        connection.close()
    with open_store(path) as store:
        old = store.get_run("old")
        assert (old.status, old.owner_host, old.owner_pid) == ("running", None, None)


def test_the_http_api_settles_orphans_when_it_starts(path):
    import asyncio

    from opgraph.cluster.http import create_app

    def status_on_disk() -> str:
        # Read past the store, so only the startup sweep can have settled the run.
        connection = sqlite3.connect(path, isolation_level=None)
        try:
            return connection.execute("SELECT status FROM runs WHERE run_id = 'left-behind'").fetchone()[0]
        finally:
            connection.close()

    async def start_app(store: RunStore) -> str:
        app = create_app(store, session_factory=lambda: None)
        async with app.router.lifespan_context(app):
            return status_on_disk()

    start_and_abandon(path, "left-behind")
    assert status_on_disk() == "running"
    with open_store(path) as store:
        assert asyncio.run(start_app(store)) == "failed"
