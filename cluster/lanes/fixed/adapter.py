"""The fixed workflow lane's adapter (ADR-0068 D2): pin and compile in ``prepare``, run in ``execute``.

Owns turning an invocation into a pinned, compiled run (a registry name pinned to a
version and hash, or a file's validated bytes; compile-before-persist), presenting an
envelope as the lane's outputs by authored node id, the source/hash check before a
checkpoint resume replays a run, and ``run_workflow`` for callers holding a resolved
source. It must not grow the topology: a fixed run never installs a spawn type or node
builder, whatever the definition says, and never calls a planner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ...store import RunRecord, RunStore, parse_ref, read_definition_file
from ..base import LaneInvocation, LaneRunResult, PreparedLaneRun, RunHooks
from ..capabilities import LaneCapabilities
from ..execution import Presentation, run_prepared
from ..provenance import PinnedSourceChangedError, RunProvenance
from ..recovery import submit_prepared
from .compiler import FIXED_FLOW_OPTIONS, CompiledWorkflow
from .contract import FIXED_WORKFLOW, FIXED_WORKFLOW_CAPABILITIES, check_fixed_provenance, fixed_workflow_provenance
from .sources import WorkflowSource, compile_source, file_source, is_file_target, registry_source
from .spec import WorkflowValidationError, problem

__all__ = ["FixedWorkflowLane", "present", "run_workflow"]


class FixedWorkflowLane:
    """The ``fixed_workflow`` adapter for one run store (None: runs are not recorded, names not resolved)."""

    lane = FIXED_WORKFLOW

    def __init__(self, store: RunStore | None = None) -> None:
        self.store = store

    def capabilities(self, invocation: LaneInvocation | None = None) -> LaneCapabilities:
        """Cancel, and checkpoint resume when the invocation is durable (ADR-0068 D3); nothing else."""
        if invocation is not None and not invocation.durable:
            return dataclasses.replace(FIXED_WORKFLOW_CAPABILITIES, checkpoint_resume=False)
        return FIXED_WORKFLOW_CAPABILITIES

    def check_provenance(self, provenance: RunProvenance) -> None:
        check_fixed_provenance(provenance)

    def invocation(self, target: str, *, inputs: Mapping[str, Any] | None = None,
                   base_dir: str | Path | None = None, model: str | None = None, run_id: str | None = None,
                   max_concurrent: int | None = 5, source_ref: str | None = None,
                   durable: bool = True) -> LaneInvocation:
        """The invocation for a command line's ``NAME[@VERSION]`` or file ``target``.

        A file is recorded by its resolved path, or by ``source_ref`` (a job records the
        path its user gave, since Ray runs it from a copy of the working dir).
        """
        if is_file_target(target):
            kind, ref, version = "workflow_file", source_ref or str(Path(target).expanduser().resolve()), None
        else:
            kind, (ref, version) = "workflow_def", parse_ref(target)
        return LaneInvocation(lane=FIXED_WORKFLOW, source_ref=ref, source_kind=kind, source_content_hash=None,
                              inputs=dict(inputs or {}), base_dir=None if base_dir is None else Path(base_dir),
                              source_version=version, model=model, run_id=run_id, max_concurrent=max_concurrent,
                              durable=durable)

    async def prepare(self, invocation: LaneInvocation) -> PreparedLaneRun:
        """Pin the source and compile it, off the event loop; every failure comes before a run exists."""
        return await asyncio.to_thread(self.prepare_now, invocation)

    def prepare_now(self, invocation: LaneInvocation) -> PreparedLaneRun:
        """``prepare``, on the calling thread (the store is read, the file read, the graph compiled)."""
        if invocation.lane != FIXED_WORKFLOW:
            raise ValueError(f"the {FIXED_WORKFLOW} adapter prepared a {invocation.lane!r} invocation")
        if invocation.source_kind == "workflow_file":
            source = file_source(invocation.source_ref, ref=invocation.source_ref)
        elif invocation.source_kind == "workflow_def":
            if self.store is None:
                raise WorkflowValidationError([problem(f"{invocation.source_ref!r} is a registry name, and no "
                                                       "store was given to resolve it")])
            source = registry_source(self.store, invocation.source_ref, invocation.source_version)
        else:
            raise WorkflowValidationError([problem(f"the {FIXED_WORKFLOW} lane runs a workflow_def or "
                                                   f"workflow_file, not a {invocation.source_kind}")])
        return self.prepare_source(source, invocation)

    def prepare_source(self, source: WorkflowSource, invocation: LaneInvocation,
                       compiled: CompiledWorkflow | None = None) -> PreparedLaneRun:
        """Prepare an already resolved ``source`` (compiled here unless ``compiled`` is given)."""
        compiled = compiled or compile_source(source, inputs=invocation.inputs, base_dir=invocation.base_dir,
                                              model=invocation.model)
        pinned = dataclasses.replace(invocation, source_content_hash=source.content_hash,
                                     source_version=source.version, run_id=invocation.run_id or str(uuid.uuid4()))
        provenance = fixed_workflow_provenance(ref=source.ref, content_hash=source.content_hash,
                                               version=source.version, source_kind=source.kind)
        # With the labels every run records, what any process needs to present the run.
        recovery = {"declared_outputs": list(compiled.declared_outputs),
                    "workflow_id": source.workflow.workflow_id if source.workflow is not None else None}
        return PreparedLaneRun(
            graph=compiled.graph, context=dict(compiled.context), invocation=pinned, recovery=recovery,
            run_id=pinned.run_id, provenance=provenance, capabilities=self.capabilities(pinned),
            flow_options=dict(FIXED_FLOW_OPTIONS), labels=compiled.spec_ids_by_node_id, label=source.label,
            workflow=source.workflow, lane_state=compiled)

    async def execute(self, prepared: PreparedLaneRun, *, session: Any,
                      hooks: RunHooks | None = None) -> LaneRunResult:
        """Record and run ``prepared`` through ``Session.flow``; its outputs by authored node id."""
        labels, declared = dict(prepared.labels), list(prepared.recovery["declared_outputs"])
        return await run_prepared(prepared, session=session, store=self.store, hooks=hooks,
                                  present=lambda envelope: present(envelope, labels, declared))

    async def submit(self, prepared: PreparedLaneRun, *, session: Any) -> str:
        """Record ``prepared`` and admit it detached (``Session.submit``); ``opgraph run result`` reads its end."""
        return await submit_prepared(prepared, session=session, store=self.store)

    def present(self, envelope: Mapping[str, Any], recovery: Mapping[str, Any]) -> Presentation:
        """A recorded run's envelope by authored node id, from the recovery it recorded."""
        return present(envelope, recovery.get("labels", {}), list(recovery.get("declared_outputs", [])))

    def check_replay(self, record: RunRecord) -> None:
        """Raise ``PinnedSourceChangedError`` unless the run's pinned source still hashes as recorded.

        A registry version is read back by its workflow id (deleted workflows too); a file is
        read again from the path the run recorded, and its bytes hashed as when it ran.
        """
        if record.source_kind == "workflow_def":
            if self.store is None:
                raise WorkflowValidationError([problem(f"run {record.run_id} pinned a registry version, and no "
                                                       "store was given to read it back")])
            found = self.store.resolve(record.workflow_id, record.version, include_deleted=True).content_hash
        else:
            _, raw, _ = read_definition_file(record.source_ref)
            found = "sha256:" + hashlib.sha256(raw).hexdigest()
        if found != record.content_hash:
            raise PinnedSourceChangedError(record.run_id, record.source_ref, record.content_hash, found)


