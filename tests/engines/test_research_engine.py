"""ResearchEngine end to end: a novelty-bounded tree of teams, merged near-duplicates, an exempt synthesizer.

    n1 "topic": researcher -> analyst -> critic
        ├── F (novelty > 0.7, distinct) ──> n2 (depth 1): researcher -> analyst -> critic
        └── depth_requested ─────────────> n3 (depth 1) ...      (while depth < max_depth)
    every node done -> synthesizer (exempt) -> report (status, synthesis, tree, contradictions)
"""

from __future__ import annotations

import re

import pytest
from engine_scripts import ByAgent, js, kinds, last_user
from running import run_engine as run

from opgraph.actors.models import ProviderUnavailable
from opgraph.actors.providers import SimulatedProvider
from opgraph.engines import (
    ContradictionFound,
    EngineInputError,
    FindingEmitted,
    ResearchEngine,
)
from opgraph.engines.research import similarity, topic_key

pytestmark = pytest.mark.ray

TOPIC = "solid-state batteries"


def finding(description, novelty=0.2, sources=("https://example.org/a",), aspect="mechanism", depth=0, **more):
    return {"description": description, "novelty": novelty, "sources": list(sources), "aspect": aspect,
            "depth": depth, "confidence": 0.7, "severity": "major", **more}


def topic_of(request):
    found = re.search(r"Research topic: (.*)", last_user(request))
    return found.group(1) if found else ""


def per_topic(replies, default):
    """A reply chosen by the node's topic (the instruction's first line)."""
    def reply(request):
        chosen = replies.get(topic_of(request), default)
        return chosen(request) if callable(chosen) else chosen
    return reply


def nothing_new(request):
    return js({"finding_emitted": [finding(f"a plain fact about {topic_of(request)}")]})


QUIET = {"researcher": nothing_new,
         "analyst": js({"finding_emitted": [finding("it follows from the facts")], "depth_requested": []}),
         "critic": js({"contradiction_found": [], "finding_emitted": [finding("the evidence is thin")],
                       "depth_requested": []}),
         "synthesizer": "the report"}


def script(**replies):
    base = dict(QUIET)
    base.update(replies)
    return ByAgent(base)


def test_similarity_is_a_token_set_jaccard_over_content_words():
    assert similarity("Solid electrolytes improve safety.", "the safety of solid electrolytes improves") == 1.0
    assert similarity("lithium dendrites", "sulfide electrolytes") == 0.0
    assert 0.3 < similarity("dendrites pierce thin separators", "dendrites pierce ceramic layers") < 0.5
    assert topic_key("Battery  Safety") == topic_key("safety of the batteries")


def test_a_team_in_turn_then_a_novel_finding_and_a_depth_request_open_deeper_nodes(session, model, sink):
    researcher = per_topic({TOPIC: js({"finding_emitted": [
        finding("sulfide electrolytes conduct lithium ions as fast as liquids", novelty=0.9, depth=7),
        finding("cells need stack pressure to keep contact", novelty=0.3)]})}, nothing_new)
    analyst = per_topic({TOPIC: js({"finding_emitted": [], "depth_requested": [
        {"question": "how do dendrites grow through ceramic separators", "aspect": "risks", "parent_depth": 5}]})},
        QUIET["analyst"])
    critic = per_topic({TOPIC: js({"contradiction_found": [{"sources": ["F1", "F2"], "nature": "rates disagree",
                                                             "severity": "High"}],
                                   "finding_emitted": [], "depth_requested": []})}, QUIET["critic"])
    engine = ResearchEngine(model=model(script(researcher=researcher, analyst=analyst, critic=critic)),
                            event_sink=sink)
    result = run(engine.run(f"  {TOPIC} ", session=session))
    research = result.run
    assert not result.degraded and result.skipped == []
    root, novel, asked = research.nodes["n1"], research.nodes["n2"], research.nodes["n3"]
    assert root.topic == TOPIC and root.children == ["n2", "n3"] and root.status == "explored"
    assert (novel.depth, novel.cause, novel.label) == (1, "F1", f"{TOPIC} › mechanism")
    assert novel.topic == "sulfide electrolytes conduct lithium ions as fast as liquids"
    assert (asked.depth, asked.label) == (1, f"{TOPIC} › risks") and asked.cause.startswith("depth requested")
    # depth is the engine's, never the model's; severities are normalised
    assert {f.depth for f in research.by_type(FindingEmitted, agent="researcher-n1")} == {0}
    assert research.by_type(ContradictionFound)[0].severity == "major"
    # the team ran in turn: researcher, analyst, critic, on each node
    created = [r.agent for r in kinds(sink, research, "agent_created")]
    assert [name for name in created if name.endswith("-n1")] == ["researcher-n1", "analyst-n1", "critic-n1"]
    assert created.index("researcher-n2") < created.index("critic-n1")  # a child starts as soon as it is found
    assert research.agents["synthesizer"].exempt and research.agents_made == 3 * 3 + 1
    assert result.text.startswith(f"Research: {TOPIC}\nStatus: complete · 3 node(s)")
    assert "the report" in result.text and "└── ● risks — how do dendrites grow" in result.text
    assert "│ ⚠ contradiction [major] between F1, F2: rates disagree" in result.text


