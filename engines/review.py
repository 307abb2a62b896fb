"""ReviewEngine: dimensional fan-out, adversarial verification, one exempt verdict (ADR-0034 D4).

Owns the review domain: its events (IssueFound, VerifyResult, ReviewVerdict, and
DimensionReviewed), the reaction topology (dimensions reviewed concurrently; an issue
of qualifying severity spawns one verifier per location; all verifiers finish before
the verdict turn), the evidence gate, and the report text.

Ideal over retrospective: an evidence gate. An approval is downgraded to
``inconclusive`` when a dimension produced nothing or a major or critical issue went
unverified, so an approval always rests on evidence that arrived; and to
``request_changes`` when the verifier confirmed a major or critical issue, so an
approval never stands over evidence against it. Severities are normalised
(``High`` is ``major``, ``blocker`` is ``critical``...) before either check.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, field_validator

from .engine import Engine
from .errors import EngineInputError, require_text
from .events import EngineEvent
from .run import EngineRun

__all__ = [
    "DEFAULT_DIMENSIONS",
    "SEVERITIES",
    "VERDICTS",
    "DimensionReviewed",
    "Finding",
    "IssueFound",
    "ReviewEngine",
    "ReviewRun",
    "ReviewVerdict",
    "VerifyResult",
    "normal_severity",
]

DEFAULT_DIMENSIONS = ("correctness", "security", "performance", "maintainability")
SEVERITIES = ("critical", "major", "minor", "info")
VERDICTS = ("approve", "request_changes", "reject")
INCONCLUSIVE = "inconclusive"  # the gate's verdict; a model cannot choose it
# Words models use for the severities above; anything else is kept as written (lowercased).
SEVERITY_SYNONYMS = {"blocker": "critical", "severe": "critical", "high": "major", "important": "major",
                     "medium": "minor", "moderate": "minor", "low": "minor", "informational": "info",
                     "note": "info", "nit": "info"}


def normal_severity(severity: str) -> str:
    """``severity`` lowercased, a known synonym replaced by its severity (``High`` -> ``major``)."""
    text = str(severity).strip().lower()
    return SEVERITY_SYNONYMS.get(text, text)


def _severity_schema(schema: dict[str, Any]) -> None:
    # The schema lists the severities and leaves out the default, so a model states one.
    schema["enum"] = list(SEVERITIES)
    schema.pop("default", None)


class Finding(EngineEvent):
    """A piece of evidence an agent found."""

    description: str
    confidence: float = Field(0.5, ge=0.0, le=1.0)
    evidence: str = ""


class IssueFound(Finding):
    """One problem in the reviewed code, in one dimension."""

    dimension: str
    location: str = ""
    severity: str = Field("minor", json_schema_extra=_severity_schema)

    @field_validator("severity", mode="before")
    @classmethod
    def _normal_severity(cls, value: object) -> object:
        return normal_severity(value) if isinstance(value, str) else value


class DimensionReviewed(EngineEvent):
    """A reviewer finished its dimension (evidence that it looked, even with no issue)."""

    dimension: str
    summary: str = ""


class VerifyResult(EngineEvent):
    """An adversarial verifier's finding on one issue: does it hold?"""

    issue: str
    holds: bool = True
    rationale: str = ""


class ReviewVerdict(EngineEvent):
    """The verdict turn's decision."""

    verdict: str = Field(json_schema_extra={"enum": list(VERDICTS)})
    rationale: str = ""
    evidence: list[str] = Field(default_factory=list)
    blocking: list[str] = Field(default_factory=list)


