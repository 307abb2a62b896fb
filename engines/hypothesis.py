"""HypothesisEngine: an event-reference chain from seed findings to applications (ADR-0034 D4).

Owns the hypothesis domain: its chain events, each with an engine-assigned eid by prefix
(FindingPosted F, QuestionRaised Q, EvidenceCollected E, HypothesisFormed H,
ExperimentDesigned X, ResultRecorded R, ConclusionDrawn C, ApplicationMapped A), the
reactions (finding -> questions -> evidence -> hypotheses -> experiments -> results ->
conclusions -> applications and follow-up questions), the question quota per generation,
experiments left pending when their method cannot be executed here, the stage guards, the
exempt synthesizer, the partial export and the report. References, eids and generations
are the engine's: set on admission, never trusted from the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator

from opgraph.actors import TurnError

from .agents import Agent
from .engine import Engine
from .errors import EngineInputError
from .events import EngineEvent
from .run import EngineRun

__all__ = [
    "EXECUTABLE_METHODS",
    "METHODS",
    "PREFIXES",
    "ApplicationMapped",
    "ChainEvent",
    "ConclusionDrawn",
    "EvidenceCollected",
    "ExperimentDesigned",
    "FindingPosted",
    "HypothesisEngine",
    "HypothesisFormed",
    "HypothesisRun",
    "QuestionRaised",
    "ResultRecorded",
    "normal_seeds",
]

# How an experiment is carried out. The first four an agent can do itself (reasoning over
# data, sources and models); the others need the world, so such experiments stay pending.
METHODS = ("literature review", "data analysis", "simulation", "computation", "lab experiment", "field study",
           "user study", "clinical trial")
EXECUTABLE_METHODS = METHODS[:4]

# The investigator's and the runner's prompts for one hypothesis and one experiment (``str.format``).
_DESIGN_PROMPT = ("{head}\nHypothesis {h.eid}: {h.statement} (metric {h.metric}, threshold {h.threshold}, falsifier "
                  "{h.falsifier})\n\nDesign the experiment that tests it: emit one experiment_designed with its "
                  "method (one of " + ", ".join(METHODS) + "), dataset, procedure and acceptance.")
_RESULT_PROMPT = ("Experiment {x.eid} ({x.method}) for hypothesis {x.hypothesis}: {x.procedure}\nDataset: {dataset}\n"
                  "Acceptance: {x.acceptance}\n\nCarry it out and emit one result_recorded with the measurements, "
                  "whether it passed the acceptance criterion, and its caveats.")


def _stated(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the schema shows no default, so a model states the value


def _engine_set(schema: dict[str, Any]) -> None:
    schema["description"] = "set by the engine; leave empty"


class ChainEvent(EngineEvent):
    """A link of the chain; ``eid`` (F1, Q2, ...) is assigned by the engine on admission."""

    eid: str = Field("", json_schema_extra=_engine_set)

    def label(self) -> str:
        """The link as the chain's prompts and report show it: its eid, its kind and its gist."""
        return self.eid


class FindingPosted(ChainEvent):
    """A seed finding the chain starts from (posted by the engine from the caller's seeds)."""

    description: str
    source: str = ""

    def label(self) -> str:
        return f"{self.eid} finding: {self.description[:200]}"


class QuestionRaised(ChainEvent):
    """An open question about a finding or a conclusion; ``parent`` and ``generation`` are the engine's."""

    area: str = Field(description="the field or sub-area the question belongs to")
    what_is_unknown: str = Field(description="precisely what is not known yet")
    parent: str = Field("", json_schema_extra=_engine_set)
    generation: int = Field(0, json_schema_extra=_engine_set)

    def label(self) -> str:
        return f"{self.eid} question (generation {self.generation}) [{self.area[:60]}]: {self.what_is_unknown[:200]}"


class EvidenceCollected(ChainEvent):
    """Evidence bearing on a question."""

    question: str = Field("", json_schema_extra=_engine_set)
    summary: str = Field(description="what the evidence shows")
    sources: list[str] = Field(default_factory=list, description="where it comes from")
    strength: float = Field(0.5, ge=0.0, le=1.0, description="how strongly it bears on the question: 0 to 1",
                            json_schema_extra=_stated)

    def label(self) -> str:
        return f"{self.eid} evidence (strength {self.strength:.2f}): {self.summary[:200]}"