def test_novelty_is_bounded_by_the_threshold_and_by_similarity_to_what_is_retained(session, model):
    researcher = per_topic({TOPIC: js({"finding_emitted": [
        finding("anode free cells plate lithium directly on copper", novelty=0.95),
        finding("anode free cells plate lithium directly on nickel foil", novelty=0.95),  # similar: novelty capped
        finding("garnet oxides resist air", novelty=0.6)]})}, nothing_new)  # under the threshold
    engine = ResearchEngine(model=model(script(researcher=researcher)))
    result = run(engine.run(TOPIC, session=session))
    research = result.run
    assert [node.cause for node in research.nodes.values()] == ["topic", "F1"]
    capped = next(f for f in research.findings if "nickel" in f.finding.description)
    assert capped.novelty == pytest.approx(1 - similarity(capped.finding.description, research.findings[0]
                                                          .finding.description), abs=1e-3)


def test_near_duplicate_findings_are_merged_by_the_novelty_check(session, model, sink):
    researcher = per_topic({TOPIC: js({"finding_emitted": [
        finding("Solid electrolytes improve safety.", sources=["a"]),
        finding("the safety of solid electrolytes improves", sources=["b"]),
        finding("costs stay high", sources=["c"])]})}, nothing_new)
    engine = ResearchEngine(model=model(script(researcher=researcher)), event_sink=sink)
    result = run(engine.run(TOPIC, session=session))
    research = result.run
    safety = research.findings[0]
    assert safety.merged == 1 and safety.sources == ["a", "b"]
    assert [f.finding.description for f in research.findings if f.agent == "researcher-n1"] == [
        "Solid electrolytes improve safety.", "costs stay high"]
    (merged,) = kinds(sink, research, "finding_merged")
    assert merged.data["into"] == "F1" and merged.data["similarity"] == 1.0
    assert len(research.by_type(FindingEmitted, agent="researcher-n1")) == 3  # what arrived is recorded


def test_a_topic_is_explored_once_and_depth_stops_at_max_depth(session, model, sink):
    def analyst(request):
        topic = topic_of(request)
        question = {TOPIC: "the batteries solid-state",  # the root's topic again, reworded
                    }.get(topic, f"deeper into {topic}")
        return js({"finding_emitted": [], "depth_requested": [{"question": question, "aspect": "evidence"},
                                                               {"question": f"next after {topic}"}]})

    engine = ResearchEngine(model=model(script(analyst=analyst)), max_depth=2, event_sink=sink)
    result = run(engine.run(TOPIC, session=session))
    research = result.run
    assert max(node.depth for node in research.nodes.values()) == 2
    stopped = [r.data["reason"] for r in kinds(sink, research, "deepening_stopped")]
    assert "topic_seen" in stopped and "max_depth" in stopped
    keys = [topic_key(node.topic) for node in research.nodes.values()]
    assert len(keys) == len(set(keys))


def test_a_team_agent_error_is_recorded_and_the_team_continues(session, model, sink):
    replies = script(researcher=ProviderUnavailable("search service down", provider="x", status=503))
    result = run(ResearchEngine(model=model(replies), event_sink=sink).run(TOPIC, session=session))
    research = result.run
    (error,) = kinds(sink, research, "agent_error")
    assert error.agent == "researcher-n1" and error.data["error_type"] == "ProviderUnavailable"
    assert research.nodes["n1"].status == "partial" and research.nodes["n1"].errors
    assert [f.agent for f in research.findings] == ["analyst-n1", "critic-n1"]  # the team went on
    assert "team agent failed: researcher-n1" in result.text and result.run.status == "completed"


def test_an_empty_topic_is_refused_before_any_run_state(session, sink):
    engine = ResearchEngine(event_sink=sink)
    for topic in ("", "   \n\t"):
        with pytest.raises(EngineInputError, match="non-empty topic"):
            run(engine.run(topic, session=session))
    assert sink.runs == {}


