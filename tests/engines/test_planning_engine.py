"""PlanningEngine end to end: plan -> validated TaskAssignments -> DAG via run_dag -> exempt synthesis.

    orchestrator --plan--> [1 researcher] --> [2 writer (depends_on 1)] --spawn--> [critic]
                                                         \\----------------------> synthesizer (exempt)
"""

from __future__ import annotations

import openai_server as srv
import pytest
from engine_scripts import HANG, ByAgent, js, kinds, last_user
from running import run_engine as run

from opgraph.actors.providers import OpenAICompatibleProvider, SimulatedProvider
from opgraph.engines import EngineInputError, PlanError, PlanningEngine, PlanProposed, TaskSettled

pytestmark = pytest.mark.ray


def plan(*assignments):
    return js({"assignments": [dict(a) for a in assignments]})


PLAN = plan({"task": "find facts", "assignee": "researcher"},
            {"task": "write it up", "assignee": "writer", "depends_on": ["1"]},
            {"task": "sing", "assignee": "bard"})


def task_reply(request):
    return js({"text": f"did: {last_user(request).splitlines()[0][:40]}", "spawn": []})


def test_plans_runs_the_dag_and_synthesises(session, model, sink):
    script = ByAgent({"orchestrator": PLAN, "researcher": task_reply, "writer": task_reply,
                      "synthesizer": "the final answer"})
    engine = PlanningEngine(model=model(script), event_sink=sink)
    result = run(engine.run("explain actors", session=session))
    assert result == "the final answer" and not result.degraded
    (proposed,) = result.run.by_type(PlanProposed)
    assert [a.assignee for a in proposed.assignments] == ["researcher", "writer"]
    assert proposed.dropped == ["bard"]  # unknown assignees are dropped
    settled = result.run.by_type(TaskSettled)
    assert sorted((s.assignee, s.status) for s in settled) == [("researcher", "completed"), ("writer", "completed")]
    # orchestrator, one agent per roster role (reactive), and the exempt synthesizer
    assert result.run.agents["synthesizer"].exempt and result.run.agents_made == 6


def test_the_writer_sees_its_dependency_result(session, model):
    def writer(request):
        return js({"text": "saw facts" if "FACT-42" in last_user(request) else "saw nothing", "spawn": []})

    script = ByAgent({"orchestrator": PLAN, "researcher": js({"text": "FACT-42", "spawn": []}), "writer": writer,
                      "synthesizer": "x"})
    result = run(PlanningEngine(model=model(script)).run("explain", session=session))
    seen = {s.assignee: s.text for s in result.run.by_type(TaskSettled)}
    assert seen == {"researcher": "FACT-42", "writer": "saw facts"}


def test_assignee_names_treat_dash_and_underscore_alike(session, model):
    roles = {"data_analyst": "analyses data"}
    script = ByAgent({"orchestrator": plan({"task": "t", "assignee": "Data-Analyst"}),
                      "data_analyst": task_reply, "synthesizer": "done"})
    result = run(PlanningEngine(roles=roles, model=model(script)).run("go", session=session))
    assert result.run.by_type(PlanProposed)[0].assignments[0].assignee == "data_analyst"


