"""A run fed for a long time: kept open for admissions, its settled nodes released once recorded.

    start (empty, keep_open) <- inject a, b, c (stateless) ... release a, b ... close -> finished

What a dataset job needs so that its state is bounded by the rows in flight: a run that does
not end while its feeder may still admit, nodes that leave every index once their outcome is
recorded elsewhere (counted, never listed), no branch for a stateless node, and all of it the
same after a rebuild from the run log.
"""

from __future__ import annotations

from opgraph.kernel import (
    AppendRecords,
    CancelRequested,
    CloneBranch,
    CloseRequested,
    DispatchOperation,
    FinishRun,
    FlowStarted,
    FlowState,
    Graph,
    InjectRequested,
    OperationFinished,
    ReleaseRequested,
    create_operation,
    decode_records,
    encode_records,
)


def row(name: str) -> object:
    operation = create_operation("answer", {"prompt": name})
    operation.metadata.update({"stateless": True, "reference_id": name})
    return operation


def fed(drive, **options):
    return drive(Graph(), reactive=True, keep_open=True, max_spawn=10_000, max_concurrent=2, **options)


def inject(driver, *operations) -> None:
    driver.handle(*(InjectRequested(now=1.0, operation=operation, independent=True, token=index)
                    for index, operation in enumerate(operations)))


def test_a_run_kept_open_waits_for_admissions_and_ends_once_closed_and_drained(drive):
    driver = fed(drive)
    assert driver.envelope is None and not driver.state.finished  # nothing to run, yet open
    a = row("a")
    inject(driver, a)
    driver.complete(a.id, "A")
    assert driver.envelope is None  # settled, and still open for more
    driver.handle(CloseRequested(now=2.0))
    assert driver.envelope is not None and driver.envelope["status"] == "completed"
    assert driver.envelope["operation_results"] == {a.id: "A"}


def test_closing_with_work_in_flight_ends_the_run_when_that_work_settles(drive):
    driver = fed(drive)
    a = row("a")
    inject(driver, a)
    driver.handle(CloseRequested(now=2.0))
    assert driver.envelope is None
    driver.complete(a.id, "A")
    assert driver.envelope is not None


def test_a_cancel_ends_a_run_kept_open_without_a_close(drive):
    driver = fed(drive)
    driver.handle(CancelRequested(now=1.0))
    assert driver.envelope is not None and driver.envelope["status"] == "cancelled"


def test_a_stateless_admission_gets_no_branch_and_runs_on_none(drive):
    driver = fed(drive)
    a, b = row("a"), create_operation("answer", {"prompt": "b"})
    inject(driver, a, b)
    clones = [instruction.node_id for instruction in driver.of_type(CloneBranch)]
    assert clones == [b.id]  # the stateful one is cloned its own branch (ADR-0023 D6), the row is not
    assert driver.dispatched()[a.id].branch_id is None


def test_a_released_node_leaves_every_index_and_is_counted_by_status(drive):
    driver = fed(drive)
    a, b, c = row("a"), row("b"), row("c")
    inject(driver, a, b, c)
    driver.complete(a.id, "A")
    driver.fail(b.id, "no")
    driver.handle(ReleaseRequested(now=2.0, node_ids=(a.id, b.id, c.id, "never-admitted")))
    state = driver.state
    # c is running: kept. a and b are gone from the graph and from every per-node index.
    assert list(state.state) == [c.id] and list(state.graph.nodes) == [c.id]
    for index in (state.results, state.errors, state.attempt, state.rank, state.branch, state.deps,
                  state.unsettled, state._stories, state.spawned_ids):
        assert a.id not in index and b.id not in index
    assert state.released_by_status == {"completed": 1, "failed": 1}
    assert state.statistics()["settled_by_status"] == {"completed": 1, "failed": 1, "skipped": 0, "cancelled": 0}
    driver.complete(c.id, "C")
    driver.handle(CloseRequested(now=3.0))
    envelope = driver.envelope
    assert envelope["operation_statuses"] == {c.id: "completed"}
    assert envelope["released_operations"] == {"completed": 1, "failed": 1}
    assert envelope["spawned_operations"] == 3


def test_a_node_an_open_dependent_still_reads_is_kept():
    """a -> b: a settled, b waiting on nothing but running: a stays until b settles."""
    graph = Graph()
    a, b = create_operation("answer", {}), create_operation("answer", {})
    graph.add_node(a)
    graph.add_node(b)
    graph.add_edge(a, b)
    state = FlowState(graph, reactive=True, keep_open=True)
    state.handle(FlowStarted(now=0.0))
    state.handle(OperationFinished(now=1.0, node_id=a.id, attempt=1, response="A"))
    state.handle(ReleaseRequested(now=2.0, node_ids=(a.id,)))
    assert a.id in state.state  # b runs and may still read a's result
    state.handle(OperationFinished(now=3.0, node_id=b.id, attempt=1, response="B"))
    state.handle(ReleaseRequested(now=4.0, node_ids=(a.id, b.id)))
    assert state.state == {}


