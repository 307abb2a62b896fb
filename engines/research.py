"""ResearchEngine: a novelty-bounded tree of research teams, its findings and its report (ADR-0034 D4).

Owns the research domain: its events (FindingEmitted, DepthRequested, ContradictionFound),
the tree (each node runs a researcher, an analyst and a critic in turn; a novel finding or
an explicit depth request opens a deeper node while depth < max_depth; a topic seen before
is not explored again), the novelty check that merges near-duplicate findings (a token-set
similarity computed here, never asked of a model), the exempt synthesizer, the partial
export of retained findings, and the report text. The hard bounds are the run's (D2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator

from opgraph.actors import TurnError

from .agents import Agent
from .engine import Engine
from .errors import EngineInputError, require_text
from .events import EngineEvent
from .review import SEVERITIES, Finding, normal_severity
from .run import EngineRun

__all__ = [
    "ASPECTS",
    "TEAM",
    "ContradictionFound",
    "DepthRequested",
    "FindingEmitted",
    "ResearchEngine",
    "ResearchNode",
    "ResearchRun",
    "RetainedFinding",
    "similarity",
    "topic_key",
]

# What a finding is about. An enum rather than free text, so findings group into a readable
# tree whatever the model (the built-in sim/ model picks one; real models classify).
ASPECTS = ("background", "mechanism", "evidence", "performance", "limitations", "risks", "costs",
           "applications", "alternatives", "open questions")
TEAM = ("researcher", "analyst", "critic")
_STOPWORDS = frozenset(
    "a an and are as at be by for from has have in into is it its of on or that the their this to was were "
    "which with".split())


def _enum(options: tuple[str, ...]) -> Any:
    def schema(target: dict[str, Any]) -> None:
        target["enum"] = list(options)
        target.pop("default", None)  # a model states one rather than taking the default
    return schema


def _stated(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the schema shows no default, so a model states the value


def _words(text: str) -> frozenset[str]:
    """Content words of ``text``: lowercased, stopwords out, a plural made singular."""
    words = set()
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        if word in _STOPWORDS:
            continue
        if len(word) > 4 and word.endswith("ies"):
            word = word[:-3] + "y"
        elif len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
            word = word[:-1]
        words.add(word)
    return frozenset(words)


def similarity(first: str, second: str) -> float:
    """Token-set Jaccard similarity of two texts' content words (1.0: the same words)."""
    a, b = _words(first), _words(second)
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def topic_key(topic: str) -> str:
    """A topic's de-duplication key: its content words, sorted (word order and case do not matter)."""
    return " ".join(sorted(_words(topic))) or topic.strip().lower()


class FindingEmitted(Finding):
    """A research finding with its sources; ``depth`` is the engine's (the node's depth)."""

    confidence: float = Field(0.5, ge=0.0, le=1.0, description="how sure the evidence makes it: 0 to 1",
                              json_schema_extra=_stated)
    severity: str = Field("info", description="how much it matters for the topic",
                          json_schema_extra=_enum(SEVERITIES))
    aspect: str = Field("background", description="which aspect of the topic the finding concerns",
                        json_schema_extra=_enum(ASPECTS))
    sources: list[str] = Field(default_factory=list,
                               description="where it comes from: URLs, papers, datasets, standards")
    novelty: float = Field(default=0.5, ge=0.0, le=1.0, json_schema_extra=_stated,
                           description="how new it is against what is well known: 0 textbook, 1 new")
    depth: int = Field(0, description="set by the engine")

    @field_validator("severity", mode="before")
    @classmethod
    def _normal_severity(cls, value: object) -> object:
        return normal_severity(value) if isinstance(value, str) else value

    @field_validator("aspect", mode="before")
    @classmethod
    def _normal_aspect(cls, value: object) -> object:
        return str(value).strip().lower().replace("_", " ") if isinstance(value, str) else value


class DepthRequested(EngineEvent):
    """An explicit request to explore a narrower question in a deeper node."""

    question: str = Field(description="the narrower question worth its own deeper look")
    aspect: str = Field("open questions", description="which aspect of the topic it deepens",
                        json_schema_extra=_enum(ASPECTS))
    parent_depth: int = Field(0, description="set by the engine")

    @field_validator("aspect", mode="before")
    @classmethod
    def _normal_aspect(cls, value: object) -> object:
        return str(value).strip().lower().replace("_", " ") if isinstance(value, str) else value


