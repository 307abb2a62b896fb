"""Every branch verb through a real flow on Ray, against the scripted provider and a real HTTP server.

Topology: test -> Session.flow -> GraphExecutor -> OperationWorker (a Ray process) -> verb
-> provider. The provider is a ``ScriptedProvider`` or an ``OpenAICompatibleProvider``
talking over loopback to ``openai_server.OpenAIChatServer`` in this process. Each test
registers its provider under its own name and runs on its own fresh default branch, so
tests sharing the session cannot see each other's providers or history.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai_server as srv  # tests/support: a real chat-completions server on loopback
import pytest
from pydantic import BaseModel
from running import run

from opgraph.actors.models import ChatRequest, ProviderHTTPError
from opgraph.actors.providers import OpenAICompatibleProvider, ScriptedProvider
from opgraph.actors.verbs import VERB_OPERATIONS
from opgraph.cluster import example_three_nodes
from opgraph.kernel import OperationGraphBuilder, SpawnRequest

# -- what the workers receive: module-level, so they travel with this module by value -----------


class Verdict(BaseModel):
    verdict: str
    score: int


class Plan(BaseModel):
    summary: str
    spawn: list[SpawnRequest] = []


def word_count(text: str) -> dict[str, int]:
    """Count the words in a text (and say which process counted them)."""
    return {"words": len(text.split()), "pid": os.getpid()}


def explode(reason: str) -> str:
    """Always fails: a tool error must come back as an observation."""
    raise RuntimeError(f"boom: {reason}")


def echo(request: ChatRequest) -> str:
    """The scripted twin of the server's default reply: ``echo: <last user message>``."""
    last = next((m.get("content") for m in reversed(request.messages) if m.get("role") == "user"), "")
    return f"echo: {last or ''}"


def never(request: ChatRequest) -> ProviderHTTPError:
    """A model that must not be asked: any call fails the node."""
    return ProviderHTTPError("this model must not be called", provider="never", status=418)


# -- the two ways to reach a model ---------------------------------------------------------------


@dataclass(frozen=True)
class Say:
    """The model answers ``text``."""

    text: str


