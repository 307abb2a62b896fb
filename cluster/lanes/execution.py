"""Running a prepared lane run on a Session, recorded in the run store: the part every lane shares.

Owns the run row's lifecycle (admitted -> running -> completed | failed | cancelled), the
recording of signals, settled nodes and branch messages as the run goes, releasing the
run's branches, and the control handle that honours only the invocation's capabilities
(ADR-0068 D3: anything else is rejected and never reaches the executor). How an envelope
becomes the lane's status and outputs is the lane's (``present``). It never schedules
anything: the graph runs through ``Session.flow`` (D2).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..store import RunRecorder, RunStore
from .base import LaneRunResult, PreparedLaneRun, RunHooks
from .capabilities import LaneCapabilities, check_capabilities

__all__ = ["LaneRunControl", "Presentation", "graph_outline", "logged_capabilities", "recorded_recovery",
           "run_prepared"]

# status, outputs, errors and statuses of a finished run, by the lane's labels
Presentation = tuple[str, dict[str, Any], dict[str, Any], dict[str, str]]


def recorded_recovery(prepared: PreparedLaneRun) -> dict[str, Any]:
    """What a run records for other processes: the lane's recovery data and its labels (graph id -> name)."""
    return {**prepared.recovery, "labels": dict(prepared.labels)}


def graph_outline(graph: Any, labels: Mapping[str, str]) -> dict[str, Any]:
    """The run's graph as the console draws it: each node's id, name (the lane's label, else the operation's)
    and operation, and each edge's ends (the run store's ``record_outline``)."""
    nodes = [[node_id, labels.get(node_id) or node.metadata.get("name") or node.operation, node.operation]
             for node_id, node in graph.nodes.items()]
    edges = [[edge.head, edge.tail] for edge in graph.edges.values()]
    return {"nodes": nodes, "edges": edges}


def logged_capabilities(prepared: PreparedLaneRun, session: Any) -> LaneCapabilities:
    """The invocation's matrix as it will hold: a run the runtime does not log cannot be resumed."""
    if prepared.capabilities.checkpoint_resume and not (prepared.invocation.durable and session.runtime.database):
        return dataclasses.replace(prepared.capabilities, checkpoint_resume=False)
    return prepared.capabilities


class LaneRunControl:
    """A live run's control handle, limited to what its invocation's capabilities include.

    Each control is checked first (``LaneCapabilityError`` when the matrix excludes it,
    and nothing reaches the executor); ``status`` is always allowed.
    """

    def __init__(self, control: Any, capabilities: LaneCapabilities, *, lane: str, run_id: str) -> None:
        self._control = control
        self.capabilities = capabilities
        self.lane = lane
        self.run_id = run_id

    def _check(self, request_kind: str) -> None:
        check_capabilities(self.capabilities, request_kind, lane=self.lane, run_id=self.run_id)

    async def status(self) -> dict[str, Any]:
        return await self._control.status()

    def watch(self, **options: Any) -> Any:
        """The run's settled nodes from its executor's bounded watcher queue (``RunControl.watch``); always
        allowed, like ``status``: watching changes nothing."""
        return self._control.watch(**options)

    async def cancel(self) -> bool:
        self._check("cancel")
        return await self._control.cancel()

    async def pause(self) -> bool:
        self._check("pause")
        return await self._control.pause()

    async def resume(self) -> bool:
        self._check("resume")
        return await self._control.resume()

    async def send_operator_message(self, text: str) -> bool:
        self._check("message")
        return await self._control.send_operator_message(text)

    async def inject(self, *args: Any, **kwargs: Any) -> Any:
        self._check("spawn")
        return await self._control.inject(*args, **kwargs)


