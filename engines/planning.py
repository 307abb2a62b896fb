"""PlanningEngine: plan TaskAssignments, build the DAG, run it through run_dag, synthesise (ADR-0034 D4).

Owns the planning domain: the planner's structured output (assignments naming roster
roles), its validation (unknown assignees dropped, the ADR-0033 D2 ordinal normaliser,
cap and cycle checks, one retry of an empty plan, then PlanError), the DAG built with
the kernel's ``build_dag_graph``, reactive growth routed by ``role_node_builder``, and
the exempt synthesis turn. It is the only engine that submits a graph (``run_dag``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import warnings
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, Field

from opgraph.actors import TurnError
from opgraph.actors.verbs import operate
from opgraph.kernel import (
    Operation,
    RoutingError,
    SpawnRequest,
    TaskAssignment,
    build_dag_graph,
    normalise_dependency_ordinals,
    role_node_builder,
)
from opgraph.kernel.failures import CANCELLED
from opgraph.kernel.patterns import DependencyReferenceWarning

from .engine import Engine
from .errors import EngineBudgetError, EngineInputError, PlanError, require_text
from .events import EngineEvent
from .run import CUT_OFF_ERROR_TYPES, MALFORMED_ERROR_TYPES, EngineRun
from .usage import ENGINE_OPERATE, METERED_VERBS

__all__ = ["DEFAULT_ROLES", "PlanProposed", "PlanningEngine", "TaskOutput", "TaskSettled", "plan_model"]

# Planned nodes run operate with its default parse retries: a node that failed to parse made that many more calls.
_OPERATE_PARSE_RETRIES = inspect.signature(operate).parameters["parse_retries"].default

DEFAULT_ROLES: dict[str, str] = {
    "researcher": "gathers facts, sources and prior work",
    "analyst": "reasons over evidence, numbers and trade-offs",
    "writer": "drafts clear, complete text",
    "critic": "finds flaws, risks and missing cases",
}


class PlanProposed(EngineEvent):
    """The validated plan the orchestrator produced (unknown assignees already dropped)."""

    assignments: list[TaskAssignment]
    dropped: list[str] = Field(default_factory=list)


class TaskSettled(EngineEvent):
    """One planned or spawned node of the DAG settled (from the flow's envelope)."""

    node_id: str
    assignee: str = ""
    status: str
    text: str = ""


class TaskOutput(BaseModel):
    """A reactive task node's reply: its answer and any follow-up work it asks for."""

    text: str
    spawn: list[SpawnRequest] = Field(default_factory=list)


def _normal(role: str) -> str:
    return str(role).strip().lower().replace("_", "-")


@lru_cache(maxsize=64)
def plan_model(roster: tuple[str, ...]) -> type[BaseModel]:
    """The planner's structured output; the schema names the roster, so assignees are roles.

    Its classes are pickled by reference (names this module resolves in ``__getattr__``):
    a planner's turn sends the class to the executor and its worker and the plan comes back
    as its instance, and a class pickled by value is rebuilt on every hop (traced: 12 ms of
    a structured turn's 22 ms overhead on sim/, against 10 ms for a plain turn)."""

    def assignee_schema(schema: dict[str, Any]) -> None:
        schema["enum"] = list(roster)

    class PlannedTask(BaseModel):
        task: str
        assignee: str = Field(json_schema_extra=assignee_schema)
        inputs: list[str] = Field(default_factory=list)
        exit_criteria: str | None = None
        depends_on: list[str] = Field(default_factory=list,
                                      description="1-based step numbers of real data dependencies only")

    class Plan(BaseModel):
        assignments: list[PlannedTask]

    encoded = json.dumps(list(roster)).encode().hex()
    for kind in (PlannedTask, Plan):
        kind.__module__ = __name__
        kind.__qualname__ = f"{_PLAN_PREFIX}{kind.__name__}__{encoded}"
    return Plan


_PLAN_PREFIX = "plan_model__"


def __getattr__(name: str) -> Any:
    """A class of ``plan_model`` by its pickled name, made in this process."""
    kind, _, encoded = name[len(_PLAN_PREFIX):].partition("__") if name.startswith(_PLAN_PREFIX) else ("", "", "")
    if kind not in ("Plan", "PlannedTask"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    plan = plan_model(tuple(json.loads(bytes.fromhex(encoded))))
    return plan if kind == "Plan" else plan.model_fields["assignments"].annotation.__args__[0]


class PlanningEngine(Engine):
    """Plans with an orchestrator, runs the plan as an operation DAG, then synthesises.

    ``roles`` maps each roster role to what it does; ``reactive`` lets task nodes ask
    for follow-up work (SpawnRequest) routed to a roster role (the emitter's own when
    none is named), at most ``max_spawn`` of them. ``run(prompt)`` returns an EngineResult.
    """

    kind = "planning"

    def __init__(self, *, roles: Mapping[str, str] | None = None, reactive: bool = True, max_assignments: int = 12,
                 max_spawn: int = 20, repair_retries: int = 1, **engine_settings: Any) -> None:
        super().__init__(**engine_settings)
        roles = dict(DEFAULT_ROLES if roles is None else roles)
        if not roles or any(not isinstance(name, str) or not name.strip() for name in roles):
            raise EngineInputError(f"roles must name at least one role, got {list(roles)!r}")
        for name, value in (("max_assignments", max_assignments), ("max_spawn", max_spawn)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "max_assignments" else 0):
                raise EngineInputError(f"{name} must be a non-negative integer (max_assignments >= 1), got {value!r}")
        self.roles = roles
        self.reactive = bool(reactive)
        self.max_assignments = max_assignments
        self.max_spawn = max_spawn
        self.repair_retries = repair_retries

    def validate(self, prompt: Any = None, *args: Any, **kwargs: Any) -> None:
        require_text(prompt, "planning needs a non-empty prompt")

    def describe_input(self, prompt: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"prompt": prompt[:4000], "roles": list(self.roles)}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "roles": list(self.roles), "reactive": self.reactive,
                "max_assignments": self.max_assignments, "max_spawn": self.max_spawn}

    # -- planning --------------------------------------------------------------------------
    def _planner_instruction(self, prompt: str, retry: bool) -> str:
        roster = "\n".join(f"- {name}: {duty}" for name, duty in self.roles.items())
        text = (f"Plan the work for this task as a wide DAG of assignments.\n\nTask: {prompt}\n\nRoles (assign "
                f"only these):\n{roster}\n\nGive each assignment a task, an assignee, and depends_on with the "
                f"1-based numbers of earlier assignments only where it needs their results. At most "
                f"{self.max_assignments} assignments; at most {self.max_assignments + self.max_spawn} operations "
                f"including spawned follow-ups.")
        if retry:
            text += "\n\nYour previous plan had no usable assignment. Return only the assignments."
        return text

    def _validated(self, run: EngineRun, planned: Any) -> tuple[list[TaskAssignment], list[str]]:
        """Assignments naming roster roles (``-``/``_`` equivalent); the rest dropped by name.

        The kept assignments' ordinals are renumbered to the kept list, so a dependency still
        names the step it named in the plan; one on a dropped step is dropped with it (and
        reported). References that are not integers or out of range are left for the ordinal
        normaliser, which drops them: out of range in the plan stays out of range here.
        """
        by_normal = {_normal(name): name for name in self.roles}
        items = list(getattr(planned, "assignments", None) or [])
        roles = [by_normal.get(_normal(item.assignee)) for item in items]
        renumbered = {str(old): str(new) for new, old in enumerate(
            (index for index, role in enumerate(roles, start=1) if role is not None), start=1)}
        kept, dropped, orphaned = [], [], []
        for index, (item, role) in enumerate(zip(items, roles, strict=True), start=1):
            if role is None:
                dropped.append(item.assignee)
                continue
            depends_on = []
            for ref in item.depends_on:
                text = str(ref).strip()
                if text.isdigit() and 1 <= int(text) <= len(items):
                    if text in renumbered:
                        depends_on.append(renumbered[text])
                    else:
                        orphaned.append(f"assignment {index}: dependency {text} was an unknown assignee's")
                else:
                    depends_on.append(ref)
            kept.append(TaskAssignment(task=item.task, assignee=role, inputs=list(item.inputs),
                                       exit_criteria=item.exit_criteria, depends_on=depends_on))
        if dropped:
            run.notify("assignees_dropped", assignees=dropped, known=list(self.roles))
        if orphaned:
            run.notify("dependencies_dropped", references=orphaned)
        return kept, dropped

    async def _plan(self, run: EngineRun, prompt: str) -> tuple[list[TaskAssignment], list[str]]:
        planner = await run.make_agent("orchestrator", name="orchestrator")
        for retry in (False, True):
            try:
                result = await run.turn(planner, self._planner_instruction(prompt, retry),
                                        response_format=plan_model(tuple(self.roles)))
                planned = result.response
            except TurnError as error:
                if error.error_type not in MALFORMED_ERROR_TYPES:
                    raise
                planned = None
            assignments, dropped = self._validated(run, planned)
            if len(assignments) > self.max_assignments:
                raise PlanError(f"the plan has {len(assignments)} assignments; the cap is {self.max_assignments}",
                                run_id=run.run_id)
            if assignments:
                return assignments, dropped
            run.notify("plan_empty", retry=not retry)
        raise PlanError("the planner returned no usable assignment, even after one retry", run_id=run.run_id)

    # -- the DAG ---------------------------------------------------------------------------
    def _graph(self, run: EngineRun, assignments: list[TaskAssignment], branches: dict[str, str]) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DependencyReferenceWarning)
            for index, assignment in enumerate(assignments):  # report what the normaliser drops
                normalise_dependency_ordinals(assignment.depends_on, index, len(assignments))
            graph, _ = build_dag_graph(assignments, branches, operation=ENGINE_OPERATE)
        dropped = sorted({str(w.message) for w in caught if issubclass(w.category, DependencyReferenceWarning)})
        if dropped:
            run.notify("dependencies_dropped", references=dropped)
        if not graph.is_acyclic():
            raise PlanError("the plan's dependencies form a cycle", run_id=run.run_id)
        for node in graph.nodes.values():
            node.parameters["assignee"] = node.metadata.get("assignee")
            model = self.model_for(node.metadata.get("assignee", ""))
            if model:
                node.parameters["model"] = model
            if self.reactive:
                node.parameters["response_format"] = TaskOutput
        return graph

    def _node_builder(self, branches: dict[str, str], spawning_roles: tuple[str, ...] | None = None) -> Any:
        """``role_node_builder`` over the roster; a request naming no role goes to its emitter's.

        Routed children run metered (``engine_operate`` with the verb they asked for), so
        their tokens count against the run's budgets and their settlements name their role.
        ``spawning_roles`` (None: every role) are the roles whose nodes may spawn; a request
        from any other is refused by routing (a ``RoutingError``, dropped by admission).
        """
        route = role_node_builder(branches)
        models = {role: self.model_for(role) for role in branches}
        allowed = None if spawning_roles is None else frozenset(spawning_roles)

        def build(request: SpawnRequest, emitter: Operation | None) -> Operation:
            if allowed is not None:
                role = emitter.metadata.get("assignee") if emitter is not None else None
                if role not in allowed:
                    raise RoutingError(f"role {role!r} may not spawn in this run; spawning roles: "
                                       f"{', '.join(sorted(allowed)) or 'none'}",
                                       node_id=emitter.id if emitter is not None else None)
            if request.assignee is None and emitter is not None and emitter.metadata.get("assignee") in branches:
                request = request.model_copy(update={"assignee": emitter.metadata["assignee"]})
            child = route(request, emitter)
            role = child.metadata.get("assignee")
            if child.operation in METERED_VERBS:
                child.parameters["verb"] = child.operation
                child.operation = ENGINE_OPERATE
                child.parameters["assignee"] = role
            if role in models and models[role]:
                child.parameters["model"] = models[role]
            return child

        return build

    # -- the public planning steps, for lanes that plan here and run the DAG themselves ----------
    async def plan(self, run: EngineRun, prompt: str) -> tuple[list[TaskAssignment], list[str]]:
        """The planner's validated assignments and the dropped assignees (``PlanError`` for an
        empty plan after one retry, or one over ``max_assignments``)."""
        return await self._plan(run, prompt)

    def plan_graph(self, run: EngineRun, assignments: list[TaskAssignment], branches: dict[str, str]) -> Any:
        """The DAG of ``assignments`` on the role ``branches`` (``PlanError`` for a cycle)."""
        return self._graph(run, assignments, branches)

    def node_builder(self, branches: dict[str, str], spawning_roles: tuple[str, ...] | None = None) -> Any:
        """The reactive node builder over ``branches`` (see ``_node_builder``)."""
        return self._node_builder(branches, spawning_roles)

    def synthesis_instruction(self, prompt: str, settled: list[TaskSettled]) -> str:
        """The exempt synthesiser's instruction over ``settled`` results."""
        parts = [f"Task: {prompt}", "Results of the planned work:"]
        for item in settled:
            parts.append(f"- [{item.assignee or 'spawned'} · {item.status}] {item.text[:2000]}")
        parts.append("Write the final answer to the task from these results.")
        return "\n".join(parts)

    async def _run(self, run: EngineRun, prompt: str) -> str:
        assignments, dropped = await self._plan(run, prompt)
        run.emit(PlanProposed(assignments=assignments, dropped=dropped), agent="orchestrator")
        branches: dict[str, str] = {}
        # A reactive run can route follow-up work to any roster role, so each gets an agent.
        roles = self.roles if self.reactive else dict.fromkeys(a.assignee for a in assignments)
        made = await asyncio.gather(*(run.make_agent(role, name=role, extra_prompt=f"You {self.roles[role]}.")
                                      for role in roles), return_exceptions=True)  # at once: the DAG needs all
        errors = [outcome for outcome in made if isinstance(outcome, BaseException)]
        if errors:  # a failure other than the budget's outranks it
            raise next((error for error in errors if not isinstance(error, EngineBudgetError)), errors[0])
        branches.update((agent.role, agent.id) for agent in made)
        graph = self._graph(run, assignments, branches)
        if run.budget.exhausted(agents=False) is not None:  # the DAG runs on the agents made above
            raise run._refuse("the planned DAG", turn=True)
        try:
            envelope = await run.run_dag(graph, reactive=self.reactive, spawn_type=SpawnRequest,
                                         node_builder=self._node_builder(branches) if self.reactive else None,
                                         max_spawn=self.max_spawn, max_concurrent=self.max_concurrent,
                                         context={"task": prompt})
        except asyncio.CancelledError:
            # No envelope, so no node's usage arrives: every node that started is estimated.
            self._estimate_started_nodes(run, graph, prompt)
            raise
        self._record_settlements(run, graph, envelope)
        synthesizer = await run.make_agent("synthesizer", name="synthesizer", exempt=True,
                                           model=self.model_for("synthesizer"))
        result = await run.turn(synthesizer, self._synthesis_instruction(run, prompt))
        return result.response if isinstance(result.response, str) else str(result.response)

    def _record_settlements(self, run: EngineRun, graph: Any, envelope: dict[str, Any]) -> None:
        results = envelope.get("operation_results", {})
        for node_id, status in envelope.get("operation_statuses", {}).items():
            result = results.get(node_id)
            node = graph.nodes.get(node_id)
            assignee = (node.metadata.get("assignee") if node is not None else None) or ""
            if isinstance(result, dict) and result.get("assignee"):
                assignee = result["assignee"]
            if isinstance(result, dict) and "usage" in result:
                run.budget.add_usage(result["usage"])
            elif isinstance(result, dict) and status in ("failed", "cancelled"):
                self._estimate_failed_node(run, node, result.get("error_type"))
            if isinstance(result, dict):
                text = result.get("text") if "text" in result else result.get("error", "")
            else:
                text = "" if result is None else str(result)
            run.emit(TaskSettled(node_id=node_id, assignee=assignee, status=status, text=str(text)[:4000]))
        if run.budget.exhausted() in ("tokens", "cost"):
            run._note_budget_exhausted(run.budget.exhausted())

    def _estimate_failed_node(self, run: EngineRun, node: Any, error_type: str | None) -> None:
        """A failed node's settlement carries no usage (only its error): estimate the calls it
        was paid for. A reply that did not parse made every parse attempt; a node cut off
        (timeout, cancellation) made one call at least; any other failure is left uncounted."""
        if error_type in MALFORMED_ERROR_TYPES:
            calls = 1 + _OPERATE_PARSE_RETRIES
        elif error_type in CUT_OFF_ERROR_TYPES:
            calls = 1
        else:
            return
        instruction = str(node.parameters.get("instruction", "")) if node is not None else ""
        model = node.parameters.get("model") if node is not None else None
        tokens = run.estimate_calls(model, len(instruction), calls)
        run.notify("usage_estimated", node_id=getattr(node, "id", None), error_type=error_type, calls=calls,
                   estimated_tokens=tokens)

    def _estimate_started_nodes(self, run: EngineRun, graph: Any, prompt: str) -> None:
        started = {record.data.get("node_id") for record in run.events.notifications("dag_progress")
                   if record.data.get("status") in ("started", "completed", "failed")}
        for node_id in sorted(node_id for node_id in started if node_id):
            node = graph.nodes.get(node_id)
            instruction = str(node.parameters.get("instruction", "")) if node is not None else ""
            model = node.parameters.get("model") if node is not None else None
            tokens = run.estimate_calls(model, len(instruction) + len(prompt))
            run.notify("usage_estimated", node_id=node_id, error_type=CANCELLED, calls=1, estimated_tokens=tokens)

    def _synthesis_instruction(self, run: EngineRun, prompt: str) -> str:
        return self.synthesis_instruction(prompt, run.by_type(TaskSettled))

    async def _partial_export(self, run: EngineRun) -> str | None:
        """The plan and whatever settled, without a model call."""
        plans = run.by_type(PlanProposed)
        if not plans:
            return None
        lines = [f"Planning stopped early ({run.degrade_reason or 'budget'}); the plan and what settled:"]
        lines += [f"{i}. [{a.assignee}] {a.task}" for i, a in enumerate(plans[-1].assignments, start=1)]
        lines += [f"- [{s.assignee or 'spawned'} · {s.status}] {s.text[:500]}" for s in run.by_type(TaskSettled)]
        return "\n".join(lines)
