"""The planned reactive flow lane's adapter (ADR-0068 D2): plan in ``prepare``, run in ``execute``, replay a checkpoint.

Owns turning an invocation into a prepared run: a new run is planned (the planner's one
call, through ``PlanningEngine``) and built into a DAG on one branch per role; a
checkpoint (``--resume``) is rebuilt from what the run recorded, with no planner call.
``execute`` records and runs it through ``Session.flow`` like every lane, then records each
role's conversation and runs the exempt synthesis when the run's configuration asks for
one. Presenting an envelope (outputs by step label) is here too. It never schedules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ...store import RunRecord, RunStore
from ..base import PLANNED_REACTIVE_FLOW, REACTIVE_PLAY, LaneInvocation, LaneRunResult, PreparedLaneRun, RunHooks
from ..capabilities import LaneCapabilities, LaneCapabilityError, check_capabilities
from ..execution import Presentation, run_prepared
from ..provenance import RunProvenance
from ..recovery import submit_prepared
from .checkpoint import CheckpointRefusedError, find_run, read_checkpoint, replayed_as, retire_logged_run
from .contract import (
    PlannedModeError,
    check_planned_provenance,
    planned_capabilities,
    planned_provenance,
    sha256_of,
    spawn_cap,
)
from .planning import ScopedPort, flow_options, plan_run, planning_engine, release_roles, run_config
from .replay import build_replay

__all__ = ["PlannedFlowLane", "present"]

_PLANNED_LANES = (PLANNED_REACTIVE_FLOW, REACTIVE_PLAY)


class PlannedFlowLane:
    """The ``planned_reactive_flow`` adapter for one run store (None: runs are not recorded).

    ``prepare`` needs the Session the planner's turn runs on (``prepare(invocation,
    session=...)``): a planned run's graph exists only once planned.
    """

    lane: str = PLANNED_REACTIVE_FLOW

    def __init__(self, store: RunStore | None = None) -> None:
        self.store = store

    def capabilities(self, invocation: LaneInvocation | None = None) -> LaneCapabilities:
        """Planner, pause/resume, messages, cancel; growth unless ``--reactive off``; resume when logged."""
        if invocation is None:
            return planned_capabilities("all")
        capabilities = planned_capabilities(invocation.reactive_mode, durable=invocation.durable)
        if invocation.source_kind == "checkpoint":  # a replay never calls the planner (ADR-0068's table)
            capabilities = dataclasses.replace(capabilities, planner=False)
        return capabilities

    def check_provenance(self, provenance: RunProvenance) -> None:
        check_planned_provenance(provenance)

    def invocation(self, target: str, *, model: str | None = None, reactive: str = "all", max_ops: int = 0,
                   roles: Mapping[str, str] | None = None, max_assignments: int | None = None,
                   synthesis: bool = True, max_concurrent: int | None = 5, run_id: str | None = None,
                   durable: bool = True, spec: str | Path | None = None, resume: bool = False,
                   retry_failed: bool = False, allow_degraded_context: bool = False) -> LaneInvocation:
        """The invocation for ``opgraph o flow``: ``target`` is the prompt, or with ``resume`` a run id
        (or a unique prefix). ``spec`` (``-f``) is a YAML or JSON flow spec whose fields (prompt,
        roles, model, max_ops, reactive, max_assignments, synthesis) fill in what the command line
        leaves out. Bad options are refused here, before anything starts (``PlannedModeError``)."""
        if resume:
            target = str(target).strip()
            if self.store is not None:  # refused here, before the runtime starts
                record = find_run(self.store, target)
                refuse_replay(record)
                target = record.run_id
            return LaneInvocation(lane=self.lane, source_ref=target, source_kind="checkpoint",
                                  source_content_hash=None, model=model, run_id=run_id, max_concurrent=max_concurrent,
                                  durable=durable, inputs={"retry_failed": bool(retry_failed),
                                                           "allow_degraded_context": bool(allow_degraded_context)})
        kind, ref, content_hash = "prompt", None, None
        fields: dict[str, Any] = {}
        if spec is not None:
            fields, raw = _read_spec(spec)
            kind, ref, content_hash = "flow_spec", str(Path(spec).expanduser().resolve()), sha256_of(raw)
        task = (str(target).strip() if target else "") or str(fields.get("prompt") or "").strip()
        if not task:
            raise PlannedModeError("a planned flow needs a prompt (or a -f spec with one)")
        return self.planned_invocation(
            task, source_kind=kind, source_ref=ref or task[:200], content_hash=content_hash or sha256_of(task),
            model=model or fields.get("model"), reactive=reactive if reactive else fields.get("reactive", "all"),
            max_ops=max_ops if max_ops else int(fields.get("max_ops") or 0), roles=roles or fields.get("roles"),
            max_assignments=max_assignments or fields.get("max_assignments"),
            synthesis=synthesis and bool(fields.get("synthesis", True)), max_concurrent=max_concurrent,
            run_id=run_id, durable=durable)

    def planned_invocation(self, task: str, *, source_kind: str, source_ref: str, content_hash: str | None,
                           model: str | None, reactive: str, max_ops: int, roles: Mapping[str, str] | None,
                           max_assignments: int | None, synthesis: bool, max_concurrent: int | None,
                           run_id: str | None, durable: bool, extra: Mapping[str, Any] | None = None,
                           ) -> LaneInvocation:
        """A new planned run of ``task`` (what ``-f`` specs and playbooks resolve to)."""
        if isinstance(max_ops, bool) or not isinstance(max_ops, int) or max_ops < 0:
            raise PlannedModeError(f"--max-ops must be a whole number >= 0, got {max_ops!r}")
        if roles is not None and (not isinstance(roles, Mapping) or not roles):
            raise PlannedModeError(f"roles must map role names to what each does, got {roles!r}")
        inputs = {"task": task, "max_assignments": max_assignments, "synthesis": synthesis,
                  **({"roles": dict(roles)} if roles else {})}
        config = run_config(inputs, reactive_mode=str(reactive or "all"), max_ops=max_ops, model=model,
                            max_concurrent=max_concurrent)
        return LaneInvocation(lane=self.lane, source_ref=source_ref, source_kind=source_kind,  # type: ignore[arg-type]
                              source_content_hash=content_hash, inputs={"task": task, "config": config,
                                                                        **dict(extra or {})},
                              reactive_mode=str(reactive or "all"), max_ops=max_ops, model=model, run_id=run_id,
                              max_concurrent=max_concurrent, durable=durable)

    # -- prepare ---------------------------------------------------------------------------
    async def prepare(self, invocation: LaneInvocation, *, session: Any = None) -> PreparedLaneRun:
        """Plan (a new run) or rebuild (a checkpoint) on ``session``; every refusal comes before a run exists."""
        if invocation.lane not in _PLANNED_LANES:
            raise ValueError(f"the {self.lane} adapter prepared a {invocation.lane!r} invocation")
        if invocation.source_kind == "checkpoint":
            return await self.prepare_replay(invocation, session=session)
        if session is None:
            raise OpGraphError("a planned run is planned on a Session: prepare(invocation, session=...)")
        run_id = invocation.run_id or str(uuid.uuid4())
        config = dict(invocation.inputs["config"])
        planned = await plan_run(session, run_id, invocation.inputs["task"], config)
        provenance = planned_provenance(
            lane=self.lane, source_kind=invocation.source_kind, ref=invocation.source_ref,
            content_hash=invocation.source_content_hash, planner_used=True,
            reactive=bool(planned.flow_options.get("reactive")), max_ops=invocation.max_ops,
            path=invocation.inputs.get("playbook", {}).get("path"))
        recovery = {**planned.recovery, **({"playbook": invocation.inputs["playbook"]}
                                           if "playbook" in invocation.inputs else {})}
        pinned = dataclasses.replace(invocation, run_id=run_id)
        return PreparedLaneRun(graph=planned.graph, context={"task": invocation.inputs["task"]}, invocation=pinned,
                               recovery=recovery, run_id=run_id, provenance=provenance,
                               capabilities=self.capabilities(pinned), flow_options=planned.flow_options,
                               labels=planned.labels, label=_label(invocation), lane_state=planned)

    async def prepare_replay(self, invocation: LaneInvocation, *, session: Any) -> PreparedLaneRun:
        """Rebuild a recorded planned run as a new run that continues it, with no planner call."""
        if self.store is None:
            raise CheckpointRefusedError("a checkpoint replay reads the run store; none was given")
        record = await asyncio.to_thread(find_run, self.store, invocation.source_ref)
        refuse_replay(record)
        checkpoint = await asyncio.to_thread(read_checkpoint, record)
        recorded = {branch["branch_id"]: branch["messages"]
                    for branch in await asyncio.to_thread(self.store.run_branches, record.run_id)}
        replay = await asyncio.to_thread(
            build_replay, checkpoint, retry_failed=invocation.inputs.get("retry_failed", False),
            allow_degraded_context=invocation.inputs.get("allow_degraded_context", False),
            recorded_branches=recorded)
        if session is None:
            raise OpGraphError("a replay runs on a Session: prepare(invocation, session=...)")
        recovery = dict(record.recovery or {})
        config = dict(recovery.get("config") or {})
        run_id = invocation.run_id or str(uuid.uuid4())
        port = ScopedPort(session, run_id)  # registers the task nodes' operation too
        branches: dict[str, str] = {}
        renamed: dict[str, str] = {}
        for role, old in dict(recovery.get("branches") or {}).items():
            renamed[old] = branches[role] = await port.new_branch(f"replay-{role}", replay.histories.get(old, []))
        for node in replay.graph.nodes.values():
            node.branch_id = renamed.get(node.branch_id, node.branch_id)
        max_spawn = spawn_cap(int(config.get("max_ops") or 0), len(recovery.get("plan") or []),
                              replay.spawned_restored)
        config["max_spawn"] = max_spawn
        options = flow_options(planning_engine(config), branches, config, max_spawn)
        provenance = planned_provenance(
            lane=record.lane, source_kind="checkpoint", ref=record.run_id, content_hash=record.content_hash,
            planner_used=False, reactive=bool(options.get("reactive")), max_ops=int(config.get("max_ops") or 0),
            resumed_from=record.run_id)
        recovery.pop("labels", None)
        recovery.update({
            "branches": branches, "config": config,
            "resumed_from": {"run_id": record.run_id, "session_id": record.session_id},
            "degraded_context": replay.degraded, "restored_ops": len(replay.restored),
            "restored_spawns": replay.spawned_restored, "retried_ops": replay.retried,
            "dropped_children": replay.dropped_children})
        pinned = dataclasses.replace(invocation, lane=record.lane, run_id=run_id,
                                     source_content_hash=record.content_hash,
                                     reactive_mode=str(config.get("reactive_mode") or "all"),
                                     max_ops=int(config.get("max_ops") or 0),
                                     max_concurrent=invocation.max_concurrent or config.get("max_concurrent"))
        await asyncio.to_thread(retire_logged_run, record.run_id, run_id)
        return PreparedLaneRun(graph=replay.graph, context={"task": recovery.get("task", "")}, invocation=pinned,
                               recovery=recovery, run_id=run_id, provenance=provenance,
                               capabilities=self.capabilities(pinned), flow_options=options, labels=replay.labels,
                               label=f"resume of {record.run_id}", lane_state=replay)

    # -- execute -----------------------------------------------------------------------------
    async def execute(self, prepared: PreparedLaneRun, *, session: Any,
                      hooks: RunHooks | None = None) -> LaneRunResult:
        """Record and run ``prepared`` through ``Session.flow``, each role's conversation recorded with the
        run's branches; then, when the configuration asks for it, the exempt synthesis runs over the results."""
        labels = dict(prepared.labels)
        roles = {branch_id: f"role:{role}" for role, branch_id in (prepared.recovery.get("branches") or {}).items()}
        try:
            result = await run_prepared(prepared, session=session, store=self.store, hooks=hooks, branches=roles,
                                        present=lambda envelope: present(envelope, {"labels": labels}))
            config = prepared.recovery.get("config") or {}
            if config.get("synthesis") and result.status == "completed":
                result = await self._synthesise(prepared, session, result)
        finally:
            await asyncio.shield(release_roles(session, prepared.run_id))
        return result

    async def _synthesise(self, prepared: PreparedLaneRun, session: Any, result: LaneRunResult) -> LaneRunResult:
        from opgraph.engines.planning import TaskSettled

        config = prepared.recovery.get("config") or {}
        engine = planning_engine(config)
        run = engine.new_run(session=session, port=ScopedPort(session, result.run_id),
                             run_id=f"{result.run_id}-synthesis")
        settled = [TaskSettled(node_id=label, assignee=label.split(":", 1)[-1].split(">")[0], status=status,
                               text=str(result.outputs.get(label, ""))[:4000])
                   for label, status in result.statuses.items()]
        agent = await run.make_agent("synthesizer", name="synthesizer", exempt=True,
                                     model=engine.model_for("synthesizer"))
        try:
            turn = await run.turn(agent, engine.synthesis_instruction(prepared.recovery.get("task", ""), settled))
            text = turn.response if isinstance(turn.response, str) else str(turn.response)
            node = {"node_id": "synthesis", "spec_node_id": "synthesis", "status": "completed",
                    "result": {"text": text}}
            outputs = {**result.outputs, "synthesis": text}
        except OpGraphError as exc:
            node = {"node_id": "synthesis", "spec_node_id": "synthesis", "status": "failed",
                    "result": {"error": str(exc), "error_type": type(exc).__name__}}
            outputs = result.outputs
        if self.store is not None:
            await self.store.writer.call(self.store.record_progress, result.run_id, nodes=[node])
            await self.store.writer.call(self.store.record_branch, result.run_id, agent.id, node_id="synthesis",
                                         messages=await session.messages(agent.id))
        return dataclasses.replace(result, outputs=outputs)

    async def submit(self, prepared: PreparedLaneRun, *, session: Any) -> str:
        """Record ``prepared`` and admit it detached; ``opgraph run result`` reads its end."""
        return await submit_prepared(prepared, session=session, store=self.store)

    def present(self, envelope: Mapping[str, Any], recovery: Mapping[str, Any]) -> Presentation:
        return present(envelope, recovery)

    def check_replay(self, record: RunRecord) -> None:
        """The plan a run replays is the one its run log holds, so nothing outside can have changed it."""


