"""ExecutorShell without Ray: what it does when the scheduler itself raises.

The shell is a plain object that the GraphExecutor actor contains, so its reaction to
a failing ``handle()`` is pinned here, in-process, with a state machine made to fail.
"""

from __future__ import annotations

import asyncio

import pytest

from opgraph.actors.executor import RunOptions
from opgraph.actors.shell import ExecutorShell, _Run
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
        await ExecutorShell([], []).feed(run, [PauseRequested()])
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
