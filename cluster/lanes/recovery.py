"""Detached and resumed runs of any lane: submitted durable, followed, settled from the run log, continued.

Owns the lane-generic half of detached runs (issue 15): submitting a prepared run with
``Session.submit`` so it outlives the process that admitted it; following it from the
process that submitted it (its settled nodes recorded as they come, its control handle
published); settling its row from the envelope the run log keeps, from any process; and
resuming a run whose owner process died, only where the invocation's capabilities include
checkpoint resume (ADR-0068 D3) and after its lane confirmed the pinned source (D4). The
graph always runs on the runtime's executor: nothing here schedules.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

from opgraph.kernel import FlowEvent

from ..store import RunRecord, RunRecorder, RunStore
from .base import LaneAdapter, LaneRunResult, PreparedLaneRun, RunHooks
from .capabilities import LaneCapabilities, check_capabilities
from .execution import LaneRunControl, Presentation, logged_capabilities, recorded_recovery

__all__ = ["follow_submitted", "logged_end", "resume_recorded", "settle_from_log", "settle_recorded",
           "submit_prepared"]


def _failure(exc: BaseException) -> dict[str, Any]:
    return {"run": {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}}


async def submit_prepared(prepared: PreparedLaneRun, *, session: Any, store: RunStore | None) -> str:
    """Record ``prepared`` and admit it as a detached run (``Session.submit``); its id once it is durable.

    On a runtime joined through an address the run goes on after this process exits, so its
    row records no owner process; on an embedded runtime it ends with this process, which
    owns it (and an orphan can be resumed). A submission that fails is recorded as failed.
    """
    invocation, run_id = prepared.invocation, prepared.run_id
    if store is not None:
        await store.writer.call(
            store.create_run, run_id, session_id=session.id, provenance=prepared.provenance.to_payload(),
            inputs=dict(invocation.inputs), workflow=prepared.workflow, status="running",
            capabilities=logged_capabilities(prepared, session).as_metadata(),
            recovery=recorded_recovery(prepared), owned=not session.runtime.detached)
    try:
        await session.submit(prepared.graph, run_id=run_id, context=dict(prepared.context),
                             max_concurrent=invocation.max_concurrent, **prepared.flow_options)
    except BaseException as exc:
        if store is not None:
            status = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            await asyncio.shield(store.writer.call(store.finish_run, run_id, status, error=_failure(exc)))
        raise
    return run_id


def settle_recorded(store: RunStore | None, record: RunRecord, envelope: Mapping[str, Any],
                    present: Callable[[Mapping[str, Any], Mapping[str, Any]], Presentation],
                    *, elapsed: float = 0.0) -> LaneRunResult:
    """The lane's result of a recorded run from its envelope; an unfinished row is finished with it.

    Every node's result is recorded from the envelope (a detached run has no driver that
    recorded them as they settled). A row that already ended keeps what it recorded.
    """
    recovery = record.recovery or {}
    status, outputs, errors, statuses = present(envelope, recovery)
    if store is not None and not store.get_run(record.run_id).terminal:
        labels = recovery.get("labels", {})
        results = envelope.get("operation_results", {})
        store.record_progress(record.run_id, nodes=[
            {"node_id": node_id, "spec_node_id": labels.get(node_id), "status": node_status,
             "result": results.get(node_id)}
            for node_id, node_status in envelope.get("operation_statuses", {}).items()])
        store.finish_run(record.run_id, status, outputs=outputs, error=errors or None)
    return LaneRunResult(run_id=record.run_id, lane=record.lane, status=status, source=_source(record),
                         content_hash=record.content_hash,
                         capabilities=LaneCapabilities.from_metadata(record.capabilities or {}), outputs=outputs,
                         errors=errors, statuses=statuses, provenance=record.provenance, elapsed=elapsed,
                         envelope=dict(envelope))


def _source(record: RunRecord) -> str:
    """What ran, for people: ``name@version`` for a registry source, else the recorded reference."""
    return f"{record.workflow_name}@{record.version}" if record.workflow_name else record.source_ref


def logged_end(run_id: str) -> tuple[str, dict[str, Any] | None, str | None] | None:
    """(status, envelope, error) of a run the run log (``OPGRAPH_DB``) records as ended; None while it is
    live or when the log does not know it. Reads the file only: no Ray is joined."""
    from opgraph.actors.persistence import RunLog, database_exists, database_path  # local: the runtime's modules

    if not database_exists(database_path()):
        return None
    log = RunLog(database_path())
    entry = log.entry(run_id)
    if entry is None or entry.status == "live":
        return None
    return entry.status, log.envelope(run_id), entry.error


def settle_from_log(store: RunStore, record: RunRecord, adapter: LaneAdapter) -> RunRecord:
    """A detached run (no owner process) still recorded as running, settled from the run log once it
    ended there: how a reader sees the end of a run nobody followed. Any other record is returned as is."""
    if record.terminal or record.owner_pid is not None:
        return record
    ended = logged_end(record.run_id)
    if ended is None:
        return record
    status, envelope, error = ended
    if envelope is None:  # failed as a whole: there is no envelope to present
        store.finish_run(record.run_id, "failed", error={"run": {"error": error, "type": status}})
    else:
        settle_recorded(store, record, envelope, adapter.present)
    return store.get_run(record.run_id)


async def follow_submitted(adapter: LaneAdapter, record: RunRecord, *, store: RunStore | None,
                           hooks: RunHooks | None = None, namespace: str | None = None) -> LaneRunResult:
    """Follow a submitted run from this process (Ray already joined) to its end, and settle its row.

    Its settled nodes are recorded as they come (with a signal each); ``hooks.control``
    gets a ``LaneRunControl`` limited to the run's recorded capabilities.
    """
    from opgraph.actors import RunControl  # local: the lanes load no Ray until a run needs it

    hooks = hooks or RunHooks()
    started = time.perf_counter()
    options = {} if namespace is None else {"namespace": namespace}
    control = await asyncio.to_thread(RunControl.attach, record.run_id, address=None, **options)
    capabilities = LaneCapabilities.from_metadata(record.capabilities or {})
    if hooks.control is not None:
        hooks.control["run_id"] = record.run_id
        hooks.control["control"] = LaneRunControl(control, capabilities, lane=record.lane, run_id=record.run_id)
    labels = (record.recovery or {}).get("labels", {})
    recorder = RunRecorder(store, record.run_id, labels, hooks.on_progress)

    async def record_settled() -> None:
        async with contextlib.aclosing(control.watch()) as events:
            async for item in events:
                if isinstance(item, FlowEvent):
                    recorder.progress(item.operation_id, item.name, item.status, 0.0)
                    await recorder.settled(item)

    watcher = asyncio.ensure_future(record_settled()) if control.executor is not None else None
    try:
        envelope = await control.result()
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await recorder.drain()
    return await _settle(store, record, envelope, adapter, time.perf_counter() - started)


async def resume_recorded(adapter: LaneAdapter, record: RunRecord, *, session: Any, store: RunStore,
                          hooks: RunHooks | None = None) -> LaneRunResult:
    """Continue a run whose owner process died, from the run log, and settle its row.

    Refused, before anything is sent, when the run's recorded capabilities exclude
    checkpoint resume (``LaneCapabilityError``), when its lane finds the pinned source
    changed (``PinnedSourceChangedError``), or when the store does not record it orphaned
    (``RunNotResumableError``). Settled nodes are not run again; the lane's progress
    callback sees the nodes that still run.
    """
    from opgraph.actors import RunControl  # local, as above

    hooks = hooks or RunHooks()
    check_capabilities(LaneCapabilities.from_metadata(record.capabilities or {}), "checkpoint_resume",
                       lane=record.lane, run_id=record.run_id)
    await asyncio.to_thread(adapter.check_replay, record)
    await store.writer.call(store.reopen_run, record.run_id, session_id=session.id)
    labels = (record.recovery or {}).get("labels", {})
    recorder = RunRecorder(store, record.run_id, labels, hooks.on_progress)
    started = time.perf_counter()
    try:
        envelope = await RunControl.resume_from_log(record.run_id, session, on_progress=recorder.progress,
                                                    on_branch_created=recorder.branch_created)
    except BaseException as exc:
        await asyncio.shield(recorder.drain())
        status = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
        await asyncio.shield(store.writer.call(store.finish_run, record.run_id, status, error=_failure(exc)))
        raise
    await recorder.drain()
    # Nodes the log settled while the dead owner's writes were on their way have no signals here yet.
    await store.writer.call(store.complete_signals, record.run_id, envelope.get("operation_statuses", {}), labels)
    return await _settle(store, record, envelope, adapter, time.perf_counter() - started)


async def _settle(store: RunStore | None, record: RunRecord, envelope: Mapping[str, Any], adapter: LaneAdapter,
                  elapsed: float) -> LaneRunResult:
    if store is None:
        return settle_recorded(None, record, envelope, adapter.present, elapsed=elapsed)
    return await store.writer.call(settle_recorded, store, record, envelope, adapter.present, elapsed=elapsed)
