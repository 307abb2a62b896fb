"""Model providers against a real OpenAI-compatible HTTP server on 127.0.0.1, and the rest.

Topology of most tests: test -> OpenAICompatibleProvider -> httpx -> loopback socket ->
OpenAIChatServer thread (scripted behaviour per request). No Ray, except the last test,
which caps one provider across two Ray worker processes through the ProviderLimiter actor.
"""

from __future__ import annotations

import asyncio
import email.utils
import pickle
import socket
import time
from typing import Any

import aiohttp
import httpx
import openai_server as srv  # tests/support: a real chat-completions server on loopback
import pydantic
import pytest
import ray

from opgraph.actors import models
from opgraph.actors.models import (
    ChatRequest,
    ChatResponse,
    ModelIdentityError,
    ProviderConfigError,
    ProviderError,
    ProviderHTTPError,
    ProviderRateLimited,
    ProviderRefusal,
    ProviderResponseError,
    ProviderTimeout,
    ProviderTruncated,
    ProviderUnavailable,
    ToolCall,
    Usage,
    parse_model_id,
)
from opgraph.actors.providers import (
    ENVIRONMENT_SETTINGS,
    AnthropicProvider,
    OpenAICompatibleProvider,
    PermitTable,
    RetryPolicy,
    ScriptedProvider,
    SimulatedProvider,
    builtin_provider,
    clear_builtin_providers,
    environment_providers,
    forget_rate_limited_providers,
    provider_from_environment,
    provider_slot,
    reset_usage_totals,
    retry_after_seconds,
    usage_totals,
)
from opgraph.actors.providers.limits import LIMITER_NAME

USER = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello server"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


@pytest.fixture(scope="module")
def server():
    with srv.OpenAIChatServer() as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_usage():
    reset_usage_totals()
    forget_rate_limited_providers()  # a 429 in one test must not gate the next one's calls
    yield


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def call(base_url: str, request: ChatRequest, **options: Any) -> ChatResponse:
    options.setdefault("backoff", 0.01)
    async with OpenAICompatibleProvider(base_url, api_key="sk-test", **options) as provider:
        return await provider.complete(request)


def raised(base_url: str, request: ChatRequest, **options: Any) -> ProviderError:
    """The ProviderError a call raises; any other type (an httpx one above all) fails the test."""
    try:
        run(call(base_url, request, **options))
    except ProviderError as exc:
        return exc
    except BaseException as exc:  # noqa: BLE001 - the point is to report what leaked
        pytest.fail(f"{type(exc).__module__}.{type(exc).__name__} escaped the provider: {exc}")
    pytest.fail("the call succeeded")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- OpenAI-compatible over real HTTP --------------------------------------------------------


def test_success_returns_text_usage_and_sends_the_model_name(server):
    """test -> provider -> server: Reply("hi there")."""
    before = len(server.requests)
    server.script(srv.Reply("hi there"))
    response = run(call(server.base_url, ChatRequest("openai/gpt-test", USER, temperature=0.2, max_tokens=50)))
    assert response.content == "hi there"
    assert response.provider == "openai" and response.model == "openai/gpt-test"
    assert response.finish_reason == "stop" and response.retries == 0
    assert response.usage.prompt_tokens > 0 and response.usage.completion_tokens == len("hi there")
    (received,) = server.requests[before:]
    assert received.path == "/v1/chat/completions"
    assert received.headers["Authorization"] == "Bearer sk-test"
    assert received.body == {"model": "gpt-test", "messages": USER, "temperature": 0.2, "max_tokens": 50}


def test_model_name_keeps_slashes_after_the_provider_prefix(server):
    before = len(server.requests)
    response = run(call(server.base_url, ChatRequest("vllm/meta-llama/Llama-3-8B", USER), name="vllm"))
    assert response.content == "echo: hello server" and response.provider == "vllm"
    assert server.requests[before].body["model"] == "meta-llama/Llama-3-8B"


def test_tool_calls_are_parsed_into_dicts(server):
    before = len(server.requests)
    server.script(srv.ToolCallReply("lookup", {"query": "weather", "days": 3}, call_id="call_7"))
    response = run(call(server.base_url, ChatRequest("openai/m", USER, tools=[WEATHER_TOOL])))
    assert response.content is None and response.finish_reason == "tool_calls"
    assert response.tool_calls == [ToolCall(id="call_7", name="lookup", arguments={"query": "weather", "days": 3})]
    assert server.requests[before].body["tools"] == [WEATHER_TOOL]


