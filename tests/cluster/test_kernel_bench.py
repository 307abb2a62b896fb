"""The kernel benchmark script runs end to end at a tiny scale (no Ray, no timing asserted)."""

from __future__ import annotations

import pytest

from opgraph.cluster.bench import kernel as kernel_bench


@pytest.mark.parametrize("signals", [[], ["--signals"]])
def test_every_shape_settles_all_its_nodes_and_a_dict_baseline_is_printed(capsys, signals):
    assert kernel_bench.main(["--scale", "0.01", "--repeat", "1", *signals]) == 0
    out = capsys.readouterr().out
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines()[2:] if line[:1] != " "}
    # 1,000 leaves plus the aggregate; 100 links; the root plus 100 children.
    assert rows["fan-out + aggregation"][0] == "1001"
    assert rows["chain"][0] == "100"
    assert rows["spawn admissions"][0] == "101"
    assert f"progress signals: {'on' if signals else 'off'}" in out
    baselines = [line.split() for line in out.splitlines() if line.startswith("dict baseline ")]
    assert sorted(int(row[2]) for row in baselines) == [100, 1000]
    assert all(float(row[3]) > 0 for row in baselines)


def test_bytecode_counts_are_printed_per_shape_and_grow_with_the_work(capsys):
    assert kernel_bench.main(["--scale", "0.01", "--repeat", "1", "--bytecodes", "--only", "chain"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "bytecodes per settlement" in line]
    # "...: 1,008.2 at N, 1,005.6 at 2N" (thousands separated by commas, the figures by ", ")
    at_n, at_2n = (float(part.split()[0].replace(",", "")) for part in line.split(":")[1].split(", "))
    assert at_n > 100 and at_2n > 100  # a settlement is real interpreter work
    assert 0.8 < at_2n / at_n < 1.25  # per settlement, a chain of 200 costs what one of 100 does


def test_the_spawn_ceiling_is_printed_with_the_spawn_shape_and_bounds_from_its_parts(capsys):
    assert kernel_bench.main(["--scale", "0.01", "--repeat", "1", "--only", "spawns"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("spawn ceiling")]
    numbers = [float(word.replace(",", "")) for word in line.replace(":", " ").split()
               if word.replace(",", "").replace(".", "").isdigit()]
    size, objects_us, settlement_us, ceiling = numbers
    assert size == 100
    assert objects_us > 0 and settlement_us > 0
    assert ceiling == pytest.approx(1e6 / (objects_us + settlement_us), rel=0.05)


def test_the_spawn_ceiling_is_not_printed_without_the_spawn_shape(capsys):
    assert kernel_bench.main(["--scale", "0.01", "--repeat", "1", "--only", "chain"]) == 0
    assert "spawn ceiling" not in capsys.readouterr().out


def test_a_state_that_stalls_is_reported_not_looped_on():
    from opgraph.kernel import FlowState, Graph, PauseRequested, create_operation

    graph = Graph()
    graph.add_node(create_operation("noop"))
    state = FlowState(graph)
    state.handle(PauseRequested())  # paused before the start: nothing is ever dispatched
    with pytest.raises(RuntimeError, match="stalled"):
        kernel_bench.drive(state)
