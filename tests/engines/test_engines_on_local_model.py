"""Each new engine once against a real model: SmolLM2-135M (`local/smollm2`, the `local` extra).

    research    one node, its team of three, the exempt synthesizer      (4 model calls)
    review      one dimension, no verifier (the bound), the exempt verdict (2 calls)
    hypothesis  the questioner of one seed, its chains refused (the bound), the synthesizer (2 calls)
    coding      planner, implementer, one fix round, a real pytest gate   (3 calls, 2 test runs)

(planning's smoke test is in tests/actors/test_local_model.py, on the served model.)

A model this small writes poor content, and under constrained decoding it often fills a list
until max_tokens cuts it off. So these tests assert structure, never wording: the typed
result with a status the engine documents; every missed emission (a reply cut off is one) a
skipped diagnostic with the run degraded `emission_failure`, never a fabricated event nor a
failed run; the bounds held; the tokens the run counted are llama.cpp's own. Every reply is
capped at MAX_TOKENS and no engine repairs (repair_retries 0), so the model calls are few.
"""

from __future__ import annotations

import pytest
from coding_fixtures import BROKEN, PYTEST, make_project, snapshot
from components import require
from running import run_engine as run

from opgraph.actors.providers import LocalModelProvider
from opgraph.engines import (
    DEGRADE_REASONS,
    CodeResultRecorded,
    CodingEngine,
    ContradictionFound,
    DepthRequested,
    FindingEmitted,
    HypothesisEngine,
    QuestionRaised,
    ResearchEngine,
    ReviewEngine,
)
from opgraph.engines.coding import VERDICTS as CODING_VERDICTS
from opgraph.engines.review import INCONCLUSIVE
from opgraph.engines.review import VERDICTS as REVIEW_VERDICTS

pytestmark = pytest.mark.ray

MODEL = "local/smollm2"
MAX_TOKENS = 32  # every reply's cap: this model's structured replies run longer, so are cut off (the point)


@pytest.fixture
def local(session):
    """``local/`` on the shared session, each reply capped (the session's providers are restored after)."""
    require("local-model")
    session.register_provider("local", LocalModelProvider(max_tokens=MAX_TOKENS))
    return session


def assert_counted_from_the_model(run_, calls: int) -> None:
    """The run counted ``calls`` calls of llama.cpp, with its own token counts, within the cap."""
    budget = run_.budget.snapshot()
    counted = budget["by_model"][MODEL]
    assert budget["calls"] == counted["calls"] == calls, budget
    assert budget["estimated_tokens"] == 0  # reported by the model, none estimated
    assert counted["prompt_tokens"] > 100 * calls  # a role profile and an instruction each time
    assert 0 <= counted["completion_tokens"] <= MAX_TOKENS * calls
    assert budget["tokens_used"] == counted["prompt_tokens"] + counted["completion_tokens"]


def assert_honest_degradation(result, *, budget: bool = False) -> None:
    """Degraded exactly when an emission was missed (or a bound refused work), and saying which."""
    missed = [record.agent for record in result.run.events.notifications("emission_missing")]
    assert sorted(f"{name} x1" for name in missed) == sorted(result.skipped)
    expected = "budget" if budget else ("emission_failure" if result.skipped else "")
    assert result.degrade_reason == expected and result.degraded == bool(expected)
    assert expected == "" or expected in DEGRADE_REASONS


def test_research_on_smollm2_completes_one_node_with_its_team_and_the_exempt_synthesizer(local):
    engine = ResearchEngine(model=MODEL, max_depth=0, max_agents=3, max_concurrent=1, repair_retries=0)
    result = run(engine.run("green tea", session=local))
    research = result.run
    assert research.status == result.run.status in ("completed", "degraded")
    assert list(research.agents) == ["researcher-n1", "analyst-n1", "critic-n1", "synthesizer"]
    assert research.budget.snapshot()["exempt_agents"] == ["synthesizer"]
    root = research.nodes["n1"]
    assert list(research.nodes) == ["n1"] and root.status == "explored"  # max_depth 0: no deeper node
    for member in ("researcher-n1", "analyst-n1", "critic-n1"):  # each one emitted, or is a skipped diagnostic
        emitted = any(research.by_type(kind, agent=member) for kind in (FindingEmitted, DepthRequested,
                                                                        ContradictionFound))
        assert emitted != (f"{member} x1" in result.skipped), (member, result.skipped)
    assert_honest_degradation(result)
    assert result.text.startswith("Research: green tea\nStatus: complete · 1 node(s) · ")
    assert "Synthesis:" in result.text and "Findings tree:\n● green tea" in result.text
    assert_counted_from_the_model(research, calls=4)


