"""HypothesisEngine end to end: an event-reference chain with engine-assigned eids, pending experiments, guards.

    seed -> F1 --questioner--> Q1 --investigator--> E1, H1 -> X1 (executable?) --runner--> R1
              --analyst--> C1 -> A1 + follow-up Q (generation derived from C1's question)
    X whose method needs the world -> run.pending (not a failure)
    all chains quiet -> synthesizer (exempt) -> report
"""

from __future__ import annotations

import pytest
from engine_scripts import HANG, ByAgent, js, kinds, last_user
from running import run_engine as run

from opgraph.actors.models import ProviderUnavailable
from opgraph.actors.providers import SimulatedProvider
from opgraph.engines import (
    ApplicationMapped,
    ConclusionDrawn,
    EngineInputError,
    EvidenceCollected,
    ExperimentDesigned,
    FindingPosted,
    HypothesisEngine,
    HypothesisFormed,
    QuestionRaised,
    ResultRecorded,
)
from opgraph.engines.hypothesis import normal_seeds

pytestmark = pytest.mark.ray

SEED = "sodium-ion cells lose capacity fast below -10 C"


def question(text="why does capacity fall", **more):
    return {"area": "electrochemistry", "what_is_unknown": text, **more}


def questioner(*texts):
    return js({"question_raised": [question(text, parent="F99", generation=5) for text in texts]})


def investigator(method="simulation"):
    def reply(request):
        text = last_user(request)
        if "Collect the evidence" in text:
            return js({"evidence_collected": [{"summary": "electrolyte viscosity rises", "sources": ["doi:1"],
                                               "strength": 0.7, "question": "Q99", "eid": "Z1"}]})
        if "Form testable hypotheses" in text:
            return js({"hypothesis_formed": [{"statement": "viscosity limits ion transport", "metric": "ionic "
                                              "conductivity", "threshold": "halves at -10 C", "falsifier":
                                              "conductivity unchanged"}]})
        return js({"experiment_designed": [{"method": method, "dataset": "published cell data", "procedure":
                                            "model conductivity against temperature", "acceptance": "fit r2 > 0.9",
                                            "hypothesis": "H42"}]})
    return reply


def analyst(*follow_ups):
    def reply(request):
        if "conclusion_drawn" in last_user(request):
            return js({"conclusion_drawn": [{"basis": "the model fits", "confidence": 0.8, "limitations": "one "
                                             "chemistry", "question": "Q7", "result": "R7"}]})
        return js({"application_mapped": [{"effect": "pre-heat packs below -10 C", "conclusion": "C9"}],
                   "question_raised": [question(text) for text in follow_ups]})
    return reply


RESULT = js({"result_recorded": [{"measurements": ["r2 = 0.94"], "passed": True, "caveats": "simulated"}]})


def script(**replies):
    base = {"questioner": questioner("why does capacity fall"), "investigator": investigator(),
            "runner": RESULT, "analyst": analyst(), "synthesizer": "what was established"}
    base.update(replies)
    return ByAgent(base)


def test_a_seed_becomes_a_chain_of_linked_events_with_engine_assigned_eids(session, model, sink):
    engine = HypothesisEngine(model=model(script()), event_sink=sink)
    result = run(engine.run([SEED], session=session))
    chain = result.run
    assert not result.degraded and result.skipped == []
    assert list(chain.chain) == ["F1", "Q1", "E1", "H1", "X1", "R1", "C1", "A1"]
    (q,) = chain.by_type(QuestionRaised)
    assert (q.eid, q.parent, q.generation) == ("Q1", "F1", 0)  # the model said F99, generation 5
    assert chain.by_type(EvidenceCollected)[0].question == "Q1"  # the model said Q99, eid Z1
    assert chain.by_type(HypothesisFormed)[0].question == "Q1"
    assert chain.by_type(ExperimentDesigned)[0].hypothesis == "H1"
    assert chain.by_type(ResultRecorded)[0].experiment == "X1"
    conclusion = chain.by_type(ConclusionDrawn)[0]
    assert (conclusion.question, conclusion.result) == ("Q1", "R1")
    assert chain.by_type(ApplicationMapped)[0].conclusion == "C1"
    assert chain.by_type(FindingPosted)[0].description == SEED and chain.pending == {}
    assert chain.agents["synthesizer"].exempt
    assert [r.agent for r in kinds(sink, chain, "agent_created")] == [
        "questioner-F1", "investigator-Q1", "runner-X1", "analyst-R1", "synthesizer"]
    assert result.text.startswith("Hypotheses from 1 seed finding(s)\nStatus: complete · 1 question(s)")
    assert "what was established" in result.text
    assert "            └── C1 conclusion (confidence 0.80): the model fits" in result.text