def test_the_settled_and_open_queries_name_what_a_new_feeder_must_reconcile(drive):
    driver = fed(drive)
    a, b, c = row("a"), row("b"), row("c")
    inject(driver, a, b, c)
    driver.complete(a.id, "A")
    outcomes = driver.state.settled_outcomes()
    assert [(node_id, status, result, metadata["reference_id"]) for node_id, status, result, metadata in outcomes] \
        == [(a.id, "completed", "A", "a")]
    assert [(node_id, metadata["reference_id"]) for node_id, metadata in driver.state.open_admissions()] \
        == [(b.id, "b"), (c.id, "c")]


def _test_key() -> bytes:
    return b"k" * 32


class LoggedRun:
    """A durable fed run whose log is kept as the executor stores it (through the codec), to rebuild from."""

    def __init__(self, run_id: str, max_concurrent: int) -> None:
        self.options = {"reactive": True, "keep_open": True, "durable": True, "max_spawn": 100,
                        "max_concurrent": max_concurrent, "run_id": run_id}
        self.state = FlowState(Graph(), **self.options)
        self.batches: list = []

    def handle(self, *events) -> list:
        out = self.state.handle(*events)
        self.batches.extend(encode_records(i.records, key=_test_key) for i in out if isinstance(i, AppendRecords))
        return out

    def rebuilt(self) -> FlowState:
        return FlowState.rebuild(Graph(), [decode_records(batch, key=_test_key) for batch in self.batches],
                                 **self.options)


def test_a_rebuild_from_the_log_releases_and_closes_again():
    """The log of a fed run (admissions, settlements, a release, the close) rebuilds to the same
    bounded state, through the codec as the executor stores it."""
    logged = LoggedRun("fed", max_concurrent=4)
    handle = logged.handle
    handle(FlowStarted(now=0.0))
    rows = [row(name) for name in "abcd"]
    handle(*(InjectRequested(now=1.0, operation=operation, independent=True, token=i)
             for i, operation in enumerate(rows)))
    handle(*(OperationFinished(now=2.0, node_id=operation.id, attempt=1, response=operation.parameters["prompt"])
             for operation in rows[:3]))
    handle(ReleaseRequested(now=3.0, node_ids=tuple(operation.id for operation in rows[:2])))
    handle(CloseRequested(now=4.0))
    rebuilt = logged.rebuilt()
    assert list(rebuilt.state) == [rows[2].id, rows[3].id]
    assert rebuilt.released_by_status == {"completed": 2} and rebuilt.closed
    assert list(rebuilt.spawned_ids) == [rows[2].id, rows[3].id] and rebuilt.spawn_count == 4
    recovered = rebuilt.recover(5.0)
    redispatched = [i.node_id for i in recovered if isinstance(i, DispatchOperation)]
    assert redispatched == [rows[3].id]  # only what was in flight is sent again
    out = rebuilt.handle(OperationFinished(now=6.0, node_id=rows[3].id, attempt=2, response="d"))
    (finish,) = [i for i in out if isinstance(i, FinishRun)]
    assert finish.envelope["released_operations"] == {"completed": 2}



def weighing(name: str, weight: int) -> object:
    operation = row(name)
    operation.metadata["weight"] = weight
    return operation


def test_capacity_counts_the_weights_of_operations_that_carry_several_calls(drive):
    """capacity 10 <- a(4) b(4) c(4) d(1): a and b go (8); c does not fit in 2 and d, behind it,
    does not pass it; once a settles, c and d go (9). A node heavier than the whole capacity goes
    alone once nothing else is in flight. A plain run (no weights) counts nodes as before."""
    driver = drive(Graph(), reactive=True, keep_open=True, max_spawn=100, max_concurrent=10)
    a, b, c, d = (weighing(name, weight) for name, weight in (("a", 4), ("b", 4), ("c", 4), ("d", 1)))
    inject(driver, a, b, c, d)
    assert set(driver.dispatched()) == {a.id, b.id}
    driver.complete(a.id, "A")
    assert set(driver.dispatched()) == {b.id, c.id, d.id}
    heavy = weighing("heavy", 25)
    inject(driver, heavy)
    assert heavy.id not in driver.dispatched()
    for node_id in (b.id, c.id, d.id):
        driver.complete(node_id, "done")
    assert set(driver.dispatched()) == {heavy.id}
    driver.complete(heavy.id, "H")
    driver.handle(CloseRequested(now=2.0))
    assert driver.envelope["status"] == "completed"

    plain = fed(drive)  # max_concurrent 2, no weights: two nodes in flight
    inject(plain, *(row(name) for name in "xyz"))
    assert len(plain.dispatched()) == 2 and not plain.state.weighted


def test_a_weighted_run_rebuilt_from_its_log_counts_weights_again():
    """p(3) q(3) r(3) at capacity 6: two in flight; the rebuilt run counts weights again, and its
    recovery sends again only the two that were in flight."""
    logged = LoggedRun("weighed", max_concurrent=6)
    logged.handle(FlowStarted(now=0.0))
    admitted = logged.handle(*(InjectRequested(now=1.0, operation=weighing(name, 3), independent=True, token=index)
                        for index, name in enumerate("pqr")))
    assert len([i for i in admitted if isinstance(i, DispatchOperation)]) == 2  # 3 + 3 of 6
    rebuilt = logged.rebuilt()
    assert rebuilt.weighted
    recovered = rebuilt.recover(2.0)
    assert len([i for i in recovered if isinstance(i, DispatchOperation)]) == 2