def test_bare_function_schemas_and_dict_arguments_in_history_are_wired_as_openai_expects(server):
    before = len(server.requests)
    bare = WEATHER_TOOL["function"]
    history = [*USER, {"role": "assistant", "content": None,
                       "tool_calls": [ToolCall("call_1", "lookup", {"query": "x"})]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    run(call(server.base_url, ChatRequest("openai/m", history, tools=[bare])))
    body = server.requests[before].body
    assert body["tools"] == [WEATHER_TOOL]
    assert body["messages"][2]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"query": "x"}'}


class Forecast(pydantic.BaseModel):
    city: str
    days: int
    rain: list[float]
    windy: bool | None = None


def test_structured_output_is_json_matching_the_schema(server):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "Forecast", "schema": Forecast.model_json_schema(), "strict": True}}
    before = len(server.requests)
    response = run(call(server.base_url, ChatRequest("openai/structured", USER, response_format=response_format)))
    forecast = Forecast.model_validate_json(response.content)
    assert forecast.city.startswith("from-server") and forecast.days >= 1 and forecast.rain
    assert server.requests[before].body["response_format"] == response_format


def test_429_with_retry_after_is_retried_after_waiting(server):
    """429 (Retry-After: 0.2) -> wait >= 0.2 s -> 200."""
    before = len(server.requests)
    server.script(srv.Status(429, retry_after="0.2"), srv.Reply("after the wait"))
    started = time.monotonic()
    response = run(call(server.base_url, ChatRequest("openai/m", USER), backoff=5.0))
    elapsed = time.monotonic() - started
    assert response.content == "after the wait" and response.retries == 1
    assert elapsed >= 0.2
    assert elapsed < 4.0  # Retry-After replaced the 5 s backoff
    first, second = server.requests[before:]
    assert second.received - first.received >= 0.2
    assert usage_totals()["openai"]["retries"] == 1


def test_429_on_every_attempt_is_rate_limited(server):
    """Without adaptive admission a 429 is one of the max_retries."""
    before = len(server.requests)
    server.script(*[srv.Status(429, retry_after="0")] * 3)
    error = raised(server.base_url, ChatRequest("openai/m", USER), max_retries=2, adaptive=False)
    assert type(error) is ProviderRateLimited and error.status == 429 and error.provider == "openai"
    assert len(server.requests) - before == 3


def test_adaptive_429s_are_waited_out_until_the_patience_runs_out(server):
    """Adaptive (default): 429 x 4 -> waited out beyond max_retries=1 -> 200; then 429s whose
    Retry-After totals more than rate_limit_patience -> ProviderRateLimited."""
    before = len(server.requests)
    server.script(*[srv.Status(429, retry_after="0.01")] * 4, srv.Reply("patient"))
    response = run(call(server.base_url, ChatRequest("openai/m", USER), max_retries=1))
    assert response.content == "patient" and response.retries == 4
    assert len(server.requests) - before == 5
    server.script(srv.Status(429, retry_after="0.2"), srv.Status(429, retry_after="0.2"), srv.Reply("never sent"))
    error = raised(server.base_url, ChatRequest("openai/m", USER), rate_limit_patience=0.3)
    assert type(error) is ProviderRateLimited and error.status == 429
    server.script()  # the scripted reply is still queued: take it off for the next test
    assert run(call(server.base_url, ChatRequest("openai/m", USER))).content == "never sent"


def test_5xx_exhausting_retries_is_unavailable(server):
    before = len(server.requests)
    server.script(srv.Status(502), srv.Status(503), srv.Status(500))
    error = raised(server.base_url, ChatRequest("openai/m", USER), max_retries=2)
    assert type(error) is ProviderUnavailable and error.status == 500
    assert "after 3 attempts" in str(error)
    assert len(server.requests) - before == 3


def test_5xx_then_success_counts_retries(server):
    server.script(srv.Status(503), srv.Status(500), srv.Reply("third time"))
    response = run(call(server.base_url, ChatRequest("openai/m", USER)))
    assert response.content == "third time" and response.retries == 2


