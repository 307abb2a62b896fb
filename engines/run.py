"""EngineRun: the single owner of one engine invocation's mutable state (ADR-0034 D1-D3, D6).

Owns the run's agents, budget, semaphore, spawned tasks, seen-keys and event log, and
the operations engines build on: ``make_agent``, ``turn``, ``operate_with_repair``,
``by_type``, ``spawn``/``wait_quiescence``/``cancel_active`` and ``run_dag``. Every agent
turn goes through the port to an OperationWorker; nothing here calls a model itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable, Coroutine
from contextvars import Context, ContextVar
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from opgraph.actors import TurnError, TurnResult
from opgraph.actors.verbs import ToolPermissionError, ToolPermissions
from opgraph.kernel import Graph, extract_requests
from opgraph.kernel.failures import CANCEL_GRACE_EXPIRED, CANCELLED, OPERATION_TIMEOUT

from .agents import Agent, agent_permissions, emission_bundle, emission_key, repair_instruction, role_profile
from .budget import RunBudget
from .errors import EngineBudgetError, EngineInputError
from .events import EngineEvent, EventLog, EventRecord
from .port import AgentPort, SessionPort
from .tasks import TaskSet

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["CUT_OFF_ERROR_TYPES", "EngineRun", "EventCallback", "MALFORMED_ERROR_TYPES", "UNPARSED_ERROR_TYPES"]

log = logging.getLogger(__name__)

EventCallback = Callable[[dict[str, Any]], Any]

# Turn failures that mean "the reply did not fit the requested shape": a repair re-prompt
# may fix them, so operate_with_repair counts them as a missed emission, not a failure.
MALFORMED_ERROR_TYPES = frozenset({"ParseError", "ValidationError"})
# A structured reply cut off at max_tokens did not parse either: to an engine it is a missed
# emission (repairable, then a skipped diagnostic), never a run failure. Kept apart from the
# malformed types, whose failed nodes are estimated as every parse attempt made.
UNPARSED_ERROR_TYPES = MALFORMED_ERROR_TYPES | {"ProviderTruncated"}
# Turn failures that cut a model call off before its usage arrived: that call is estimated.
CUT_OFF_ERROR_TYPES = frozenset({OPERATION_TIMEOUT, CANCELLED, CANCEL_GRACE_EXPIRED})
EMISSION_DEPTH = 4
# (run id, the turns the current task's next turn comes after); tasks inherit it when made.
_AFTER_TURNS: ContextVar[tuple[str, tuple[int, ...]] | None] = ContextVar("opgraph_engine_after_turns", default=None)


class EngineRun:
    """One invocation's state; a fresh run per ``Engine.run`` (ADR-0034 D1).

    Without ``session`` (and without ``port``) the run constructs a new ``Session()`` and
    owns it: the run's end closes it, dropping its agents' branches (``owns_session``).
    A supplied Session is used as it is, never cloned, reset or closed; its branches
    live until its owner closes it. ``port`` replaces the runtime entirely (a fake for
    unit tests). ``event_sink`` receives every record.
    """

    def __init__(self, engine: Engine, *, session: Any = None, on_event: EventCallback | None = None,
                 on_branch_created: Callable[[Any], None] | None = None, port: AgentPort | None = None,
                 event_sink: Any = None, run_id: str | None = None) -> None:
        self.engine = engine
        self.owns_session = False
        if port is None:
            if session is None:
                from opgraph.actors import Session  # local: constructing one starts Ray

                session = Session()
                self.owns_session = True
            port = SessionPort(session)
        self.session = session if session is not None else getattr(port, "session", None)
        self.port = port
        self.run_id = run_id or str(uuid.uuid4())
        self.root = str(getattr(self.session, "default_branch", "") or "")
        self.on_event = on_event
        self.on_branch_created = on_branch_created
        self.budget = RunBudget(engine.limits, engine.prices)
        self.log = EventLog(self.run_id, event_sink if event_sink is not None else engine.event_sink,
                            max_retained_events=engine.max_retained_events,
                            max_retained_notifications=engine.max_retained_notifications)
        self.tasks = TaskSet(self._admit_spawn, name=f"{engine.kind}-{self.run_id[:8]}")
        self._sem = asyncio.Semaphore(engine.max_concurrent)
        self._seen: set[str] = set()
        self._run_task: asyncio.Task | None = None
        self._emission_failures: list[str] = []
        self._agent_errors: list[str] = []
        self._context_chars: dict[str, int] = {}  # per agent: what its branch holds, for estimates
        self._last_model: str | None = None
        self._turns_begun = 0
        self._turns_ended: list[int] = []
        self.agents: dict[str, Agent] = {}
        self.judge_lock = asyncio.Lock()  # the judge agent is made once, however many judge at once
        self.budget_notified = False
        self.exhausted_reason = ""
        self.deadline_hit = False
        self.status = "created"
        self.degrade_reason = ""

    # -- the record's attribute names ------------------------------------------------------
    @property
    def agents_made(self) -> int:
        return self.budget.agents_made

    @property
    def events(self) -> EventLog:
        """The run's event log (the record's observer item pile, bounded here)."""
        return self.log

    @property
    def budget_hit(self) -> bool:
        """Some discretionary work was refused or stopped for lack of budget."""
        return self.budget_notified or self.tasks.budget_hit

    # -- D1 ----------------------------------------------------------------------------
    def seen(self, key: str) -> bool:
        """True for a duplicate key (stripped, lowercased); records an unseen one."""
        normal = str(key).strip().lower()
        if normal in self._seen:
            return True
        self._seen.add(normal)
        return False

    def notify(self, kind: str, *, agent: str | None = None, **data: Any) -> EventRecord:
        """Record a notification and hand ``{"type": kind, **data}`` to ``on_event``."""
        record = self.log.add_notification(kind, data, agent=agent)
        self._deliver(record)
        return record

    def emit(self, event: EngineEvent, *, agent: str | None = None) -> EventRecord:
        """Record a typed event the engine itself states (never one made up for a model)."""
        if not isinstance(event, EngineEvent):
            raise TypeError(f"emit() takes an EngineEvent, got {type(event).__name__}")
        record = self.log.add_event(event, agent=agent)
        self._deliver(record)
        return record

    def _deliver(self, record: EventRecord) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(record.as_dict())
        except Exception as exc:  # noqa: BLE001 - an observer's bug must not end the run; it is recorded
            log.warning("on_event raised %s for %s", type(exc).__name__, record.type)
            self.log.add_notification("observer_error", {"error": str(exc), "error_type": type(exc).__name__,
                                                         "for": record.type})

    def by_type(self, event_type: type | Callable[[Any], bool], *, agent: str | None = None) -> list[Any]:
        """Payloads of retained typed events matching ``event_type`` (a class or a predicate).

        Matching values inside emission bundles are returned as payloads, never bundles.
        ``agent`` narrows to one agent's emissions.
        """
        return self.log.by_type(event_type, agent=agent)

    # -- D2: hard bounds -----------------------------------------------------------------
    def budget_left(self) -> bool:
        """The hard predicate: agents, deadline, tokens and cost; nothing semantic."""
        return self.budget.exhausted() is None

    def _note_budget_exhausted(self, reason: str) -> None:
        """One ``budget_exhausted`` notification per run, whatever runs out first."""
        if self.budget_notified:
            return
        self.budget_notified = True
        self.exhausted_reason = reason
        self.engine.statistics_counters.budget_exhausted(reason)
        self.notify("budget_exhausted", reason=reason, **self.budget.snapshot())

    def _refuse(self, what: str, agent: str | None = None, *, turn: bool = False) -> EngineBudgetError:
        reason = self.budget.exhausted(agents=not turn) or "agents"
        self._note_budget_exhausted(reason)
        return EngineBudgetError(f"{what} refused: the run's {reason} budget is spent", reason=reason,
                                 run_id=self.run_id, branch_id=agent)

    def _admit_spawn(self) -> bool:
        reason = self.budget.exhausted()
        if reason is None:
            return True
        self._note_budget_exhausted(reason)
        return False

    async def make_agent(self, role: str, *, name: str | None = None, modes: list[str] | None = None,
                         model: str | None = None, tools: tuple[Any, ...] = (), emits: tuple[type, ...] = (),
                         permissions: Any = None, cwd: str | None = None, secure: bool = True, exempt: bool = False,
                         mcp_servers: list[str] | None = None, extra_prompt: str | None = None) -> Agent:
        """A new agent: a branch in the BranchStore with its role profile and model.

        Without budget a non-exempt call notifies once and raises EngineBudgetError. An
        exempt (terminal) agent bypasses the check but is still counted in ``agents_made``;
        its name is kept in ``budget.exempt_agents``, so a display can show it beside the bound.
        """
        try:
            ToolPermissions.of(permissions, cwd=cwd, secure=secure)  # bad permissions: refused before any branch
        except ToolPermissionError as exc:
            raise EngineInputError(f"agent {name or role!r}: {exc.message}", run_id=self.run_id) from None
        if not exempt and not self.budget_left():
            raise self._refuse(f"agent {name or role!r}")
        self.budget.agents_made += 1  # before the await: concurrent calls cannot overshoot
        self.engine.statistics_counters.add("agents_made")  # counted as the budget counts it
        ordinal = self.budget.agents_made
        name = name or f"{role}-{ordinal}"
        if exempt:
            self.budget.exempt_agents.append(name)
        model = model or self.engine.model_for(role)
        profile = role_profile(role, name=name, modes=tuple(modes or ()), extra_prompt=extra_prompt,
                               emits=tuple(emits))
        branch_id = await self.port.new_branch(f"engine-{self.run_id}-{name}-{ordinal}",
                                               [{"role": "system", "content": profile}])
        agent = Agent(id=branch_id, name=name, role=role, model=model, modes=tuple(modes or ()), tools=tuple(tools),
                      emits=tuple(emits), exempt=exempt, permissions=permissions, cwd=cwd, secure=secure,
                      mcp_servers=tuple(mcp_servers or ()), extra_prompt=extra_prompt, profile=profile)
        self.agents[name] = agent
        self.notify("agent_created", agent=name, role=role, model=model, exempt=exempt, branch_id=branch_id,
                    ordinal=ordinal)
        if self.on_branch_created is not None:
            self.on_branch_created(agent)
        return agent

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        """Schedule discretionary work if budget is left; else close it, notify once, None."""
        return self.tasks.spawn(coro)

    def drain_pending(self) -> list[asyncio.Task]:
        return self.tasks.drain_pending()

    async def wait_quiescence(self) -> None:
        """Wait until no spawned work is left (D2); what comes next comes after every turn so far."""
        await self.tasks.wait_quiescence()
        _AFTER_TURNS.set((self.run_id, tuple(self._turns_ended)))

    async def cancel_active(self) -> list[asyncio.Task]:
        """Cancel spawned work, waiting at most ``cancel_timeout_s``; stragglers are left."""
        stragglers = await self.tasks.cancel_active(self.engine.cancel_timeout_s)
        if stragglers:
            self.notify("cancel_timeout", tasks=[task.get_name() for task in stragglers],
                        waited_s=self.engine.cancel_timeout_s)
        while self.tasks.unobserved_errors:
            error = self.tasks.unobserved_errors.pop(0)
            self.notify("spawned_task_error", error=str(error), error_type=type(error).__name__)
        return stragglers

    async def release(self) -> int | None:
        """Close the Session this run made for itself (dropping its branches); returns how
        many branches were dropped, or None when the Session is not the run's to close."""
        if not self.owns_session or self.session is None:
            return None
        self.owns_session = False  # once, even if closing fails
        return await self.session.aclose()

    async def _watch_deadline(self) -> None:
        """Sleep until the deadline, then record exhaustion and cancel the root task."""
        left = self.budget.seconds_left()
        if left is None:
            return
        await asyncio.sleep(left)
        self.budget.deadline_passed = True
        self.deadline_hit = True
        self._note_budget_exhausted("deadline")
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()

    # -- turns ---------------------------------------------------------------------------
    async def turn(self, agent: Agent, instruction: str, *, operation: str = "operate",
                   response_format: type[BaseModel] | None = None, timeout: float | None = None,
                   **parameters: Any) -> TurnResult:
        """One turn of ``agent`` on a worker; typed emissions in its response are recorded.

        A non-exempt agent's turn is refused (EngineBudgetError) once the deadline, token
        or cost bound is spent (the agent bound limits making agents, not their turns);
        exempt terminal agents still run. ``max_concurrent`` turns run at once.
        The agent's ``permissions``, ``cwd`` and ``secure`` travel with the call and are
        enforced where its tools run (a ``permissions`` parameter can only narrow them).
        """
        if not agent.exempt and self.budget.exhausted(agents=False) is not None:
            raise self._refuse(f"turn of {agent.name!r}", agent.id, turn=True)
        async with self._sem:
            if not agent.exempt and self.budget.exhausted(agents=False) is not None:
                raise self._refuse(f"turn of {agent.name!r}", agent.id, turn=True)
            arguments = {"instruction": instruction, **parameters}
            if agent.model and "model" not in arguments:
                arguments["model"] = agent.model
            if response_format is not None:
                arguments["response_format"] = response_format
            if agent.tools and "tools" not in arguments:
                arguments["tools"] = list(agent.tools)
            permissions = agent_permissions(agent, arguments.get("permissions"))
            if permissions is not None:
                arguments["permissions"] = permissions  # enforced on the worker, whatever the model asks
            turn, after = self._begin_turn()
            try:
                result = await self.port.turn(agent.id, operation, timeout=timeout or self.engine.turn_timeout_s,
                                              **arguments)
            except TurnError as error:
                self._end_turn(turn)
                # A failed turn's model calls were made and paid for: they count like any other,
                # and a call it cut off (a timeout) is counted at an estimate.
                self.budget.add_usage(error.usage)
                estimated = (self._estimate_cut_off(agent, instruction, response_format)
                             if error.error_type in CUT_OFF_ERROR_TYPES else 0)
                kind = error.error_type or type(error).__name__
                self._agent_errors.append(f"{agent.name}: {kind}: {error}")
                self.notify("agent_error", agent=agent.name, error=str(error), error_type=kind,
                            tokens=int(error.usage.get("total_tokens", 0) or 0), estimated_tokens=estimated,
                            tokens_used=self.budget.tokens_used, cost_usd=round(self.budget.cost_usd, 6),
                            turn=turn, after=after)
                raise
            except asyncio.CancelledError:
                # Cut off (the deadline, cleanup, the caller) before any usage arrived: estimated.
                estimated = self._estimate_cut_off(agent, instruction, response_format)
                self.notify("turn_cut_off", agent=agent.name, operation=operation, estimated_tokens=estimated,
                            tokens_used=self.budget.tokens_used, cost_usd=round(self.budget.cost_usd, 6))
                raise
        self._end_turn(turn)
        self.budget.add_usage(result.usage)
        self._last_model = next(iter((result.usage or {}).get("by_model") or ()), self._last_model)
        self._context_chars[agent.name] = (self._context_chars.get(agent.name, 0) + len(instruction)
                                           + len(result.response if isinstance(result.response, str)
                                                 else str(result.response)))
        self.notify("turn_completed", agent=agent.name, operation=operation, elapsed=round(result.elapsed, 4),
                    tokens=int((result.usage or {}).get("total_tokens", 0) or 0),
                    tokens_used=self.budget.tokens_used, cost_usd=round(self.budget.cost_usd, 6),
                    turn=turn, after=after)
        self._observe(agent, result.response)
        return result

    # Causality of turns, for the record: each turn notes the turns it came after (the last
    # turn of the task that made it, or every earlier turn after a quiescence join), so the
    # record implies its critical path (benchmarks compare wall time with it).
    def _begin_turn(self) -> tuple[int, list[int]]:
        self._turns_begun += 1
        cause = _AFTER_TURNS.get()
        return self._turns_begun, list(cause[1]) if cause is not None and cause[0] == self.run_id else []

    def _end_turn(self, turn: int) -> None:
        self._turns_ended.append(turn)
        _AFTER_TURNS.set((self.run_id, (turn,)))

    def follow_turns(self, context: Context) -> None:
        """What this task does next comes after the last turn made in ``context``: the context
        of a task it awaited as part of its own chain (one made to watch the work, say). A
        task's turns are otherwise its own, and the task that awaits it would not know them."""
        cause = context.get(_AFTER_TURNS)
        if cause is not None and cause[0] == self.run_id:
            _AFTER_TURNS.set(cause)

    def _estimate_cut_off(self, agent: Agent, instruction: str, response_format: type[BaseModel] | None) -> int:
        """Count a model call cut off before its usage arrived: its prompt (the agent's branch,
        the instruction, the schema) at about four characters a token, and a completion the
        size of the run's mean reported one. Returns the tokens added."""
        chars = len(agent.profile) + self._context_chars.get(agent.name, 0) + len(instruction)
        if response_format is not None:
            chars += len(json.dumps(response_format.model_json_schema()))
        return self.estimate_calls(agent.model, chars)

    def estimate_calls(self, model: str | None, prompt_chars: int, calls: int = 1) -> int:
        """Count ``calls`` model calls whose usage never reached the run, each with a prompt of
        ``prompt_chars`` characters (about four a token, as the providers' own rough count)
        and the run's mean reported completion. Returns the tokens added (``estimated_tokens``)."""
        prompt = (max(0, prompt_chars) + 3) // 4
        completion = self.budget.mean_completion_tokens()
        return sum(self.budget.add_estimate(model or self._last_model, prompt, completion) for _ in range(calls))

    def _observe(self, agent: Agent, response: Any) -> list[EngineEvent]:
        """Record every EngineEvent in a turn's response as that agent's emission."""
        if isinstance(response, EngineEvent):
            found = [response]
        else:
            found = extract_requests(response, (EngineEvent,), max_depth=EMISSION_DEPTH)
        admitted = []
        for event in found:
            event = self.admit_emission(agent, event)
            if event is not None:
                self.emit(event, agent=agent.name)
                admitted.append(event)
        return admitted

    def admit_emission(self, agent: Agent, event: EngineEvent) -> EngineEvent | None:
        """A domain run's hook on each typed emission before it is recorded: the event as
        recorded (fields the engine owns, such as ids, references and depth, set by the
        engine rather than trusted from the model), or None to leave it unrecorded. This
        run records what arrived."""
        return event

    async def operate_with_repair(self, branch: Agent, instruction: str, *, arrived: Callable[[], bool],
                                  emits: tuple[type, ...] = (), retries: int = 1, **parameters: Any) -> Any:
        """One ``operate`` turn, then at most ``retries`` re-prompts while ``arrived()`` is false.

        The turn asks for an emission bundle of ``emits`` (the agent's own by default).
        A malformed reply (``ParseError``), or one cut off at ``max_tokens``
        (``ProviderTruncated``), counts as a missed emission, not a failure.
        Repair asks the model to emit; it never constructs the event. On a final miss it
        notifies ``emission_missing``, records ``<agent> x<attempts>`` and returns the
        last raw response (None when no reply parsed).
        """
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        emits = tuple(emits) or branch.emits
        bundle = emission_bundle(emits) if emits else parameters.pop("response_format", None)
        parameters.setdefault("parse_retries", 0)  # repair is the engine's job, and it is bounded
        response = await self._attempt(branch, instruction, bundle, parameters)
        attempts = 1
        while not arrived() and attempts <= retries:
            response = await self._attempt(branch, repair_instruction(instruction, emits), bundle, parameters)
            attempts += 1
        if not arrived():
            self._emission_failures.append(f"{branch.name} x{attempts}")
            self.engine.statistics_counters.add("emissions_missing")
            self.notify("emission_missing", agent=branch.name, attempts=attempts,
                        expected=[emission_key(kind) for kind in emits])
        return response

    async def _attempt(self, agent: Agent, instruction: str, bundle: type[BaseModel] | None,
                       parameters: dict[str, Any]) -> Any:
        try:
            result = await self.turn(agent, instruction, response_format=bundle, **parameters)
        except TurnError as error:
            if error.error_type in UNPARSED_ERROR_TYPES:
                self.notify("emission_malformed", agent=agent.name, error=str(error)[:500],
                            error_type=error.error_type)
                return None
            raise
        return result.response

    async def run_team(self, agents: list[Agent], instruction: str, **parameters: Any) -> list[str]:
        """Each agent in turn (sequentially); one agent's failure becomes a notification and
        failure text, and later members continue. Budget errors and cancellation propagate."""
        texts = []
        for agent in agents:
            try:
                result = await self.turn(agent, instruction, **parameters)
            except TurnError as error:
                texts.append(f"[{agent.name} failed: {error.error_type or type(error).__name__}: {error}]")
                continue
            texts.append(result.response if isinstance(result.response, str) else str(result.response))
        return texts

    # -- D6 ------------------------------------------------------------------------------
    async def run_dag(self, graph: Graph, *, reactive: bool = False, spawn_type: type | None = None,
                      node_builder: Any = None, max_spawn: int = 50, max_concurrent: int = 5, verbose: bool = False,
                      executor_ref: dict[str, Any] | None = None, context: dict[str, Any] | None = None,
                      spawn_branch_setup: Any = None) -> dict[str, Any]:
        """Run ``graph`` through ``Session.flow`` and return its envelope; no policy of its own.

        Node lifecycle signals become ``dag_progress`` notifications of this run; the
        Session drains them before ``flow()`` returns, so all are recorded on return.
        """
        def on_progress(op_id: str, name: str, status: str, elapsed: float) -> None:
            self.notify("dag_progress", node_id=op_id, name=name, status=status, elapsed=round(elapsed, 4))

        def on_branch(view: Any) -> None:
            if self.on_branch_created is not None:
                self.on_branch_created(view)

        return await self.port.flow(
            graph, context=context, max_concurrent=max_concurrent, verbose=verbose, on_progress=on_progress,
            reactive=reactive, spawn_type=spawn_type, node_builder=node_builder, max_spawn=max_spawn,
            executor_ref=executor_ref, on_branch_created=on_branch, spawn_branch_setup=spawn_branch_setup)

    # -- reporting -----------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "engine": self.engine.kind,
            "status": self.status,
            "degrade_reason": self.degrade_reason,
            "budget": self.budget.snapshot(),
            "agents": len(self.agents),
            "spawned": self.tasks.spawned,
            "spawns_refused": self.tasks.refused,
            "emission_failures": list(self._emission_failures),
            "agent_errors": len(self._agent_errors),
            "events": self.log.statistics(),
        }