class HypothesisFormed(ChainEvent):
    """A testable answer to a question."""

    question: str = Field("", json_schema_extra=_engine_set)
    statement: str = Field(description="the hypothesis, stated so it can be tested")
    metric: str = Field(description="what is measured")
    threshold: str = Field(description="the value of the metric that supports the hypothesis")
    falsifier: str = Field(description="the observation that would refute it")

    def label(self) -> str:
        return (f"{self.eid} hypothesis: {self.statement[:200]} (metric {self.metric[:60]}; "
                f"threshold {self.threshold[:60]})")


class ExperimentDesigned(ChainEvent):
    """An experiment that tests a hypothesis."""

    hypothesis: str = Field("", json_schema_extra=_engine_set)
    method: str = Field(description="how the experiment is carried out",
                        json_schema_extra={"enum": list(METHODS)})
    dataset: str = Field("", description="the data or material it uses")
    procedure: str = Field(description="the steps")
    acceptance: str = Field(description="the result that counts as support")

    @field_validator("method", mode="before")
    @classmethod
    def _normal_method(cls, value: object) -> object:
        return " ".join(value.replace("_", " ").lower().split()) if isinstance(value, str) else value

    def label(self) -> str:
        return f"{self.eid} experiment [{self.method}]: {self.procedure[:160]}"


class ResultRecorded(ChainEvent):
    """The outcome of an executed experiment."""

    experiment: str = Field("", json_schema_extra=_engine_set)
    measurements: list[str] = Field(default_factory=list, description="what was measured, with values")
    passed: bool = Field(description="whether the acceptance criterion was met")
    caveats: str = Field("", description="what limits the result")

    def label(self) -> str:
        measured = "; ".join(self.measurements)[:160] or "-"
        return f"{self.eid} result ({'passed' if self.passed else 'failed'}): {measured}"


class ConclusionDrawn(ChainEvent):
    """What a result means for its question."""

    question: str = Field("", json_schema_extra=_engine_set)
    result: str = Field("", json_schema_extra=_engine_set)
    basis: str = Field(description="why the result supports this conclusion")
    confidence: float = Field(0.5, ge=0.0, le=1.0, description="0 to 1", json_schema_extra=_stated)
    limitations: str = Field("", description="where the conclusion stops holding")

    def label(self) -> str:
        return f"{self.eid} conclusion (confidence {self.confidence:.2f}): {self.basis[:200]}"


class ApplicationMapped(ChainEvent):
    """Where a conclusion can be put to use."""

    conclusion: str = Field("", json_schema_extra=_engine_set)
    effect: str = Field(description="what applying the conclusion changes, and where")

    def label(self) -> str:
        return f"{self.eid} application: {self.effect[:200]}"


PREFIXES: dict[type[ChainEvent], str] = {
    FindingPosted: "F", QuestionRaised: "Q", EvidenceCollected: "E", HypothesisFormed: "H",
    ExperimentDesigned: "X", ResultRecorded: "R", ConclusionDrawn: "C", ApplicationMapped: "A",
}
# The references each kind of link carries, filled from the stage that produced it.
_REFERENCES: dict[type[ChainEvent], tuple[str, ...]] = {
    QuestionRaised: ("parent",), EvidenceCollected: ("question",), HypothesisFormed: ("question",),
    ExperimentDesigned: ("hypothesis",), ResultRecorded: ("experiment",), ConclusionDrawn: ("question", "result"),
    ApplicationMapped: ("conclusion",),
}


def normal_seeds(seeds: Any) -> list[str]:
    """The seeds as distinct, whitespace-normalised, non-empty strings, in order (one str is one seed)."""
    if isinstance(seeds, str):
        seeds = [seeds]
    if not isinstance(seeds, (list, tuple)):
        return []
    kept: dict[str, str] = {}
    for seed in seeds:
        text = " ".join(str(seed).split()) if isinstance(seed, str) else ""
        if text and text.lower() not in kept:
            kept[text.lower()] = text
    return list(kept.values())


@dataclass
class Stage:
    """What an agent's current turn works on: the stage and the references its emissions get."""

    name: str
    references: dict[str, str] = field(default_factory=dict)


