"""CodingEngine: plan, implement, test, fix, verify, a chain gated by a real test command (ADR-0034 D4).

Owns the coding domain: the spec (a workspace folder that exists and a non-empty test
command, refused before any run state exists), the events (WorkPlanned, ChangeProposed,
TestsRan, VerifyResult, CodeResultRecorded), the chain and its bounds (``max_fix_rounds``,
test and turn timeouts, a heartbeat while a stage waits), and the structured result.

The test command's exit status is ground truth: TestsRan is stated by the engine from the
gate, never by a model. Model edits and gates touch only a copy of the workspace made on
a worker (engines/workspace.py); a write that leads outside it is refused and recorded,
and the original is untouched until the caller applies the offered patch
(``result.apply()``). Coding returns its structured ``CodeResultRecorded``, not an
EngineResult (D5); budget or deadline exhaustion returns the same record, marked degraded.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from opgraph.actors.providers import offers_tools
from opgraph.actors.verbs import PathEscapeError, SandboxError, is_secret_name
from opgraph.kernel import OpGraphError

from .engine import Engine
from .errors import EngineInputError
from .events import EngineEvent
from .run import EngineRun
from .workspace import FileChange, FileEdit, Sandbox, WorkspaceReader, apply_changes

__all__ = [
    "DEFAULT_HEARTBEAT_S",
    "DEFAULT_MAX_FIX_ROUNDS",
    "DEFAULT_TEST_TIMEOUT_S",
    "DEFAULT_TURN_TIMEOUT_S",
    "VERDICTS",
    "ChangeProposed",
    "CodeResultRecorded",
    "CodingEngine",
    "CodingRun",
    "CodingSpec",
    "TestsRan",
    "VerifyResult",
    "WorkPlanned",
]

DEFAULT_MAX_FIX_ROUNDS = 3
DEFAULT_TEST_TIMEOUT_S = 600.0
DEFAULT_TURN_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_S = 30.0
# passed: tests green and the verifier found the acceptance criteria met; unmet: green, but
# the verifier named unmet criteria; unverified: green, no verification arrived; failed: the
# last test run was red (or timed out); stopped: a budget or the deadline ended the chain.
VERDICTS = ("passed", "unmet", "unverified", "failed", "stopped")
_READ_TOOLS = ("read_file", "list_files")
_PATCH_IN_PROMPT = 20_000


# -- the domain events ---------------------------------------------------------------------
class WorkPlanned(EngineEvent):
    """The planner's plan for the change."""

    approach: str
    files_to_touch: list[str] = Field(default_factory=list)
    test_strategy: str = ""
    acceptance_criteria: list[str] = Field(default_factory=list)


class ChangeProposed(EngineEvent):
    """A change the implementer proposes: whole-file edits of the workspace."""

    plan: str = Field("", description="the reference of the plan it follows (P1)")
    summary: str
    files_touched: list[str] = Field(default_factory=list)
    edits: list[FileEdit] = Field(default_factory=list)


class TestsRan(EngineEvent):
    """One run of the test command in the workspace copy, as the gate measured it (never a model's)."""

    __test__ = False  # not a pytest test class, whatever its name

    change: str = ""  # the change it tested (C1, C2...), "" when no change arrived
    cmd: str
    passed: bool  # exit status 0 within the timeout
    returncode: int | None = None
    timed_out: bool = False
    round: int = 0  # 0 after implementing, n after fix round n
    output_tail: str = ""
    output_bytes: int = 0
    truncated: bool = False
    duration_s: float = 0.0
    killed: bool = False
    notes: list[str] = Field(default_factory=list)


class VerifyResult(EngineEvent):
    """The verifier's check of a green change against the plan's acceptance criteria."""

    change: str = ""
    tests: str = ""
    meets_acceptance: bool
    unmet: list[str] = Field(default_factory=list)


