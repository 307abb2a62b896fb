"""ExecutorShell without Ray: what it does when the scheduler or a worker's reply fails.

The shell is a plain object that the GraphExecutor actor contains, so its reactions are
pinned here, in-process: with a state machine made to fail, and with a stand-in worker
whose reply cannot be received. Either way the run must end, never stay open.
"""

from __future__ import annotations

import asyncio

import pytest

from opgraph.actors.executor.shell import ExecutorShell, _Run
from opgraph.actors.protocol import ACKNOWLEDGED, RunOptions
from opgraph.actors.workers.supervision import ActorPool
from opgraph.kernel import (
    ExecutionError,
    FlowState,
    Graph,
    OperationError,
    PauseRequested,
    create_operation,
)


class Failing(FlowState):
    """A state machine whose mutator raises what it is told to."""

    def __init__(self, error: BaseException) -> None:
        graph = Graph()
        graph.add_node(create_operation("chat"))
        super().__init__(graph)
        self.error = error

    def handle(self, *events):
        raise self.error


def fed(error: BaseException) -> _Run:
    """A run whose scheduler raises ``error``, after the shell fed it one event."""

    async def go() -> _Run:
        run = _Run("run-7", Failing(error), RunOptions())
        await shell_with([]).feed(run, [PauseRequested()])
        return run

    return asyncio.run(go())


def test_a_scheduler_that_raises_unexpectedly_ends_the_run_with_a_typed_error():
    run = fed(KeyError("lost"))
    assert run.done.is_set()
    assert isinstance(run.error, ExecutionError)
    assert "run-7" in str(run.error) and "PauseRequested" in str(run.error) and "KeyError" in str(run.error)
    assert run.final_summary()["status"] == "error"


@pytest.mark.parametrize("error", [OperationError("Graph must be acyclic for flow execution")])
def test_a_typed_scheduler_error_ends_the_run_as_it_is(error):
    run = fed(error)
    assert run.done.is_set()
    assert run.error is error


def shell_with(workers: list) -> ExecutorShell:
    """A shell over stand-in workers and no stores; nothing in it is a Ray actor."""
    pool = ActorPool("operation worker", workers, [f"worker-{i}" for i in range(len(workers))],
                     start=lambda index, generation: None)
    shell = ExecutorShell(pool, ActorPool("branch store", [], [], start=lambda index, generation: None))
    shell.bind_loop()
    return shell


class _Method:
    def __init__(self, function) -> None:
        self.function = function

    def remote(self, *args):
        return self.function(*args)

    def options(self, **options):
        return self


async def _value(value):
    return value


class _Unreadable:
    """A worker that acknowledges a batch, then whose outcome cannot be received."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.run_batch = _Method(self._stream)
        self.forget = _Method(self._forget)

    def _forget(self, key: str):
        self.forgotten.append(key)
        return _value(None)

    async def _stream(self, run_id: str, calls: list, slot: int = 0, shipped: bytes | None = None):
        async def unreadable():
            raise ValueError("the outcome would not unpickle")

        yield _value(ACKNOWLEDGED)
        yield unreadable()


def test_an_outcome_that_cannot_be_received_fails_its_node_and_the_run_finishes():
    from opgraph.kernel import DispatchOperation, FlowStarted

    async def go():
        graph = Graph()
        node = graph.add_node(create_operation("chat"))
        state = FlowState(graph)
        (dispatch,) = [i for i in state.handle(FlowStarted()) if isinstance(i, DispatchOperation)]
        worker = _Unreadable()
        shell = shell_with([worker])
        run = _Run("run-8", state, RunOptions())
        shell.runs[run.run_id] = run
        shell.resources[run.run_id] = run.options.resources
        await shell._drive_batch(run, [(node.id, dispatch.attempt, "chat", {}, None, 0)])
        await asyncio.gather(*shell.told)  # the forget tell, watched to its end
        return run, node.id, worker

    run, node_id, worker = asyncio.run(go())
    assert run.done.is_set() and run.error is None
    assert run.envelope["operation_statuses"] == {node_id: "failed"}
    result = run.envelope["operation_results"][node_id]
    assert result["error_type"] == "OutcomeLost" and "would not unpickle" in result["error"]
    assert worker.forgotten == ["run-8"]


def test_an_injection_waiting_for_admission_is_failed_not_stranded_when_its_run_fails():
    """inject is awaiting AdmissionDecided when the scheduler raises: the waiter gets the run's error."""

    async def go():
        shell = shell_with([])
        run = _Run("run-9", Failing(KeyError("lost")), RunOptions())
        waiter = asyncio.get_running_loop().create_future()
        run.inject_waiters[1] = waiter
        await shell.feed(run, [PauseRequested()])
        return run, waiter

    run, waiter = asyncio.run(go())
    assert run.done.is_set()
    assert isinstance(waiter.exception(), ExecutionError) and waiter.exception().run_id == "run-9"