def test_connection_dropped_mid_request_is_retried(server):
    server.script(srv.Hangup(), srv.Reply("reconnected"))
    response = run(call(server.base_url, ChatRequest("openai/m", USER)))
    assert response.content == "reconnected" and response.retries == 1


def test_other_4xx_is_not_retried(server):
    before = len(server.requests)
    server.script(srv.Status(400, body='{"error": {"message": "bad field"}}'))
    error = raised(server.base_url, ChatRequest("openai/m", USER))
    assert type(error) is ProviderHTTPError and error.status == 400 and "bad field" in str(error)
    assert len(server.requests) - before == 1


def test_timeout_raises_provider_timeout_without_retrying(server):
    """Slow(5 s) against a 0.3 s request timeout; the server is released when it stops."""
    before = len(server.requests)
    server.script(srv.Slow(5.0))
    started = time.monotonic()
    error = raised(server.base_url, ChatRequest("openai/m", USER, timeout=0.3))
    assert type(error) is ProviderTimeout and error.provider == "openai"
    assert 0.3 <= time.monotonic() - started < 2.0
    assert len(server.requests) - before == 1


def test_provider_default_timeout_applies_without_a_request_timeout(server):
    server.script(srv.Slow(5.0))
    error = raised(server.base_url, ChatRequest("openai/m", USER), timeout=0.2)
    assert type(error) is ProviderTimeout


@pytest.mark.parametrize("behaviour, expected", [
    (srv.Malformed("this is not json"), "not JSON"),
    (srv.Malformed('{"id": "chatcmpl-1", "object": "chat.completion"}'), "no choices"),
    (srv.Malformed('{"choices": []}'), "no choices"),
    (srv.Malformed('["a", "list"]'), "not a JSON object"),
    (srv.ToolCallReply("lookup", '{"query": '), "arguments are not JSON"),
])
def test_malformed_body_is_a_response_error(server, behaviour, expected):
    server.script(behaviour)
    error = raised(server.base_url, ChatRequest("openai/m", USER))
    assert type(error) is ProviderResponseError and error.status == 200
    assert expected in str(error)


def test_connection_refused_is_unavailable_after_retries():
    port = free_port()  # bound then closed: nothing listens there
    started = time.monotonic()
    error = raised(f"http://127.0.0.1:{port}/v1", ChatRequest("openai/m", USER), max_retries=2)
    assert type(error) is ProviderUnavailable and error.status is None
    # The default client is aiohttp's; its refusal is what the ProviderError was raised from.
    assert "after 3 attempts" in str(error) and isinstance(error.__cause__, aiohttp.ClientConnectorError)
    assert time.monotonic() - started < 5.0
    assert usage_totals()["openai"] == {"prompt_tokens": 0, "completion_tokens": 0, "cache_read_tokens": 0,
                                        "cache_creation_tokens": 0, "calls": 0, "retries": 2, "failures": 1}


def test_base_url_without_scheme_is_a_config_error():
    error = raised("127.0.0.1:1/v1", ChatRequest("openai/m", USER))
    assert type(error) is ProviderConfigError


def test_usage_totals_add_up_tokens_calls_and_retries(server):
    server.script(srv.Reply("one"), srv.Status(503, retry_after="0"), srv.Reply("two"))

    async def two_calls() -> list[ChatResponse]:
        async with OpenAICompatibleProvider(server.base_url, api_key="k", name="local", backoff=0.01) as provider:
            return [await provider.complete(ChatRequest("local/m", USER)) for _ in range(2)]

    responses = run(two_calls())
    totals = usage_totals()["local"]
    assert totals == {
        "prompt_tokens": sum(r.usage.prompt_tokens for r in responses),
        "completion_tokens": sum(r.usage.completion_tokens for r in responses),
        "cache_read_tokens": 0, "cache_creation_tokens": 0, "calls": 2, "retries": 1, "failures": 0,
    }


def test_provider_pickles_and_works_in_another_event_loop(server):
    provider = OpenAICompatibleProvider(server.base_url, api_key="k")

    async def once(p: OpenAICompatibleProvider) -> str | None:
        try:
            return (await p.complete(ChatRequest("openai/m", USER))).content
        finally:
            await p.aclose()

    assert run(once(provider)) == "echo: hello server"
    copy = pickle.loads(pickle.dumps(provider))
    assert run(once(copy)) == "echo: hello server"