class ReviewRun(EngineRun):
    """A review invocation's domain state: who reviewed what, which issue each verifier checks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reviewers: dict[str, str] = {}  # dimension -> reviewer agent name
        self.to_verify: dict[str, IssueFound] = {}  # location key -> the first issue there
        self.verifiers: dict[str, str] = {}  # location key -> verifier agent name
        self.verifier_count = 0
        self.verdict: ReviewVerdict | None = None
        self.final_verdict = ""
        self.gate_reasons: list[str] = []

    def verification(self, key: str) -> VerifyResult | None:
        name = self.verifiers.get(key)
        results = self.by_type(VerifyResult, agent=name) if name else []
        return results[-1] if results else None


def _location_key(issue: IssueFound) -> str:
    return (issue.location or issue.description).strip().lower()


class ReviewEngine(Engine):
    """Reviews code along ``dimensions`` concurrently, verifies serious issues, then decides.

    ``run(code, *, context="")`` returns an EngineResult whose text is the report; the
    run (``result.run``) is a ``ReviewRun`` with ``final_verdict`` and ``gate_reasons``.
    A dimension's failure cancels verifier work already spawned and propagates.
    """

    run_context_cls = ReviewRun
    kind = "review"

    def __init__(self, *, dimensions: tuple[str, ...] = DEFAULT_DIMENSIONS,
                 verify_severities: tuple[str, ...] = ("critical", "major"), repair_retries: int = 1,
                 max_code_chars: int = 200_000, **engine_settings: Any) -> None:
        super().__init__(**engine_settings)
        dimensions = tuple(str(d).strip() for d in dimensions)
        if not dimensions or any(not d for d in dimensions) or len(set(dimensions)) != len(dimensions):
            raise EngineInputError(f"dimensions must be distinct non-empty names, got {dimensions!r}")
        if isinstance(repair_retries, bool) or not isinstance(repair_retries, int) or repair_retries < 0:
            raise EngineInputError(f"repair_retries must be an integer >= 0, got {repair_retries!r}")
        self.dimensions = dimensions
        self.verify_severities = tuple(normal_severity(s) for s in verify_severities)
        self.repair_retries = repair_retries
        self.max_code_chars = max_code_chars

    def validate(self, code: Any = None, *args: Any, **kwargs: Any) -> None:
        require_text(code, "review needs the code (or diff) to review as non-empty text", what="the code to review",
                     limit=self.max_code_chars, setting="max_code_chars")

    def describe_input(self, code: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"chars": len(code), "head": code[:2000], "context": str(kwargs.get("context", ""))[:2000],
                "dimensions": list(self.dimensions)}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "dimensions": list(self.dimensions),
                "verify_severities": list(self.verify_severities), "repair_retries": self.repair_retries}

    async def _run(self, run: ReviewRun, code: str, *, context: str = "") -> str:
        async with asyncio.TaskGroup() as group:
            for dimension in self.dimensions:
                group.create_task(self._review_dimension(run, dimension, code, context))
        await run.wait_quiescence()  # every verifier finishes before the verdict
        verdict_agent = await run.make_agent("verdict", name="verdict", emits=(ReviewVerdict,), exempt=True,
                                             model=self.model_for("verdict"))
        await run.operate_with_repair(verdict_agent, self._verdict_instruction(run, code),
                                      arrived=lambda: bool(run.by_type(ReviewVerdict, agent="verdict")),
                                      retries=self.repair_retries)
        verdicts = run.by_type(ReviewVerdict, agent="verdict")
        run.verdict = verdicts[-1] if verdicts else None
        self._gate(run)
        return self.report(run)

    async def _review_dimension(self, run: ReviewRun, dimension: str, code: str, context: str) -> None:
        reviewer = await run.make_agent("reviewer", name=f"reviewer-{dimension}", emits=(IssueFound, DimensionReviewed),
                                        extra_prompt=f"You review only for {dimension}.")
        run.reviewers[dimension] = reviewer.name
        instruction = (f"Review this code for {dimension}. Emit one issue_found per problem (dimension "
                       f"{dimension!r}, a location, a severity among {', '.join(SEVERITIES)}), then one "
                       f"dimension_reviewed summarising what you checked."
                       + (f"\n\nContext: {context}" if context else "") + f"\n\n```\n{code}\n```")

        def arrived() -> bool:
            return bool(run.by_type(DimensionReviewed, agent=reviewer.name)
                        or run.by_type(IssueFound, agent=reviewer.name))

        await run.operate_with_repair(reviewer, instruction, arrived=arrived, retries=self.repair_retries)
        for issue in run.by_type(IssueFound, agent=reviewer.name):
            self._maybe_verify(run, issue, code)

    def _maybe_verify(self, run: ReviewRun, issue: IssueFound, code: str) -> None:
        if issue.severity not in self.verify_severities:
            return
        key = _location_key(issue)
        if run.seen(f"verify::{key}"):
            return  # one verifier per location
        run.to_verify[key] = issue
        if run.spawn(self._verify(run, key, issue, code)) is None:
            run.notify("verification_skipped", location=key, reason=run.exhausted_reason or "budget")

    async def _verify(self, run: ReviewRun, key: str, issue: IssueFound, code: str) -> None:
        run.verifier_count += 1  # before the await: concurrent verifiers get distinct names
        verifier = await run.make_agent("verifier", name=f"verifier-{run.verifier_count}", emits=(VerifyResult,),
                                        extra_prompt="You are adversarial: try hard to show the issue does not hold.")
        run.verifiers[key] = verifier.name
        instruction = (f"Does this {issue.severity} {issue.dimension} issue really hold?\n"
                       f"Location: {issue.location}\nIssue: {issue.description}\n"
                       f"Emit one verify_result (issue: the location, holds: true or false, rationale)."
                       f"\n\n```\n{code}\n```")
        await run.operate_with_repair(verifier, instruction,
                                      arrived=lambda: bool(run.by_type(VerifyResult, agent=verifier.name)),
                                      retries=self.repair_retries)

    def _verdict_instruction(self, run: ReviewRun, code: str) -> str:
        lines = ["Decide the review verdict (approve, request_changes or reject) from this evidence, and "
                 "emit one review_verdict with rationale, evidence and blocking items."]
        lines += self._evidence_lines(run)
        return "\n".join(lines) + f"\n\nThe code:\n```\n{code[:20_000]}\n```"

    def _gate(self, run: ReviewRun) -> None:
        """The evidence gate: an approval needs every dimension and every serious issue checked,
        and no serious issue the verifier confirmed (that one becomes ``request_changes``)."""
        reasons = []
        for dimension in self.dimensions:
            name = run.reviewers.get(dimension)
            if not name or not (run.by_type(IssueFound, agent=name) or run.by_type(DimensionReviewed, agent=name)):
                reasons.append(f"dimension {dimension} produced no evidence")
        confirmed = []
        for key, issue in run.to_verify.items():
            check = run.verification(key)
            if check is None:
                reasons.append(f"{issue.severity} issue at {key} was not verified")
            elif check.holds:
                confirmed.append(f"verified {issue.severity} issue at {key} is open: an approval cannot stand")
        if run.verdict is None:
            run.final_verdict, run.gate_reasons = INCONCLUSIVE, ["no verdict was emitted", *reasons]
        elif run.verdict.verdict == "approve" and confirmed:
            # Evidence against the approval outranks missing evidence: changes are needed.
            run.final_verdict, run.gate_reasons = "request_changes", confirmed + reasons
        elif run.verdict.verdict == "approve" and reasons:
            run.final_verdict, run.gate_reasons = INCONCLUSIVE, reasons
        else:
            run.final_verdict, run.gate_reasons = run.verdict.verdict, []
        if run.gate_reasons:
            run.notify("evidence_gate", verdict=run.verdict.verdict if run.verdict else None,
                       final_verdict=run.final_verdict, reasons=run.gate_reasons)

    def _evidence_lines(self, run: ReviewRun) -> list[str]:
        lines = []
        for dimension in self.dimensions:
            name = run.reviewers.get(dimension)
            issues = run.by_type(IssueFound, agent=name) if name else []
            done = bool(name and run.by_type(DimensionReviewed, agent=name))
            lines.append(f"- {dimension}: {len(issues)} issue(s){', reviewed' if done else ''}")
            for issue in issues:
                key = _location_key(issue)
                check = run.verification(key)
                if key not in run.to_verify:
                    state = "not verified (below the verification severity)"
                elif check is None:
                    state = "UNVERIFIED"
                else:
                    state = f"verified: {'holds' if check.holds else 'refuted'}" + (
                        f" ({check.rationale})" if check.rationale else "")
                lines.append(f"    [{issue.severity}] {issue.location or '-'}: {issue.description} — {state}")
        return lines

    def report(self, run: ReviewRun) -> str:
        """The review as text: the verdict (and why the gate changed it), then the evidence."""
        head = [f"Review verdict: {run.final_verdict}"]
        if run.verdict is not None and run.final_verdict != run.verdict.verdict:
            head.append(f"(the verdict turn said {run.verdict.verdict}; the evidence gate changed it)")
        if run.gate_reasons:
            head.append("Gate: " + "; ".join(run.gate_reasons))
        if run.verdict is not None and run.verdict.rationale:
            head.append(f"Rationale: {run.verdict.rationale}")
        if run.verdict is not None and run.verdict.blocking:
            head.append("Blocking: " + "; ".join(run.verdict.blocking))
        issues = sum(len(run.by_type(IssueFound, agent=name)) for name in run.reviewers.values())
        head.append(f"Evidence ({issues} issue(s) over {len(self.dimensions)} dimension(s)):")
        return "\n".join(head + self._evidence_lines(run))

    async def _partial_export(self, run: ReviewRun) -> str | None:
        """The evidence collected before the stop, without a verdict (no model call)."""
        if not run.reviewers:
            return None
        reason = run.degrade_reason or "budget"
        return "\n".join([f"Review stopped early ({reason}): no verdict; partial evidence follows.",
                          *self._evidence_lines(run)])