class HypothesisRun(EngineRun):
    """A hypothesis invocation's chain: the eid index, prefix counters, pending experiments, stage errors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seeds: list[str] = []
        self.chain: dict[str, ChainEvent] = {}  # eid -> event
        self.counters: Counter[str] = Counter()  # prefix -> eids given
        self.questions_per_generation: Counter[int] = Counter()
        self.pending: dict[str, ExperimentDesigned] = {}  # experiments whose method is not executable here
        self.stage_errors: list[dict[str, str]] = []
        self.stage_of: dict[str, Stage] = {}  # agent name -> what its current turn works on

    def next_eid(self, kind: type[ChainEvent]) -> str:
        prefix = PREFIXES[kind]
        self.counters[prefix] += 1
        return f"{prefix}{self.counters[prefix]}"

    def post(self, event: ChainEvent, *, agent: str | None = None) -> ChainEvent:
        """Record a link the engine itself states (a seed finding), with its eid."""
        event = event.model_copy(update={"eid": self.next_eid(type(event))})
        self.chain[event.eid] = event
        self.emit(event, agent=agent)
        return event

    def generation_of(self, parent: str) -> int:
        """A question's generation from its parent: 0 under a finding, one more than the
        question a conclusion answers; capped at the engine's max_depth."""
        event = self.chain.get(parent)
        if isinstance(event, ConclusionDrawn):
            question = self.chain.get(event.question)
            generation = (question.generation + 1) if isinstance(question, QuestionRaised) else 0
        else:
            generation = 0
        return min(generation, self.engine.max_depth)

    def admit_emission(self, agent: Agent, event: EngineEvent) -> EngineEvent | None:
        """Give a link its eid and the references of the stage that produced it; drop a
        question over its generation's quota (``max(1, max_questions >> generation)``)."""
        stage = self.stage_of.get(agent.name)
        if stage is None or not isinstance(event, ChainEvent) or type(event) not in PREFIXES:
            return event
        update = {name: stage.references.get(name, "") for name in _REFERENCES.get(type(event), ())}
        if isinstance(event, QuestionRaised):
            generation = self.generation_of(update["parent"])
            quota = max(1, self.engine.max_questions >> generation)
            if self.questions_per_generation[generation] >= quota:
                self.notify("question_dropped", agent=agent.name, parent=update["parent"], generation=generation,
                            quota=quota, question=event.what_is_unknown[:300])
                return None
            self.questions_per_generation[generation] += 1
            update["generation"] = generation
        update["eid"] = self.next_eid(type(event))
        admitted = event.model_copy(update=update)
        self.chain[admitted.eid] = admitted
        return admitted

    def links(self, kind: type[ChainEvent], **references: str) -> list[Any]:
        """Admitted links of ``kind`` whose references match (``question="Q1"``...)."""
        return [event for event in self.chain.values() if type(event) is kind
                and all(getattr(event, name) == value for name, value in references.items())]