def test_provider_concurrency_cap_holds_within_a_process(server):
    """Six calls, concurrency=2: at most two reach the slow server at once."""
    server.script(*[srv.Slow(0.1, then=srv.Reply("ok"))] * 6)
    provider = OpenAICompatibleProvider(server.base_url, api_key="k", name="capped", concurrency=2)
    in_flight = peak = 0
    original = provider._http._attempt

    async def counted(*args: Any, **options: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await original(*args, **options)
        finally:
            in_flight -= 1

    provider._http._attempt = counted

    async def six() -> list[ChatResponse]:
        async with provider:
            return await asyncio.gather(*[provider.complete(ChatRequest("capped/m", USER)) for _ in range(6)])

    assert [r.content for r in run(six())] == ["ok"] * 6
    assert peak == 2


# -- pure pieces -----------------------------------------------------------------------------


def test_retry_after_reads_seconds_and_http_dates():
    now = 1_700_000_000.0
    assert retry_after_seconds("0.2") == pytest.approx(0.2)
    assert retry_after_seconds(" 3 ") == 3.0
    assert retry_after_seconds(email.utils.formatdate(now + 7, usegmt=True), now=now) == pytest.approx(7.0)
    assert retry_after_seconds(email.utils.formatdate(now - 7, usegmt=True), now=now) == 0.0
    assert retry_after_seconds("soon") is None and retry_after_seconds(None) is None


def test_backoff_grows_jitters_and_is_capped():
    import random

    policy = RetryPolicy(backoff=1.0, max_delay=5.0)
    rng = random.Random(1)
    for retry, base in [(0, 1.0), (1, 2.0), (2, 4.0), (5, 5.0)]:
        assert base / 2 <= policy.delay(retry, None, rng) <= base
    assert policy.delay(0, 60.0, rng) == 5.0  # Retry-After is capped by max_delay
    assert policy.delay(3, 0.25, rng) == 0.25


@pytest.mark.parametrize("bad", ["gpt-4", "", "/gpt-4", "openai/", None])
def test_model_id_without_provider_names_the_expected_form(bad):
    with pytest.raises(ModelIdentityError, match="provider/model"):
        parse_model_id(bad)


def test_model_id_splits_at_the_first_slash():
    assert parse_model_id("openai/gpt-4.1-mini") == ("openai", "gpt-4.1-mini")
    assert parse_model_id("ollama/library/llama3:8b") == ("ollama", "library/llama3:8b")


def test_complete_rejects_a_model_without_provider(server):
    error = raised(server.base_url, ChatRequest("gpt-4", USER))
    assert type(error) is ModelIdentityError


ERROR_TYPES = [ProviderError, ModelIdentityError, ProviderConfigError, ProviderTimeout, ProviderRateLimited,
               ProviderUnavailable, ProviderHTTPError, ProviderResponseError, ProviderRefusal,
               ProviderTruncated]


@pytest.mark.parametrize("error_type", ERROR_TYPES)
def test_every_provider_error_pickles_with_provider_and_status(error_type):
    error = error_type("it failed", provider="openai", status=503, node_id="n1", branch_id="b1")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is error_type and copy.message == "it failed" and str(copy) == str(error)
    assert (copy.provider, copy.status, copy.node_id, copy.branch_id) == ("openai", 503, "n1", "b1")


def test_the_error_list_covers_the_tree():
    declared = {getattr(models, name) for name in models.__all__}
    tree = {t for t in declared if isinstance(t, type) and issubclass(t, ProviderError)}
    assert tree == set(ERROR_TYPES)


# -- Anthropic through httpx.MockTransport ---------------------------------------------------


def anthropic_reply(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
        "content": [{"type": "text", "text": "Let me look. "},
                    {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"query": "tides"}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 21, "output_tokens": 9},
    })


