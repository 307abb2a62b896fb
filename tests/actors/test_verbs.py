"""The branch verbs against a scripted in-test provider and an in-memory branch; no Ray.

Each test drives one verb: ``FakeBranch`` stands in for RemoteBranch (history, append,
emit, provider_for) and ``FakeProvider`` answers each ChatRequest from a script,
recording every request so the tests can read what the model was shown.
"""

from __future__ import annotations

import asyncio
import enum
import pickle
import uuid
from typing import Annotated, Any

import pytest
from fake_chat import FakeBranch, FakeProvider, call, reply
from pydantic import BaseModel, Field

from opgraph.actors.models import ProviderConfigError
from opgraph.actors.verbs import (
    VERB_OPERATIONS,
    ParseError,
    ReAct,
    ReActStream,
    SelectionError,
    Tool,
    ToolDefinitionError,
    VerbError,
    VerbParameterError,
    act,
    chat,
    chat_and_record,
    communicate,
    interpret,
    json_candidates,
    name_predecessor_results,
    operate,
    parse,
    select,
    tool,
)
from opgraph.kernel import EscalationRequest, OperationGraphBuilder, SpawnRequest, extract_requests


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def assert_valid_history(history: list[dict[str, Any]]) -> None:
    """Every assistant tool-call turn is answered by one tool message per call id."""
    for index, message in enumerate(history):
        if message.get("tool_calls"):
            ids = [item["id"] for item in message["tool_calls"]]
            answers = history[index + 1:index + 1 + len(ids)]
            assert [answer["role"] for answer in answers] == ["tool"] * len(ids)
            assert [answer["tool_call_id"] for answer in answers] == ids


class Verdict(BaseModel):
    answer: str
    confidence: float


class Plan(BaseModel):
    summary: str
    spawn: list[SpawnRequest] = []
    escalation: EscalationRequest | None = None


def add(a: int, b: Annotated[int, Field(description="the second addend")] = 2) -> int:
    """Add two integers."""
    return a + b


def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


# -- chat, chat_and_record, communicate, interpret ------------------------------------------------

def test_chat_appends_the_turn_and_sends_history_and_context():
    """history(2) + context -> chat -> history(4); the context is shown, not recorded."""
    provider = FakeProvider("Paris.")
    history = [{"role": "user", "content": "We talk geography."}, {"role": "assistant", "content": "Sure."}]
    branch = FakeBranch(provider, history)
    text = run(chat(branch, "Capital of France?", context={"abc_result": {"hint": "EU"}}))
    assert text == "Paris."
    assert branch.history[2:] == [{"role": "user", "content": "Capital of France?"},
                                  {"role": "assistant", "content": "Paris."}]
    sent = provider.requests[0]
    assert sent.model == "fake/default"
    assert sent.messages[:2] == history
    assert '"abc_result":{"hint":"EU"}' in sent.messages[2]["content"]
    assert sent.messages[2]["content"].endswith("Capital of France?")