class CodeResultRecorded(EngineEvent):
    """What a coding run produced: the structured result ``CodingEngine.run`` returns.

    ``passed`` is the last test run's verdict (exit 0 within the timeout); ``verdict``
    adds the verification (see ``VERDICTS``). ``files_changed`` (with unified diffs) and
    ``patch`` are offered, not applied: ``apply()`` writes them into the workspace.
    ``plan`` is the planner's plan, kept so that a run stopped early still reports it.
    """

    passed: bool
    verdict: str
    rounds_used: int
    max_fix_rounds: int
    workspace: str
    test_cmd: str
    plan: WorkPlanned | None = None
    files_changed: list[FileChange] = Field(default_factory=list)
    patch: str = ""
    test_runs: list[TestsRan] = Field(default_factory=list)
    refusals: list[dict[str, Any]] = Field(default_factory=list)
    measurements: dict[str, Any] = Field(default_factory=dict)
    caveats: list[str] = Field(default_factory=list)
    skipped: list[str] = Field(default_factory=list)
    degraded: bool = False
    degrade_reason: str = ""
    run_id: str = ""
    _run: Any = PrivateAttr(default=None)

    @property
    def run(self) -> Any:
        """The live CodingRun (None for a record rebuilt from data)."""
        return self._run

    def apply(self, workspace: str | None = None) -> list[str]:
        """Write the offered changes into ``workspace`` (the run's own by default); the paths written.

        All or none: WorkspaceConflictError when a file changed since the copy was made.
        """
        return apply_changes(self.files_changed, workspace or self.workspace)

    def report(self) -> str:
        """The result as text: the verdict, the plan, each test run, refusals, caveats, then the patch."""
        lines = [f"Coding verdict: {self.verdict} (tests {'passed' if self.passed else 'did not pass'}; "
                 f"{self.rounds_used} of {self.max_fix_rounds} fix round(s) used)"]
        if self.degraded:
            lines.append(f"Degraded: {self.degrade_reason}")
        if self.plan is not None:
            lines.append(f"Plan (P1): {self.plan.approach}")
        for test in self.test_runs:
            state = "timed out" if test.timed_out else f"exit {test.returncode}"
            lines.append(f"- tests round {test.round} ({test.change or 'no change'}): {state}, "
                         f"{test.duration_s:.2f} s, {test.output_bytes} bytes of output")
        for refusal in self.refusals:
            lines.append(f"- refused in round {refusal.get('round')}: {refusal.get('path')!r}: {refusal.get('reason')}")
        lines += [f"Caveat: {caveat}" for caveat in self.caveats]
        if self.files_changed:
            lines.append(f"Files changed ({len(self.files_changed)}): "
                         + ", ".join(f"{change.path} ({change.status})" for change in self.files_changed))
            lines.append(self.patch.rstrip("\n"))
        else:
            lines.append("No file changed.")
        return "\n".join(lines)


