"""Planning a new planned run: the planner's call, the validated plan, the DAG and its recovery record.

Owns turning a prompt (a ``-f`` spec's, or a playbook's rendered template) into a graph
ready for ``Session.flow``: the planner runs through ``PlanningEngine`` (an ``operate`` turn
with the roster in its schema; unknown assignees dropped, the cap, the ordinal normaliser,
cycles refused, an empty plan retried once, then ``PlanError``), one branch per role, the
DAG from ``build_dag_graph``, and the reactive options ``--reactive`` and ``--max-ops`` allow.
What a checkpoint replay needs (the plan, roles, branches, configuration) is returned as data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from opgraph.actors.calls import ExecutorStub, ask
from opgraph.engines import PlanningEngine
from opgraph.engines.planning import DEFAULT_ROLES, TaskOutput
from opgraph.engines.port import SessionPort
from opgraph.kernel import Graph, SpawnRequest

from .contract import reactive_roles, spawn_cap

__all__ = ["DEFAULT_MAX_ASSIGNMENTS", "PlannedGraph", "ScopedPort", "flow_options", "label_of", "plan_run",
           "planning_engine", "release_roles", "role_scope"]

DEFAULT_MAX_ASSIGNMENTS = 12


@dataclass
class PlannedGraph:
    """A planned graph, its labels (node id -> ``N:role``), flow options and recovery data."""

    graph: Graph
    labels: dict[str, str]
    flow_options: dict[str, Any]
    recovery: dict[str, Any]
    engine: PlanningEngine
    dropped: list[str] = field(default_factory=list)


def role_scope(run_id: str) -> str:
    """The branch scope of a planned run's agents (planner, roles, synthesiser): dropped with the run."""
    return f"lane-{run_id}"


class ScopedPort(SessionPort):
    """The Session's port, making agent branches in the run's own scope rather than the Session's, so a
    long-lived Session (``opgraph serve``) keeps nothing of a run once it is recorded (``release_roles``)."""

    def __init__(self, session: Any, run_id: str) -> None:
        super().__init__(session)
        self.scope = role_scope(run_id)

    async def new_branch(self, name: str, messages: list[dict[str, Any]]) -> str:
        branch_id = f"{self.scope}-{name}"
        shard = await ask(self.session.runtime.member(0), ExecutorStub.create_branch, branch_id, list(messages),
                          self.scope)
        # Known to the Session, so its runs use the branch as it is rather than cloning it.
        self.session._locations[branch_id] = shard
        return branch_id


async def release_roles(session: Any, run_id: str) -> None:
    """Drop the run's agent branches (once recorded)."""
    await ask(session.runtime.member(0), ExecutorStub.drop_scope, role_scope(run_id))
    for branch_id in [branch for branch in session._locations if branch.startswith(role_scope(run_id) + "-")]:
        session._locations.pop(branch_id, None)


def label_of(index: int, role: str) -> str:
    return f"{index}:{role}"


def planning_engine(config: Mapping[str, Any]) -> PlanningEngine:
    """The engine a run's configuration describes (the same on a replay, which plans nothing)."""
    spawning = config.get("spawning_roles")
    return PlanningEngine(roles=dict(config["roles"]), reactive=spawning is None or bool(spawning),
                          max_assignments=int(config["max_assignments"]), max_spawn=int(config["max_spawn"]),
                          model=config.get("model"), models=dict(config.get("models") or {}),
                          max_concurrent=max(1, int(config.get("max_concurrent") or 5)),
                          max_agents=len(config["roles"]) + 8)


def flow_options(engine: PlanningEngine, branches: Mapping[str, str], config: Mapping[str, Any],
                 max_spawn: int) -> dict[str, Any]:
    """``Session.flow``'s reactive options for the run: none when ``--reactive off``."""
    spawning = config.get("spawning_roles")
    if spawning is not None and not spawning:
        return {"reactive": False}
    return {"reactive": True, "spawn_type": SpawnRequest, "max_spawn": max_spawn,
            "node_builder": engine.node_builder(dict(branches), None if spawning is None else tuple(spawning))}


def run_config(inputs: Mapping[str, Any], *, reactive_mode: str, max_ops: int, model: str | None,
               max_concurrent: int | None) -> dict[str, Any]:
    """The run configuration a new run records (and a replay reuses), from the invocation."""
    roles = dict(inputs.get("roles") or DEFAULT_ROLES)
    spawning = reactive_roles(reactive_mode, roles)
    max_assignments = inputs.get("max_assignments") or (max_ops if max_ops else DEFAULT_MAX_ASSIGNMENTS)
    return {"roles": roles, "reactive_mode": reactive_mode,
            "spawning_roles": None if spawning is None else list(spawning), "max_ops": max_ops,
            "max_assignments": int(max_assignments), "max_spawn": spawn_cap(max_ops, 0),
            "model": model, "models": dict(inputs.get("models") or {}), "max_concurrent": max_concurrent or 5,
            "synthesis": bool(inputs.get("synthesis", True))}


async def plan_run(session: Any, run_id: str, task: str, config: dict[str, Any]) -> PlannedGraph:
    """Plan ``task`` with the planner and build the run's DAG (``PlanError`` when no plan is usable)."""
    engine = planning_engine(config)
    engine.validate(task)
    run = engine.new_run(session=session, port=ScopedPort(session, run_id), run_id=run_id)
    try:
        return await _plan(engine, run, task, config)
    except BaseException:
        await release_roles(session, run_id)
        raise


async def _plan(engine: PlanningEngine, run: Any, task: str, config: dict[str, Any]) -> PlannedGraph:
    assignments, dropped = await engine.plan(run, task)
    spawning = config["spawning_roles"]
    roles = engine.roles if spawning is None or spawning else dict.fromkeys(a.assignee for a in assignments)
    branches: dict[str, str] = {}
    for role in roles:
        agent = await run.make_agent(role, name=role, extra_prompt=f"You {engine.roles[role]}.")
        branches[role] = agent.id
    graph = engine.plan_graph(run, assignments, branches)
    node_ids = list(graph.nodes)
    labels, plan = {}, []
    for index, (node_id, assignment) in enumerate(zip(node_ids, assignments, strict=True), start=1):
        node = graph.nodes[node_id]
        labels[node_id] = label_of(index, assignment.assignee)
        node.metadata["reference_id"] = labels[node_id]
        if spawning is not None and assignment.assignee not in spawning:
            node.parameters.pop("response_format", None)  # a role that may not spawn is not asked to
        elif spawning is not None or engine.reactive:
            node.parameters["response_format"] = TaskOutput
        plan.append({"index": index, "node_id": node_id, "task": assignment.task, "assignee": assignment.assignee,
                     "inputs": list(assignment.inputs), "exit_criteria": assignment.exit_criteria,
                     "depends_on": [node_ids.index(edge.head) + 1 for edge in graph.edges.values()
                                    if edge.tail == node_id and edge.head in node_ids]})
    config = {**config, "max_spawn": spawn_cap(config["max_ops"], len(assignments))}
    recovery = {"task": task, "plan": plan, "branches": branches, "config": config, "dropped_assignees": dropped}
    return PlannedGraph(graph, labels, flow_options(engine, branches, config, config["max_spawn"]), recovery,
                        engine, dropped)
