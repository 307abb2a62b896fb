"""ReviewEngine end to end: concurrent dimensions, verifiers per serious issue location, exempt verdict, gate.

    reviewer-correctness ─┬─ issue (major, a.py:3) ──> verifier-1 ─┐
    reviewer-security ────┤  issue (major, a.py:3) ──> (same location: no second verifier)
    reviewer-... ─────────┘  issue (minor)  ──> no verifier        ├─> verdict (exempt) -> evidence gate
"""

from __future__ import annotations

import openai_server as srv
import pytest
from engine_scripts import HANG, ByAgent, js, kinds
from running import run_engine as run

from opgraph.actors.models import ProviderUnavailable
from opgraph.actors.providers import OpenAICompatibleProvider, SimulatedProvider
from opgraph.engines import (
    DimensionReviewed,
    EngineInputError,
    IssueFound,
    ReviewEngine,
    ReviewVerdict,
    VerifyResult,
)

pytestmark = pytest.mark.ray

CODE = "def load(path):\n    return eval(open(path).read())\n"


def issues(*items, dimension="x"):
    return js({"issue_found": [{"description": d, "dimension": dimension, "location": loc, "severity": sev}
                               for d, loc, sev in items],
               "dimension_reviewed": [{"dimension": dimension, "summary": "looked"}]})


CLEAN = js({"issue_found": [], "dimension_reviewed": [{"dimension": "x", "summary": "nothing found"}]})
APPROVE = js({"review_verdict": [{"verdict": "approve", "rationale": "fine"}]})
HOLDS = js({"verify_result": [{"issue": "a.py:2", "holds": True, "rationale": "eval of file text"}]})


def script(**replies):
    base = {"reviewer-correctness": CLEAN, "reviewer-security": CLEAN, "reviewer-performance": CLEAN,
            "reviewer-maintainability": CLEAN, "verifier": HOLDS, "verdict": APPROVE}
    base.update({name.replace("_", "-"): reply for name, reply in replies.items()})
    return ByAgent(base)


def test_reviews_every_dimension_then_one_exempt_verdict(session, model):
    result = run(ReviewEngine(model=model(script())).run(CODE, session=session))
    assert result.run.final_verdict == "approve" and not result.degraded
    reviewed = {name for name in result.run.reviewers.values()}
    assert reviewed == {"reviewer-correctness", "reviewer-security", "reviewer-performance",
                        "reviewer-maintainability"}
    assert len(result.run.by_type(DimensionReviewed)) == 4
    assert result.run.agents["verdict"].exempt and result.run.agents_made == 5
    assert result.startswith("Review verdict: approve")


def test_a_serious_issue_gets_one_adversarial_verifier_per_location(session, model):
    serious = issues(("eval of file text", "a.py:2", "major"))
    replies = script(reviewer_correctness=serious, reviewer_security=serious,
                     reviewer_maintainability=issues(("long line", "a.py:1", "minor")))
    result = run(ReviewEngine(model=model(replies)).run(CODE, session=session))
    assert list(result.run.to_verify) == ["a.py:2"]  # de-duplicated by location; minor not verified
    assert list(result.run.verifiers.values()) == ["verifier-1"]
    assert result.run.verification("a.py:2").holds is True


def test_all_verifiers_finish_before_the_verdict_turn(session, model, sink):
    serious = issues(("one", "a.py:1", "critical"), ("two", "a.py:2", "major"))
    result = run(ReviewEngine(model=model(script(reviewer_security=serious)), event_sink=sink)
                 .run(CODE, session=session))
    order = [r.agent for r in sink.records[result.run.run_id] if r.type == "VerifyResult" or
             (r.type == "agent_created" and r.agent == "verdict")]
    assert order == ["verifier-1", "verifier-2", "verdict"] or order == ["verifier-2", "verifier-1", "verdict"]


def test_the_gate_downgrades_an_approval_when_a_dimension_produced_nothing(session, model, sink):
    replies = script(reviewer_performance="I had a look; all good.")  # prose twice: no emission
    result = run(ReviewEngine(model=model(replies), event_sink=sink).run(CODE, session=session))
    assert result.run.verdict.verdict == "approve" and result.run.final_verdict == "inconclusive"
    assert result.run.gate_reasons == ["dimension performance produced no evidence"]
    assert kinds(sink, result.run, "evidence_gate")[0].data["final_verdict"] == "inconclusive"
    assert result.skipped == ["reviewer-performance x2"]


def test_the_gate_downgrades_an_approval_over_an_unverified_major_issue(session, model):
    replies = script(reviewer_security=issues(("eval", "a.py:2", "major")), verifier="cannot say")
    result = run(ReviewEngine(model=model(replies)).run(CODE, session=session))
    assert result.run.final_verdict == "inconclusive"
    assert result.run.gate_reasons == ["major issue at a.py:2 was not verified"]