def test_anthropic_request_and_response_mapping():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return anthropic_reply(request)

    history = [*USER, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "toolu_0", "type": "function",
                                       "function": {"name": "lookup", "arguments": '{"query": "moon"}'}}]},
               {"role": "tool", "tool_call_id": "toolu_0", "content": "full"},
               {"role": "user", "content": "and tides?"}]
    request = ChatRequest("anthropic/claude-test", history, tools=[WEATHER_TOOL], max_tokens=300, temperature=0.0,
                          response_format={"type": "json_schema", "json_schema": {"name": "F", "schema": {
                              "type": "object", "properties": {"a": {"type": "string"}}}}})

    async def go() -> ChatResponse:
        async with AnthropicProvider("ak-test", "https://anthropic.test", transport=httpx.MockTransport(handler),
                                     backoff=0.01) as provider:
            return await provider.complete(request)

    response = run(go())
    (sent,) = seen
    assert sent.url == "https://anthropic.test/v1/messages"
    assert sent.headers["x-api-key"] == "ak-test" and sent.headers["anthropic-version"] == "2023-06-01"
    body = httpx.Response(200, content=sent.content).json()
    assert body["model"] == "claude-test" and body["max_tokens"] == 300
    assert "temperature" not in body  # the Messages API's request type no longer takes it
    assert body["system"].startswith("be brief") and '"a"' in body["system"]
    assert body["tools"] == [{"name": "lookup", "description": "Look something up.",
                              "input_schema": WEATHER_TOOL["function"]["parameters"]}]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hello server"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "lookup",
                                           "input": {"query": "moon"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0", "content": "full"},
                                     {"type": "text", "text": "and tides?"}]},
    ]
    assert response.content == "Let me look. "
    assert response.tool_calls == [ToolCall("toolu_1", "lookup", {"query": "tides"})]
    assert response.usage == Usage(21, 9) and response.finish_reason == "tool_calls"
    assert response.provider == "anthropic" and response.retries == 0