def test_out_of_budget_the_retained_findings_are_synthesised_under_a_budget_status(session, model, sink):
    """max_agents 2: researcher-n1 and analyst-n1 run, critic-n1 is refused at the root:
    the partial export synthesises the two retained findings with an exempt agent."""
    analyst = js({"finding_emitted": [finding("interfaces degrade over cycles")], "depth_requested": []})
    engine = ResearchEngine(model=model(script(analyst=analyst, synthesizer="what we know so far")), max_agents=2,
                            event_sink=sink)
    result = run(engine.run(TOPIC, session=session))
    assert result.degraded and result.degrade_reason == "budget"
    assert result.text.startswith(f"Research: {TOPIC}\nStatus: budget exhausted (budget): partial research")
    assert "what we know so far" in result.text and len(result.run.findings) == 2
    assert result.run.agents["synthesizer"].exempt and result.run.agents_made == 3


def test_out_of_budget_without_findings_there_is_no_synthesis_call(session, model, sink):
    engine = ResearchEngine(model=model(script(researcher="nothing useful, in prose")), max_agents=1,
                            event_sink=sink)
    result = run(engine.run(TOPIC, session=session))
    assert result.degraded and result.text == "" and result.skipped == ["researcher-n1 x2"]
    assert "synthesizer" not in result.run.agents and result.run.agents_made == 1


def test_a_judge_error_fails_open_and_a_rejection_prunes_the_node(session, model, sink):
    analyst = per_topic({TOPIC: js({"finding_emitted": [],
                                    "depth_requested": [{"question": "a narrower question"}]})},
                        QUIET["analyst"])
    replies = script(analyst=analyst)
    failing = model(ByAgent(default=ProviderUnavailable("judge down", provider="x", status=503)))
    opened = run(ResearchEngine(model=model(replies), judge_model=failing).run(TOPIC, session=session))
    assert opened.run.nodes["n2"].status == "explored"
    rejecting = model(ByAgent(default="I reject this expansion."))
    pruned = run(ResearchEngine(model=model(replies), judge_model=rejecting).run(TOPIC, session=session))
    assert pruned.run.nodes["n2"].status == "judged_out" and "[judged_out]" in pruned.text


def test_concurrent_judgements_share_one_judge_agent(session, model, sink):
    asks = [{"question": f"narrower question {index}"} for index in range(3)]
    analyst = per_topic({TOPIC: js({"finding_emitted": [], "depth_requested": asks})}, QUIET["analyst"])
    engine = ResearchEngine(model=model(script(analyst=analyst)), judge_model=model(ByAgent(default="go ahead")),
                            event_sink=sink)
    result = run(engine.run(TOPIC, session=session))
    assert [n.status for n in result.run.nodes.values()] == ["explored"] * 4
    assert [r.agent for r in kinds(sink, result.run, "agent_created")].count("judge") == 1
    assert len(kinds(sink, result.run, "judged")) == 3


def test_research_on_sim_grows_a_tree_of_typed_findings(session):
    session.register_provider("sim", SimulatedProvider(latency=0.0, seed=5))
    # sim/'s findings read as distinct sentences, so few merge and the tree branches wide:
    # room for a whole three-level tree, so the run completes instead of filling its bound.
    result = run(ResearchEngine(max_agents=200).run(TOPIC, session=session))
    research = result.run
    assert not result.degraded and result.skipped == []
    assert len(research.nodes) > 3 and max(node.depth for node in research.nodes.values()) == 3
    assert len(research.findings) >= 2 * len(research.nodes)
    assert all(f.finding.aspect in ("background", "mechanism", "evidence", "performance", "limitations", "risks",
                                    "costs", "applications", "alternatives", "open questions")
               for f in research.findings)
    assert research.agents_made <= 200 and "Findings tree:" in result.text


def test_the_progress_line_names_the_exempt_synthesizer_beside_a_spent_agent_bound(session, model):
    """The bound spent (2/2), the budget-exempt synthesizer still runs: it is named, never an overrun (3/2)."""
    import io

    from rich.console import Console

    from opgraph.cluster.cli.engine import EngineProgress

    analyst = js({"finding_emitted": [finding("interfaces degrade over cycles")], "depth_requested": []})
    engine = ResearchEngine(model=model(script(analyst=analyst)), max_agents=2)
    screen = io.StringIO()
    progress = EngineProgress(console=Console(file=screen, width=400), live=False)
    run_ = engine.new_run(session=session, on_event=progress)
    progress.attach(run_)
    result = run(engine.execute(run_, TOPIC))
    assert result.degraded and result.run.agents_made == 3 and result.run.agents["synthesizer"].exempt
    assert progress.budget_line().startswith("agents 2/2 + synthesizer · tokens ")
    finished = [line for line in screen.getvalue().splitlines() if " run_finished " in line]
    assert len(finished) == 1 and "[agents 2/2 + synthesizer · tokens " in finished[0], screen.getvalue()
    assert "agents 3/2" not in screen.getvalue()
