"""ADR-0034 D3 through real actors: typed payloads, bounded repair that never fabricates, the judge.

    agent turn (worker) -> emission bundle -> run.by_type(T) payloads
                       \\-> no emission -> at most `retries` re-prompts -> emission_missing
"""

from __future__ import annotations

import pytest
from engine_scripts import ByAgent, Note, ScriptEngine, js, kinds, last_user
from pydantic import ValidationError
from running import run_engine as run

from opgraph.actors.models import ProviderUnavailable
from opgraph.engines import EngineEvent, JudgeVerdict, emission_bundle

pytestmark = pytest.mark.ray


async def note_body(run_, retries=1):
    agent = await run_.make_agent("worker", name="noter", emits=(Note,))
    await run_.operate_with_repair(agent, "write a note", arrived=lambda: bool(run_.by_type(Note)), retries=retries)
    return "done"


def turns_of(sink, run_, agent):
    """Every turn the agent took: completed ones and failed ones (a malformed reply fails its turn)."""
    return [r for r in sink.records[run_.run_id] if r.type in ("turn_completed", "agent_error") and r.agent == agent]


def test_engine_events_refuse_unknown_fields():
    with pytest.raises(ValidationError):
        Note(text="a", extra="no")


def test_by_type_returns_payloads_never_bundles(session, model):
    engine = ScriptEngine(note_body, model=model(ByAgent(default=js({"note": [{"text": "kept"}]}))))
    result = run(engine.run(session=session))
    payloads = result.run.by_type(Note)
    assert [type(p) for p in payloads] == [Note] and payloads[0].text == "kept"
    assert result.run.by_type(emission_bundle((Note,))) == []
    assert result.events_by_type(Note) == payloads


def test_repair_is_one_call_when_the_emission_arrives(session, model, sink):
    engine = ScriptEngine(note_body, model=model(ByAgent(default=js({"note": [{"text": "first try"}]}))),
                          event_sink=sink)
    result = run(engine.run(session=session))
    assert len(turns_of(sink, result.run, "noter")) == 1
    assert result.skipped == [] and not result.degraded


def test_repair_reprompts_at_most_retries_times_then_records_the_miss(session, model, sink):
    engine = ScriptEngine(note_body, model=model(ByAgent(default=js({"note": []}))), event_sink=sink)
    result = run(engine.run(session=session))
    assert len(turns_of(sink, result.run, "noter")) == 2  # the original turn and one repair
    assert result.skipped == ["noter x2"]
    missing = kinds(sink, result.run, "emission_missing")
    assert len(missing) == 1 and missing[0].data["expected"] == ["note"]


def test_repair_never_fabricates_the_missing_event(session, model):
    engine = ScriptEngine(note_body, model=model(ByAgent(default="prose, not JSON")))
    result = run(engine.run(session=session))
    assert result.run.by_type(Note) == [] and result.run.by_type(EngineEvent) == []


def test_a_missing_emission_degrades_a_finished_run(session, model):
    engine = ScriptEngine(note_body, model=model(ByAgent(default="prose, not JSON")))
    result = run(engine.run(session=session))
    assert result == "done" and result.degraded and result.degrade_reason == "emission_failure"


def test_repair_recovers_a_malformed_first_reply(session, model, sink):
    def script(request):
        return js({"note": [{"text": "repaired"}]}) if "did not contain" in last_user(request) else "{\"note\": [{"
    engine = ScriptEngine(note_body, model=model(ByAgent(default=script)), event_sink=sink)
    result = run(engine.run(session=session))
    assert [n.text for n in result.run.by_type(Note)] == ["repaired"] and result.skipped == []
    assert len(kinds(sink, result.run, "emission_malformed")) == 1


def test_repair_prompt_names_the_expected_keys(session, model):
    def script(request):
        text = last_user(request)
        if "did not contain" in text:
            assert "top-level keys are note" in text and '"text"' in text
            return js({"note": [{"text": "ok"}]})
        return "no"
    engine = ScriptEngine(note_body, model=model(ByAgent(default=script)))
    assert run(engine.run(session=session)).run.by_type(Note)[0].text == "ok"


def test_repair_with_zero_retries_is_a_single_call(session, model, sink):
    async def body(run_):
        return await note_body(run_, retries=0)
    engine = ScriptEngine(body, model=model(ByAgent(default="no")), event_sink=sink)
    result = run(engine.run(session=session))
    assert len(turns_of(sink, result.run, "noter")) == 1 and result.skipped == ["noter x1"]


# -- the judge ------------------------------------------------------------------------------


