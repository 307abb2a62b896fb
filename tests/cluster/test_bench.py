"""`opgraph bench` end to end: tiny shapes through the real runtime, and beside real lionagi and LangGraph.

The runs join the shared Ray of ``session`` (the bench leaves a Ray it did not start
running). Shapes at ``--nodes 20``: fan-outs of 20 (+ 1 aggregation node), a chain of 2,
and spawns of 2 (root -> 2 children), emitted live or returned.
"""

from __future__ import annotations

import json
import sys

import pytest

from opgraph.cluster.bench.engines import Work, implied_work, schedule
from opgraph.cluster.bench.shapes import main, standard_shapes

SHAPE_KEYS = [shape.key for shape in standard_shapes()]


def test_every_standard_shape_reports_positive_figures_at_or_above_the_ideal(session, tmp_path, capsys):
    """Every standard shape, one run each: medians, nodes/s and ratios in the table and the JSON."""
    path = tmp_path / "figures.json"

    status = main(["--nodes", "20", "--repeat", "1", "--json", str(path)])

    assert status == 0
    output = capsys.readouterr().out
    assert "median of 1 run(s) per shape" in output
    assert "embedded Ray start excluded" in output
    document = json.loads(path.read_text())
    assert document["repeat"] == 1
    assert document["machine"]["cores"] >= 1
    assert [shape["key"] for shape in document["shapes"]] == SHAPE_KEYS
    for shape in document["shapes"]:
        figures = shape["results"]["opgraph"]
        assert figures["status"] == "ok", figures["reason"]
        assert figures["median_seconds"] > 0
        assert figures["nodes_per_second"] > 0
        assert shape["label"] in output
        if shape["ideal_seconds"]:
            # Real sleeps: no run beats the makespan of its latencies (5% for clock granularity).
            assert figures["ratio_to_ideal"] >= 0.95
        else:
            assert figures["ratio_to_ideal"] is None  # 0 ms: nodes/s stands in for a ratio
        if shape["kind"] == "chain":  # what each link costs beyond its sleep, printed too
            overhead = figures["per_link_overhead_ms"]
            assert overhead == pytest.approx(1000 * (figures["median_seconds"] - shape["ideal_seconds"])
                                             / shape["width"])
            assert f"per-link overhead (wall time beyond the ideal, per link): opgraph {overhead:.2f} ms" in output
        else:
            assert figures["per_link_overhead_ms"] is None


def _compare(tmp_path, capsys, shapes: str, peers: str) -> tuple[str, str, dict, dict]:
    """`opgraph bench --shapes SHAPES --nodes 20 --repeat 1 --compare PEERS`: what it printed, its table's
    header line, the JSON document (every library named in it), and the results by shape key."""
    path = tmp_path / "figures.json"
    status = main(["--shapes", shapes, "--nodes", "20", "--repeat", "1", "--compare", peers, "--json", str(path)])
    assert status == 0
    output = capsys.readouterr().out
    header = next(line for line in output.splitlines() if line.startswith("shape"))
    document = json.loads(path.read_text())
    assert document["libraries"] == ["opgraph", *peers.split(",")]
    return output, header, document, {shape["key"]: shape["results"] for shape in document["shapes"]}


def test_compare_lionagi_runs_the_same_shapes_in_the_same_run(session, tmp_path, capsys):
    """fan-out 20 x 50 ms and root -> 2 returned spawns on both libraries; emitted spawns are n/a on lionagi."""
    output, header, document, results = _compare(tmp_path, capsys, "fanout-50ms,spawns-returned,spawns", "lionagi")
    for column in ("opgraph s", "lionagi s", "lionagi nodes/s", "lionagi/ideal", "opgraph/lionagi"):
        assert column in header
    assert document["machine"]["lionagi"]
    for key in ("fanout-50ms", "spawns-returned"):
        for library in ("opgraph", "lionagi"):
            figures = results[key][library]
            assert figures["status"] == "ok", (key, library, figures["reason"])
            assert figures["median_seconds"] > 0
            assert figures["ratio_to_ideal"] >= 0.95
    assert results["spawns"]["opgraph"]["status"] == "ok"
    unsupported = results["spawns"]["lionagi"]
    assert unsupported["status"] == "n/a" and unsupported["median_seconds"] is None
    assert f"lionagi spawns: n/a: {unsupported['reason']}" in output


def test_compare_langgraph_beside_lionagi_runs_each_kind_of_shape(session, tmp_path, capsys):
    """Three libraries in one run: fan-out 20 x 0 ms, chain of 2, fan-out 20 + 1 aggregation, root -> 2
    returned spawns; emitted spawns are n/a on both peers. opgraph's ratio to each peer is a column."""
    shapes = "fanout-0ms,chain,aggregation,spawns-returned,spawns"
    output, header, document, results = _compare(tmp_path, capsys, shapes, "lionagi,langgraph")
    for column in ("langgraph s", "langgraph nodes/s", "langgraph/ideal", "opgraph/lionagi", "opgraph/langgraph"):
        assert column in header
    assert document["machine"]["langgraph"]
    for key in ("fanout-0ms", "chain", "aggregation", "spawns-returned"):
        figures = results[key]["langgraph"]
        assert figures["status"] == "ok", (key, figures["reason"])
        assert figures["median_seconds"] > 0
        if figures["ratio_to_ideal"] is not None:
            assert figures["ratio_to_ideal"] >= 0.95
    unsupported = results["spawns"]["langgraph"]
    assert unsupported["status"] == "n/a"
    assert f"langgraph spawns: n/a: {unsupported['reason']}" in output