def test_anthropic_overloaded_is_retried_and_malformed_is_typed():
    answers = iter([httpx.Response(529, json={"type": "error"}), None,
                    httpx.Response(200, json={"content": "nope"})])

    def handler(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        return answer if answer is not None else anthropic_reply(request)

    async def go() -> tuple[ChatResponse, BaseException]:
        async with AnthropicProvider("k", "https://anthropic.test", transport=httpx.MockTransport(handler),
                                     backoff=0.01) as provider:
            first = await provider.complete(ChatRequest("anthropic/c", USER))
            try:
                await provider.complete(ChatRequest("anthropic/c", USER))
            except ProviderError as exc:
                return first, exc
            pytest.fail("a malformed body was accepted")

    response, error = run(go())
    assert response.retries == 1 and response.tool_calls
    assert type(error) is ProviderResponseError and error.provider == "anthropic"


def test_anthropic_transport_errors_do_not_leak_httpx_types():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async def go() -> None:
        async with AnthropicProvider("k", "https://anthropic.test", transport=httpx.MockTransport(handler)) as p:
            await p.complete(ChatRequest("anthropic/c", USER))

    with pytest.raises(ProviderTimeout):
        run(go())


# -- scripted and simulated ------------------------------------------------------------------


def reply_by_prompt(request: ChatRequest) -> Any:
    text = request.messages[-1]["content"]
    if text == "tool please":
        return {"tool_calls": [{"name": "lookup", "arguments": {"query": "q"}}]}
    if text == "fail":
        return ProviderUnavailable("scripted outage", provider="scripted", status=503)
    return f"you said {text}"


def test_scripted_callable_answers_from_the_request():
    provider = ScriptedProvider(reply_by_prompt)

    async def go() -> list[ChatResponse]:
        return [await provider.complete(ChatRequest("scripted/x", [{"role": "user", "content": text}]))
                for text in ("hi", "tool please")]

    plain, tool = run(go())
    assert plain.content == "you said hi" and plain.provider == "scripted" and plain.model == "scripted/x"
    assert tool.tool_calls == [ToolCall("call_0", "lookup", {"query": "q"})] and tool.finish_reason == "tool_calls"
    with pytest.raises(ProviderUnavailable, match="scripted outage"):
        run(provider.complete(ChatRequest("scripted/x", [{"role": "user", "content": "fail"}])))
    assert usage_totals()["scripted"]["calls"] == 2 and usage_totals()["scripted"]["failures"] == 1


def test_scripted_async_callable():
    async def later(request: ChatRequest) -> str:
        await asyncio.sleep(0)
        return "async reply"

    assert run(ScriptedProvider(later).complete(ChatRequest("scripted/x", USER))).content == "async reply"


def test_scripted_list_is_consumed_in_order_then_runs_out():
    provider = ScriptedProvider(["first", {"content": "second", "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
                                 ChatResponse(content="third", finish_reason="length")])
    request = ChatRequest("scripted/x", USER)
    first = run(provider.complete(request))
    copy = pickle.loads(pickle.dumps(provider))  # a worker gets the list as it stands
    second, third = run(provider.complete(request)), run(provider.complete(request))
    assert [first.content, second.content, third.content] == ["first", "second", "third"]
    assert second.usage == Usage(5, 2) and third.finish_reason == "length" and third.provider == "scripted"
    with pytest.raises(ProviderConfigError, match="ran out of replies after 3"):
        run(provider.complete(request))
    assert copy.remaining == 2 and run(copy.complete(request)).content == "second"


def test_scripted_rejects_bad_replies():
    with pytest.raises(ProviderConfigError, match="unknown keys"):
        run(ScriptedProvider([{"text": "typo"}]).complete(ChatRequest("scripted/x", USER)))
    with pytest.raises(ProviderConfigError):
        ScriptedProvider(42)


def test_sim_sleeps_its_latency_and_reports_tokens():
    provider = SimulatedProvider(latency=0.1, completion_tokens=7, prompt_tokens=11)
    started = time.monotonic()
    response = run(provider.complete(ChatRequest("sim/default", USER)))
    assert time.monotonic() - started >= 0.1
    assert response.usage == Usage(11, 7) and "hello server" in response.content
    assert response.content == run(provider.complete(ChatRequest("sim/default", USER))).content  # deterministic
    assert usage_totals()["sim"] == {"prompt_tokens": 22, "completion_tokens": 14, "cache_read_tokens": 0,
                                     "cache_creation_tokens": 0, "calls": 2, "retries": 0, "failures": 0}


def test_sim_instant_preset_and_estimated_prompt_tokens():
    provider = SimulatedProvider(latency=5.0)
    started = time.monotonic()
    response = run(provider.complete(ChatRequest("sim/instant", [{"role": "user", "content": "x" * 400}])))
    assert time.monotonic() - started < 1.0
    assert response.usage.prompt_tokens == 100


def test_sim_seeded_failure_rate_is_reproducible():
    def outcomes(seed: int) -> list[bool]:
        provider = SimulatedProvider(latency=0.0, failure_rate=0.5, seed=seed)

        async def go() -> list[bool]:
            results = []
            for _ in range(40):
                try:
                    await provider.complete(ChatRequest("sim/default", USER))
                    results.append(True)
                except ProviderUnavailable as exc:
                    assert exc.provider == "sim" and exc.status == 503
                    results.append(False)
            return results

        return run(go())

    first = outcomes(7)
    assert first == outcomes(7)
    assert 5 < first.count(False) < 35
    assert first != outcomes(8)


def test_sim_structured_output_fits_the_schema():
    response_format = {"type": "json_schema", "json_schema": {"name": "F", "schema": Forecast.model_json_schema()}}
    response = run(SimulatedProvider(latency=0).complete(ChatRequest("sim/x", USER, response_format=response_format)))
    Forecast.model_validate_json(response.content)


# -- built-ins -------------------------------------------------------------------------------


def test_builtin_providers(monkeypatch):
    clear_builtin_providers()
    try:
        assert isinstance(builtin_provider("sim"), SimulatedProvider)
        assert builtin_provider("sim") is builtin_provider("sim")
        with pytest.raises(ProviderConfigError, match=r"register_provider\(\"scripted\""):
            builtin_provider("scripted")
        with pytest.raises(ProviderConfigError, match="openai, anthropic, sim"):
            builtin_provider("mystery")
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
        with pytest.raises(ProviderConfigError, match="OPENAI_API_KEY"):
            builtin_provider("openai")
        monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
        local = builtin_provider("openai")
        assert isinstance(local, OpenAICompatibleProvider) and local.base_url == "http://127.0.0.1:8000/v1"
        monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
        monkeypatch.delenv("ANTHROPIC_BASE_URL", raising=False)
        with pytest.raises(ProviderConfigError, match="ANTHROPIC_API_KEY"):
            builtin_provider("anthropic")
        monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
        assert isinstance(builtin_provider("anthropic"), AnthropicProvider)
    finally:
        clear_builtin_providers()


# -- concurrency permits ---------------------------------------------------------------------


def test_permit_table_caps_holders_and_backs_out_abandoned_tokens():
    async def go() -> None:
        table = PermitTable()
        assert await table.acquire("p", 1, "a")
        waiter = asyncio.create_task(table.acquire("p", 1, "b"))
        await asyncio.sleep(0)
        assert not waiter.done() and table.statistics()["p"]["waiting"] == 1
        assert not await table.release("p", "b")  # b gave up while queued
        assert await asyncio.wait_for(waiter, 1.0) is False
        assert await table.release("p", "a")
        assert not await table.release("p", "a")  # twice is harmless
        assert not await table.acquire("p", 1, "a")  # ...but a late acquire of a released token backs out
        assert table.statistics()["p"] == {"limit": 1, "in_use": 0, "waiting": 0, "granted": 1}

    run(go())


def test_provider_slot_rejects_a_bad_limit():
    async def go() -> None:
        async with provider_slot("p", 0):
            pass

    with pytest.raises(ProviderConfigError):
        run(go())


async def hold_slots_async(gauge: Any, key: str, count: int, limit: int) -> int:
    async def one() -> None:
        async with provider_slot(key, limit):
            await gauge.enter.remote(key)
            await asyncio.sleep(0.1)
            await gauge.exit.remote(key)

    await asyncio.gather(*[one() for _ in range(count)])
    return count


@ray.remote(num_cpus=0)
def hold_slots(gauge: Any, key: str, count: int, limit: int) -> int:
    return asyncio.run(hold_slots_async(gauge, key, count, limit))


@pytest.mark.ray
def test_limiter_caps_a_provider_across_worker_processes(session, gauge):
    """Ray task (own process) x 4 slots + driver x 4 slots -> ProviderLimiter(limit 2) -> Gauge.

    The driver starts once the task holds a permit, so the two processes contend.
    """
    key = "limited-provider"
    task = hold_slots.remote(gauge, key, 4, 2)

    async def driver_side() -> int:
        await asyncio.wait_for(gauge.wait_entered.remote(key, 1), timeout=30)
        return await hold_slots_async(gauge, key, 4, 2)

    assert run(driver_side()) == 4
    assert ray.get(task, timeout=30) == 4
    snapshot = ray.get(gauge.snapshot.remote(key), timeout=10)
    assert snapshot["entered"] == 8 and snapshot["peak"] == 2
    limiter = ray.get_actor(LIMITER_NAME)
    deadline = time.monotonic() + 10
    while True:  # releases are fire-and-forget from other processes: bounded wait for them
        statistics = ray.get(limiter.statistics.remote(), timeout=10)[key]
        if statistics["in_use"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert statistics == {"limit": 2, "in_use": 0, "waiting": 0, "granted": 8}


# -- settings, refusals, Anthropic's empty turns and cache tokens (issue 14) ------------------


def test_timeout_and_max_tokens_come_from_the_environment_with_documented_defaults(server):
    """The built-in openai/ provider: 600 s per attempt unless OPENAI_TIMEOUT says otherwise
    (60 s failed nodes of a slow local model), OPENAI_MAX_TOKENS when a request names none;
    a request's own timeout and max_tokens win."""
    default = provider_from_environment("openai", {"OPENAI_BASE_URL": server.base_url})
    assert default._http.timeout == 600.0 and default.max_tokens is None
    assert "[600" in ENVIRONMENT_SETTINGS["openai"]["OPENAI_TIMEOUT"]  # documented where it is read
    configured = provider_from_environment("openai", {"OPENAI_BASE_URL": server.base_url, "OPENAI_TIMEOUT": "0.3",
                                                      "OPENAI_MAX_TOKENS": "64"})
    before = len(server.requests)
    server.script(srv.Slow(1.0), srv.Slow(0.3, srv.Reply("in time")), srv.Reply("capped"))

    async def go() -> tuple[ProviderError, ChatResponse, ChatResponse]:
        async with configured:
            try:
                await configured.complete(ChatRequest("openai/slow", USER))
            except ProviderTimeout as exc:
                late = exc
            patient = await configured.complete(ChatRequest("openai/slow", USER, timeout=5.0, max_tokens=8))
            capped = await configured.complete(ChatRequest("openai/m", USER))
            return late, patient, capped

    late, patient, capped = run(go())
    assert "0.3 s" in late.message and "OPENAI_TIMEOUT" in late.message
    assert patient.content == "in time" and capped.content == "capped"
    sent = [request.body for request in server.requests[before:]]
    assert [body.get("max_tokens") for body in sent] == [64, 8, 64]
    with pytest.raises(ProviderConfigError, match="OPENAI_TIMEOUT"):
        provider_from_environment("openai", {"OPENAI_BASE_URL": server.base_url, "OPENAI_TIMEOUT": "soon"})
    with pytest.raises(ProviderConfigError, match="above 0"):
        provider_from_environment("openai", {"OPENAI_BASE_URL": server.base_url, "OPENAI_MAX_TOKENS": "0"})
    anthropic = provider_from_environment("anthropic", {"ANTHROPIC_API_KEY": "k", "ANTHROPIC_MAX_TOKENS": "99",
                                                        "ANTHROPIC_TIMEOUT": "30"})
    assert anthropic.max_tokens == 99 and anthropic._http.timeout == 30.0


def test_only_the_providers_the_environment_configures_are_built_for_a_session(server):
    assert environment_providers({}) == {}
    built = environment_providers({"OPENAI_BASE_URL": server.base_url, "OPENAI_MAX_CONCURRENCY": "1"})
    assert set(built) == {"openai"} and built["openai"]._http.concurrency == 1
    # Set but incomplete (no key for api.openai.com): left to the built-in, which reports it on the node.
    assert environment_providers({"OPENAI_MAX_CONCURRENCY": "1"}) == {}


def test_an_openai_refusal_is_a_typed_error_with_its_words(server):
    server.script(srv.Refusal("I can't help with building that."))
    error = raised(server.base_url, ChatRequest("openai/gpt-test", USER))
    assert type(error) is ProviderRefusal
    assert error.refusal == "I can't help with building that." and "can't help" in error.message
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ProviderRefusal and copy.refusal == error.refusal and copy.provider == "openai"


def _anthropic(handler) -> AnthropicProvider:
    return AnthropicProvider("ak-test", "https://anthropic.test", transport=httpx.MockTransport(handler),
                             backoff=0.01)


def test_anthropic_leaves_empty_turns_out_of_the_history_it_sends():
    """user, assistant "" (an empty reply recorded on the branch), user "  ", user: the empty
    and blank turns are not sent; the two user turns that remain are one message."""
    seen: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.content)
        return anthropic_reply(request)

    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "  "}, {"role": "assistant", "content": None},
               {"role": "user", "content": "second"}]

    async def go() -> None:
        async with _anthropic(handler) as provider:
            await provider.complete(ChatRequest("anthropic/claude-test", history))

    run(go())
    body = httpx.Response(200, content=seen[0]).json()
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "first"},
                                                             {"type": "text", "text": "second"}]}]