async def run_prepared(
    prepared: PreparedLaneRun,
    *,
    session: Any,
    store: RunStore | None,
    present: Callable[[Mapping[str, Any]], Presentation],
    hooks: RunHooks | None = None,
    branches: Mapping[str, str] | None = None,
) -> LaneRunResult:
    """Record ``prepared`` as a run, execute it on ``session`` and record the outcome.

    A failed operation makes the run ``failed`` (as ``present`` says); an unexpected
    runtime error is recorded and the run returned as ``failed`` (ADR-0073 D5); task
    cancellation records ``cancelled`` and re-raises. Every signal and every settled
    node's result reach the store as the run goes (``RunRecorder``), each write on the
    store's writer thread. Without a store nothing is recorded and the run still runs.
    ``branches`` (branch id -> the node id it is recorded under) are the lane's own branches
    to record with the run's, in the same read and write (a planned run's roles).
    """
    hooks = hooks or RunHooks()
    run_id, invocation = prepared.run_id, prepared.invocation
    provenance = prepared.provenance.to_payload()
    capabilities = logged_capabilities(prepared, session)
    try:
        recorder = RunRecorder(store, run_id, prepared.labels, hooks.on_progress)
        if store is not None:
            await recorder.write(store.create_run, run_id, session_id=session.id, provenance=provenance,
                                 inputs=dict(invocation.inputs), workflow=prepared.workflow,
                                 capabilities=capabilities.as_metadata(), recovery=recorded_recovery(prepared))
            await recorder.write(store.record_outline, run_id, graph_outline(prepared.graph, prepared.labels))
            await recorder.write(store.mark_running, run_id)
    except BaseException as exc:
        if hooks.on_admitted is not None and not hooks.on_admitted.done():
            hooks.on_admitted.set_exception(exc)
        raise
    if hooks.on_admitted is not None and not hooks.on_admitted.done():
        hooks.on_admitted.set_result("running" if store is not None else "admitted")
    executor_ref: dict[str, Any] = {}
    control = hooks.control
    if control is not None:
        control["run_id"] = run_id
    started = time.perf_counter()

    async def publish_control() -> None:
        # executor_ref is filled once the executor has admitted the run.
        while "executor" not in executor_ref:
            await asyncio.sleep(0.01)
        control["control"] = LaneRunControl(executor_ref["executor"], capabilities,
                                            lane=prepared.provenance.lane, run_id=run_id)

    helper = asyncio.ensure_future(publish_control()) if control is not None else None
    status, outputs, errors, statuses, envelope = "failed", {}, {}, {}, None
    default_branch = f"run-{run_id}-default"  # the isolated run's own (the envelope names it too)
    try:
        try:
            # Isolated: its own default branch, so no other run's conversation reaches it,
            # and its branches are dropped once recorded (below), so a long-lived runtime
            # (opgraph serve, a detached cluster runtime) stays flat run after run.
            envelope = await session.flow(
                prepared.graph, context=dict(prepared.context), **prepared.flow_options,
                max_concurrent=invocation.max_concurrent, run_id=run_id, durable=invocation.durable,
                on_progress=recorder.progress,
                on_branch_created=recorder.branch_created, on_settled=recorder.settled,
                executor_ref=executor_ref, isolated=True,
            )
            default_branch = envelope.get("default_branch", default_branch)
            status, outputs, errors, statuses = present(envelope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - D5: a runtime error is a failed run, recorded
            errors = {"run": {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}}
        finally:
            if helper is not None:
                helper.cancel()
        released: list[bool] = []

        async def release() -> None:
            released.append(True)
            await _release(session, run_id, errors)

        try:
            await recorder.drain()  # every signal and node result before the branches and the end
            # Read, the branches are let go while their records are written.
            await recorder.record_branches(default_branch, session.messages,
                                           messages_many=getattr(session, "messages_many", None), then=release,
                                           extra=branches)
        except Exception as exc:  # noqa: BLE001 - lost branch history must not hide the run's outcome
            errors.setdefault("branches", {"error": f"could not record branch messages: {exc}"})
        finally:
            if not released:
                await _release(session, run_id, errors)
    except asyncio.CancelledError:
        # Cancelled while running or while recording branches: the row must still end.
        await asyncio.shield(recorder.drain())
        if store is not None:
            await recorder.write(store.finish_run, run_id, "cancelled",
                                 error={"run": {"error": "the run was cancelled", "type": "CancelledError"}})
        raise
    if recorder.failure is not None:
        failure = recorder.failure
        errors.setdefault("recording", {"error": f"recording or showing the run's progress failed: "
                                                 f"{type(failure).__name__}: {failure}"})
    if store is not None:
        await recorder.write(store.finish_run, run_id, status, outputs=outputs, error=errors or None)
    return LaneRunResult(run_id=run_id, lane=prepared.provenance.lane, status=status, source=prepared.label,
                         content_hash=invocation.source_content_hash, capabilities=capabilities,
                         outputs=outputs, errors=errors, statuses=statuses, provenance=provenance,
                         elapsed=time.perf_counter() - started, envelope=envelope)


async def _release(session: Any, run_id: str, errors: dict[str, Any]) -> None:
    """Drop the run's branches from the stores, once recorded; a failure is noted on the run."""
    try:
        await session.release_run(run_id)
    except Exception as exc:  # noqa: BLE001 - the run's outcome stands; the leak is reported with it
        errors.setdefault("branches", {"error": f"could not release the run's branches: {exc}"})