class ContradictionFound(EngineEvent):
    """Findings or sources that disagree."""

    sources: list[str] = Field(default_factory=list,
                               description="the finding ids (F1, F2...) or sources that disagree")
    nature: str = Field(description="what the disagreement is")
    severity: str = Field("minor", description="how much it matters", json_schema_extra=_enum(SEVERITIES))

    @field_validator("severity", mode="before")
    @classmethod
    def _normal_severity(cls, value: object) -> object:
        return normal_severity(value) if isinstance(value, str) else value


@dataclass
class RetainedFinding:
    """A finding the novelty check kept (``fid`` F1, F2...), with the sources of its merged near-duplicates."""

    fid: str
    finding: FindingEmitted
    node: str
    agent: str
    novelty: float
    sources: list[str] = field(default_factory=list)
    merged: int = 0


@dataclass
class ResearchNode:
    """One node of the tree: a topic explored by one team.

    ``status``: ``pending`` (spawned), ``exploring``, ``explored``, ``partial`` (a member
    failed or the budget stopped it), ``refused`` (no budget to spawn it) or ``judged_out``.
    """

    id: str
    topic: str
    label: str
    depth: int
    parent: str | None = None
    cause: str = ""
    status: str = "pending"
    findings: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class ResearchRun(EngineRun):
    """A research invocation's domain state: the tree, the retained findings, the contradictions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.topic = ""
        self.nodes: dict[str, ResearchNode] = {}
        self.findings: list[RetainedFinding] = []
        self.agent_node: dict[str, str] = {}  # team agent name -> its node's id
        self._absorbed: dict[tuple[str, str], int] = {}  # (agent, event type) -> how many were considered

    def open_node(self, topic: str, *, label: str, depth: int, parent: str | None, cause: str) -> ResearchNode:
        node = ResearchNode(id=f"n{len(self.nodes) + 1}", topic=topic, label=label, depth=depth, parent=parent,
                            cause=cause)
        self.nodes[node.id] = node
        if parent is not None:
            self.nodes[parent].children.append(node.id)
        self.notify("node_opened", node=node.id, parent=parent, depth=depth, label=label, topic=topic[:500],
                    cause=cause)
        return node

    def admit_emission(self, agent: Agent, event: EngineEvent) -> EngineEvent | None:
        """Depth is the engine's: a team agent's finding gets its node's depth, its request the parent's."""
        node_id = self.agent_node.get(agent.name)
        if node_id is None:
            return event
        depth = self.nodes[node_id].depth
        if isinstance(event, FindingEmitted) and event.depth != depth:
            return event.model_copy(update={"depth": depth})
        if isinstance(event, DepthRequested) and event.parent_depth != depth:
            return event.model_copy(update={"parent_depth": depth})
        return event

    def unconsidered(self, agent: str, kind: type) -> list[Any]:
        """``agent``'s emissions of ``kind`` not yet considered by the engine (each once)."""
        emitted = self.by_type(kind, agent=agent)
        seen = self._absorbed.get((agent, kind.__name__), 0)
        self._absorbed[(agent, kind.__name__)] = len(emitted)
        return emitted[seen:]

    def most_similar(self, text: str) -> tuple[RetainedFinding | None, float]:
        best, score = None, 0.0
        for retained in self.findings:
            value = similarity(text, retained.finding.description)
            if value > score:
                best, score = retained, value
        return best, score


_ROLE_EMITS: dict[str, tuple[type[EngineEvent], ...]] = {
    "researcher": (FindingEmitted,),
    "analyst": (FindingEmitted, DepthRequested),
    "critic": (ContradictionFound, FindingEmitted, DepthRequested),
}
_ROLE_PROMPTS = {
    "researcher": "You gather specific, sourced facts.",
    "analyst": "You reason over the evidence: patterns, implications, trade-offs, and what needs a closer look.",
    "critic": "You look for disagreements, weak evidence and claims that do not hold.",
}