def test_an_experiment_that_cannot_be_executed_stays_pending_not_failed(session, model, sink):
    engine = HypothesisEngine(model=model(script(investigator=investigator("lab experiment"))), event_sink=sink)
    result = run(engine.run([SEED], session=session))
    chain = result.run
    assert list(chain.pending) == ["X1"] and chain.pending["X1"].method == "lab experiment"
    assert not chain.by_type(ResultRecorded) and "runner-X1" not in chain.agents
    assert not result.degraded and chain.status == "completed" and chain.stage_errors == []
    assert kinds(sink, chain, "experiment_pending")[0].data["experiment"] == "X1"
    assert "PENDING: not executable here" in result.text and "- X1 [lab experiment] for H1" in result.text


def test_questions_are_capped_per_generation_and_generations_are_derived_and_capped(session, model, sink):
    """max_questions 2, max_depth 1: generation 0 takes 2 of 3 questions; every conclusion
    asks two follow-ups, generation 1 (quota 1) takes one; a follow-up of generation 1 is
    capped at generation 1, whose quota is spent, so it is dropped."""
    replies = script(questioner=questioner("one", "two", "three"), analyst=analyst("more?", "and more?"))
    engine = HypothesisEngine(model=model(replies), max_questions=2, max_depth=1, event_sink=sink)
    result = run(engine.run(SEED, session=session))
    questions = result.run.by_type(QuestionRaised)
    assert sorted((q.generation, q.parent[0]) for q in questions) == [(0, "F"), (0, "F"), (1, "C")]
    dropped = kinds(sink, result.run, "question_dropped")
    assert [d.data["generation"] for d in dropped].count(0) == 1
    assert all(d.data["quota"] == (2 if d.data["generation"] == 0 else 1) for d in dropped)
    assert len(dropped) == 1 + 5  # one over generation 0's quota; of 3 conclusions' 6 follow-ups, 5 over quota
    assert max(q.generation for q in questions) == 1


def test_a_stage_error_is_announced_and_leaves_unrelated_chains_running(session, model, sink):
    def failing_for_one(request):
        if "capacity" in last_user(request):
            return ProviderUnavailable("evidence service down", provider="x", status=503)
        return investigator()(request)

    replies = script(questioner=questioner("why does capacity fall", "why do anodes swell"),
                     investigator=failing_for_one)
    result = run(HypothesisEngine(model=model(replies), event_sink=sink).run([SEED], session=session))
    chain = result.run
    (error,) = kinds(sink, chain, "stage_error")
    assert error.data["stage"] == "investigation" and error.data["error_type"] == "ProviderUnavailable"
    broken = error.data["ref"]
    assert chain.links(EvidenceCollected, question=broken) == []
    assert len(chain.by_type(ConclusionDrawn)) == 1  # the other chain went all the way
    assert chain.status == "completed" and "Stage errors (each ended its own chain only):" in result.text


@pytest.mark.parametrize("seeds", [[], ["  ", "\n\t"], "   ", None, [3]])
def test_an_empty_normalised_seed_list_is_refused_before_any_run_state(session, sink, seeds):
    with pytest.raises(EngineInputError, match="at least one non-empty seed"):
        run(HypothesisEngine(event_sink=sink).run(seeds, session=session))
    assert sink.runs == {}


def test_seeds_are_normalised_and_de_duplicated():
    assert normal_seeds(["  a  b ", "A B", "", "c"]) == ["a b", "c"]
    assert normal_seeds("one seed") == ["one seed"]


def test_cut_off_by_the_deadline_the_chain_so_far_is_synthesised_under_a_budget_status(session, model):
    engine = HypothesisEngine(model=model(script(runner=HANG, synthesizer="partial view")), deadline_s=2.0)
    result = run(engine.run([SEED], session=session))
    assert result.degraded and result.degrade_reason == "deadline"
    assert "Status: budget exhausted (deadline): partial chain" in result.text and "partial view" in result.text
    assert list(result.run.chain) == ["F1", "Q1", "E1", "H1", "X1"]


def test_cut_off_without_evidence_there_is_no_synthesis_call(session, model):
    engine = HypothesisEngine(model=model(script(questioner=HANG)), deadline_s=1.0)
    result = run(engine.run([SEED], session=session))
    assert result.degraded and result.text == "" and "synthesizer" not in result.run.agents


def test_hypothesis_on_sim_links_every_chain(session):
    session.register_provider("sim", SimulatedProvider(latency=0.0, seed=9))
    result = run(HypothesisEngine().run([SEED, "graphite anodes swell"], session=session))
    chain = result.run
    assert not result.degraded and chain.counters["F"] == 2 and chain.counters["Q"] >= 2
    for event in chain.chain.values():
        for reference in ("parent", "question", "hypothesis", "experiment", "result", "conclusion"):
            target = getattr(event, reference, None)
            assert target is None or target in chain.chain, (event.eid, reference, target)
    assert all(x.method not in ("literature review", "data analysis", "simulation", "computation")
               for x in chain.pending.values())