def refuse_replay(record: RunRecord) -> None:
    """Raise unless ``record`` is a planned run ``--resume`` may replay (``LaneCapabilityError`` for a
    fixed-lane run, a live one, or one whose capabilities exclude it; ``CheckpointRefusedError`` for one
    that completed)."""
    capabilities = record.capabilities or {}
    if record.lane not in _PLANNED_LANES:
        raise LaneCapabilityError(
            f"run {record.run_id} is a {record.lane} run: `opgraph o flow --resume` replays planned checkpoints "
            "only (a fixed run is continued with `opgraph run resume`); nothing ran", lane=record.lane,
            request_kind="checkpoint_resume", capabilities=capabilities, run_id=record.run_id)
    if not record.terminal:
        raise LaneCapabilityError(
            f"run {record.run_id} is live ({record.status}): a live run is controlled (opgraph run pause, message, "
            "cancel), not replayed; nothing ran", lane=record.lane, request_kind="checkpoint_resume",
            capabilities=capabilities, run_id=record.run_id)
    check_capabilities(LaneCapabilities.from_metadata(capabilities), "checkpoint_resume", lane=record.lane,
                       run_id=record.run_id)
    if record.status == "completed":
        raise CheckpointRefusedError(f"run {record.run_id} completed: there is nothing to resume",
                                     run_id=record.run_id)
    successor = replayed_as(record.run_id)
    if successor is not None:
        raise CheckpointRefusedError(f"run {record.run_id} was already replayed as run {successor}; resume that "
                                     "run instead", run_id=record.run_id)