def present(envelope: Mapping[str, Any], labels: Mapping[str, str], declared_outputs: list[str]) -> Presentation:
    """A fixed run's status and its outputs, errors and statuses by authored node id.

    ``labels`` maps graph ids to authored ids (what every run records), so any process
    holding the envelope and the run record can present it.
    """
    spec_ids = dict(labels)
    node_ids = {spec_id: node_id for node_id, spec_id in spec_ids.items()}
    results = envelope.get("operation_results", {})
    operation_statuses = envelope.get("operation_statuses", {})
    statuses = {spec_ids.get(node_id, node_id): status for node_id, status in operation_statuses.items()}
    errors = {spec_ids.get(node_id, node_id): results.get(node_id) for node_id in envelope.get("failed_operations", [])}
    wanted = declared_outputs or [spec_ids[node_id] for node_id in operation_statuses if node_id in spec_ids]
    outputs = {spec_id: results.get(node_ids[spec_id]) for spec_id in wanted
               if spec_id in node_ids and operation_statuses.get(node_ids[spec_id]) == "completed"}
    if envelope.get("status") == "cancelled":
        status = "cancelled"
    else:
        failed = envelope.get("status") == "failed" or any(
            isinstance(result, dict) and "error" in result
            for node_id, result in results.items() if operation_statuses.get(node_id) != "skipped")
        status = "failed" if failed else "completed"
    return status, outputs, errors, statuses


async def run_workflow(
    session: Any,
    source: WorkflowSource,
    *,
    inputs: Mapping[str, Any] | None = None,
    base_dir: str | Path | None = None,
    model: str | None = None,
    store: RunStore | None = None,
    run_id: str | None = None,
    max_concurrent: int | None = 5,
    on_progress: Callable[[str, str, str, float], Any] | None = None,
    control: dict[str, Any] | None = None,
    compiled: CompiledWorkflow | None = None,
    on_admitted: asyncio.Future | None = None,
) -> LaneRunResult:
    """Run a resolved ``source`` on ``session`` as a fixed run, recorded in ``store`` (ADR-0073 D5).

    The adapter's ``prepare`` then ``execute``, for a caller that already holds the source
    (and perhaps its compiled graph). A compile error raises ``WorkflowCompileError``
    before any run row exists; the rest is ``run_prepared``'s.
    """
    lane = FixedWorkflowLane(store)
    invocation = LaneInvocation(lane=FIXED_WORKFLOW, source_ref=source.ref, source_kind=source.kind,  # type: ignore[arg-type]
                                source_content_hash=source.content_hash, inputs=dict(inputs or {}),
                                base_dir=None if base_dir is None else Path(base_dir), source_version=source.version,
                                model=model, run_id=run_id, max_concurrent=max_concurrent)
    hooks = RunHooks(on_progress=on_progress, control=control, on_admitted=on_admitted)
    try:
        prepared = lane.prepare_source(source, invocation, compiled)
    except BaseException as exc:
        if on_admitted is not None and not on_admitted.done():
            on_admitted.set_exception(exc)
        raise
    return await lane.execute(prepared, session=session, hooks=hooks)