class CodingSpec(BaseModel):
    """What to do and where: refused (EngineInputError) before any run state exists."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    workspace: str
    test_cmd: str | tuple[str, ...]
    keep_env: tuple[str, ...] = ()

    @classmethod
    def build(cls, task: Any, *, workspace: Any = None, test_cmd: Any = None, keep_env: Any = ()) -> CodingSpec:
        if isinstance(task, CodingSpec):
            return task
        if not isinstance(task, str) or not task.strip():
            raise EngineInputError("coding needs a task: non-empty text saying what to change")
        if not isinstance(workspace, (str, os.PathLike)) or not str(workspace).strip():
            raise EngineInputError("coding needs workspace=: the folder to work on")
        folder = os.path.abspath(os.path.expanduser(os.fspath(workspace)))
        if not os.path.isdir(folder):
            raise EngineInputError(f"the workspace {workspace!s} is not an existing folder")
        if isinstance(test_cmd, str):
            if not test_cmd.strip():
                raise EngineInputError("coding needs a non-empty test command (test_cmd=)")
            command: str | tuple[str, ...] = test_cmd
        elif isinstance(test_cmd, Sequence) and test_cmd and all(isinstance(p, str) and p for p in test_cmd):
            command = tuple(test_cmd)
        else:
            raise EngineInputError(f"coding needs a non-empty test command (test_cmd=), got {test_cmd!r}")
        names = (keep_env,) if isinstance(keep_env, str) else tuple(keep_env or ())
        secret = [name for name in names if not isinstance(name, str) or is_secret_name(name)]
        if secret:
            raise EngineInputError(f"keep_env may not pass secrets (keys, tokens, credentials) to the tests: "
                                   f"{', '.join(map(str, secret))}")
        return cls(task=task.strip(), workspace=folder, test_cmd=command, keep_env=names)

    @property
    def command_text(self) -> str:
        return self.test_cmd if isinstance(self.test_cmd, str) else " ".join(self.test_cmd)


class CodingRun(EngineRun):
    """A coding invocation's domain state: the sandbox, the plan, changes, test runs, refusals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec: CodingSpec | None = None
        self.sandbox: Sandbox | None = None
        self.plan: WorkPlanned | None = None
        self.changes: list[ChangeProposed] = []
        self.test_runs: list[TestsRan] = []
        self.refusals: list[dict[str, Any]] = []
        self.touched: set[str] = set()
        self.files_changed: list[FileChange] | None = None
        self.verification: VerifyResult | None = None
        self.rounds_used = 0
        self.caveats: list[str] = []

    @property
    def tests_passed(self) -> bool:
        return bool(self.test_runs) and self.test_runs[-1].passed