def test_an_empty_plan_is_retried_once(session, model):
    def orchestrator(request):
        retry = "Return only the assignments" in last_user(request)
        return plan({"task": "t", "assignee": "writer"}) if retry else plan()

    script = ByAgent({"orchestrator": orchestrator, "writer": task_reply, "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script)).run("go", session=session))
    assert result == "done"


def test_an_empty_plan_after_the_retry_is_a_plan_error(session, model, sink):
    engine = PlanningEngine(model=model(ByAgent({"orchestrator": plan({"task": "t", "assignee": "nobody"})})),
                            event_sink=sink)
    with pytest.raises(PlanError, match="even after one retry"):
        run(engine.run("go", session=session))
    (state,) = sink.runs.values()
    assert state["status"] == "failed"


def test_a_plan_over_the_cap_is_a_plan_error(session, model):
    many = plan(*({"task": f"t{i}", "assignee": "writer"} for i in range(4)))
    engine = PlanningEngine(model=model(ByAgent({"orchestrator": many})), max_assignments=3)
    with pytest.raises(PlanError, match="cap is 3"):
        run(engine.run("go", session=session))


def test_a_cyclic_plan_is_a_plan_error(session, model):
    cyclic = plan({"task": "a", "assignee": "writer", "depends_on": ["2"]},
                  {"task": "b", "assignee": "writer", "depends_on": ["1"]})
    with pytest.raises(PlanError, match="cycle"):
        run(PlanningEngine(model=model(ByAgent({"orchestrator": cyclic}))).run("go", session=session))


def test_bad_ordinals_are_dropped_and_recorded(session, model, sink):
    odd = plan({"task": "a", "assignee": "writer", "depends_on": ["1", "seven", "9"]})
    script = ByAgent({"orchestrator": odd, "writer": task_reply, "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script), event_sink=sink).run("go", session=session))
    dropped = kinds(sink, result.run, "dependencies_dropped")[0].data["references"]
    assert len(dropped) == 3 and any("itself" in text for text in dropped)


def test_a_reactive_node_grows_the_dag_through_the_role_router(session, model):
    def writer(request):
        return js({"text": "drafted", "spawn": [{"instruction": "check the draft", "assignee": "critic"}]})

    script = ByAgent({"orchestrator": plan({"task": "draft", "assignee": "writer"}), "writer": writer,
                      "critic": "checked", "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script)).run("go", session=session))
    settled = {s.assignee: s for s in result.run.by_type(TaskSettled)}
    assert settled["critic"].status == "completed" and settled["critic"].text == "checked"


def test_spawned_nodes_of_any_verb_are_metered_and_name_their_role(session, model):
    """writer --spawn chat--> critic: the chat child's tokens count against the run's
    budget like every other call (4 calls of 15 tokens), and its settlement names its role."""
    def writer(request):
        return js({"text": "drafted", "spawn": [{"instruction": "check the draft", "assignee": "critic",
                                                  "operation": "chat"}]})

    script = ByAgent({"orchestrator": plan({"task": "draft", "assignee": "writer"}), "writer": writer,
                      "critic": "checked", "synthesizer": "done"})
    engine = PlanningEngine(model=model(script, prompt_tokens=10, completion_tokens=5))
    result = run(engine.run("go", session=session))
    settled = {s.assignee: s for s in result.run.by_type(TaskSettled)}
    assert settled["critic"].status == "completed" and settled["critic"].text == "checked"
    assert (result.run.budget.calls, result.run.budget.tokens_used) == (4, 60)


def test_a_node_whose_reply_never_parses_is_estimated_not_free(session, model, sink):
    """writer: three unparseable replies (operate's parse attempts) -> failed node. Its
    settlement has no usage, so the run counts its three calls at an estimate."""
    script = ByAgent({"orchestrator": plan({"task": "draft", "assignee": "writer"}), "writer": "not json",
                      "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script), event_sink=sink).run("go", session=session))
    assert [s.status for s in result.run.by_type(TaskSettled)] == ["failed"]
    (estimate,) = kinds(sink, result.run, "usage_estimated")
    assert estimate.data["error_type"] == "ParseError" and estimate.data["calls"] == 3
    assert result.run.budget.estimated_tokens == estimate.data["estimated_tokens"] > 0


def test_a_dag_cut_off_by_the_deadline_estimates_its_started_nodes(session, model, sink):
    script = ByAgent({"orchestrator": plan({"task": "a", "assignee": "writer"}, {"task": "b", "assignee": "critic"}),
                      "writer": HANG, "critic": HANG, "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script), deadline_s=2.0, event_sink=sink).run("go", session=session))
    assert result.degrade_reason == "deadline"
    estimated = kinds(sink, result.run, "usage_estimated")
    assert sorted(e.data["error_type"] for e in estimated) == ["Cancelled", "Cancelled"]
    assert result.run.budget.estimated_tokens == sum(e.data["estimated_tokens"] for e in estimated) > 0


def test_not_reactive_means_no_growth(session, model):
    def writer(request):
        assert "spawn" not in last_user(request)  # no structured output asked
        return "drafted"

    script = ByAgent({"orchestrator": plan({"task": "draft", "assignee": "writer"}), "writer": writer,
                      "synthesizer": "done"})
    result = run(PlanningEngine(model=model(script), reactive=False).run("go", session=session))
    assert [s.assignee for s in result.run.by_type(TaskSettled)] == ["writer"]


def test_an_empty_prompt_is_refused_before_any_agent(session):
    with pytest.raises(EngineInputError):
        run(PlanningEngine().run("   ", session=session))


def test_planning_runs_end_to_end_on_sim(session):
    session.register_provider("sim", SimulatedProvider(latency=0.0, list_items=2, seed=3))
    result = run(PlanningEngine(max_spawn=4).run("a short plan about actor runtimes", session=session))
    assert result.text and not result.degraded
    assert len(result.run.by_type(PlanProposed)[0].assignments) == 2
    assert sum(1 for s in result.run.by_type(TaskSettled) if s.status == "completed") >= 2


def test_planning_runs_against_an_openai_compatible_server(session):
    with srv.OpenAIChatServer() as server:
        session.register_provider("loop", OpenAICompatibleProvider(base_url=server.base_url, api_key="sk-test",
                                                                   name="loop", max_retries=1, backoff=0.01))
        result = run(PlanningEngine(model="loop/structured", max_spawn=2).run("plan over http", session=session))
        assert server.handler_errors == []
        bodies = [r.body for r in server.requests]
    assert result.run.by_type(PlanProposed) and not result.degraded
    assert any(b.get("response_format", {}).get("json_schema", {}).get("name") == "Plan" for b in bodies)


def test_the_plan_model_travels_by_name_not_rebuilt_on_every_hop():
    """A planner's turn ships its class to the executor and a worker, and its plan comes back as an
    instance: pickled by reference (a name the module resolves), a process rebuilds it at most once."""
    import pickle

    from ray import cloudpickle

    from opgraph.engines import planning

    plan = planning.plan_model(("writer", "data analyst", "é"))
    item = plan.model_validate({"assignments": [{"task": "draft", "assignee": "é", "depends_on": ["1"]}]})
    shipped = cloudpickle.dumps((plan, item))
    assert len(shipped) < 1000  # a name, not the class's code
    back_class, back_item = pickle.loads(shipped)
    assert back_class is plan and back_item == item
    assert plan.__name__ == "Plan" and plan.model_json_schema()["$defs"]["PlannedTask"]["properties"]["assignee"][
        "enum"] == ["writer", "data analyst", "é"]
    with pytest.raises(AttributeError):
        planning.plan_model__Other__00  # noqa: B018 - only the two classes resolve
