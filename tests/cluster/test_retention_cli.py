"""Retention from the outside: `opgraph runs list|prune`, `opgraph store vacuum`, and `opgraph serve`'s
automatic policy pruning beside requests and a process that writes runs.

The CLI runs in-process; the server is the real app (no runtime: these runs are written
through the store's and the run log's own paths, tests/support/stored_run_rows.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from api_server import serve
from stored_run_rows import RunRows, table_counts

from opgraph.cluster.cli import main as cli_main
from opgraph.cluster.cli.commands import _build_parser
from opgraph.cluster.cli.runs import retention_schedule
from opgraph.cluster.http import create_app
from opgraph.cluster.http.retention import RetentionSchedule
from opgraph.cluster.lanes import open_store
from opgraph.cluster.processes import wait_until
from opgraph.cluster.store import RetentionPolicy


@pytest.fixture
def six_runs(database_target):
    """A store (SQLite, then PostgreSQL) with five ended runs and one orphan whose run log is elsewhere
    (OPGRAPH_DB is another database: so it may be resumable there, and is kept)."""
    target = database_target
    with RunRows(target) as rows:
        ids = [rows.lane_run(at=1000.0 + index) for index in range(5)]
        ids.append(rows.orphaned_run(at=900.0))
    return target, ids


def test_runs_prune_counts_on_a_dry_run_then_deletes_and_says_what_it_freed(six_runs, capsys):
    target, ids = six_runs
    before = table_counts(target)
    assert cli_main(["runs", "prune", "--keep-last", "2", "--dry-run", "--json", "--store", str(target)]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert table_counts(target) == before
    assert dry["dry_run"] is True and dry["runs"] == 3 and dry["kept"] == {
        "recent": 2, "younger": 0, "resumable": 1, "changed_meanwhile": 0}
    assert dry["resumable_examples"][0]["run_id"] == ids[-1]
    assert cli_main(["runs", "prune", "--keep-last", "2", "--store", str(target)]) == 0
    printed = capsys.readouterr().out
    assert "deleted 3 of 6 matching runs; kept 2 recent, 0 younger than --older-than, 1 resumable" in printed
    assert [line.split() for line in printed.splitlines() if line.strip().startswith(("runs ", "total "))] == [
        ["runs", "3"], ["total", str(sum(dry["rows"].values()))]]
    assert "given back" in printed and f"kept {ids[-1]} (failed): orphaned" in printed
    assert table_counts(target)["runs"] == 3


def test_runs_prune_refuses_to_guess_which_runs_go(six_runs, capsys):
    target, _ = six_runs
    assert cli_main(["runs", "prune", "--store", str(target)]) == 2
    assert "say which runs go" in capsys.readouterr().err
    assert table_counts(target)["runs"] == 6
    with pytest.raises(SystemExit) as exited:
        cli_main(["runs", "prune", "--older-than", "ten days", "--store", str(target)])
    assert exited.value.code == 2



def test_runs_prune_makes_no_store_where_there_is_none(tmp_path, capsys):
    assert cli_main(["runs", "prune", "--older-than", "1d", "--store", str(tmp_path / "none.db")]) == 2
    assert "there is no run store at" in capsys.readouterr().err
    assert not (tmp_path / "none.db").exists()


def test_runs_list_shows_every_kind_and_what_can_still_be_resumed(tmp_path, capsys):
    target = tmp_path / "opgraph.db"
    with RunRows(target) as rows:
        lane = rows.lane_run(at=1000.0)
        engine = rows.engine_run(status="running", at=1001.0)
        logged = rows.logged_run(status="live", started=1002.0)
    assert cli_main(["runs", "list", "--json", "--store", str(target)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(run["run_id"], run["kind"], run["status"]) for run in listed["runs"]] == [
        (logged, "logged", "running"), (engine, "engine", "running"), (lane, "lane", "completed")]
    assert [bool(run["resumable"]) for run in listed["runs"]] == [True, True, False]
    assert cli_main(["runs", "list", "--status", "completed", "--store", str(target)]) == 0
    printed = capsys.readouterr().out
    assert lane in printed and engine not in printed and "1 of 3 stored runs shown" in printed


def test_store_vacuum_converts_an_older_file_and_prune_vacuum_does_both(tmp_path, capsys):
    target = tmp_path / "old.db"
    legacy = sqlite3.connect(target)
    legacy.execute("CREATE TABLE made_by_an_older_opgraph (x)")
    legacy.close()
    with RunRows(target) as rows:
        for index in range(20):
            rows.lane_run(at=1000.0 + index, nodes=20)
    assert cli_main(["runs", "prune", "--keep-last", "2", "--store", str(target)]) == 0
    assert "`opgraph store vacuum`" in capsys.readouterr().out  # its free pages stay in the file
    assert cli_main(["store", "vacuum", "--json", "--store", str(target)]) == 0
    vacuumed = json.loads(capsys.readouterr().out)
    assert vacuumed["converted_to_incremental"] is True and vacuumed["reclaimed_bytes"] > 0
    assert cli_main(["runs", "prune", "--keep-last", "0", "--vacuum", "--store", str(target)]) == 0
    assert "vacuum: " in capsys.readouterr().out and table_counts(target)["runs"] == 0


def test_serve_takes_its_retention_policy_from_options_or_the_environment(monkeypatch):
    arguments = _build_parser().parse_args(["serve"])
    assert retention_schedule(arguments) is None  # off unless asked for
    arguments = _build_parser().parse_args(["serve", "--retention-keep-last", "50", "--retention-interval", "10m"])
    assert retention_schedule(arguments) == RetentionSchedule(RetentionPolicy(keep_last=50), 600.0)
    monkeypatch.setenv("OPGRAPH_RETENTION_OLDER_THAN", "30d")
    monkeypatch.setenv("OPGRAPH_RETENTION_INTERVAL", "2h")
    arguments = _build_parser().parse_args(["serve"])
    assert retention_schedule(arguments) == RetentionSchedule(RetentionPolicy(older_than=30 * 86400.0), 7200.0)
    monkeypatch.setenv("OPGRAPH_RETENTION_KEEP_LAST", "many")
    with pytest.raises(SystemExit) as exited:
        _build_parser().parse_args(["serve"])
    assert exited.value.code == 2


def test_the_server_prunes_on_its_schedule_beside_requests_and_a_writer(tmp_path, capfd):
    """`opgraph serve` with a policy keeping the last 5, every 0.2 s: 15 old runs go; meanwhile another
    process writes 12 runs and the API keeps answering; at the end the last 5 remain."""
    target = tmp_path / "opgraph.db"
    with RunRows(target, ) as rows:
        for index in range(15):
            rows.lane_run(at=1000.0 + index)
    with open_store(target) as store:
        app = create_app(store, start_runtime=False,
                         retention=RetentionSchedule(RetentionPolicy(keep_last=5), interval=0.2))
        served = serve(app)
        try:
            with served.client(timeout=10) as client:
                wait_until(lambda: len(client.get("/api/runs").json()["runs"]) == 5, timeout=30,
                           what="the first scheduled prune")
                script = Path(__file__).parent.parent / "support" / "stored_run_rows.py"
                writer = subprocess.Popen([sys.executable, str(script), str(target), "12"],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
                answers = []
                try:
                    while writer.poll() is None:
                        answers.append(client.get("/api/runs", params={"limit": 100}).status_code)
                        time.sleep(0.02)
                    _, errors = writer.communicate(timeout=60)
                finally:
                    if writer.poll() is None:
                        writer.kill()
                assert writer.returncode == 0, errors
                assert answers and set(answers) == {200}
                pruning = app.state.retention
                prunes = pruning.runs
                wait_until(lambda: pruning.runs >= prunes + 2, timeout=30, what="two more scheduled prunes")
                assert len(client.get("/api/runs", params={"limit": 100}).json()["runs"]) == 5
        finally:
            served.stop()
    assert table_counts(target)["runs"] == 5 and table_counts(target)["runtime_runs"] == 5
    assert "opgraph serve: retention: deleted 10 of 15 matching runs" in capfd.readouterr().err