def judging(eid="F1", subject="a finding"):
    async def body(run_):
        allowed = await run_.engine.judge(run_, eid, subject)
        return "allowed" if allowed else "refused"
    return body


def test_judge_without_a_judge_model_allows_without_a_turn(session, sink):
    result = run(ScriptEngine(judging(), event_sink=sink).run(session=session))
    assert result == "allowed" and result.run.agents_made == 0
    assert kinds(sink, result.run, "judged")[0].data["outcome"] == "skipped"


def test_a_matching_typed_verdict_is_authoritative(session, model):
    reply = "I reject nothing here. " + js({"subject": "F1", "allow": True, "reason": "sound"})
    engine = ScriptEngine(judging(), judge_model=model(ByAgent(default=reply)))
    result = run(engine.run(session=session))
    assert result == "allowed"  # the typed verdict wins over the word "reject" in the text
    assert result.run.by_type(JudgeVerdict)[0].reason == "sound"


def test_a_typed_verdict_for_another_subject_is_not_authoritative(session, model):
    reply = js({"subject": "OTHER", "allow": True}) + " reject"
    engine = ScriptEngine(judging(), judge_model=model(ByAgent(default=reply)))
    assert run(engine.run(session=session)) == "refused"


def test_reject_in_the_text_fails_the_gate(session, model):
    engine = ScriptEngine(judging(), judge_model=model(ByAgent(default="I would REJECT this.")))
    assert run(engine.run(session=session)) == "refused"


def test_other_text_passes_the_gate(session, model):
    engine = ScriptEngine(judging(), judge_model=model(ByAgent(default="looks useful")))
    assert run(engine.run(session=session)) == "allowed"


def test_judge_fails_closed_without_budget(session, model):
    async def body(run_):
        await run_.make_agent("worker")
        return await judging()(run_)
    engine = ScriptEngine(body, judge_model=model(ByAgent(default="fine")), max_agents=1)
    assert run(engine.run(session=session)) == "refused"


def test_judge_fails_open_on_any_other_error(session, model, sink):
    failing = model(ByAgent(default=ProviderUnavailable("judge service down", provider="x", status=503)))
    engine = ScriptEngine(judging(), judge_model=failing, event_sink=sink)
    result = run(engine.run(session=session))
    assert result == "allowed"
    errors = kinds(sink, result.run, "judge_error")
    assert len(errors) == 1 and errors[0].data["eid"] == "F1"
    assert result.run.engine.statistics()["judge_outcomes"].get("error", 0) >= 1


def test_a_bundle_of_opgraph_events_pickles_by_reference_and_keeps_its_schema():
    """Workers get the bundle by name and make it once; its schema is made once and copied out."""
    import pickle

    from ray import cloudpickle

    from opgraph.engines import DepthRequested, FindingEmitted, IssueFound

    bundle = emission_bundle((FindingEmitted, DepthRequested))
    shipped = cloudpickle.dumps(bundle)
    assert len(shipped) < 400 and b"opgraph.engines.agents" in shipped
    assert pickle.loads(shipped) is bundle and bundle.__name__ == "EmissionsFindingEmittedDepthRequested"
    first, second = bundle.model_json_schema(), bundle.model_json_schema()
    assert first == second and first is not second
    assert emission_bundle((IssueFound,)).model_json_schema()["properties"].keys() == {"issue_found"}
    assert b"engine_scripts" in cloudpickle.dumps(emission_bundle((Note,)))  # a test's own type travels by value


def test_a_reply_cut_off_at_max_tokens_is_a_missed_emission_then_repaired(session, model, sink):
    """A small model fills a list until max_tokens: that reply is unparsed, so repairable, never a failed run."""
    def script(request):
        if "did not contain" in last_user(request):
            return js({"note": [{"text": "shorter"}]})
        return {"content": '{"note": [{"text": "and on and on', "finish_reason": "length",
                "usage": {"prompt_tokens": 40, "completion_tokens": 8}}

    engine = ScriptEngine(note_body, model=model(ByAgent(default=script)), event_sink=sink)
    result = run(engine.run(session=session))
    assert [n.text for n in result.run.by_type(Note)] == ["shorter"] and not result.degraded
    (malformed,) = kinds(sink, result.run, "emission_malformed")
    assert malformed.data["error_type"] == "ProviderTruncated"
    assert result.run.budget.snapshot()["tokens_used"] >= 48  # the cut-off reply's tokens were counted

    cut_off = ScriptEngine(note_body, model=model(ByAgent(default=lambda request: {
        "content": '{"note": [', "finish_reason": "length"})))
    missed = run(cut_off.run(session=session))
    assert missed == "done" and missed.skipped == ["noter x2"] and missed.degrade_reason == "emission_failure"