class HypothesisEngine(Engine):
    """Turns seed findings into questions, evidence, hypotheses, experiments, results,
    conclusions and applications, then an exempt synthesizer writes the report.

    ``run(seeds)`` (a list of strings, or one) returns an EngineResult whose text is the
    report; the run (``result.run``) is a ``HypothesisRun`` with the ``chain`` and
    ``pending``. ``max_questions`` (8) is generation 0's quota; generation g gets
    ``max(1, max_questions >> g)``; generations stop growing at ``max_depth``. An
    experiment whose method is not in ``executable_methods`` stays pending. A stage's
    failed turn is announced (``stage_error``) and ends that chain only.
    """

    run_context_cls = HypothesisRun
    kind = "hypothesis"

    def __init__(self, *, max_questions: int = 8, executable_methods: tuple[str, ...] = EXECUTABLE_METHODS,
                 repair_retries: int = 1, max_seed_chars: int = 4000, **engine_settings: Any) -> None:
        super().__init__(**engine_settings)
        for name, value in (("max_questions", max_questions), ("max_seed_chars", max_seed_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EngineInputError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(repair_retries, bool) or not isinstance(repair_retries, int) or repair_retries < 0:
            raise EngineInputError(f"repair_retries must be an integer >= 0, got {repair_retries!r}")
        self.max_questions = max_questions
        self.executable_methods = tuple(" ".join(m.replace("_", " ").lower().split()) for m in executable_methods)
        self.repair_retries = repair_retries
        self.max_seed_chars = max_seed_chars

    def validate(self, seeds: Any = None, *args: Any, **kwargs: Any) -> None:
        normal = normal_seeds(seeds)
        if not normal:
            raise EngineInputError("hypothesis needs at least one non-empty seed finding")
        longest = max(len(seed) for seed in normal)
        if longest > self.max_seed_chars:
            raise EngineInputError(f"a seed has {longest} characters; the limit is {self.max_seed_chars}")

    def describe_input(self, seeds: Any = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"seeds": [seed[:2000] for seed in normal_seeds(seeds)]}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "max_questions": self.max_questions,
                "executable_methods": list(self.executable_methods), "repair_retries": self.repair_retries}

    # -- the chain ------------------------------------------------------------------------
    async def _run(self, run: HypothesisRun, seeds: Any) -> str:
        run.seeds = normal_seeds(seeds)
        for seed in run.seeds:
            finding = run.post(FindingPosted(description=seed, source="seed"), agent="seed")
            if run.spawn(self._guarded(run, "questions", finding.eid, lambda f=finding: self._questions(run, f))) \
                    is None:
                run.notify("chain_refused", finding=finding.eid, reason=run.exhausted_reason or "budget")
        await run.wait_quiescence()
        synthesis = await self._synthesize(run, partial_reason="")
        return self.report(run, synthesis)

    async def _guarded(self, run: HypothesisRun, stage: str, ref: str, work: Callable[[], Awaitable[None]]) -> None:
        """One stage of one chain: a failed turn is announced and ends this chain, no other.

        ``work`` makes the stage's coroutine only when it runs (a refused spawn leaves none unawaited).
        """
        try:
            await work()
        except TurnError as error:
            kind = error.error_type or type(error).__name__
            run.stage_errors.append({"stage": stage, "ref": ref, "error_type": kind, "error": str(error)[:500]})
            run.notify("stage_error", stage=stage, ref=ref, error_type=kind, error=str(error)[:500])

    async def _step(self, run: HypothesisRun, agent: Agent, stage: Stage, instruction: str,
                    emits: tuple[type[EngineEvent], ...]) -> None:
        """One turn of ``agent`` in ``stage``; its emissions are admitted with the stage's references."""
        run.stage_of[agent.name] = stage
        before = {kind: len(run.by_type(kind, agent=agent.name)) for kind in emits}

        def arrived() -> bool:
            return any(len(run.by_type(kind, agent=agent.name)) > before[kind] for kind in emits)

        await run.operate_with_repair(agent, instruction, arrived=arrived, emits=emits, retries=self.repair_retries)

    async def _questions(self, run: HypothesisRun, source: FindingPosted) -> None:
        """Questions a seed finding leaves open (generation 0); follow-ups come from conclusions."""
        agent = await run.make_agent("questioner", name=f"questioner-{source.eid}", emits=(QuestionRaised,),
                                     model=self.model_for("questioner"),
                                     extra_prompt="You find the open questions a finding raises.")
        generation = run.generation_of(source.eid)
        quota = max(1, self.max_questions >> generation)
        instruction = (f"Finding {source.eid}: {source.description}\n\nRaise at most {quota} question(s) it "
                       f"leaves open: emit question_raised items, each with its area and precisely what is unknown.")
        await self._step(run, agent, Stage("questions", {"parent": source.eid}), instruction, (QuestionRaised,))
        for question in run.by_type(QuestionRaised, agent=agent.name):
            self._start_chain(run, question)

    def _start_chain(self, run: HypothesisRun, question: QuestionRaised) -> None:
        if run.spawn(self._guarded(run, "investigation", question.eid,
                                   lambda: self._investigate(run, question))) is None:
            run.notify("chain_refused", question=question.eid, reason=run.exhausted_reason or "budget")

    async def _investigate(self, run: HypothesisRun, question: QuestionRaised) -> None:
        """Evidence, then hypotheses, then one experiment design per hypothesis (one investigator)."""
        agent = await run.make_agent("investigator", name=f"investigator-{question.eid}", model=self.model_for(
            "investigator"), emits=(EvidenceCollected, HypothesisFormed, ExperimentDesigned),
            extra_prompt="You investigate one question: evidence, hypotheses, experiments.")
        head = f"Question {question.eid} ({question.area}): {question.what_is_unknown}"
        await self._step(run, agent, Stage("evidence", {"question": question.eid}),
                         f"{head}\n\nCollect the evidence that bears on it: emit evidence_collected items with a "
                         f"summary, sources and strength.", (EvidenceCollected,))
        evidence = run.links(EvidenceCollected, question=question.eid)
        await self._step(run, agent, Stage("hypotheses", {"question": question.eid}),
                         f"{head}\nEvidence: " + "; ".join(f"{e.eid} {e.summary[:300]}" for e in evidence)
                         + "\n\nForm testable hypotheses: emit hypothesis_formed items, each with a statement, the "
                         "metric, the threshold that supports it and the falsifier.", (HypothesisFormed,))
        for hypothesis in run.links(HypothesisFormed, question=question.eid):
            await self._step(run, agent, Stage("experiment", {"hypothesis": hypothesis.eid}),
                             _DESIGN_PROMPT.format(head=head, h=hypothesis), (ExperimentDesigned,))
            for experiment in run.links(ExperimentDesigned, hypothesis=hypothesis.eid):
                if experiment.method not in self.executable_methods:
                    run.pending[experiment.eid] = experiment  # waits for the world; not a failure
                    run.notify("experiment_pending", experiment=experiment.eid, method=experiment.method,
                               hypothesis=hypothesis.eid)
                    continue
                if run.spawn(self._guarded(run, "result", experiment.eid,
                                           lambda x=experiment: self._execute(run, question, x))) is None:
                    run.notify("chain_refused", experiment=experiment.eid, reason=run.exhausted_reason or "budget")

    async def _execute(self, run: HypothesisRun, question: QuestionRaised, experiment: ExperimentDesigned) -> None:
        """Run an executable experiment, then conclude from its results."""
        runner = await run.make_agent("runner", name=f"runner-{experiment.eid}", emits=(ResultRecorded,),
                                      model=self.model_for("runner"),
                                      extra_prompt="You carry out experiments by analysis, computation and sources.")
        await self._step(run, runner, Stage("result", {"experiment": experiment.eid}),
                         _RESULT_PROMPT.format(x=experiment, dataset=experiment.dataset or "-"), (ResultRecorded,))
        for result in run.links(ResultRecorded, experiment=experiment.eid):
            await self._guarded(run, "conclusion", result.eid, lambda r=result: self._conclude(run, question, r))

    async def _conclude(self, run: HypothesisRun, question: QuestionRaised, result: ResultRecorded) -> None:
        """A conclusion on the question from the result, then its applications and follow-up questions."""
        analyst = await run.make_agent("analyst", name=f"analyst-{result.eid}", model=self.model_for("analyst"),
                                       emits=(ConclusionDrawn, ApplicationMapped, QuestionRaised),
                                       extra_prompt="You draw conclusions from results and map their uses.")
        await self._step(run, analyst, Stage("conclusion", {"question": question.eid, "result": result.eid}),
                         f"Question {question.eid}: {question.what_is_unknown}\nResult {result.eid} "
                         f"({'passed' if result.passed else 'failed'}): {'; '.join(result.measurements) or '-'}; "
                         f"caveats: {result.caveats or '-'}\n\nEmit one conclusion_drawn with its basis, confidence "
                         f"and limitations.", (ConclusionDrawn,))
        for conclusion in run.links(ConclusionDrawn, result=result.eid):
            generation = run.generation_of(conclusion.eid)
            quota = max(1, self.max_questions >> generation)
            await self._step(run, analyst, Stage("application", {"conclusion": conclusion.eid, "parent":
                                                                 conclusion.eid}),
                             f"Conclusion {conclusion.eid}: {conclusion.basis}\n\nEmit application_mapped items for "
                             f"where it can be used and what that changes, and at most {quota} question_raised for "
                             f"what it leaves open.", (ApplicationMapped, QuestionRaised))
            for follow_up in run.links(QuestionRaised, parent=conclusion.eid):
                self._start_chain(run, follow_up)

    # -- the end --------------------------------------------------------------------------
    def _evidence_exists(self, run: HypothesisRun) -> bool:
        return any(not isinstance(event, FindingPosted) for event in run.chain.values())

    async def _synthesize(self, run: HypothesisRun, *, partial_reason: str) -> str:
        synthesizer = await run.make_agent("synthesizer", name="synthesizer", exempt=True,
                                           model=self.model_for("synthesizer"))
        lines = ["Summarise what this investigation established, citing eids."]
        if partial_reason:
            lines.append(f"It stopped early ({partial_reason}): say what is established and what remains open.")
        lines += self._chain_lines(run)
        result = await run.turn(synthesizer, "\n".join(lines), operation="chat")
        return result.response if isinstance(result.response, str) else str(result.response)

    async def _partial_export(self, run: HypothesisRun) -> str | None:
        """Only with evidence beyond the seeds: the chain synthesised under a budget-exhausted status."""
        if not self._evidence_exists(run):
            return None
        reason = run.degrade_reason or run.exhausted_reason or "budget"
        synthesis = await self._synthesize(run, partial_reason=f"{reason} budget exhausted")
        return self.report(run, synthesis, status=f"budget exhausted ({reason}): partial chain")

    def _chain_lines(self, run: HypothesisRun) -> list[str]:
        lines: list[str] = []
        for event in run.chain.values():
            if isinstance(event, FindingPosted):
                lines += self._subtree(run, event, "", True, top=True)
        return lines

    def _label(self, run: HypothesisRun, event: ChainEvent) -> str:
        if isinstance(event, ExperimentDesigned) and event.eid in run.pending:
            return f"{event.label()} — PENDING: not executable here"
        return event.label()

    def _children(self, run: HypothesisRun, event: ChainEvent) -> list[ChainEvent]:
        eid = event.eid
        if isinstance(event, (FindingPosted, ConclusionDrawn)):
            follow = run.links(QuestionRaised, parent=eid)
            return ([*run.links(ApplicationMapped, conclusion=eid), *follow] if isinstance(event, ConclusionDrawn)
                    else follow)
        if isinstance(event, QuestionRaised):
            return [*run.links(EvidenceCollected, question=eid), *run.links(HypothesisFormed, question=eid)]
        if isinstance(event, HypothesisFormed):
            return run.links(ExperimentDesigned, hypothesis=eid)
        if isinstance(event, ExperimentDesigned):
            return run.links(ResultRecorded, experiment=eid)
        if isinstance(event, ResultRecorded):
            return run.links(ConclusionDrawn, result=eid)
        return []

    def _subtree(self, run: HypothesisRun, event: ChainEvent, prefix: str, last: bool, *,
                 top: bool = False) -> list[str]:
        branch = "" if top else ("└── " if last else "├── ")
        lines = [f"{prefix}{branch}{self._label(run, event)}"]
        inner = prefix + ("" if top else ("    " if last else "│   "))
        children = self._children(run, event)
        for index, child in enumerate(children):
            lines += self._subtree(run, child, inner, index == len(children) - 1)
        return lines

    def report(self, run: HypothesisRun, synthesis: str, *, status: str = "") -> str:
        """The report: counts and status, the synthesis, the chains, pending experiments, stage errors."""
        if not status and run.budget_hit:
            status = f"complete within budget ({run.exhausted_reason or 'budget'}; some chains were not followed)"
        status = status or "complete"
        counts = run.counters
        lines = [f"Hypotheses from {len(run.seeds)} seed finding(s)",
                 f"Status: {status} · {counts['Q']} question(s) · {counts['H']} hypothesis(es) · {counts['X']} "
                 f"experiment(s) ({len(run.pending)} pending) · {counts['R']} result(s) · {counts['C']} "
                 f"conclusion(s) · {counts['A']} application(s) · {run.agents_made} agent(s)",
                 "", "Synthesis:", synthesis.strip() or "(empty)", "", "Chains:", *self._chain_lines(run)]
        if run.pending:
            lines += ["", "Pending experiments (their method cannot be executed here):"]
            lines += [f"- {x.eid} [{x.method}] for {x.hypothesis}: {x.procedure[:160]}" for x in run.pending.values()]
        if run.stage_errors:
            lines += ["", "Stage errors (each ended its own chain only):"]
            lines += [f"- {e['stage']} of {e['ref']}: {e['error_type']}: {e['error'][:200]}" for e in run.stage_errors]
        return "\n".join(lines)