@dataclass(frozen=True)
class Call:
    """The model calls the tool ``name`` with ``arguments``."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    call_id: str = "call_1"


def _scripted_reply(reply: Say | Call) -> dict[str, Any]:
    if isinstance(reply, Say):
        return {"content": reply.text}
    return {"tool_calls": [{"id": reply.call_id, "name": reply.name, "arguments": reply.arguments}]}


def _server_reply(reply: Say | Call) -> Any:
    if isinstance(reply, Say):
        return srv.Reply(reply.text)
    return srv.ToolCallReply(reply.name, reply.arguments, reply.call_id)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def http_provider(base_url: str, name: str, **options: Any) -> OpenAICompatibleProvider:
    options.setdefault("max_retries", 2)
    options.setdefault("backoff", 0.01)
    return OpenAICompatibleProvider(base_url=base_url, api_key="sk-test", name=name, **options)


class Backend:
    """A model for one test: scripted replies, or the same replies queued on the HTTP server.

    ``model(*replies)`` registers a provider under a name of its own and returns its
    ``provider/model`` id; with no replies the model echoes the last user message.
    """

    def __init__(self, kind: str, session: Any, server: Any = None) -> None:
        self.kind = kind
        self.session = session
        self.server = server

    def model(self, *replies: Say | Call) -> str:
        name = unique(self.kind)
        if self.kind == "scripted":
            provider: Any = ScriptedProvider([_scripted_reply(r) for r in replies] if replies else echo, name=name)
        else:
            self.server.script(*(_server_reply(r) for r in replies))
            provider = http_provider(self.server.base_url, name)
        self.session.register_provider(name, provider)
        return f"{name}/m"

    def bodies(self) -> list[Any] | None:
        """The request bodies the HTTP server received; None for the scripted provider."""
        return None if self.server is None else [request.body for request in self.server.requests]


@pytest.fixture(scope="module", autouse=True)
def verbs(session):
    """The verbs under their record names: another module may have replaced one (``operate``)."""
    for name, entry in VERB_OPERATIONS.items():
        session.register_operation(name, entry.fn, record_turn=entry.record_turn, timeout=entry.timeout)


@pytest.fixture
def server():
    with srv.OpenAIChatServer() as running:
        yield running


@pytest.fixture(params=["scripted", "http"])
def backend(request, session):
    if request.param == "scripted":
        yield Backend("scripted", session)
        return
    with srv.OpenAIChatServer() as running:
        yield Backend("http", session, running)
        assert running.handler_errors == []


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed on exit: a connection there is refused


async def flow_on_fresh_branch(session: Any, builder: OperationGraphBuilder, **options: Any
                               ) -> tuple[dict[str, Any], str]:
    """Run the graph isolated: a new default branch of its own (the roots' conversation), which
    dependents are cloned from too, so nothing of an earlier test reaches them; return both."""
    envelope = await session.flow(builder.get_graph(), isolated=True, **options)
    return envelope, envelope["default_branch"]


def single(session: Any, operation: str, **parameters: Any) -> tuple[Any, list[Any], str]:
    """root: one verb node on a fresh branch -> (result, the branch's messages, status)."""
    builder = OperationGraphBuilder(operation)
    node = builder.add_operation(operation, **parameters)

    async def go() -> tuple[dict[str, Any], list[Any]]:
        envelope, branch = await flow_on_fresh_branch(session, builder)
        return envelope, await session.messages(branch)

    envelope, messages = run(go())
    status = envelope["operation_statuses"][node]
    return envelope["operation_results"][node], messages, status


# -- each verb, on both backends ------------------------------------------------------------------


def test_chat_records_user_and_assistant_turns_on_each_node_branch(session, backend):
    """first (default branch) -> second (its own clone): each branch gets exactly its own turn."""
    model = backend.model()
    builder = OperationGraphBuilder("chat")
    first = builder.add_operation("chat", instruction="first question", model=model)
    second = builder.add_operation("chat", depends_on=[first], instruction="second question", model=model)
    created: dict[str, str] = {}

    async def go() -> tuple[dict[str, Any], list[Any], list[Any]]:
        envelope, branch = await flow_on_fresh_branch(
            session, builder, on_branch_created=lambda view: created.setdefault(view.node_id, view.id))
        return envelope, await session.messages(branch), await session.messages(created[second])

    envelope, root_history, second_history = run(go())

    assert envelope["status"] == "completed"
    results = envelope["operation_results"]
    assert results[first] == "echo: first question"
    assert root_history == [{"role": "user", "content": "first question"},
                            {"role": "assistant", "content": "echo: first question"}]
    # The dependent saw the first result as context; its branch records only the instruction.
    assert "echo: first question" in results[second] and results[second].endswith("second question")
    assert second_history == [{"role": "user", "content": "second question"},
                              {"role": "assistant", "content": results[second]}]


def test_operate_parses_structured_output_into_the_pydantic_model(session, backend):
    """root: operate(response_format=Verdict) -> a Verdict instance back in the driver."""
    model = backend.model(Say('Sure.\n```json\n{"verdict": "ship", "score": 7}\n```'))

    result, history, status = single(session, "operate", instruction="judge it", model=model,
                                     response_format=Verdict)

    assert status == "completed"
    assert isinstance(result, Verdict) and result == Verdict(verdict="ship", score=7)
    assert [message["role"] for message in history] == ["user", "assistant"]
    if backend.bodies() is not None:
        [body] = backend.bodies()
        assert body["response_format"]["type"] == "json_schema"
        assert body["response_format"]["json_schema"]["name"] == "Verdict"


def test_operate_runs_a_tool_inside_the_worker_and_answers(session, backend):
    """root: operate(tools=[word_count]): call -> tool runs in the worker -> final answer."""
    model = backend.model(Call("word_count", {"text": "one two three"}), Say("three words"))

    result, history, status = single(session, "operate", instruction="count", model=model, tools=[word_count])

    assert (status, result) == ("completed", "three words")
    assert [message["role"] for message in history] == ["user", "assistant", "tool", "assistant"]
    assert history[1]["tool_calls"][0]["function"]["name"] == "word_count"
    observation = json.loads(history[2]["content"])
    assert observation["words"] == 3 and observation["pid"] != os.getpid()
    if backend.bodies() is not None:
        first, second = backend.bodies()
        assert first["tools"][0]["function"]["name"] == "word_count"
        tool_messages = [message for message in second["messages"] if message["role"] == "tool"]
        assert [message["tool_call_id"] for message in tool_messages] == ["call_1"]


def test_operate_spawn_request_runs_a_child_in_a_reactive_flow(session, backend):
    """emitter: operate(response_format=Plan) => child (operate on the default sim model)."""
    plan = {"summary": "needs a helper", "spawn": [{"instruction": "write the helper"}]}
    model = backend.model(Say(json.dumps(plan)))
    builder = OperationGraphBuilder("spawn")
    emitter = builder.add_operation("operate", instruction="plan it", model=model, response_format=Plan)

    envelope, _ = run(flow_on_fresh_branch(session, builder, reactive=True))

    assert envelope["spawned_operations"] == 1
    assert envelope["dropped_spawns"] == []
    [child] = [node for node in envelope["operation_statuses"] if node != emitter]
    assert envelope["operation_statuses"] == {emitter: "completed", child: "completed"}
    assert envelope["operation_results"][emitter].spawn == [SpawnRequest(instruction="write the helper")]


def test_react_with_tools_stops_at_max_rounds(session, backend):
    """root: ReAct(max_rounds=3) with a model that never stops calling tools: three rounds."""
    model = backend.model(*(Call("word_count", {"text": "a " * n}, f"call_{n}") for n in (1, 2, 3)))

    result, history, status = single(session, "ReAct", instruction="keep counting", model=model,
                                     tools=[word_count], max_rounds=3)

    assert status == "completed"
    assert result["stopped"] == "max_rounds"
    assert [len(item["actions"]) for item in result["rounds"]] == [1, 1, 1]
    assert [item["actions"][0]["output"]["words"] for item in result["rounds"]] == [1, 2, 3]
    assert result["usage"]["calls"] == 3
    assert [message["role"] for message in history] == ["user"] + ["assistant", "tool"] * 3


def test_react_stream_node_response_is_one_list_of_rounds(session, backend):
    """root: ReActStream: a tool round, then the answer, consumed into one list."""
    model = backend.model(Call("explode", {"reason": "test"}), Say("final answer"))

    result, history, status = single(session, "ReActStream", instruction="try", model=model,
                                     tools=[word_count, explode])

    assert status == "completed"
    assert isinstance(result, list)
    assert [item["final"] for item in result] == [False, True]
    assert result[0]["actions"][0]["error"] == "RuntimeError: boom: test"
    assert result[-1]["thought"] == "final answer"
    assert [message["role"] for message in history] == ["user", "assistant", "tool", "assistant"]


def test_parse_falls_back_to_the_model_and_leaves_the_branch_alone(session, backend):
    """root: parse(text=prose) -> the model extracts the JSON -> a Verdict; no turn recorded."""
    model = backend.model(Say('{"verdict": "ship", "score": 7}'))

    result, history, status = single(session, "parse", model=model, response_format=Verdict,
                                      text="We decided to ship it; I would score it seven.")

    assert (status, result, history) == ("completed", Verdict(verdict="ship", score=7), [])


def test_select_normalises_the_choice_and_records_the_turn(session, backend):
    """root: select(choices=[red, green, blue]); the model says "GREEN." -> "green"."""
    model = backend.model(Say('{"selected": ["GREEN."], "reason": "calm"}'))

    result, history, status = single(session, "select", instruction="pick a colour", model=model,
                                     choices=["red", "green", "blue"])

    assert status == "completed"
    assert (result["selected"], result["reason"], result["usage"]["calls"]) == (["green"], "calm", 1)
    assert [message["role"] for message in history] == ["user", "assistant"]


def test_interpret_returns_the_rewritten_prompt_without_recording(session, backend):
    """root: interpret(raw request) -> the clearer prompt; the branch is unchanged."""
    model = backend.model(Say("  Write a 5-7-5 haiku about autumn leaves.  "))

    result, history, status = single(session, "interpret", instruction="haiku pls, leaves", model=model)

    assert (status, result, history) == ("completed", "Write a 5-7-5 haiku about autumn leaves.", [])
    if backend.bodies() is not None:
        [body] = backend.bodies()
        assert body["messages"][0]["role"] == "system"
        assert "Raw request:\nhaiku pls, leaves" in body["messages"][-1]["content"]


def test_communicate_repairs_a_bad_reply_and_can_leave_the_branch_alone(session, backend):
    """root: communicate(response_format=Verdict, record=False): prose, then JSON after feedback."""
    model = backend.model(Say("I think we should hold."), Say('{"verdict": "hold", "score": 2}'))

    result, history, status = single(session, "communicate", instruction="verdict?", model=model,
                                     response_format=Verdict, record=False)

    assert (status, result, history) == ("completed", Verdict(verdict="hold", score=2), [])
    if backend.bodies() is not None:
        repair = backend.bodies()[1]["messages"][-1]["content"]
        assert repair.startswith("Your reply could not be parsed into Verdict")


def test_act_runs_the_call_the_model_proposes(session, backend):
    """root: act(tools=[word_count]) -> the model's one call is run -> its entry."""
    model = backend.model(Call("word_count", {"text": "a b"}))

    result, history, status = single(session, "act", instruction="count a b", model=model, tools=[word_count])

    assert status == "completed"
    [entry] = result
    assert (entry["function"], entry["arguments"], entry["output"]["words"]) == ("word_count", {"text": "a b"}, 2)
    assert [message["role"] for message in history] == ["user", "assistant", "tool"]


def test_chat_and_record_returns_text_model_and_usage(session, backend):
    """root: chat_and_record -> {text, model, provider, finish_reason, usage}; the turn is recorded."""
    model = backend.model(Say("recorded reply"))

    result, history, status = single(session, "chat_and_record", instruction="say it", model=model)

    assert status == "completed"
    assert (result["text"], result["model"], result["finish_reason"]) == ("recorded reply", model, "stop")
    assert result["provider"] == model.partition("/")[0]
    assert result["usage"]["calls"] == 1 and result["usage"]["total_tokens"] > 0
    assert history == [{"role": "user", "content": "say it"}, {"role": "assistant", "content": "recorded reply"}]


# -- scripted only: paths that need no second backend ------------------------------------------


def test_parse_reads_the_predecessor_result_without_asking_a_model(session):
    """chat -> parse: the JSON in the chat reply is parsed directly; the parse model is never called."""
    talker = unique("scripted")
    session.register_provider(talker, ScriptedProvider(lambda request: 'Result: {"verdict": "ship", "score": 9}'))
    silent = unique("never")
    session.register_provider(silent, ScriptedProvider(never, name=silent))
    builder = OperationGraphBuilder("chat-then-parse")
    said = builder.add_operation("chat", instruction="verdict?", model=f"{talker}/m")
    parsed = builder.add_operation("parse", depends_on=[said], model=f"{silent}/m", response_format=Verdict)

    envelope, _ = run(flow_on_fresh_branch(session, builder))

    assert envelope["operation_statuses"] == {said: "completed", parsed: "completed"}
    assert envelope["operation_results"][parsed] == Verdict(verdict="ship", score=9)


def test_act_with_given_actions_turns_tool_failures_into_observations(session):
    """root: act(actions=[ok, raises, unknown]) with no model: one output, two errors, completed."""
    actions = [{"function": "word_count", "arguments": {"text": "x y z"}},
               {"function": "explode", "arguments": {"reason": "asked to"}},
               {"function": "missing", "arguments": {}}]

    result, history, status = single(session, "act", instruction="do these", tools=[word_count, explode],
                                     actions=actions)

    assert status == "completed"
    assert result[0]["output"]["words"] == 3
    assert result[1]["error"] == "RuntimeError: boom: asked to"
    assert result[2]["error"].startswith("unknown tool 'missing'")
    assert [message["role"] for message in history] == ["user", "assistant", "tool", "tool", "tool"]


def test_operate_emitting_live_and_returning_the_spawn_admits_one_child(session):
    """emitter: operate(emit_live=True) => child: the live and the returned sighting count once."""
    name = unique("scripted")
    plan = json.dumps({"summary": "helper", "spawn": [{"instruction": "only once"}]})
    session.register_provider(name, ScriptedProvider([plan], name=name))
    builder = OperationGraphBuilder("spawn-live")
    builder.add_operation("operate", instruction="plan", model=f"{name}/m", response_format=Plan, emit_live=True)

    envelope, _ = run(flow_on_fresh_branch(session, builder, reactive=True))

    assert envelope["spawned_operations"] == 1
    assert [entry["reason"] for entry in envelope["dropped_spawns"]] == ["duplicate"]
    assert set(envelope["operation_statuses"].values()) == {"completed"}


def test_aggregation_node_runs_a_verb(session):
    """(a, b) -> merge via add_aggregation: the builder's bookkeeping parameters do not reach the model."""
    name = unique("scripted")
    session.register_provider(name, ScriptedProvider(echo, name=name))
    model = f"{name}/m"
    builder = OperationGraphBuilder("aggregate")
    sources = [builder.add_operation("chat", depends_on=[], instruction=part, model=model) for part in ("a", "b")]
    merge = builder.add_aggregation("chat", source_node_ids=sources, instruction="merge", model=model)

    envelope, _ = run(flow_on_fresh_branch(session, builder))

    assert envelope["status"] == "completed"
    merged = envelope["operation_results"][merge]
    assert "echo: a" in merged and "echo: b" in merged and merged.endswith("merge")


# -- the HTTP server only: retries and provider failures during a flow --------------------------


def test_429_then_retry_completes_the_node(session, server):
    """root: chat over HTTP; the server answers 429 (Retry-After: 0), then the reply."""
    name = unique("http")
    session.register_provider(name, http_provider(server.base_url, name))
    server.script(srv.Status(429, retry_after="0"), srv.Reply("after the wait"))

    result, _, status = single(session, "chat", instruction="hello", model=f"{name}/m")

    assert (status, result) == ("completed", "after the wait")
    assert len(server.requests) == 2


def test_structured_output_from_a_server_honouring_the_response_format(session, server):
    """root: operate(response_format=Verdict); the server builds the JSON from the sent schema."""
    name = unique("http")
    session.register_provider(name, http_provider(server.base_url, name))
    server.script(srv.StructuredReply())

    result, _, status = single(session, "operate", instruction="judge", model=f"{name}/m", response_format=Verdict)

    assert (status, result) == ("completed", Verdict(verdict="from-server-verdict", score=1))


def test_provider_failures_fail_their_nodes_and_the_run_goes_on(session, server):
    """refused, timed-out (independent roots) | fine -> after: the failures are typed, the rest completes."""
    refused = unique("refused")
    session.register_provider(refused, http_provider(f"http://127.0.0.1:{closed_port()}/v1", refused,
                                                     max_retries=1))
    slow = unique("http")
    session.register_provider(slow, http_provider(server.base_url, slow))
    server.script(srv.Slow(30.0))  # released when the server stops
    fine = unique("scripted")
    session.register_provider(fine, ScriptedProvider(echo, name=fine))
    builder = OperationGraphBuilder("failures")
    unreachable = builder.add_operation("chat", depends_on=[], instruction="x", model=f"{refused}/m")
    late = builder.add_operation("chat", depends_on=[], instruction="y", model=f"{slow}/m", timeout=0.3)
    first = builder.add_operation("chat", depends_on=[], instruction="z", model=f"{fine}/m")
    after = builder.add_operation("chat", depends_on=[first], instruction="then", model=f"{fine}/m")

    envelope, _ = run(flow_on_fresh_branch(session, builder))

    statuses, results = envelope["operation_statuses"], envelope["operation_results"]
    assert envelope["status"] == "failed"
    assert statuses == {unreachable: "failed", late: "failed", first: "completed", after: "completed"}
    assert results[unreachable]["error_type"] == "ProviderUnavailable"
    assert "connection failed" in results[unreachable]["error"]
    assert results[late]["error_type"] == "ProviderTimeout"
    assert results[first] == "echo: z"


# -- the README example -----------------------------------------------------------------------


def test_three_node_example_on_the_shared_session(session, capsys):
    """plan -> (draft-a, draft-b) -> merge on sim/default: exit code 0, one line per node."""
    assert run(example_three_nodes.main(session, model="sim/default")) == 0

    printed = capsys.readouterr().out
    for label in ("plan", "draft-a", "draft-b", "merge"):
        assert f"\n{label} " in printed
    assert "run completed: 4 nodes" in printed


def test_three_node_example_against_the_http_server(session, server, capsys):
    """The same graph with an explicit provider/model: four chat completions on the server."""
    name = unique("http")
    code = run(example_three_nodes.main(session, model=f"{name}/m", provider=http_provider(server.base_url, name)))

    assert code == 0
    assert len(server.requests) == 4
    assert {request.body["model"] for request in server.requests} == {"m"}
    assert "run completed: 4 nodes" in capsys.readouterr().out


def test_three_node_example_exits_non_zero_when_the_run_fails(session, capsys):
    """The graph against a closed port: every node fails, the exit code is 1, the error type is printed."""
    name = unique("refused")
    provider = http_provider(f"http://127.0.0.1:{closed_port()}/v1", name, max_retries=0)

    assert run(example_three_nodes.main(session, model=f"{name}/m", provider=provider)) == 1
    assert "ProviderUnavailable" in capsys.readouterr().out


def test_example_model_comes_from_the_environment_it_is_given():
    """No OPENAI_BASE_URL: sim/default; with it: openai/<OPENAI_MODEL or gpt-4.1-mini>. A dict, not os.environ."""
    assert example_three_nodes.model_from_environment({}) == ("sim/default", None)
    model, provider = example_three_nodes.model_from_environment({"OPENAI_BASE_URL": "http://127.0.0.1:1/v1"})
    assert model == "openai/gpt-4.1-mini"
    assert provider.base_url == "http://127.0.0.1:1/v1"
    model, _ = example_three_nodes.model_from_environment({"OPENAI_BASE_URL": "http://h/v1", "OPENAI_MODEL": "qwen3"})
    assert model == "openai/qwen3"