def test_compare_lionagi_without_the_package_exits_2_naming_the_extra(monkeypatch, capsys):
    """No lionagi importable: exit 2 before any Ray work, with the install command."""
    monkeypatch.setitem(sys.modules, "lionagi", None)  # makes `import lionagi` raise ImportError

    status = main(["--compare", "lionagi"])

    assert status == 2
    assert "pip install 'opgraph[bench]'" in capsys.readouterr().err


def test_compare_takes_durability_alone_or_known_peers(capsys):
    for wrong in ("lionagi,durability", "crewai"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--compare", wrong])
        assert exit_info.value.code == 2
        assert "choose 'durability', or one or more of lionagi, langgraph" in capsys.readouterr().err


def test_unknown_shape_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--shapes", "fanout-50ms,spiral"])
    assert exit_info.value.code == 2
    assert "unknown shape(s) spiral" in capsys.readouterr().err


# -- engines: wall time against the critical path each run's record implies ---------------------

def test_the_ideal_schedules_recorded_work_at_its_concurrency():
    """a -> b, a -> c, (b, c) -> d at 0.2 s each: 0.6 s with two in flight, 0.8 s with one."""
    work = Work({key: 0.2 for key in "abcd"}, {"b": ["a"], "c": ["a"], "d": ["b", "c"]}, list("abcd"))
    assert schedule(work, 2) == pytest.approx({"ideal_s": 0.6, "critical_path_s": 0.6, "work_s": 0.8, "items": 4})
    assert schedule(work, 1)["ideal_s"] == pytest.approx(0.8)


def test_a_coding_runs_test_runs_are_work_at_their_measured_durations_between_its_turns():
    """Plan (t1), implement (t2), test 0.5 s, fix (t3), test 0.25 s: one chain of 0.2 + 0.2 + 0.5 + 0.2 + 0.25 s."""
    turns = [_Record(2, "turn_completed", {"turn": 1, "after": []}),
             _Record(4, "turn_completed", {"turn": 2, "after": [1]}),
             _Record(8, "turn_completed", {"turn": 3, "after": [2]})]
    gates = [_Record(6, "TestsRan", {"duration_s": 0.5}), _Record(10, "TestsRan", {"duration_s": 0.25})]
    work = implied_work(_Run(turns, gates), 0.2)
    assert work.order == ["t1", "t2", "g1", "t3", "g2"]
    assert (work.after["g1"], work.after["t3"], work.after["g2"]) == (["t2"], ["g1", "t2"], ["t3"])
    assert schedule(work, 5) == pytest.approx({"ideal_s": 1.35, "critical_path_s": 1.35, "work_s": 1.35, "items": 5})


class _Record:
    def __init__(self, seq: int, type_: str, data: dict) -> None:
        self.seq, self.type, self.data, self.agent, self.payload = seq, type_, data, None, None


class _Run:
    def __init__(self, turns: list, gates: list) -> None:
        self.events = _Log(turns, gates)


class _Log:
    def __init__(self, turns: list, gates: list) -> None:
        self._turns, self._gates = turns, gates

    def notifications(self, kind: str | None = None) -> list:
        return [record for record in self._turns if kind in (None, record.type)]

    def events(self) -> list:
        return self._gates


def test_bench_shapes_engines_reports_each_engine_against_its_recorded_critical_path(session, tmp_path, capsys):
    path = tmp_path / "engines.json"
    status = main(["--shapes", "engines", "--engines", "review,planning,coding", "--engine-latency", "0.05",
                   "--repeat", "1", "--json", str(path)])
    assert status == 0
    output = capsys.readouterr().out
    assert "wall/ideal" in output and "review, 4 dimensions" in output and "planning, 6 tasks" in output
    assert "coding, failing pytest" in output
    figures = json.loads(path.read_text())["engines"]
    assert [item["shape"] for item in figures] == ["review", "planning", "coding"]
    for item in figures:
        # every turn waits its latency on the critical path: no run beats its ideal
        assert item["status"] == "completed" and item["wall_s"] >= 0.95 * item["ideal_s"] > 0
        assert item["ideal_s"] >= item["critical_path_s"] >= 2 * 0.05
    coding = figures[-1]
    # the whole chain (plan, implement, 3 fixes; 4 real test runs) is one path: nothing overlaps
    assert (coding["turns"], coding["gates"]) == (5, 4) and coding["gate_s"] > 0
    assert coding["critical_path_s"] == pytest.approx(coding["ideal_s"]) == pytest.approx(5 * 0.05 + coding["gate_s"])


def test_the_dataset_job_benchmark_reports_its_figures_at_a_small_size(tmp_path, capsys):
    """`opgraph bench --shapes map` at 300 rows: one job at 50 ms (each process's peak read), and one of
    300 rows killed twice and run again. Each client starts a Ray of its own; none joins this one."""
    path = tmp_path / "figures.json"

    status = main(["--shapes", "map", "--map-sizes", "300", "--map-concurrency", "20", "--map-kill-rows", "300",
                   "--map-parts", "speed,kills", "--json", str(path)])

    output = capsys.readouterr().out
    document = json.loads((tmp_path / "figures-map.json").read_text())
    (speed,) = document["speed"]
    assert speed["done"] == 300 and speed["rows_per_second"] > 0 and speed["ratio_to_ideal"] >= 0.95
    assert speed["peaks_mib"]["client (driver)"] > 0 and speed["peaks_mib"]["ray::GraphExecutor"] > 0
    killed = document["kills"]
    assert killed["records"] == killed["distinct_ids"] == 300
    assert killed["rows_called_twice"] <= killed["bound"]
    assert "killed twice" in output and "rows called twice" in output
    assert status in (0, 1)  # 1: a ratio above its target, which a busy machine may see at this size