def present(envelope: Mapping[str, Any], recovery: Mapping[str, Any]) -> Presentation:
    """A planned run's status and its outputs (each op's text), errors and statuses by step label
    (``N:role``; a spawned op as ``parent>spawn-K``, or ``spawned:ID`` when its parent is unknown)."""
    labels = dict(recovery.get("labels", {}))
    results = envelope.get("operation_results", {})
    operation_statuses = envelope.get("operation_statuses", {})

    def name(node_id: str) -> str:
        return labels.get(node_id) or f"spawned:{node_id[:8]}"

    statuses = {name(node_id): status for node_id, status in operation_statuses.items()}
    errors = {name(node_id): results.get(node_id) for node_id in envelope.get("failed_operations", [])}
    outputs = {}
    for node_id, status in operation_statuses.items():
        if status == "completed":
            result = results.get(node_id)
            outputs[name(node_id)] = result.get("text", result) if isinstance(result, Mapping) else result
    if envelope.get("status") == "cancelled":
        status = "cancelled"
    elif envelope.get("status") == "failed" or errors:
        status = "failed"
    else:
        status = "completed"
    return status, outputs, errors, statuses


def _label(invocation: LaneInvocation) -> str:
    playbook = invocation.inputs.get("playbook")
    if playbook:
        return f"playbook {playbook['name']}"
    if invocation.source_kind == "flow_spec":
        return invocation.source_ref
    task = invocation.inputs.get("task", "")
    return json.dumps(task[:60] + ("…" if len(task) > 60 else ""), ensure_ascii=False)


def _read_spec(spec: str | Path) -> tuple[dict[str, Any], bytes]:
    """A ``-f`` flow spec's fields and bytes (YAML or JSON); unknown fields are refused."""
    path = Path(spec).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PlannedModeError(f"cannot read the flow spec {str(path)!r}: {exc.strerror or exc}") from None
    try:
        import yaml

        fields = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise PlannedModeError(f"the flow spec {str(path)!r} is not YAML or JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise PlannedModeError(f"the flow spec {str(path)!r} must be a mapping of fields")
    unknown = set(fields) - {"prompt", "roles", "model", "max_ops", "reactive", "max_assignments", "synthesis"}
    if unknown:
        raise PlannedModeError(f"the flow spec {str(path)!r} has unknown fields: {', '.join(sorted(unknown))}")
    return fields, raw
