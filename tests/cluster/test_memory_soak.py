"""A long-lived runtime stays flat run after run: 50 isolated fixed runs, as a server runs them.

    run_workflow x 50 on the shared Session (a server's per-run path: prepare, execute, record
    in the run store, release the run's branches):  in -> n0 .. n99, each a chat on sim/fast

After each run the resident memory of the executor and of the branch store (their
``statistics()`` snapshots) and of this driver process is read. The first runs warm each
process up (allocator arenas, SQLite's page cache, code paths met once); from the tenth run
on, none may grow by more than 10%. A runtime that kept something per run grows without
bound: with the executor's old leak put back (a forgotten run's timer held its whole state
for 300 s), the executor went from 109.5 MiB at run 10 to 124.4 at run 50 and this failed;
without it, 105.9 -> 107.5 (executor), 105.6 -> 108.4 (store), 177.8 -> 179.1 (driver).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import ray

from opgraph.actors.statistics import current_rss_mib
from opgraph.cluster.lanes import open_store
from opgraph.cluster.lanes.fixed import WorkflowSource, file_source, run_workflow

RUNS = 50
BASELINE_RUN = 10  # warmed up by then: what every later run is held to
GROWTH = 1.10  # at most 10% above the baseline run's resident memory
WIDTH = 199  # chat nodes per run: with the input, the fixed lane's most (MAX_NODES)


def fan_out_spec(width: int) -> dict[str, Any]:
    """in -> n0 .. n<width-1>, each a chat on sim/fast; n0 is the output."""
    nodes = [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}}]
    nodes += [{"id": f"n{index}", "kind": "chat", "pos": {"x": 1, "y": index},
               "config": {"prompt": f"Answer part {index}", "model": "sim/fast"}} for index in range(width)]
    edges = [{"id": f"e{index}", "from": "in", "to": f"n{index}"} for index in range(width)]
    return {"version": 1, "nodes": nodes, "edges": edges, "inputs": ["topic"], "outputs": ["n0"]}


def resident(session: Any) -> dict[str, float]:
    """Resident MiB of the executor, each branch store and this driver, from their snapshots now."""
    sizes = {"executor": ray.get(session.runtime.executor.statistics.remote())["rss_mib"]}
    for index, store in enumerate(session.runtime.stores):
        sizes[f"store-{index}"] = ray.get(store.statistics.remote())["rss_mib"]
    sizes["driver"] = current_rss_mib()
    return sizes


@pytest.mark.ray
def test_fifty_isolated_runs_leave_the_executor_the_store_and_the_driver_flat(session, tmp_path):
    definition = tmp_path / "fan-out.json"
    definition.write_text(json.dumps(fan_out_spec(WIDTH)))
    source: WorkflowSource = file_source(definition)
    held_before = ray.get(session.runtime.executor.statistics.remote())["branches"]["branches"]

    async def soak(store: Any) -> list[dict[str, float]]:
        sizes = []
        for index in range(RUNS):
            result = await run_workflow(session, source, inputs={"topic": f"soak {index}"}, store=store,
                                        max_concurrent=WIDTH)
            assert result.status == "completed", result.errors
            sizes.append(await asyncio.to_thread(resident, session))
        return sizes

    with open_store(tmp_path / "runs.db") as store:
        sizes = asyncio.run(soak(store))

    baseline = sizes[BASELINE_RUN - 1]
    for process, base in baseline.items():
        series = [round(size[process], 1) for size in sizes]
        assert max(series[BASELINE_RUN:]) <= base * GROWTH, (process, series)
    statistics = ray.get(session.runtime.executor.statistics.remote())
    assert statistics["runs"] == {}  # every run forgotten once its driver had the envelope
    assert statistics["branches"]["branches"] == held_before  # and every run's branches released