def test_an_ended_run_no_driver_takes_is_let_go_after_the_unclaimed_time(monkeypatch):
    """Its driver died, or it was recovered for one that is gone: it must not stay in memory for good."""
    from opgraph.actors import settings

    monkeypatch.setattr(settings, "UNCLAIMED_RUN_SECONDS", 0.05)

    async def go():
        shell = shell_with([])
        graph = Graph()
        graph.add_node(create_operation("chat"))
        taken, left = _Run("run-10", FlowState(graph), RunOptions()), _Run("run-11", FlowState(graph), RunOptions())
        for run in (taken, left):
            shell.runs[run.run_id] = run
            shell._settle(run, {"status": "completed", "operation_statuses": {}})
        assert set(shell.runs) == {"run-10", "run-11"}  # ended, waiting for their drivers
        assert shell.forget_run("run-10")  # this one's driver took its result
        await asyncio.sleep(0.2)
        return shell

    shell = asyncio.run(go())
    assert shell.runs == {} and shell.totals["unclaimed"] == 1


def test_a_run_its_driver_forgot_is_freed_at_once_not_held_by_its_unclaimed_timer():
    """The timer that lets an unclaimed run go held the run, and with it the whole graph and
    state, for ``UNCLAIMED_RUN_SECONDS`` after its driver had forgotten it: a reused
    executor grew by a whole run's memory with every run."""
    import gc
    import weakref

    async def go():
        shell = shell_with([])
        graph = Graph()
        graph.add_node(create_operation("chat"))
        run = _Run("run-12", FlowState(graph), RunOptions())
        shell.runs[run.run_id] = run
        shell._settle(run, {"status": "completed", "operation_statuses": {}})
        state = weakref.ref(run.state)
        timer = run.unclaimed_timer
        assert timer is not None and not timer.cancelled()  # armed while no driver has taken it
        assert shell.forget_run("run-12")
        del run
        gc.collect()
        return state, timer

    state, timer = asyncio.run(go())
    assert timer.cancelled()
    assert state() is None


class _SlowStore:
    """A branch store whose clones take a while: the order of the calls is what the test reads."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.clone_many = _Method(self._clone_many)
        self.create = _Method(lambda branch_id, messages, exist_ok: _value(True))

    async def _clone_many(self, pairs):
        await asyncio.sleep(0.05)
        self.log.extend(f"cloned {destination} from {source}" for source, destination in pairs)
        return []


class _Recording:
    """A worker that notes each dispatch and never answers."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.run_one = _Method(self._dispatched)
        self.run_batch = _Method(self._dispatched)

    def _dispatched(self, run_id, calls, *rest):
        self.log.append("dispatched")
        return asyncio.get_running_loop().create_future()


def test_a_dependents_clone_of_the_roots_branch_is_made_before_the_root_is_dispatched_to_append_to_it():
    """root (on the run's own branch) -> child (a clone of that branch, decided at the start).

    The clone is not one the first dispatch runs on, yet it must be made before that dispatch:
    the root's turn is appended to the clone's source, and the child must not inherit it."""

    async def go() -> list[str]:
        log: list[str] = []
        graph = Graph()
        root = graph.add_node(create_operation("chat"))
        child = create_operation("chat")
        graph.add_node(child)
        graph.add_edge(root.id, child.id)
        pool = ActorPool("operation worker", [_Recording(log)], ["worker-0"], start=lambda index, generation: None)
        stores = ActorPool("branch store", [_SlowStore(log)], ["store-0"], start=lambda index, generation: None)
        shell = ExecutorShell(pool, stores)
        shell.bind_loop()
        await shell.start_run("run-c", graph, RunOptions(isolated=True))
        for _ in range(200):
            if "dispatched" in log:
                break
            await asyncio.sleep(0.01)
        return log

    log = asyncio.run(go())
    assert log[-1] == "dispatched" and len(log) == 2, log
    assert log[0].startswith("cloned ") and log[0].endswith(" from run-run-c-default"), log
