"""Run one fixed workflow on a Session and persist it (ADR-0073 D5, ADR-0068 D4).

Owns source resolution (a registry name pinned to a version, or a file whose validated
bytes are hashed once), compile-before-persist, the run row's lifecycle (admitted ->
running -> completed | failed | cancelled), per-node lifecycle signals, branch messages
and outputs, and the lane's control surface (cancel only; the rest is rejected, never
queued). It must not grow the topology: a fixed run never installs a spawn type or node
builder, whatever the definition says.

Ideal over retrospective (ADR-0073 delta 1): a run pins ``name@version`` and its
``sha256:`` hash before execution, so a definition edited mid-run does not change it;
the result carries the declared outputs by their authored node ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ...store.recorder import RunRecorder
from ...store.runs import RunStore
from ..capabilities import FIXED_WORKFLOW, FIXED_WORKFLOW_CAPABILITIES, RunProvenance, check_control
from .compiler import CompiledWorkflow, compile_workflow
from .spec import WorkflowCompileError, WorkflowValidationError, load_definition, problem, validate_definition

__all__ = [
    "FixedRunControl",
    "WorkflowRunResult",
    "WorkflowSource",
    "file_source",
    "parse_ref",
    "registry_source",
    "resolve_source",
    "run_workflow",
]


@dataclass(frozen=True, slots=True)
class WorkflowSource:
    """The exact definition a run compiles: where it came from, pinned, and its spec."""

    kind: str  # "workflow_def" (registry) or "workflow_file"
    ref: str  # the registry name, or the file's resolved path
    content_hash: str
    spec: Mapping[str, Any] | None
    version: int | None = None
    workflow: Any = None  # the store's WorkflowVersion for registry sources

    @property
    def label(self) -> str:
        return f"{self.ref}@{self.version}" if self.version is not None else self.ref


def registry_source(store: RunStore, name: str, version: int | None = None) -> WorkflowSource:
    """Pin ``name`` (latest when ``version`` is None) before anything runs."""
    pinned = store.resolve(name, version)
    return WorkflowSource(kind="workflow_def", ref=pinned.name, content_hash=pinned.content_hash,
                          spec=pinned.spec, version=pinned.version, workflow=pinned)


def file_source(path: str | Path, *, ref: str | None = None) -> WorkflowSource:
    """Read a definition file once; its validated bytes are what is hashed and compiled.

    The run records ``ref`` as its source (default: the file's resolved path): a Ray job
    reads a temporary copy of the file and records the path its user gave instead.
    Raises ``WorkflowValidationError`` (a problem list) for unreadable JSON or a spec
    that breaks a storage rule, so a bad file never reaches the runtime.
    """
    resolved = Path(path).expanduser().resolve()
    try:
        raw = resolved.read_bytes()
    except OSError as exc:
        raise WorkflowValidationError(
            [problem(f"cannot read workflow file {str(resolved)!r}: {exc.strerror or exc}")]) from exc
    try:
        spec = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkflowValidationError([problem(f"workflow file {str(resolved)!r} is not JSON: {exc}")]) from exc
    except RecursionError as exc:  # the parser's own depth limit, at about 1,000 levels
        raise WorkflowValidationError([problem(f"workflow file {str(resolved)!r} nests deeper than JSON is "
                                               "read here (a definition nests at most 64 levels)")]) from exc
    problems = validate_definition(spec)
    if problems:
        raise WorkflowValidationError(problems)
    return WorkflowSource(kind="workflow_file", ref=ref or str(resolved),
                          content_hash="sha256:" + hashlib.sha256(raw).hexdigest(), spec=spec)


def resolve_source(target: str, store: RunStore | None) -> WorkflowSource:
    """``target`` is a file path (it exists, or ends in .json), ``name`` or ``name@VERSION``."""
    if target.endswith(".json") or Path(target).expanduser().is_file():
        return file_source(target)
    if store is None:
        raise OpGraphError(f"{target!r} is no workflow file, and no store was given to resolve it by name")
    name, version = parse_ref(target)
    return registry_source(store, name, version)


def parse_ref(target: str) -> tuple[str, int | None]:
    """``name`` -> (name, None); ``name@VERSION`` -> (name, VERSION), a positive integer."""
    if "@" not in target:
        return target, None
    name, _, version_text = target.rpartition("@")
    if not version_text.isdigit() or int(version_text) < 1:
        raise OpGraphError(f"workflow version in {target!r} must be a positive integer")
    return name, int(version_text)


@dataclass(frozen=True, slots=True)
class WorkflowRunResult:
    """What a fixed run ends with; ``outputs``/``errors``/``statuses`` use authored node ids."""

    run_id: str
    status: str  # completed | failed | cancelled
    source: str
    content_hash: str
    outputs: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "status": self.status, "source": self.source,
            "content_hash": self.content_hash, "outputs": self.outputs, "errors": self.errors,
            "statuses": self.statuses, "provenance": self.provenance,
            "lane_capabilities": FIXED_WORKFLOW_CAPABILITIES.as_metadata(),
            "elapsed": round(self.elapsed, 3),
        }


class FixedRunControl:
    """The fixed lane's control handle: ``cancel`` and ``status`` have consumers.

    Pause, resume, live messages and injection are not capabilities of this lane
    (ADR-0068 D3): each raises ``LaneCapabilityError`` and nothing reaches the executor.
    """

    def __init__(self, control: Any) -> None:
        self._control = control

    async def cancel(self) -> bool:
        check_control(FIXED_WORKFLOW, "cancel")
        return await self._control.cancel()

    async def status(self) -> dict[str, Any]:
        return await self._control.status()

    async def pause(self) -> bool:
        check_control(FIXED_WORKFLOW, "pause")
        return False  # unreachable: the lane rejects it above

    async def resume(self) -> bool:
        check_control(FIXED_WORKFLOW, "resume")
        return False

    async def send_operator_message(self, text: str) -> bool:
        check_control(FIXED_WORKFLOW, "message")
        return False

    async def inject(self, *args: Any, **kwargs: Any) -> bool:
        check_control(FIXED_WORKFLOW, "spawn")
        return False


def compile_source(source: WorkflowSource, *, inputs: Mapping[str, Any] | None = None,
                   base_dir: str | Path | None = None, model: str | None = None) -> CompiledWorkflow:
    """Compile a pinned source; a definition stored without a spec cannot run."""
    if source.spec is None:
        raise WorkflowCompileError("workflow definition has no spec_json to run")
    definition = load_definition(source.spec)
    return compile_workflow(definition, inputs=inputs, model_override=model, base_dir=base_dir,
                            name=source.label)


def _summarise(envelope: Mapping[str, Any], compiled: CompiledWorkflow) -> tuple[dict, dict, dict]:
    spec_ids = compiled.spec_ids_by_node_id
    results = envelope.get("operation_results", {})
    statuses = {spec_ids.get(node_id, node_id): status
                for node_id, status in envelope.get("operation_statuses", {}).items()}
    errors = {spec_ids.get(node_id, node_id): results.get(node_id)
              for node_id in envelope.get("failed_operations", [])}
    wanted = compiled.declared_outputs or tuple(spec_ids[node_id] for node_id in envelope.get("operation_statuses", {})
                                                if node_id in spec_ids)
    node_ids = compiled.node_ids_by_spec_id
    outputs = {spec_id: results.get(node_ids[spec_id])
               for spec_id in wanted
               if spec_id in node_ids and envelope["operation_statuses"].get(node_ids[spec_id]) == "completed"}
    return outputs, errors, statuses


def _run_status(envelope: Mapping[str, Any]) -> str:
    if envelope.get("status") == "cancelled":
        return "cancelled"
    failed = envelope.get("status") == "failed" or any(
        isinstance(result, dict) and "error" in result
        for node_id, result in envelope.get("operation_results", {}).items()
        if envelope.get("operation_statuses", {}).get(node_id) != "skipped"
    )
    return "failed" if failed else "completed"


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
) -> WorkflowRunResult:
    """Compile ``source``, persist the run, execute it on ``session`` and record the outcome.

    A compile error raises ``WorkflowCompileError`` before any run row exists. A failed
    operation makes the run ``failed``; an unexpected runtime error is recorded and the
    run returned as ``failed`` (ADR-0073 D5); task cancellation records ``cancelled`` and
    re-raises. ``on_progress(spec_node_id, name, status, elapsed)`` sees each lifecycle
    signal; ``control`` (a dict) receives ``"control"``: a ``FixedRunControl``;
    ``on_admitted`` (a future) gets the run's status once its row is written, or the
    error that came first. Every signal and every settled node's result reach the store
    as the run goes (``RunRecorder``), each store write on the store's writer thread.
    """
    try:
        compiled = compiled or compile_source(source, inputs=inputs, base_dir=base_dir, model=model)
        run_id = run_id or str(uuid.uuid4())
        provenance = RunProvenance.fixed_workflow(
            ref=source.ref, content_hash=source.content_hash, version=source.version, source_kind=source.kind,
        ).to_payload()
        recorder = RunRecorder(store, run_id, compiled.spec_ids_by_node_id, on_progress)
        if store is not None:
            await recorder.write(store.create_run, run_id, session_id=session.id, provenance=provenance,
                                 inputs=dict(inputs or {}), workflow=source.workflow)
            await recorder.write(store.mark_running, run_id)
    except BaseException as exc:
        if on_admitted is not None and not on_admitted.done():
            on_admitted.set_exception(exc)
        raise
    if on_admitted is not None and not on_admitted.done():
        on_admitted.set_result("running" if store is not None else "admitted")
    executor_ref: dict[str, Any] = {}
    if control is not None:
        control["run_id"] = run_id
    started = time.perf_counter()

    async def publish_control() -> None:
        # executor_ref is filled once the executor has admitted the run.
        while "executor" not in executor_ref:
            await asyncio.sleep(0.01)
        control["control"] = FixedRunControl(executor_ref["executor"])

    helper = asyncio.ensure_future(publish_control()) if control is not None else None
    status, outputs, errors, statuses = "failed", {}, {}, {}
    default_branch = f"run-{run_id}-default"  # the isolated run's own (the envelope names it too)
    try:
        try:
            # Isolated: its own default branch, so no other run's conversation reaches it,
            # and its branches are dropped once recorded (below), so a long-lived runtime
            # (opgraph serve, a detached cluster runtime) stays flat run after run.
            envelope = await session.flow(
                compiled.graph, **compiled.flow_options(), max_concurrent=max_concurrent, run_id=run_id,
                on_progress=recorder.progress, on_branch_created=recorder.branch_created,
                on_settled=recorder.settled, executor_ref=executor_ref, isolated=True,
            )
            default_branch = envelope.get("default_branch", default_branch)
            status = _run_status(envelope)
            outputs, errors, statuses = _summarise(envelope, compiled)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - D5: a runtime error is a failed run, recorded
            errors = {"run": {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}}
        finally:
            if helper is not None:
                helper.cancel()
        try:
            await recorder.drain()  # every signal and node result before the branches and the end
            await recorder.record_branches(default_branch, session.messages)
        except Exception as exc:  # noqa: BLE001 - lost branch history must not hide the run's outcome
            errors.setdefault("branches", {"error": f"could not record branch messages: {exc}"})
        finally:
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
    return WorkflowRunResult(run_id=run_id, status=status, source=source.label, content_hash=source.content_hash,
                             outputs=outputs, errors=errors, statuses=statuses, provenance=provenance,
                             elapsed=time.perf_counter() - started)



async def _release(session: Any, run_id: str, errors: dict[str, Any]) -> None:
    """Drop the run's branches from the stores, once recorded; a failure is noted on the run."""
    try:
        await session.release_run(run_id)
    except Exception as exc:  # noqa: BLE001 - the run's outcome stands; the leak is reported with it
        errors.setdefault("branches", {"error": f"could not release the run's branches: {exc}"})