def _positive(name: str, value: Any, *, integer: bool = False, minimum: float = 0.0, strict: bool = True) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < minimum or (strict and value <= minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise EngineInputError(f"{name} must be {'a whole' if integer else 'a'} number {bound}, got {value!r}")
    return value


def _fenced(text: str) -> str:
    return "```\n" + text.replace("```", "'''") + "\n```"


class CodingEngine(Engine):
    """Changes code in a workspace copy until its tests pass, in a bounded chain.

    ``run(task, workspace=..., test_cmd=...)`` (or ``run(CodingSpec(...))``) returns a
    ``CodeResultRecorded``. Settings beyond the Engine's: ``max_fix_rounds`` (3),
    ``test_timeout_s`` (600), ``turn_timeout_s`` (600), ``heartbeat_s`` (30, a
    ``heartbeat`` notification while a turn or a gate is awaited), ``kill_grace_s``
    between SIGTERM and SIGKILL of a gate's group, ``max_output_bytes`` of test output
    kept (the tail), ``max_workspace_bytes`` copied, ``context_chars`` of workspace text
    shown to the agents, ``repair_retries`` per stage. Agents may read the copy
    (``read_file``, ``list_files``) and nothing else: their permissions say so and the
    runtime enforces it. ``read_tools`` (None: unless the agent's model's provider takes
    no tools, as ``local/`` does) offers those tools; without them an agent works from the
    workspace snapshot in its prompt.
    """

    run_context_cls = CodingRun
    kind = "coding"

    def __init__(self, *, max_fix_rounds: int = DEFAULT_MAX_FIX_ROUNDS, test_timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
                 turn_timeout_s: float = DEFAULT_TURN_TIMEOUT_S, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 kill_grace_s: float = 5.0, max_output_bytes: int = 64 * 1024,
                 max_workspace_bytes: int = 512 * 2**20, context_chars: int = 60_000, repair_retries: int = 1,
                 settle_timeout_s: float = 120.0, read_tools: bool | None = None, **engine_settings: Any) -> None:
        super().__init__(turn_timeout_s=turn_timeout_s, **engine_settings)
        self.max_fix_rounds = _positive("max_fix_rounds", max_fix_rounds, integer=True, strict=False)
        self.test_timeout_s = float(_positive("test_timeout_s", test_timeout_s))
        self.heartbeat_s = float(_positive("heartbeat_s", heartbeat_s))
        self.kill_grace_s = float(_positive("kill_grace_s", kill_grace_s, strict=False))
        self.max_output_bytes = _positive("max_output_bytes", max_output_bytes, integer=True)
        self.max_workspace_bytes = _positive("max_workspace_bytes", max_workspace_bytes, integer=True)
        self.context_chars = _positive("context_chars", context_chars, integer=True, strict=False)
        self.repair_retries = _positive("repair_retries", repair_retries, integer=True, strict=False)
        self.settle_timeout_s = float(_positive("settle_timeout_s", settle_timeout_s))
        if read_tools is not None and not isinstance(read_tools, bool):
            raise EngineInputError(f"read_tools must be True, False or None, got {read_tools!r}")
        self.read_tools = read_tools

    # -- input, config, store ----------------------------------------------------------------
    def spec(self, task: Any = None, *, workspace: Any = None, test_cmd: Any = None, keep_env: Any = ()) -> CodingSpec:
        return CodingSpec.build(task, workspace=workspace, test_cmd=test_cmd, keep_env=keep_env)

    def validate(self, task: Any = None, *args: Any, workspace: Any = None, test_cmd: Any = None,
                 keep_env: Any = (), **kwargs: Any) -> None:
        if args or kwargs:
            raise EngineInputError(f"coding takes (task, workspace=, test_cmd=, keep_env=), got extra "
                                   f"{list(args) + sorted(kwargs)!r}")
        self.spec(task, workspace=workspace, test_cmd=test_cmd, keep_env=keep_env)

    def describe_input(self, task: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        spec = self.spec(task, **kwargs)
        return {"task": spec.task[:4000], "workspace": spec.workspace, "test_cmd": spec.command_text,
                "keep_env": list(spec.keep_env)}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "max_fix_rounds": self.max_fix_rounds, "test_timeout_s": self.test_timeout_s,
                "turn_timeout_s": self.turn_timeout_s, "heartbeat_s": self.heartbeat_s,
                "kill_grace_s": self.kill_grace_s, "max_output_bytes": self.max_output_bytes,
                "repair_retries": self.repair_retries}

    def describe_result(self, result: Any) -> str | None:
        return result.report() if isinstance(result, CodeResultRecorded) else super().describe_result(result)

    # -- the chain ---------------------------------------------------------------------------
    async def _run(self, run: CodingRun, task: Any, *, workspace: Any = None, test_cmd: Any = None,
                   keep_env: Any = ()) -> CodeResultRecorded:
        run.spec = spec = self.spec(task, workspace=workspace, test_cmd=test_cmd, keep_env=keep_env)
        run.sandbox = await self._beating(run, "workspace", Sandbox.open(
            run.port, run.root or None, spec.workspace, timeout_s=self.turn_timeout_s,
            max_bytes=self.max_workspace_bytes, snapshot_chars=self.context_chars))
        sandbox = run.sandbox
        run.notify("workspace_opened", files=sandbox.files, bytes=sandbox.bytes, copy=sandbox.copy,
                   skipped=sandbox.skipped[:50])
        if sandbox.skipped:
            run.caveats.append(f"{len(sandbox.skipped)} special file(s) were not copied: "
                               + ", ".join(sandbox.skipped[:10]))
        try:
            await self._chain(run)
        finally:
            await self._settle(run)
        return self._record(run)

    async def _chain(self, run: CodingRun) -> None:
        sandbox = run.sandbox
        assert sandbox is not None
        tools = WorkspaceReader(sandbox.copy).tools()
        registered = getattr(getattr(run.port, "session", None), "providers", None)

        def reading(role: str) -> dict[str, Any]:
            offered = self.read_tools
            if offered is None:  # a model whose provider takes no tools reads the snapshot in its prompt
                offered = offers_tools(self.model_for(role), registered)
            return {"tools": tools if offered else (), "permissions": {"allow": list(_READ_TOOLS)},
                    "cwd": sandbox.copy, "secure": True}

        planner = await run.make_agent("planner", name="planner", emits=(WorkPlanned,), **reading("planner"))
        await self._beating(run, "plan", run.operate_with_repair(
            planner, self._plan_instruction(run), arrived=lambda: bool(run.by_type(WorkPlanned, agent="planner")),
            retries=self.repair_retries))
        plans = run.by_type(WorkPlanned, agent="planner")
        run.plan = plans[-1] if plans else None
        implementer = await run.make_agent("implementer", name="implementer", emits=(ChangeProposed,),
                                           **reading("implementer"))
        await self._propose(run, implementer, self._implement_instruction(run), round_=0)
        await self._test(run, round_=0)
        while not run.tests_passed and run.rounds_used < self.max_fix_rounds:
            run.rounds_used += 1
            await self._propose(run, implementer, self._fix_instruction(run), round_=run.rounds_used)
            await self._test(run, round_=run.rounds_used)
        if not run.tests_passed:
            return  # ground truth says no: a verifier cannot change that
        run.files_changed = await self._beating(run, "diff", sandbox.changes(run.touched))
        verifier = await run.make_agent("verifier", name="verifier", emits=(VerifyResult,), exempt=True,
                                        **reading("verifier"))
        await self._beating(run, "verify", run.operate_with_repair(
            verifier, self._verify_instruction(run), arrived=lambda: bool(run.by_type(VerifyResult, agent="verifier")),
            retries=self.repair_retries))
        verdicts = run.by_type(VerifyResult, agent="verifier")
        run.verification = verdicts[-1] if verdicts else None

    async def _propose(self, run: CodingRun, agent: Any, instruction: str, *, round_: int) -> None:
        """One implement or fix turn; its edits go into the copy, or are refused whole."""
        before = len(run.by_type(ChangeProposed, agent=agent.name))
        await self._beating(run, "implement" if round_ == 0 else f"fix {round_}", run.operate_with_repair(
            agent, instruction, arrived=lambda: len(run.by_type(ChangeProposed, agent=agent.name)) > before,
            retries=self.repair_retries))
        proposals = run.by_type(ChangeProposed, agent=agent.name)[before:]
        if not proposals:
            return
        run.changes.extend(proposals)
        reference = f"C{len(run.changes)}"
        edits = [edit for proposal in proposals for edit in proposal.edits]
        if not edits:
            run.notify("change_empty", change=reference, round=round_)
            return
        try:
            written = await self._beating(run, "write", run.sandbox.write(edits))
        except PathEscapeError as refused:
            record = {"round": round_, "change": reference, "path": refused.path, "reason": refused.message}
            run.refusals.append(record)
            run.notify("write_refused", **record)
            return
        except SandboxError as refused:
            record = {"round": round_, "change": reference, "path": "", "reason": refused.message}
            run.refusals.append(record)
            run.notify("write_refused", **record)
            return
        run.touched.update(written)
        run.notify("change_applied", change=reference, round=round_, files=written)

    async def _test(self, run: CodingRun, *, round_: int) -> TestsRan:
        spec, sandbox = run.spec, run.sandbox
        assert spec is not None and sandbox is not None
        gate = await self._beating(run, f"test {round_}", sandbox.gate(
            list(spec.test_cmd) if isinstance(spec.test_cmd, tuple) else spec.test_cmd,
            timeout_s=self.test_timeout_s, kill_grace_s=self.kill_grace_s, max_output_bytes=self.max_output_bytes,
            keep_env=spec.keep_env))
        returncode = gate.get("returncode")
        timed_out = bool(gate.get("timed_out"))
        tested = TestsRan(change=f"C{len(run.changes)}" if run.changes else "", cmd=str(gate.get("command", "")),
                          passed=returncode == 0 and not timed_out, returncode=returncode, timed_out=timed_out,
                          round=round_, output_tail=str(gate.get("output_tail", "")),
                          output_bytes=int(gate.get("output_bytes", 0)), truncated=bool(gate.get("truncated")),
                          duration_s=float(gate.get("duration_s", 0.0)), killed=bool(gate.get("killed")),
                          notes=list(gate.get("notes", [])))
        run.test_runs.append(tested)
        run.emit(tested, agent="gate")  # the engine's measurement, not a model's emission
        return tested

    async def _beating(self, run: CodingRun, stage: str, work: Awaitable[Any]) -> Any:
        """Await ``work``, notifying ``heartbeat`` every ``heartbeat_s`` until it ends.

        The work runs as a task of its own (so it can be watched), but it is this chain's next
        step: what comes after it comes after its turns, and the record says so."""
        context = contextvars.copy_context()
        task = (asyncio.get_running_loop().create_task(work, context=context) if asyncio.iscoroutine(work)
                else asyncio.ensure_future(work))
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.heartbeat_s)
                if done:
                    run.follow_turns(context)
                    return task.result()
                run.notify("heartbeat", stage=stage, elapsed_s=round(time.monotonic() - started, 1))
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _settle(self, run: CodingRun) -> None:
        """Read the changes (unless already read) and remove the copy; shielded and bounded."""
        sandbox = run.sandbox
        if sandbox is None or sandbox.closed:
            return

        async def settle() -> None:
            try:
                if run.files_changed is None:
                    run.files_changed = await sandbox.changes(run.touched)
            except OpGraphError as exc:
                run.caveats.append(f"the changes could not be read from the copy: {exc}")
                run.notify("changes_unreadable", error=str(exc), error_type=type(exc).__name__)
            finally:
                try:
                    await sandbox.close()
                    run.notify("workspace_closed")
                except OpGraphError as exc:
                    run.caveats.append(f"the workspace copy {sandbox.path} could not be removed: {exc}")
                    run.notify("workspace_close_failed", error=str(exc), error_type=type(exc).__name__)

        task = asyncio.ensure_future(settle())
        try:
            await asyncio.wait_for(asyncio.shield(task), self.settle_timeout_s)
        except TimeoutError:
            run.caveats.append(f"reading the changes and removing the copy took over {self.settle_timeout_s} s; "
                               "left unfinished")
            run.notify("settle_timeout", timeout_s=self.settle_timeout_s)

    # -- the result --------------------------------------------------------------------------
    def _record(self, run: CodingRun, *, stopped: str = "") -> CodeResultRecorded:
        spec = run.spec
        passed = run.tests_passed
        if stopped:
            verdict = "stopped"
        elif not passed:
            verdict = "failed"
        elif run.verification is None:
            verdict = "unverified"
        else:
            verdict = "passed" if run.verification.meets_acceptance else "unmet"
        reason = stopped or ("emission_failure" if run._emission_failures else "")
        run.degrade_reason = reason
        caveats = list(run.caveats)
        if not run.test_runs:
            caveats.append("the tests never ran")
        if any(test.truncated for test in run.test_runs):
            caveats.append("some test output was longer than max_output_bytes; its tail is kept")
        if run.verification is not None and run.verification.unmet:
            caveats.append("unmet acceptance criteria: " + "; ".join(run.verification.unmet))
        changes = list(run.files_changed or [])
        plans = run.by_type(WorkPlanned, agent="planner")  # also one that arrived just before a stop
        budget = run.budget.snapshot()
        record = CodeResultRecorded(
            passed=passed, verdict=verdict, rounds_used=run.rounds_used, max_fix_rounds=self.max_fix_rounds,
            workspace=spec.workspace if spec else "", test_cmd=spec.command_text if spec else "",
            plan=plans[-1] if plans else None, files_changed=changes, patch="".join(change.diff for change in changes),
            test_runs=list(run.test_runs), refusals=list(run.refusals),
            measurements={"test_runs": len(run.test_runs), "test_seconds": round(sum(t.duration_s for t in
                                                                                       run.test_runs), 3),
                          "agents": budget["agents_made"], "tokens_used": budget["tokens_used"],
                          "cost_usd": budget["cost_usd"], "elapsed_s": budget["elapsed_s"],
                          "files_changed": len(changes)},
            caveats=caveats, skipped=list(run._emission_failures), degraded=bool(reason), degrade_reason=reason,
            run_id=run.run_id)
        record._run = run
        run.emit(record, agent="engine")
        return record

    async def _degrade(self, run: CodingRun, reason: str) -> CodeResultRecorded:
        """Budget or deadline stopped the chain: the same structured record, marked, from what exists."""
        run.degrade_reason = reason
        await run.cancel_active()
        return self._record(run, stopped=reason)

    # -- the prompts -------------------------------------------------------------------------
    def _workspace_text(self, run: CodingRun) -> str:
        sandbox = run.sandbox
        assert sandbox is not None
        lines = [f"The workspace has {sandbox.files} file(s); listing (hidden files left out):"]
        lines += [f"  {path}" for path in sandbox.listing]
        for path, text in sandbox.texts.items():
            lines.append(f"\n--- {path} ---\n{text}")
        lines.append("\nYou may read more with the read_file and list_files tools (paths relative to the workspace).")
        return "\n".join(lines)

    def _plan_text(self, run: CodingRun) -> str:
        plan = run.plan
        if plan is None:
            return "There is no plan: work from the task."
        return (f"The plan (P1): {plan.approach}\nFiles to touch: {', '.join(plan.files_to_touch) or '-'}\n"
                f"Test strategy: {plan.test_strategy or '-'}\n"
                f"Acceptance criteria: {'; '.join(plan.acceptance_criteria) or '-'}")

    def _plan_instruction(self, run: CodingRun) -> str:
        spec = run.spec
        assert spec is not None
        return (f"Task: {spec.task}\n\nThe change is accepted only when the test command `{spec.command_text}` "
                f"exits with status 0 in the workspace.\n\n{self._workspace_text(run)}\n\nPlan the change. Emit one "
                "work_planned: approach, files_to_touch (paths relative to the workspace), test_strategy, "
                "acceptance_criteria.")

    def _implement_instruction(self, run: CodingRun) -> str:
        spec = run.spec
        assert spec is not None
        return (f"Task: {spec.task}\n\n{self._plan_text(run)}\n\n{self._workspace_text(run)}\n\nMake the change. "
                "Emit one change_proposed with plan \"P1\", a summary, files_touched, and edits: one per file, "
                "its path relative to the workspace root and its complete new content (or delete: true). "
                "Paths outside the workspace (absolute, '..', through links) are refused.")

    def _fix_instruction(self, run: CodingRun) -> str:
        last = run.test_runs[-1]
        state = "timed out" if last.timed_out else f"exited with status {last.returncode}"
        lines = [f"The tests ({last.cmd}) {state} after round {last.round}. The end of their output:",
                 _fenced(last.output_tail[-8000:])]
        refused = [item for item in run.refusals if item["round"] == last.round]
        for item in refused:
            lines.append(f"Your change was refused and nothing of it was written: {item['path']!r}: {item['reason']}")
        if run.touched:
            lines.append(f"Files changed so far (in the copy): {', '.join(sorted(run.touched))}.")
        lines.append("Fix it. Emit one change_proposed whose edits give the complete new content of each file "
                     "you change.")
        return "\n".join(lines)

    def _verify_instruction(self, run: CodingRun) -> str:
        spec = run.spec
        assert spec is not None
        last = run.test_runs[-1]
        patch = "".join(change.diff for change in run.files_changed or []) or "(no file changed)"
        if len(patch) > _PATCH_IN_PROMPT:
            patch = patch[:_PATCH_IN_PROMPT] + "\n... (patch truncated)"
        return (f"Task: {spec.task}\n\n{self._plan_text(run)}\n\nThe change {last.change or '(none)'} passed the "
                f"tests (T{len(run.test_runs)}: `{last.cmd}` exited 0). Its patch:\n{_fenced(patch)}\n\n"
                f"Check it against the task and the acceptance criteria. Emit one verify_result: change "
                f"{last.change!r}, tests 'T{len(run.test_runs)}', meets_acceptance, and unmet (the criteria "
                "it does not meet).")