class ResearchEngine(Engine):
    """Explores a topic as a tree of teams, then an exempt synthesizer writes the report.

    ``run(topic)`` returns an EngineResult whose text is the report (status, synthesis,
    the findings tree, contradictions); the run (``result.run``) is a ``ResearchRun``.
    ``novelty_threshold`` (0.7): a retained finding more novel than this opens a deeper
    node. ``merge_similarity`` (0.8): a finding at least this similar to a retained one
    is merged into it (its sources kept), never retained twice. Novelty is the lower of
    the model's claim and one minus the similarity to what is retained.
    """

    run_context_cls = ResearchRun
    kind = "research"

    def __init__(self, *, novelty_threshold: float = 0.7, merge_similarity: float = 0.8, repair_retries: int = 1,
                 max_topic_chars: int = 4000, findings_in_prompt: int = 12, **engine_settings: Any) -> None:
        super().__init__(**engine_settings)
        for name, value in (("novelty_threshold", novelty_threshold), ("merge_similarity", merge_similarity)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise EngineInputError(f"{name} must be within [0, 1], got {value!r}")
        for name, value in (("repair_retries", repair_retries), ("findings_in_prompt", findings_in_prompt),
                            ("max_topic_chars", max_topic_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "max_topic_chars" else 0):
                raise EngineInputError(f"{name} must be a non-negative integer, got {value!r}")
        self.novelty_threshold = float(novelty_threshold)
        self.merge_similarity = float(merge_similarity)
        self.repair_retries = repair_retries
        self.max_topic_chars = max_topic_chars
        self.findings_in_prompt = findings_in_prompt

    def validate(self, topic: Any = None, *args: Any, **kwargs: Any) -> None:
        require_text(topic, "research needs a non-empty topic", what="the topic", limit=self.max_topic_chars)

    def describe_input(self, topic: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"topic": topic[:4000]}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "novelty_threshold": self.novelty_threshold,
                "merge_similarity": self.merge_similarity, "repair_retries": self.repair_retries}

    # -- the tree -------------------------------------------------------------------------
    async def _run(self, run: ResearchRun, topic: str) -> str:
        run.topic = " ".join(topic.split())
        run.seen(f"topic::{topic_key(run.topic)}")
        root = run.open_node(run.topic, label=run.topic, depth=0, parent=None, cause="topic")
        await self._explore(run, root)
        await run.wait_quiescence()
        synthesis = await self._synthesize(run, partial_reason="")
        return self.report(run, synthesis)

    async def _explore(self, run: ResearchRun, node: ResearchNode) -> None:
        """The node's team in turn; a member's failed turn is recorded and the next goes on."""
        node.status = "exploring"
        try:
            for role in TEAM:
                agent = await run.make_agent(role, name=f"{role}-{node.id}", emits=_ROLE_EMITS[role],
                                             extra_prompt=_ROLE_PROMPTS[role], model=self.model_for(role))
                run.agent_node[agent.name] = node.id

                def arrived(name: str = agent.name) -> bool:
                    return bool(run.by_type(FindingEmitted, agent=name) or run.by_type(DepthRequested, agent=name)
                                or run.by_type(ContradictionFound, agent=name))

                try:
                    await run.operate_with_repair(agent, self._instruction(run, node, role), arrived=arrived,
                                                  retries=self.repair_retries)
                except TurnError as error:  # already an agent_error record; the team continues
                    node.errors.append(f"{agent.name}: {error.error_type or type(error).__name__}")
                    continue
                self._absorb(run, node, agent)
        except BaseException:
            node.status = "partial"
            raise
        node.status = "partial" if node.errors else "explored"

    def _absorb(self, run: ResearchRun, node: ResearchNode, agent: Agent) -> None:
        """Consider the agent's new findings (merge or retain; a novel one deepens) and depth requests."""
        for finding in run.unconsidered(agent.name, FindingEmitted):
            closest, score = run.most_similar(finding.description)
            if closest is not None and score >= self.merge_similarity:
                closest.merged += 1
                closest.sources.extend(s for s in finding.sources if s not in closest.sources)
                run.notify("finding_merged", agent=agent.name, node=node.id, into=closest.fid,
                           similarity=round(score, 3))
                continue
            novelty = min(finding.novelty, 1.0 - score)
            retained = RetainedFinding(f"F{len(run.findings) + 1}", finding, node.id, agent.name, round(novelty, 3),
                                       list(dict.fromkeys(finding.sources)))
            run.findings.append(retained)
            node.findings.append(retained.fid)
            run.notify("finding_retained", agent=agent.name, node=node.id, fid=retained.fid,
                       novelty=retained.novelty, similarity=round(score, 3), aspect=finding.aspect)
            if novelty > self.novelty_threshold:
                self._deepen(run, node, finding.description, finding.aspect, cause=retained.fid)
        for request in run.unconsidered(agent.name, DepthRequested):
            self._deepen(run, node, request.question, request.aspect, cause=f"depth requested by {agent.name}")

    def _deepen(self, run: ResearchRun, node: ResearchNode, topic: str, aspect: str, *, cause: str) -> None:
        """Open a deeper node on ``topic`` unless too deep or seen; spawn it if budget is left."""
        topic = " ".join(str(topic).split())
        if not topic:
            return
        if node.depth >= self.max_depth:
            run.notify("deepening_stopped", node=node.id, reason="max_depth", topic=topic[:200], cause=cause)
            return
        if run.seen(f"topic::{topic_key(topic)}"):
            run.notify("deepening_stopped", node=node.id, reason="topic_seen", topic=topic[:200], cause=cause)
            return
        child = run.open_node(topic, label=f"{node.label} › {aspect}", depth=node.depth + 1, parent=node.id,
                              cause=cause)
        if run.spawn(self._explore_child(run, child)) is None:
            child.status = "refused"
            run.notify("node_refused", node=child.id, reason=run.exhausted_reason or "budget")

    async def _explore_child(self, run: ResearchRun, node: ResearchNode) -> None:
        if self.judge_model and not await self.judge(run, node.id, node.topic):
            node.status = "judged_out"
            return
        await self._explore(run, node)

    # -- prompts --------------------------------------------------------------------------
    def _known(self, run: ResearchRun, node: ResearchNode | None = None) -> list[str]:
        chosen = [f for f in run.findings if node is None or f.node == node.id]
        return [f"- {f.fid} [{f.finding.aspect}, confidence {f.finding.confidence:.2f}] {f.finding.description[:300]}"
                for f in chosen[-self.findings_in_prompt:]]

    def _instruction(self, run: ResearchRun, node: ResearchNode, role: str) -> str:
        lines = [f"Research topic: {node.topic}"]
        if node.parent is not None:
            lines.append(f"This is a deeper look within: {run.nodes[node.parent].label} (prompted by {node.cause}).")
        if role == "researcher":
            known = self._known(run)
            if known:
                lines += ["Findings already known (do not repeat them):", *known]
            lines.append("Emit finding_emitted items: each one specific claim with its evidence, its sources, a "
                         "confidence (0 to 1), a severity (how much it matters), its aspect, and its novelty (0 well "
                         "known, 1 new).")
        elif role == "analyst":
            lines += ["Findings on this topic so far:", *(self._known(run, node) or ["- none yet"])]
            lines.append("Emit finding_emitted items for what follows from them (implications, patterns, "
                         "trade-offs), and one depth_requested for the narrower question that most deserves its own "
                         "deeper look.")
        else:
            lines += ["Findings on this topic so far:", *(self._known(run, node) or ["- none yet"])]
            lines.append("Emit contradiction_found where findings or their sources disagree (sources: the finding "
                         "ids), finding_emitted for weaknesses in the evidence, and depth_requested for a doubtful "
                         "claim that needs a closer look.")
        return "\n".join(lines)

    # -- the end --------------------------------------------------------------------------
    async def _synthesize(self, run: ResearchRun, *, partial_reason: str) -> str:
        """The exempt synthesizer's report over the retained findings (one chat turn)."""
        synthesizer = await run.make_agent("synthesizer", name="synthesizer", exempt=True,
                                           model=self.model_for("synthesizer"))
        lines = [f"Write a concise research report on: {run.topic}"]
        if partial_reason:
            lines.append(f"The research stopped early ({partial_reason}); report what the retained findings show "
                         "and what remains open.")
        lines.append("Cite finding ids. Retained findings:")
        for item in run.findings:
            finding = item.finding
            sources = f" (sources: {', '.join(item.sources[:5])})" if item.sources else ""
            lines.append(f"- {item.fid} [{finding.aspect}, {finding.severity}, confidence {finding.confidence:.2f}] "
                         f"{finding.description[:500]}{sources}")
        contradictions = run.by_type(ContradictionFound)
        if contradictions:
            lines.append("Contradictions:")
            lines += [f"- {', '.join(c.sources) or '?'}: {c.nature[:300]}" for c in contradictions]
        result = await run.turn(synthesizer, "\n".join(lines), operation="chat")
        return result.response if isinstance(result.response, str) else str(result.response)

    async def _partial_export(self, run: ResearchRun) -> str | None:
        """Only with evidence: the retained findings synthesised under a budget-exhausted status."""
        if not run.findings:
            return None
        reason = run.degrade_reason or run.exhausted_reason or "budget"
        synthesis = await self._synthesize(run, partial_reason=f"{reason} budget exhausted")
        return self.report(run, synthesis, status=f"budget exhausted ({reason}): partial research")

    def report(self, run: ResearchRun, synthesis: str, *, status: str = "") -> str:
        """The report: a status line, the synthesis, and the tree of findings and contradictions."""
        if not status and run.budget_hit:
            status = f"complete within budget ({run.exhausted_reason or 'budget'}; some deeper nodes were not explored)"
        status = status or "complete"
        merged = sum(f.merged for f in run.findings)
        contradictions = run.by_type(ContradictionFound)
        lines = [f"Research: {run.topic}",
                 f"Status: {status} · {len(run.nodes)} node(s) · {len(run.findings)} finding(s)"
                 + (f" ({merged} near-duplicate(s) merged)" if merged else "")
                 + f" · {len(contradictions)} contradiction(s) · {run.agents_made} agent(s)",
                 "", "Synthesis:", synthesis.strip() or "(empty)", "", "Findings tree:"]
        root = next((node for node in run.nodes.values() if node.parent is None), None)
        if root is not None:
            lines += self._tree(run, root, prefix="", last=True, top=True)
        return "\n".join(lines)

    def _tree(self, run: ResearchRun, node: ResearchNode, *, prefix: str, last: bool, top: bool = False) -> list[str]:
        branch = "" if top else ("└── " if last else "├── ")
        state = "" if node.status == "explored" else f" [{node.status}]"
        head = node.topic if top else node.label.rsplit(" › ", 1)[-1]
        detail = "" if top else f" — {node.topic[:120]}"
        lines = [f"{prefix}{branch}● {head}{state}{detail}"]
        inner = prefix + ("" if top else ("    " if last else "│   "))
        by_id = {f.fid: f for f in run.findings}
        for fid in node.findings:
            item = by_id[fid]
            finding = item.finding
            merged = f", +{item.merged} merged" if item.merged else ""
            lines.append(f"{inner}│ {fid} [{finding.aspect} · {finding.severity} · confidence {finding.confidence:.2f}"
                         f" · novelty {item.novelty:.2f}{merged}] {finding.description[:160]}")
            if item.sources:
                lines.append(f"{inner}│    sources: {', '.join(s[:80] for s in item.sources[:4])}")
        for role in TEAM:
            for contradiction in run.by_type(ContradictionFound, agent=f"{role}-{node.id}"):
                known = [ref for ref in contradiction.sources if ref in by_id]
                between = f" between {', '.join(known)}" if known else ""
                others = [ref for ref in contradiction.sources if ref not in by_id]
                sources = f" (sources: {', '.join(s[:80] for s in others[:4])})" if others else ""
                lines.append(f"{inner}│ ⚠ contradiction [{contradiction.severity}]{between}: "
                             f"{contradiction.nature[:200]}{sources}")
        for error in node.errors:
            lines.append(f"{inner}│ (team agent failed: {error})")
        for index, child in enumerate(node.children):
            lines += self._tree(run, run.nodes[child], prefix=inner, last=index == len(node.children) - 1)
        return lines
