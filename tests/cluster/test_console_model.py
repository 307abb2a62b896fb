"""What the console reads and draws, without a browser: the store's outline and node summaries on both
backends, the folding of a fan-out into groups, the layout's direction and the SVG's escaping.

No Ray and no browser: the store is written as a run writes it (test_console.py drives the pages).
"""

from __future__ import annotations

import time

from opgraph.cluster.bench.console import record_fanout
from opgraph.cluster.http.console import build_model, render_svg
from opgraph.cluster.store import RunStore

SCRIPT = "<script>alert(1)</script>"


def test_the_store_keeps_a_runs_outline_and_sums_its_nodes_by_state(database_target):
    with RunStore(database_target) as store:
        record_fanout(store, "fan", 50, failed=2)
        outline = store.run_outline("fan")
        assert len(outline["nodes"]) == 52 and ["split", "w0"] in outline["edges"]
        summary = store.node_summary(["fan", "unknown-run"])
        assert summary == {"fan": {"counts": {"completed": 50, "failed": 2}, "tokens": 52 * 30, "cost_usd": 0.0}}
        states = store.node_states("fan")
        assert states["w0"] == "failed" and states["w5"] == "completed" and len(states) == 52
        assert store.run_node("fan", "w5")["result"]["text"] == "answer 6"
        assert [signal["kind"] for signal in store.node_signals("fan", "w5")] == ["queued", "started", "completed"]
        assert store.list_runs(limit=1, offset=1) == []


def test_a_fan_out_is_one_group_between_its_neighbours_laid_out_left_to_right():
    width = 10_000
    outline = {"nodes": [["s", "split", "split"]] + [[f"w{i}", f"row-{i}", "work"] for i in range(width)]
               + [["j", "join", "join"], ["x", "draft", "chat"], ["y", "check", "chat"]],
               "edges": [["s", f"w{i}"] for i in range(width)] + [[f"w{i}", "j"] for i in range(width)]
               + [["j", "x"], ["x", "y"]]}
    started = time.perf_counter()
    model = build_model(outline)
    svg = render_svg(model, {f"w{i}": "completed" for i in range(9_000)} | {"w9999": "failed"}, run_id="r")
    assert time.perf_counter() - started < 5
    assert len(model.shapes) == 5  # split, the group of 10,000, join, draft, check
    (group,) = [shape for shape in model.shapes.values() if shape.group]
    assert len(group.members) == width and group.label == "work"
    xs = {shape.label: shape.x for shape in model.shapes.values()}
    assert xs["split"] < xs["work"] < xs["join"] < xs["draft"] < xs["check"]  # layered by dependency
    assert "work ×10,000" in svg and "✓9,000" in svg and "✗1" in svg and "○999" in svg
    assert svg.count("<a ") == 5


def test_siblings_below_the_group_size_stay_nodes_and_every_name_is_escaped():
    outline = {"nodes": [["a", "classify", "chat"], ["b", SCRIPT, "chat"], ["c", "escalate", "chat"]],
               "edges": [["a", "b"], ["a", "c"]]}
    model = build_model(outline)
    assert not any(shape.group for shape in model.shapes.values())
    svg = render_svg(model, {"a": "completed", "b": "running"}, run_id='run"<x>')
    assert SCRIPT not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg
    assert 'run"<x>' not in svg
    assert model.shapes[model.shape_of["a"]].x < model.shapes[model.shape_of["b"]].x