@pytest.mark.parametrize("severity", ["critical", "major", "High"])
def test_the_gate_refuses_an_approval_over_a_verified_serious_issue(session, model, sink, severity):
    """reviewer-security -> [severity] issue -> verifier: holds -> verdict: approve -> gate: request_changes.

    An issue the adversarial verifier confirmed is evidence against approval; the
    verdict turn's approve is downgraded and the result says why. "High" is a synonym of
    major (models use both), so it is verified and gated the same way.
    """
    replies = script(reviewer_security=issues(("eval of file text", "a.py:2", severity)))
    result = run(ReviewEngine(model=model(replies), event_sink=sink).run(CODE, session=session))
    assert result.run.verification("a.py:2").holds is True
    assert result.run.verdict.verdict == "approve"
    assert result.run.final_verdict == "request_changes"
    normal = "major" if severity == "High" else severity
    assert result.run.gate_reasons == [f"verified {normal} issue at a.py:2 is open: an approval cannot stand"]
    assert result.startswith("Review verdict: request_changes")
    assert "the evidence gate changed it" in result.text and "verified " + normal in result.text
    assert kinds(sink, result.run, "evidence_gate")[0].data["final_verdict"] == "request_changes"


def test_the_gate_keeps_an_approval_when_the_verifier_refutes_the_issue(session, model):
    refuted = js({"verify_result": [{"issue": "a.py:2", "holds": False, "rationale": "input is trusted"}]})
    replies = script(reviewer_security=issues(("eval of file text", "a.py:2", "critical")), verifier=refuted)
    result = run(ReviewEngine(model=model(replies)).run(CODE, session=session))
    assert result.run.final_verdict == "approve" and result.run.gate_reasons == []


def test_the_gate_keeps_a_rejection(session, model):
    reject = js({"review_verdict": [{"verdict": "reject", "blocking": ["eval"]}]})
    replies = script(reviewer_security=issues(("eval", "a.py:2", "major")), verifier="cannot say",
                     verdict=reject)
    result = run(ReviewEngine(model=model(replies)).run(CODE, session=session))
    assert result.run.final_verdict == "reject" and result.run.gate_reasons == []


def test_no_verdict_emission_is_inconclusive(session, model):
    result = run(ReviewEngine(model=model(script(verdict="no JSON here"))).run(CODE, session=session))
    assert result.run.final_verdict == "inconclusive" and result.run.gate_reasons[0] == "no verdict was emitted"


def test_a_dimension_failure_cancels_verifiers_and_propagates(session, model, sink):
    replies = script(reviewer_security=issues(("eval", "a.py:2", "major")), verifier=HANG,
                     reviewer_performance=ProviderUnavailable("reviewer down", provider="x"))
    engine = ReviewEngine(model=model(replies), event_sink=sink)
    with pytest.raises(ExceptionGroup):
        run(engine.run(CODE, session=session))
    (run_id,) = sink.runs
    assert sink.runs[run_id]["status"] == "failed"


def test_out_of_agents_the_review_exports_its_partial_evidence(session, model):
    replies = script(reviewer_security=issues(("eval", "a.py:2", "major")))
    result = run(ReviewEngine(model=model(replies), max_agents=4).run(CODE, session=session))
    assert result.degraded and result.degrade_reason == "budget"
    assert "UNVERIFIED" in result.text or "Review stopped early" in result.text


def test_empty_code_is_refused_before_any_agent(session):
    with pytest.raises(EngineInputError):
        run(ReviewEngine().run("  \n", session=session))


def test_duplicate_or_empty_dimensions_are_refused():
    with pytest.raises(EngineInputError):
        ReviewEngine(dimensions=("security", "security"))
    with pytest.raises(EngineInputError):
        ReviewEngine(dimensions=())


def test_review_on_sim_with_four_dimensions_and_twenty_issues(session):
    session.register_provider("sim", SimulatedProvider(latency=0.0, list_items=5, seed=5))
    result = run(ReviewEngine().run(CODE, session=session))
    found = result.run.by_type(IssueFound)
    assert len(found) == 20 and len(result.run.reviewers) == 4
    serious = [i for i in found if i.severity in ("critical", "major")]
    assert len(result.run.verifiers) == len(serious) and len(result.run.by_type(VerifyResult)) == 5 * len(serious)
    assert result.run.by_type(ReviewVerdict) and result.run.agents_made == 4 + len(serious) + 1


def test_review_repairs_malformed_sim_replies(session):
    session.register_provider("sim", SimulatedProvider(latency=0.0, malformed_rate=0.5, seed=11))
    result = run(ReviewEngine().run(CODE, session=session))
    malformed = result.run.events.notifications("emission_malformed")
    assert malformed, "a 0.5 malformed rate must break some replies"
    assert result.run.final_verdict in ("approve", "request_changes", "reject", "inconclusive")


def test_review_runs_against_an_openai_compatible_server(session):
    with srv.OpenAIChatServer() as server:
        session.register_provider("loop", OpenAICompatibleProvider(base_url=server.base_url, api_key="sk-test",
                                                                   name="loop", max_retries=1, backoff=0.01))
        result = run(ReviewEngine(model="loop/structured").run(CODE, session=session))
        assert server.handler_errors == []
        names = [r.body["response_format"]["json_schema"]["name"] for r in server.requests]
    assert len(result.run.by_type(DimensionReviewed)) == 4 and result.run.verdict is not None
    assert names.count("EmissionsIssueFoundDimensionReviewed") == 4