def test_predecessor_results_are_shown_by_name_without_bookkeeping():
    """plan (a chat record) and score (unnamed) -> write: the model reads "plan" and the plan's
    text, never a node id nor the record's model, provider or usage; shared data apart."""
    plan, score = str(uuid.uuid4()), str(uuid.uuid4())
    record = {"text": "Part one, then part two.", "model": "sim/fast", "provider": "sim", "finish_reason": "stop",
              "usage": {"calls": 1, "prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}}
    context = {f"{plan}_result": record, f"{score}_result": {"score": 3}, "topic": "actors"}
    for verb in (chat, chat_and_record, operate, communicate):
        provider = FakeProvider("ok")
        run(verb(FakeBranch(provider), "Write it.", context=context, result_names={plan: "plan"}))
        shown = provider.requests[0].messages[-1]["content"]
        results, shared = shown.split("\n\n")[:2]
        assert results == ('Results of earlier steps:\n{"plan":"Part one, then part two.","step 2":{"score":3}}'), verb
        assert shared == 'Shared context:\n{"topic":"actors"}'
        assert plan not in shown and score not in shown
        assert not any(word in shown for word in ('"usage"', '"provider"', '"model"', "sim/fast")), shown
        assert "result_names" not in str(provider.requests[0])  # bookkeeping for the verb, not the model


def test_name_predecessor_results_names_only_verb_nodes_by_reference_id():
    """plan -> draft (chat) and plan -> tally (a user operation, which takes no result_names)."""
    builder = OperationGraphBuilder()
    plan = builder.add_operation("chat", node_id="plan", instruction="plan")
    draft = builder.add_operation("chat", node_id="draft", depends_on=[plan], instruction="draft")
    tally = builder.add_operation("tally", node_id="tally", depends_on=[plan])
    graph = name_predecessor_results(builder.get_graph())
    assert graph.nodes[draft].parameters["result_names"] == {plan: "plan"}
    assert "result_names" not in graph.nodes[plan].parameters  # no predecessors
    assert "result_names" not in graph.nodes[tally].parameters


def test_chat_uses_the_model_parameter_and_passes_model_options():
    provider = FakeProvider("ok")
    branch = FakeBranch(provider)
    run(chat(branch, "hi", model="fake/other", temperature=0.2, max_tokens=7, system="Be brief."))
    sent = provider.requests[0]
    assert (sent.model, sent.temperature, sent.max_tokens) == ("fake/other", 0.2, 7)
    assert sent.messages[0] == {"role": "system", "content": "Be brief."}
    assert branch.models_asked == ["fake/other"]


def test_chat_rejects_unknown_options_and_a_missing_model():
    branch = FakeBranch(FakeProvider("ok"))
    with pytest.raises(VerbParameterError, match="temprature") as caught:
        run(chat(branch, "hi", temprature=0.1))
    assert caught.value.node_id == "node-1"
    with pytest.raises(ProviderConfigError, match="default_model"):
        run(chat(FakeBranch(FakeProvider("ok"), default_model=None), "hi"))


def test_chat_and_record_returns_text_model_and_usage():
    branch = FakeBranch(FakeProvider(reply("done", prompt=12, completion=3)))
    record = run(chat_and_record(branch, "go", model="fake/m"))
    assert record["text"] == "done"
    assert record["model"] == "fake/m"
    assert record["usage"] == {"calls": 1, "prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                               "cache_read_tokens": 0, "cache_creation_tokens": 0}
    assert [message["role"] for message in branch.history] == ["user", "assistant"]


def test_communicate_parses_and_can_leave_the_branch_unchanged():
    provider = FakeProvider('{"answer": "yes", "confidence": 0.9}')
    branch = FakeBranch(provider, [{"role": "user", "content": "earlier"}])
    verdict = run(communicate(branch, "Is it?", response_format=Verdict, record=False))
    assert verdict == Verdict(answer="yes", confidence=0.9)
    assert branch.history == [{"role": "user", "content": "earlier"}]
    assert provider.requests[0].messages[0] == {"role": "user", "content": "earlier"}
    assert provider.requests[0].response_format["json_schema"]["name"] == "Verdict"
    assert run(communicate(branch, "And now?")) == '{"answer": "yes", "confidence": 0.9}'
    assert len(branch.history) == 3


def test_interpret_rewrites_without_touching_the_branch():
    provider = FakeProvider("  Write a 200-word summary of the attached report for executives.  ")
    branch = FakeBranch(provider)
    text = run(interpret(branch, "summ this for bosses", domain="business"))
    assert text == "Write a 200-word summary of the attached report for executives."
    assert branch.history == []
    sent = provider.requests[0].messages
    assert sent[0]["role"] == "system" and "Do not answer" in sent[0]["content"]
    assert "summ this for bosses" in sent[-1]["content"] and "Domain: business." in sent[-1]["content"]


# -- operate ------------------------------------------------------------------------------------

def test_operate_retries_a_malformed_structured_reply():
    """reply 1 is not JSON -> feedback -> reply 2 parses; history keeps only the good reply."""
    provider = FakeProvider("I think yes, fairly sure.", '```json\n{"answer": "yes", "confidence": 0.8}\n```')
    branch = FakeBranch(provider)
    verdict = run(operate(branch, "Decide.", response_format=Verdict))
    assert verdict == Verdict(answer="yes", confidence=0.8)
    assert len(provider.requests) == 2
    feedback = provider.requests[1].messages[-1]
    assert feedback["role"] == "user" and "could not be parsed into Verdict" in feedback["content"]
    assert [message["role"] for message in branch.history] == ["user", "assistant"]
    assert "confidence" in branch.history[1]["content"]


def test_operate_raises_a_typed_parse_error_after_the_retries():
    provider = FakeProvider('{"answer": "yes"}')
    branch = FakeBranch(provider)
    with pytest.raises(ParseError, match="confidence") as caught:
        run(operate(branch, "Decide.", response_format=Verdict, parse_retries=1))
    assert caught.value.node_id == "node-1" and caught.value.branch_id == "branch-1"
    assert len(provider.requests) == 2
    assert branch.history == []


def test_operate_runs_tools_and_a_failing_tool_becomes_an_observation():
    """model: add + explode -> observations -> final answer; the operation still returns."""
    provider = FakeProvider(reply("", call("add", "c1", a=2, b=3), call("explode", "c2", reason="x")),
                            "The sum is 5; explode failed.")
    branch = FakeBranch(provider)
    text = run(operate(branch, "Add, then explode.", tools=[add, explode]))
    assert text == "The sum is 5; explode failed."
    observations = provider.requests[1].messages[-2:]
    assert observations == [
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": '{"error":"RuntimeError: boom: x"}'},
    ]
    assert [tool["function"]["name"] for tool in provider.requests[0].tools] == ["add", "explode"]
    assert [message["role"] for message in branch.history] == ["user", "assistant", "tool", "tool", "assistant"]
    assert_valid_history(branch.history)


def test_operate_bounds_the_tool_rounds():
    provider = FakeProvider(reply("again", call("add", a=1)))
    branch = FakeBranch(provider)
    text = run(operate(branch, "Loop forever.", tools=[add], max_tool_rounds=2))
    assert text == "again"
    assert len(provider.requests) == 3
    assert "used all 2 tool rounds" in provider.requests[2].messages[-1]["content"]
    assert_valid_history(branch.history)
    assert branch.history[-1] == {"role": "assistant", "content": "again"}


def test_operate_emits_spawn_requests_live_and_in_the_response():
    """operate(emit_live) -> SpawnRequest reaches branch.emit and stays in the response."""
    body = ('{"summary": "split", "spawn": [{"instruction": "draft A"}], '
            '"escalation": {"reason": "too hard"}}')
    branch = FakeBranch(FakeProvider(body))
    plan = run(operate(branch, "Plan.", response_format=Plan, emit_live=True))
    assert plan.spawn[0].instruction == "draft A"
    found = extract_requests(plan)
    assert len(found) == 2 and len(branch.emitted) == 2
    # The same objects both ways: that shared identity is the executor's de-duplication key.
    assert all(any(sent is item for item in found) for sent in branch.emitted)

    quiet = FakeBranch(FakeProvider(body))
    plan = run(operate(quiet, "Plan.", response_format=Plan))
    assert quiet.emitted == [] and len(extract_requests(plan)) == 2


def test_a_tool_returning_a_spawn_request_is_emitted_live():
    def delegate(task: str) -> SpawnRequest:
        """Ask the graph for a helper."""
        return SpawnRequest(instruction=task)

    provider = FakeProvider(reply("", call("delegate", task="research")), "delegated")
    branch = FakeBranch(provider)
    assert run(operate(branch, "Delegate.", tools=[delegate])) == "delegated"
    assert [request.instruction for request in branch.emitted] == ["research"]


# -- tools ----------------------------------------------------------------------------------------

def test_tool_schema_comes_from_type_hints():
    schema = Tool.from_function(add).schema
    function = schema["function"]
    assert schema["type"] == "function" and function["name"] == "add"
    assert function["description"] == "Add two integers."
    assert function["parameters"]["required"] == ["a"]
    assert function["parameters"]["properties"]["a"]["type"] == "integer"
    assert function["parameters"]["properties"]["b"]["description"] == "the second addend"
    assert function["parameters"]["additionalProperties"] is False


def test_tool_argument_validation_error_is_an_observation():
    provider = FakeProvider(reply("", call("add", "c1", a="three")), "could not add")
    branch = FakeBranch(provider)
    assert run(operate(branch, "Add.", tools=[add])) == "could not add"
    observation = provider.requests[1].messages[-1]
    assert observation["role"] == "tool" and observation["tool_call_id"] == "c1"
    assert "invalid arguments for add" in observation["content"] and '"error"' in observation["content"]
    assert "a: Input should be a valid integer" in observation["content"]


def test_tools_accept_async_functions_awkward_names_and_reject_star_args():
    @tool(name="lookup")
    async def fetch(json: str, *, limit: int = 1) -> dict:
        """Look up a key."""
        return {"key": json, "limit": limit}

    assert fetch.name == "lookup"
    assert run(fetch.invoke({"json": "k", "limit": "3"})) == {"key": "k", "limit": 3}
    assert run(fetch.invoke('{"json": "k"}')) == {"key": "k", "limit": 1}

    def first(value: int, /) -> int:
        return value

    assert run(Tool.from_function(first).invoke({"value": 4})) == 4
    assert add(1, 1) == 2 and tool(add)(1, 1) == 2

    def spread(*values: int) -> int:
        return sum(values)

    with pytest.raises(ToolDefinitionError, match="spread"):
        Tool.from_function(spread)
    with pytest.raises(ToolDefinitionError, match="two tools"):
        run(operate(FakeBranch(FakeProvider("x")), "x", tools=[add, Tool.from_function(first, name="add")]))


def test_tools_survive_pickling():
    rebuilt = pickle.loads(pickle.dumps(Tool.from_function(add, name="plus")))
    assert rebuilt.name == "plus" and run(rebuilt.invoke({"a": 1})) == 3


# -- act ------------------------------------------------------------------------------------------

def test_act_runs_given_actions_and_a_bad_tool_name_is_an_error_entry():
    branch = FakeBranch(FakeProvider("unused"))
    entries = run(act(branch, tools=[add], actions=[
        {"function": "add", "arguments": {"a": 1, "b": 1}},
        {"function": "subtract", "arguments": {"a": 1}},
        {"function": "add", "arguments": '{"a": 5}'},
    ]))
    assert entries[0] == {"function": "add", "arguments": {"a": 1, "b": 1}, "output": 2}
    assert entries[1]["function"] == "subtract" and "unknown tool 'subtract'" in entries[1]["error"]
    assert entries[2]["output"] == 7
    assert branch.provider.requests == []
    assert [message["role"] for message in branch.history] == ["assistant", "tool", "tool", "tool"]
    assert_valid_history(branch.history)


def test_act_runs_the_calls_the_model_proposes():
    provider = FakeProvider(reply("", call("add", "x1", a=4, b=4)))
    branch = FakeBranch(provider)
    entries = run(act(branch, "Add four and four.", tools=[add]))
    assert entries == [{"function": "add", "arguments": {"a": 4, "b": 4}, "output": 8}]
    assert [message["role"] for message in branch.history] == ["user", "assistant", "tool"]
    assert run(act(FakeBranch(FakeProvider("no tools needed")), "Nothing.", tools=[add])) == []


# -- ReAct and ReActStream ------------------------------------------------------------------------

def test_react_answers_when_the_model_stops_calling_tools():
    provider = FakeProvider(reply("Let me add.", call("add", a=1, b=2)), reply("It is 3.", prompt=20, completion=2))
    branch = FakeBranch(provider)
    result = run(ReAct(branch, "What is 1 + 2?", tools=[add]))
    assert result["answer"] == "It is 3." and result["stopped"] == "answered"
    assert result["rounds"][0]["thought"] == "Let me add."
    assert result["rounds"][0]["actions"] == [{"function": "add", "arguments": {"a": 1, "b": 2}, "output": 3}]
    assert result["rounds"][1]["final"] is True
    assert result["usage"] == {"calls": 2, "prompt_tokens": 30, "completion_tokens": 7, "total_tokens": 37,
                               "cache_read_tokens": 0, "cache_creation_tokens": 0}
    assert_valid_history(branch.history)


def test_react_stops_at_max_rounds():
    calls_made = []

    def counted(a: int) -> int:
        calls_made.append(a)
        return a

    provider = FakeProvider(reply("more", call("counted", a=1)))
    branch = FakeBranch(provider)
    result = run(ReAct(branch, "Never done.", tools=[counted], max_rounds=3))
    assert result["stopped"] == "max_rounds" and len(result["rounds"]) == 3
    assert len(provider.requests) == 3 and calls_made == [1, 1, 1]
    assert "last round" in provider.requests[2].messages[-1]["content"]
    assert "last round" not in provider.requests[1].messages[-1]["content"]
    assert_valid_history(branch.history)


def test_react_stream_yields_each_round_as_it_completes():
    provider = FakeProvider(reply("step", call("add", a=1)), "final answer")
    branch = FakeBranch(provider)

    async def consume() -> list[tuple[dict, int, int]]:
        seen = []
        async for item in ReActStream(branch, "Go.", tools=[add]):
            # Between rounds: this round is recorded, the next model call has not happened.
            seen.append((item, len(provider.requests), len(branch.history)))
        return seen

    seen = run(consume())
    assert [(item["round"], item["final"]) for item, _, _ in seen] == [(1, False), (2, True)]
    assert [(requests, recorded) for _, requests, recorded in seen] == [(1, 3), (2, 4)]

    registered = VERB_OPERATIONS["ReActStream"]
    rounds = run(registered.fn(FakeBranch(FakeProvider(reply("step", call("add", a=1)), "done")),
                               instruction="Go.", context={}, tools=[add]))
    assert isinstance(rounds, list) and [item["round"] for item in rounds] == [1, 2]
    assert rounds[-1]["thought"] == "done"


# -- select ---------------------------------------------------------------------------------------

def test_select_normalises_and_retries_once_on_an_invalid_choice():
    provider = FakeProvider('{"selected": ["purple"], "reason": "pretty"}',
                            '{"selected": [" RED. "], "reason": "warm"}')
    branch = FakeBranch(provider)
    result = run(select(branch, "Pick a colour.", choices=["red", "green"]))
    assert result["selected"] == ["red"] and result["reason"] == "warm"
    assert "'purple' is not one of the choices: red, green" in provider.requests[1].messages[-1]["content"]
    assert result["usage"]["calls"] == 2
    assert [message["role"] for message in branch.history] == ["user", "assistant"]


def test_select_takes_an_enum_and_raises_after_the_retry():
    class Route(enum.Enum):
        FAST = "fast"
        SAFE = "safe"

    provider = FakeProvider('{"selected": "Safe", "reason": "careful"}')
    assert run(select(FakeBranch(provider), "Route?", choices=Route))["selected"] == ["safe"]

    wrong = FakeProvider('{"selected": ["fast", "safe"], "reason": "both"}')
    with pytest.raises(SelectionError, match="at most 1") as caught:
        run(select(FakeBranch(wrong), "Route?", choices=Route))
    assert caught.value.node_id == "node-1" and len(wrong.requests) == 2
    with pytest.raises(VerbParameterError, match="choices"):
        run(select(FakeBranch(wrong), "Route?", choices=[]))


# -- parse ----------------------------------------------------------------------------------------

def test_parse_extracts_json_without_a_model():
    branch = FakeBranch(FakeProvider("unused"), default_model=None)
    text = 'Here you go:\n```json\n{"answer": "a", "confidence": 1}\n```'
    assert run(parse(branch, text=text, response_format=Verdict)) == Verdict(answer="a", confidence=1)
    embedded = 'The verdict {"answer": "b", "confidence": 0.5} is final.'
    assert run(parse(branch, embedded, response_format=Verdict)).answer == "b"
    predecessor = {"n1_result": {"answer": "c", "confidence": 0.1}, "topic": "x"}
    assert run(parse(branch, context=predecessor, response_format=Verdict)).answer == "c"
    assert branch.provider.requests == [] and branch.history == []


def test_parse_falls_back_to_the_model_and_raises_when_impossible():
    provider = FakeProvider('{"answer": "yes", "confidence": 0.7}')
    branch = FakeBranch(provider)
    verdict = run(parse(branch, text="The committee agreed, with 70% confidence.", response_format=Verdict))
    assert verdict == Verdict(answer="yes", confidence=0.7)
    assert "The committee agreed" in provider.requests[0].messages[-1]["content"]
    assert branch.history == []

    hopeless = FakeProvider("I cannot.")
    with pytest.raises(ParseError, match="Verdict") as caught:
        run(parse(FakeBranch(hopeless), text="nothing here", response_format=Verdict, parse_retries=1))
    assert caught.value.node_id == "node-1" and len(hopeless.requests) == 2
    with pytest.raises(VerbParameterError, match="response_format"):
        run(parse(FakeBranch(hopeless), text="x"))


def test_json_candidates_find_fenced_blocks_and_balanced_objects():
    text = 'See ```json\n{"a": 1}\n``` and then {"b": {"c": "}"}} plus {broken'
    assert json_candidates(text)[1:] == ['{"a": 1}', '{"b": {"c": "}"}}']


# -- the registered surface ----------------------------------------------------------------------

def test_every_verb_is_registered_without_turn_recording():
    assert set(VERB_OPERATIONS) == {"chat", "chat_and_record", "operate", "communicate", "parse", "ReAct",
                                    "select", "interpret", "act", "ReActStream"}
    assert all(registered.record_turn is False for registered in VERB_OPERATIONS.values())


@pytest.mark.parametrize("error_class", [VerbError, VerbParameterError, ToolDefinitionError, ParseError,
                                         SelectionError])
def test_verb_errors_pickle_with_their_ids(error_class):
    error = error_class("it broke", node_id="n", branch_id="b")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is error_class
    assert (copy.message, copy.node_id, copy.branch_id) == ("it broke", "n", "b")
