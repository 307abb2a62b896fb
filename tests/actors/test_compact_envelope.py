"""The envelope as a driver receives it (protocol ``CompactEnvelope``), without Ray.

The executor leaves the node ids out when they are the submitted graph's, in its order;
the driver puts its own back. What comes out must equal what went in, and a driver that
does not hold as many ids as were left out is refused rather than given a wrong mapping.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from opgraph.actors.executor.shell import ExecutorShell
from opgraph.actors.protocol import CompactEnvelope


def _envelope(ids: list[str], statuses: list[str]) -> dict:
    results = {node_id: {"n": index} for index, (node_id, status) in enumerate(zip(ids, statuses, strict=True))
               if status != "skipped"}
    return {
        "completed_operations": [node_id for node_id in results],
        "operation_results": results,
        "final_context": {"k": 1},
        "skipped_operations": [i for i, s in zip(ids, statuses, strict=True) if s == "skipped"],
        "failed_operations": [i for i, s in zip(ids, statuses, strict=True) if s == "failed"],
        "cancelled_operations": [],
        "operation_statuses": dict(zip(ids, statuses, strict=True)),
        "context_collisions": [],
        "status": "failed" if "failed" in statuses else "completed",
        "run_id": "r1",
        "scheduler_messages": 7,
    }


def _run(envelope: dict, submitted: int) -> SimpleNamespace:
    return SimpleNamespace(envelope=envelope, submitted_nodes=submitted)


@pytest.mark.parametrize("statuses", [["completed"] * 5, ["completed", "failed", "completed", "failed", "completed"],
                                      ["completed", "failed", "skipped", "completed", "failed"]])
def test_ids_of_the_submitted_graph_are_left_out_and_put_back_equal(statuses):
    ids = [f"node-{index}" for index in range(len(statuses))]
    envelope = _envelope(ids, statuses)
    compact = ExecutorShell.compact_result(_run(envelope, len(ids)))
    assert isinstance(compact, CompactEnvelope)
    assert compact.columns["ids"] is None and compact.columns["count"] == len(ids)
    if "skipped" not in statuses:  # every node has a result: no id travels at all
        assert not any(node_id in pickle.dumps(compact).decode("latin-1") for node_id in ids)
    assert pickle.loads(pickle.dumps(compact)).expand(list(ids)) == envelope


def test_a_run_that_grew_past_its_graph_keeps_its_ids():
    """Spawned nodes: the envelope names nodes the driver's graph does not hold."""
    ids = ["emitter", "child-1", "child-2"]
    envelope = _envelope(ids, ["completed"] * 3)
    compact = ExecutorShell.compact_result(_run(envelope, 1))
    assert compact.columns["ids"] == ids
    assert compact.expand(["emitter"]) == envelope
    assert compact.expand(None) == envelope


def test_a_driver_without_as_many_ids_is_refused():
    ids = ["a", "b", "c"]
    compact = ExecutorShell.compact_result(_run(_envelope(ids, ["completed"] * 3), 3))
    with pytest.raises(ValueError, match="left out its 3 node ids, and 2 were known"):
        compact.expand(["a", "b"])
    with pytest.raises(ValueError, match="none were known"):
        compact.expand(None)


def test_an_envelope_without_node_maps_travels_as_it_is():
    envelope = {"status": "completed", "operation_statuses": None, "operation_results": None}
    compact = ExecutorShell.compact_result(_run(envelope, 0))
    assert compact.columns == {} and compact.expand(None) == envelope
