"""The built-in action adapters: each task kind run through the lane registry or ``Session.flow``.

Owns turning a task (its target and payload) into a run, and a task whose earlier attempt's
lease lapsed into that run continued: a lane run through ``resume_recorded`` (the lane checks
its capabilities and pinned source), a plain graph through ``RunControl.resume_from_log``; a run
that ended meanwhile is read, not run again. ``workflow`` goes to the fixed lane, ``flow`` and
``flow_yaml`` to the planned reactive lane, ``play`` to reactive play (ADR-0068 D5); ``agent``
(one chat node) and ``fanout`` (N sleeping nodes) are non-lane adapters. Loaded only by workers.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping
from typing import Any

from opgraph.kernel import Graph, OpGraphError, create_operation

from ..lanes import (
    FIXED_WORKFLOW,
    PLANNED_REACTIVE_FLOW,
    REACTIVE_PLAY,
    LaneCapabilityError,
    LaneInvocation,
    RunHooks,
    lane_adapter,
    logged_end,
    resume_recorded,
)
from ..store import OWNER_PROCESS_LOST, RunNotFoundError
from .actions import ActionContext, ActionOutcome
from .queue import TaskRecord

__all__ = ["AGENT", "FANOUT", "FLOW", "FLOW_YAML", "PLAY", "WORKFLOW", "GraphAction", "LaneAction"]


def _model(task: TaskRecord) -> str | None:
    return task.payload.get("model")


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}


def _ended(status: str, run_id: str, outputs: Any, errors: Any) -> ActionOutcome:
    result = {"run_id": run_id, "status": status, "outputs": outputs or {}}
    if status == "completed":
        return ActionOutcome("completed", result)
    if status == "cancelled":
        return ActionOutcome("cancelled", result, error=errors or {"error": "the run was cancelled"})
    return ActionOutcome("failed", result, error=errors or {"error": f"run {run_id} ended {status}"})


class LaneAction:
    """A task run on a lane, reached through the lane registry (never a lane's internals)."""

    def __init__(self, action_kind: str, lane: str,
                 invocation: Callable[[Any, TaskRecord, str], LaneInvocation]) -> None:
        self.action_kind, self.lane, self._invocation = action_kind, lane, invocation

    async def run(self, task: TaskRecord, context: ActionContext) -> ActionOutcome:
        adapter = lane_adapter(self.lane, context.store)
        hooks = RunHooks(on_progress=context.on_progress)
        if task.run_id is not None:
            continued = await self._continue(adapter, task, context, hooks)
            if continued is not None:
                return continued
        try:
            prepared = await adapter.prepare(self._invocation(adapter, task, f"{task.task_id}-a{task.attempts}"))
        except (OpGraphError, ValueError, OSError) as exc:  # a workflow that does not exist, bad inputs
            return ActionOutcome("failed", error=_failure(exc), retryable=False)
        await context.started(prepared.run_id)
        result = await adapter.execute(prepared, session=await context.session(), hooks=hooks)
        return _ended(result.status, result.run_id, result.outputs, result.errors)

    async def _continue(self, adapter: Any, task: TaskRecord, context: ActionContext,
                        hooks: RunHooks) -> ActionOutcome | None:
        """The earlier attempt's run: read if it ended, continued from the log if its owner died;
        None when it never got a row (a new run starts)."""
        store = context.store
        try:
            record = await asyncio.to_thread(store.get_run, task.run_id)  # settles an orphan
        except RunNotFoundError:
            return None
        if record.orphaned:
            try:
                await context.started(record.run_id)
                result = await resume_recorded(adapter, record, session=await context.session(), store=store,
                                               hooks=hooks)
            except LaneCapabilityError:
                return None  # the lane cannot continue it: a new run
            return _ended(result.status, result.run_id, result.outputs, result.errors)
        if record.status == "cancelled" and not task.cancel_requested:
            return None  # its holder lost the lease and stopped it; nobody asked: a new run
        if record.terminal:
            return _ended(record.status, record.run_id, record.outputs, record.error)
        if record.owner_host is not None and record.owner_host != socket.gethostname():
            # The store cannot tell whether a process on another machine lives; the lease can: its holder
            # stopped heartbeating, and a holder that only lost touch cancels its run when its next
            # heartbeat is refused. The run is recorded orphaned, then continued as one.
            await asyncio.to_thread(store.finish_run, record.run_id, "failed", error={
                "error": f"the worker on {record.owner_host} (pid {record.owner_pid}) lost the lease of task "
                         f"{task.task_id}", "error_type": OWNER_PROCESS_LOST})
            return await self._continue(adapter, task, context, hooks)
        return ActionOutcome("failed", error={"error": f"run {record.run_id} is still {record.status}, owned by "
                                                      f"the live pid {record.owner_pid} on {record.owner_host}"})


class GraphAction:
    """A task run as a plain graph on ``Session.flow``, durable, under a run id of its own."""

    def __init__(self, action_kind: str, build: Callable[[TaskRecord], Graph]) -> None:
        self.action_kind, self._build = action_kind, build

    async def run(self, task: TaskRecord, context: ActionContext) -> ActionOutcome:
        from opgraph.actors import RunControl, envelope_summary  # local: a worker loads Ray when it runs a task
        from opgraph.actors.persistence import RunLog, database_path

        if task.run_id is not None:
            ended = await asyncio.to_thread(logged_end, task.run_id)
            if ended is not None and not (ended[0] == "cancelled" and not task.cancel_requested):
                status, envelope, error = ended
                return self._outcome(task.run_id, envelope, status, error, envelope_summary)
            entry = await asyncio.to_thread(lambda: RunLog(database_path()).entry(task.run_id))
            if entry is not None and entry.status == "live":
                await context.started(task.run_id)
                envelope = await RunControl.resume_from_log(task.run_id, await context.session(),
                                                            on_progress=self._progress(context))
                return self._outcome(task.run_id, envelope, envelope["status"], None, envelope_summary)
        try:
            graph = self._build(task)
        except (OpGraphError, ValueError, TypeError) as exc:
            return ActionOutcome("failed", error=_failure(exc), retryable=False)
        run_id = f"{task.task_id}-a{task.attempts}"
        await context.started(run_id)
        session = await context.session()
        envelope = await session.flow(graph, run_id=run_id, durable=True, isolated=True,
                                      max_concurrent=int(task.payload.get("max_concurrent", 10)),
                                      on_progress=self._progress(context))
        return self._outcome(run_id, envelope, envelope["status"], None, envelope_summary)

    @staticmethod
    def _progress(context: ActionContext) -> Any:
        if context.on_progress is None:
            return None
        return lambda op_id, name, status, elapsed: context.on_progress(op_id, name, status, elapsed)

    @staticmethod
    def _outcome(run_id: str, envelope: Mapping[str, Any] | None, status: str, error: str | None,
                 summary: Callable[[Any], dict[str, Any]]) -> ActionOutcome:
        if envelope is None:
            return ActionOutcome("failed", {"run_id": run_id}, error={"error": error or f"run {run_id} {status}"})
        described = {"run_id": run_id, **summary(envelope)}
        if status == "completed":
            return ActionOutcome("completed", described)
        errors = {node: str(value) for node, value in (envelope.get("errors") or {}).items()} or None
        return ActionOutcome("cancelled" if status == "cancelled" else "failed", described,
                             error=errors or {"error": f"run {run_id} ended {status}"})


def _agent_graph(task: TaskRecord) -> Graph:
    graph = Graph("agent")
    parameters: dict[str, Any] = {"instruction": task.target}
    if _model(task):
        parameters["model"] = _model(task)
    graph.add_node(create_operation("chat_and_record", parameters))
    return graph


def _fanout_graph(task: TaskRecord) -> Graph:
    from ..jobs import fanout_graph

    nodes, seconds = int(task.payload.get("nodes", 10)), float(task.payload.get("seconds", 0.1))
    if not 1 <= nodes <= 100_000:
        raise ValueError(f"a fanout task has 1 to 100000 nodes, got {nodes}")
    return fanout_graph(nodes, seconds)


def _common(task: TaskRecord, run_id: str) -> dict[str, Any]:
    return {"model": _model(task), "run_id": run_id,
            "max_concurrent": int(task.payload.get("max_concurrent", 5))}


WORKFLOW = LaneAction("workflow", FIXED_WORKFLOW, lambda adapter, task, run_id: adapter.invocation(
    task.target, inputs=dict(task.payload.get("inputs") or {}), **_common(task, run_id)))
FLOW = LaneAction("flow", PLANNED_REACTIVE_FLOW, lambda adapter, task, run_id: adapter.invocation(
    task.target, reactive=task.payload.get("reactive", "all"), max_ops=int(task.payload.get("max_ops", 0)),
    **_common(task, run_id)))
FLOW_YAML = LaneAction("flow_yaml", PLANNED_REACTIVE_FLOW, lambda adapter, task, run_id: adapter.invocation(
    "", spec=task.target, **_common(task, run_id)))
PLAY = LaneAction("play", REACTIVE_PLAY, lambda adapter, task, run_id: adapter.invocation(
    task.target, text=str(task.payload.get("text", "")), args=task.payload.get("args") or {}, **_common(task, run_id)))
AGENT = GraphAction("agent", _agent_graph)
FANOUT = GraphAction("fanout", _fanout_graph)
