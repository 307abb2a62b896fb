"""`opgraph bench --shapes planned`: the planned lane's 700-op plan, beside a plain fan-out in the same run.

Topology: scripted planner -> 200 assignments on one role branch; assignments 1..100 each
spawn 5 follow-ups (500 spawns) -> 700 ops at 10 ms, 100 in flight, the run recorded in a
store; then a Session.flow fan-out of 700 sleep nodes at 100, the baseline.
"""

from __future__ import annotations

import json

import pytest

from opgraph.cluster.bench.planned import ideal_seconds
from opgraph.cluster.bench.shapes import main


def test_the_ideal_is_whole_waves_of_the_plans_ops():
    assert ideal_seconds(0.05, 100) == pytest.approx(0.35)  # 700 ops, 100 at a time
    assert ideal_seconds(0.05, 1000) == pytest.approx(0.1)  # never under its two levels: an assignment, its children


def test_the_planned_shape_prints_its_ratio_beside_the_fan_out(session, tmp_path, capsys):
    path = tmp_path / "figures.json"

    status = main(["--shapes", "planned", "--repeat", "1", "--planned-latency", "0.01", "--json", str(path)])

    output = capsys.readouterr().out
    assert status == 0, output
    assert "planned lane, 700 ops" in output and "Session.flow fan-out of 700" in output
    figures = json.loads((tmp_path / "figures-planned.json").read_text())
    assert figures["status"] == "completed" and figures["ops"] == 700
    (run,) = figures["runs"]
    assert run["ops"] == 700 and run["spawned"] == 500
    assert figures["ratio_to_ideal"] >= 0.95 and figures["ratio_to_baseline"] > 0
