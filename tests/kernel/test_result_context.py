"""Where a settled node's result goes: to dependents as ``<id>_result`` (converted once for
all of them), into the envelope, and back onto the graph's Operation unless turned off."""

from __future__ import annotations

import pytest
from kernel_graphs import build, nested  # tests/support: shared kernel test graphs
from pydantic import BaseModel, field_serializer

from opgraph.kernel import Graph, SpawnRequest, create_operation


class Finding(BaseModel):
    title: str
    score: int = 0


def test_children_spawned_from_one_result_share_one_converted_mapping(drive):
    graph = Graph()
    root = graph.add_node(create_operation("chat", {"instruction": "plan"}))
    driver = drive(graph, reactive=True, max_spawn=100, max_concurrent=100)
    requests = [SpawnRequest(instruction=f"task {i}") for i in range(30)]
    driver.complete(root.id, {"requests": requests})
    contexts = [d.parameters["context"][f"{root.id}_result"] for d in driver.dispatched().values()]
    assert len(contexts) == 30
    assert contexts[0] == {"requests": [r.model_dump() for r in requests]}
    assert all(context is contexts[0] for context in contexts)  # one conversion, not thirty


def test_the_shared_mapping_is_named_for_the_runtime_and_made_again_after_a_rebuild(drive):
    """``shared_results`` names the mapping the children share (what the runtime ships once per
    worker); ``dependency_result`` hands out that same object, and makes it when none is kept."""
    graph = Graph()
    root = graph.add_node(create_operation("chat", {"instruction": "plan"}))
    driver = drive(graph, reactive=True, max_spawn=10, max_concurrent=10)
    driver.complete(root.id, [SpawnRequest(instruction=f"task {i}") for i in range(3)])
    context = next(iter(driver.dispatched().values())).parameters["context"][f"{root.id}_result"]
    assert driver.state.shared_results() == {root.id: context}
    assert driver.state.dependency_result(root.id) is context
    driver.state._mapped_results.clear()  # as a rebuilt run starts: nothing converted yet
    again = driver.state.dependency_result(root.id)
    assert again == context and driver.state.shared_results() == {root.id: again}
    with pytest.raises(KeyError):
        driver.state.dependency_result("not-a-node")


def test_a_single_dependent_gets_a_fresh_mapping_and_nothing_is_kept(drive):
    graph = Graph()
    a = graph.add_node(create_operation("chat"))
    b = graph.add_node(create_operation("chat"))
    graph.add_edge(a, b)
    driver = drive(graph)
    driver.complete(a.id, Finding(title="x"))
    (dispatch,) = driver.dispatched().values()
    assert dispatch.parameters["context"][f"{a.id}_result"] == {"title": "x", "score": 0}
    assert driver.state._mapped_results == {}


def test_dependents_of_a_fork_each_see_the_same_values(drive):
    graph = Graph()
    a = graph.add_node(create_operation("chat"))
    tails = [graph.add_node(create_operation("chat")) for _ in range(3)]
    for tail in tails:
        graph.add_edge(a, tail)
    driver = drive(graph)
    driver.complete(a.id, {"finding": Finding(title="shared")})
    values = [d.parameters["context"][f"{a.id}_result"] for d in driver.dispatched().values()]
    assert values == [{"finding": {"title": "shared", "score": 0}}] * 3


def test_results_are_written_back_onto_the_graph_unless_turned_off(drive):
    for write_back in (True, False):
        graph = Graph()
        a = graph.add_node(create_operation("chat"))
        driver = drive(graph, write_back=write_back)
        driver.complete(a.id, {"answer": 42})
        assert driver.envelope["operation_statuses"] == {a.id: "completed"}
        assert driver.envelope["operation_results"] == {a.id: {"answer": 42}}
        assert (a.status, a.response) == (("completed", {"answer": 42}) if write_back else ("pending", None))
        # Turned off, the graph is nobody's to read once the run has ended: the state lets it go.
        assert driver.state.graph_released is not write_back
        assert list(driver.state.graph.nodes) == ([a.id] if write_back else [])


class Unserializable(BaseModel):
    secret: str = "x"

    @field_serializer("secret")
    def refuse(self, value: str) -> str:
        raise ValueError("this result will not be dumped")


@pytest.mark.parametrize("result", [Unserializable(), nested(5_000)], ids=["dump raises", "nests too deep"])
def test_a_result_that_cannot_become_context_fails_only_its_dependent_and_the_run_goes_on(drive, result):
    """a -> b -> c, and d on its own: b cannot be prepared from a's result; c still runs."""
    graph, n = build("a", "b", "c", "d", edges=(("a", "b"), ("b", "c")))
    driver = drive(graph, max_concurrent=2)
    driver.complete(n.a, result)
    assert driver.state.status_of(n.b) == "failed"
    assert driver.state.results[n.b]["error_type"] == "DispatchError"
    assert "could not be prepared" in driver.state.results[n.b]["error"]
    assert n.b not in driver.dispatched()
    assert driver.signals("failed", op_id=n.b)
    # b's failure released c in the same handle() (a failed predecessor still satisfies
    # an unconditional edge): it went out with d, not waiting for another event.
    assert set(driver.dispatched()) == {n.c, n.d}
    envelope = driver.run_to_end()
    assert envelope["failed_operations"] == [n.b]
    assert envelope["operation_statuses"][n.c] == "completed"