def test_review_on_smollm2_reaches_a_verdict_the_gate_accepts_or_states_why_not(local):
    engine = ReviewEngine(model=MODEL, dimensions=("correctness",), max_agents=1, repair_retries=0)
    result = run(engine.run(BROKEN, session=local))
    review = result.run
    assert review.final_verdict in (*REVIEW_VERDICTS, INCONCLUSIVE)
    assert review.agents["verdict"].exempt and review.verifier_count == 0  # the bound left no verifier
    if review.verdict is None:
        assert review.final_verdict == INCONCLUSIVE and review.gate_reasons[0] == "no verdict was emitted"
    elif review.final_verdict != review.verdict.verdict:  # the gate changed it, and says why
        assert review.gate_reasons
    assert result.text.startswith(f"Review verdict: {review.final_verdict}")
    assert "Evidence (" in result.text and "- correctness: " in result.text
    skipped_verification = review.events.notifications("verification_skipped")
    assert_honest_degradation(result, budget=bool(skipped_verification))
    assert_counted_from_the_model(review, calls=2)


def test_hypothesis_on_smollm2_questions_a_seed_and_synthesises_within_its_bound(local):
    engine = HypothesisEngine(model=MODEL, max_questions=1, max_agents=1, repair_retries=0)
    result = run(engine.run(["Green tea improves sleep quality."], session=local))
    chain = result.run
    assert list(chain.agents) == ["questioner-F1", "synthesizer"]
    assert chain.stage_errors == [] and chain.pending == {}  # a cut-off reply is a missed emission
    questions = chain.by_type(QuestionRaised, agent="questioner-F1")
    refused = chain.events.notifications("chain_refused")
    assert len(refused) == len(questions)  # the bound (one agent) refused every chain, each announced
    assert result.text.startswith("Hypotheses from 1 seed finding(s)\nStatus: ")
    assert "F1 finding: Green tea improves sleep quality." in result.text
    assert_honest_degradation(result, budget=bool(refused))
    assert_counted_from_the_model(chain, calls=2)


def test_coding_on_smollm2_runs_the_gated_chain_in_a_copy_and_returns_a_structured_result(local, tmp_path):
    project, outside = make_project(tmp_path)
    before, around = snapshot(project), snapshot(outside)
    engine = CodingEngine(model=MODEL, max_fix_rounds=1, repair_retries=0, test_timeout_s=60.0, turn_timeout_s=60.0,
                          kill_grace_s=0.5)
    result = run(engine.run("make add() add", session=local, workspace=str(project), test_cmd=PYTEST))
    assert isinstance(result, CodeResultRecorded) and result.verdict in CODING_VERDICTS
    # local/ takes no tools: the agents read the workspace snapshot in their prompts instead
    assert all(agent.tools == () for agent in result.run.agents.values())
    assert result.rounds_used == (0 if result.test_runs[0].passed else 1)
    assert [test.round for test in result.test_runs] == list(range(result.rounds_used + 1))
    for test in result.test_runs:  # the gate is a real pytest: its exit status, its output, bounded
        assert test.returncode in (0, 1) and not test.timed_out and 0 < test.output_bytes <= 64 * 1024
        assert ("passed" if test.passed else "failed") in test.output_tail
    assert result.passed == result.test_runs[-1].passed
    if not result.passed:
        assert result.verdict == "failed" and "verifier" not in result.run.agents
    assert result.degraded == bool(result.skipped) and result.degrade_reason == ("emission_failure" if result.skipped
                                                                                else "")
    assert snapshot(project) == before and snapshot(outside) == around  # offered as a patch, nothing applied
    calls = 2 + result.rounds_used + (1 if "verifier" in result.run.agents else 0)
    assert_counted_from_the_model(result.run, calls=calls)