def test_anthropic_cache_tokens_are_counted_and_a_refusal_is_typed():
    answers = iter([
        {"content": [{"type": "text", "text": "cached"}], "stop_reason": "end_turn",
         "usage": {"input_tokens": 5, "output_tokens": 7, "cache_read_input_tokens": 1200,
                   "cache_creation_input_tokens": 300}},
        {"content": [{"type": "text", "text": "I won't."}], "stop_reason": "refusal",
         "usage": {"input_tokens": 5, "output_tokens": 3}},
    ])

    async def go() -> tuple[ChatResponse, ProviderError]:
        async with _anthropic(lambda request: httpx.Response(200, json=next(answers))) as provider:
            response = await provider.complete(ChatRequest("anthropic/claude-test", USER))
            try:
                await provider.complete(ChatRequest("anthropic/claude-test", USER))
            except ProviderRefusal as exc:
                return response, exc
        pytest.fail("the refusal was not raised")

    response, refusal = run(go())
    assert response.usage == Usage(prompt_tokens=1505, completion_tokens=7, cache_read_tokens=1200,
                                   cache_creation_tokens=300)
    assert usage_totals()["anthropic"]["cache_read_tokens"] == 1200
    assert usage_totals()["anthropic"]["prompt_tokens"] == 1505
    assert refusal.refusal == "I won't."


def test_openai_cached_prompt_tokens_are_reported():
    body = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 2000, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1536}}}
    provider = OpenAICompatibleProvider("http://127.0.0.1:1/v1", api_key="k")
    response = provider.parse_body(body, ChatRequest("openai/m", USER))
    assert response.usage == Usage(prompt_tokens=2000, completion_tokens=3, cache_read_tokens=1536)
