"""Adaptive admission under provider rate limits.

Pure tests drive ``AdaptiveLimit`` with a fake clock. The Ray test runs a fan-out of model
calls: flow -> executor -> 2 workers -> OpenAICompatibleProvider (adaptive, the gate in the
ProviderLimiter actor) -> RateLimitedChatServer on 127.0.0.1 (429 + Retry-After above its
RPM/TPM). It asserts no node failed and every 429's wait was honoured.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from opgraph.actors.models import ProviderConfigError
from opgraph.actors.providers import (
    AdaptiveGate,
    AdaptiveLimit,
    OpenAICompatibleProvider,
    RateBudget,
    adaptive_statistics,
    forget_rate_limited_providers,
    provider_from_environment,
)
from opgraph.actors.providers.http import estimated_tokens, reported_tokens, server_wait_seconds
from opgraph.cluster.bench.goodput import CALL, fanout_of_calls, goodput_call
from opgraph.cluster.bench.provider_server import RateLimitedChatServer


def test_first_429_paces_at_the_pass_rate_and_pauses_for_retry_after():
    """10 successes in 1 s, then a 429 (Retry-After 0.5 s): rate = 90% of the 5/s passed over
    the last 2 s, nothing starts for 0.5 s, then calls start 1/rate apart."""
    limit = AdaptiveLimit(RateBudget(), now=0.0)
    assert limit.rate is not None  # gated after a 429 already: paced from the start
    limit.rate = None  # as a budget-gated provider before its first 429
    for step in range(10):
        now = step * 0.1
        assert limit.wait_for(10, now) == 0
        granted = limit.grant(10, now)
        limit.settle(granted_at=now, outcome="ok", retry_after=None, estimated=10, charged=granted, reported=12,
                     now=now + 0.05)
    limit.grant(10, 1.0)
    limit.settle(granted_at=1.0, outcome="rate_limited", retry_after=0.5, estimated=10, charged=0.0, reported=None,
                 now=1.0)
    assert limit.rate == pytest.approx(0.9 * 10 / 2.0)
    assert limit.wait_for(10, 1.2) == pytest.approx(0.3)  # paused for the Retry-After
    assert limit.wait_for(10, 1.5) == 0
    limit.grant(10, 1.5)
    assert limit.wait_for(10, 1.5) == pytest.approx(1 / limit.rate)  # the next one is spaced
    assert limit.counts["decreases"] == 1


def test_a_429_for_a_call_granted_before_the_last_cut_does_not_cut_again():
    limit = AdaptiveLimit(RateBudget(), now=0.0)
    limit.rate = 100.0
    limit.probing = False
    for at in (0.0, 0.01):
        limit.grant(1, at)
    limit.settle(granted_at=0.0, outcome="rate_limited", retry_after=None, estimated=1, charged=0.0, reported=None,
                 now=0.2)
    limit.settle(granted_at=0.01, outcome="rate_limited", retry_after=None, estimated=1, charged=0.0, reported=None,
                 now=0.21)
    assert limit.rate == pytest.approx(85.0) and limit.counts["decreases"] == 1


def test_budget_spends_requests_and_tokens_and_credits_what_the_server_reports():
    """60 RPM / 600 TPM: one request a second; a call estimated at 100 tokens that used 20
    gets 80 back."""
    limit = AdaptiveLimit(RateBudget(requests_per_minute=60, tokens_per_minute=600), now=0.0)
    assert limit.wait_for(100, 0.0) == 0
    charged = limit.grant(100, 0.0)
    assert charged == 100
    assert limit.requests.wait_for(1, 0.0) == pytest.approx(1.0)  # one request a second
    assert limit.wait_for(100, 0.0) == pytest.approx(10.0)  # tokens 90 in debt: a full bucket (10) at 10/s
    limit.settle(granted_at=0.0, outcome="ok", retry_after=None, estimated=100, charged=charged, reported=20,
                 now=0.0)
    assert limit.tokens.level == pytest.approx(10 - 100 + 80)
    with pytest.raises(ProviderConfigError):
        RateBudget(requests_per_minute=0)


def test_waits_tokens_and_settings_are_read_the_way_servers_and_users_write_them():
    assert server_wait_seconds({"retry-after": "1", "retry-after-ms": "250"}) == pytest.approx(0.25)
    assert server_wait_seconds({"retry-after": "2"}) == 2.0 and server_wait_seconds({}) is None
    assert estimated_tokens({"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 5}) == 15
    assert reported_tokens({"usage": {"total_tokens": 9}}) == 9
    assert reported_tokens({"usage": {"input_tokens": 3, "output_tokens": 4}}) == 7  # Anthropic's shape
    assert reported_tokens({"choices": []}) is None
    environ = {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_MAX_RPM": "500", "OPENAI_MAX_TPM": "30000"}
    configured = provider_from_environment("openai", environ)
    assert configured._http.budget == RateBudget(500.0, 30000.0) and configured._http.adaptive
    fixed = provider_from_environment("openai", {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_ADAPTIVE": "0"})
    assert fixed._http.adaptive is False
    with pytest.raises(ProviderConfigError, match="OPENAI_ADAPTIVE"):
        provider_from_environment("openai", {"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "OPENAI_ADAPTIVE": "yes"})
    with pytest.raises(ProviderConfigError, match="adaptive"):
        OpenAICompatibleProvider("http://127.0.0.1:9/v1", adaptive=False, requests_per_minute=60)


def test_gate_withdraws_a_queued_call_whose_caller_gave_up():
    async def go() -> None:
        gate = AdaptiveGate()
        budget = RateBudget(max_concurrency=1)
        assert await gate.acquire("p", budget, 1, "a") is not None
        waiter = asyncio.create_task(gate.acquire("p", budget, 1, "b"))
        await asyncio.sleep(0)
        assert gate.statistics()["p"]["waiting"] == 1
        assert gate.settle("p", "b", "failed") is False  # b gave up while queued
        assert await asyncio.wait_for(waiter, 1.0) is None
        assert gate.settle("p", "a", "ok") is True
        assert gate.statistics()["p"]["in_flight"] == 0

    asyncio.run(go())


@pytest.mark.ray
def test_fan_out_against_a_rate_limited_server_fails_no_node_and_honours_every_429(session):
    """120 calls, all at once -> a server allowing 40 req/s: 0 failed nodes, 429s answered,
    none retried before its Retry-After, and after them the calls went through the gate."""
    forget_rate_limited_providers()
    session.register_operation(CALL, goodput_call)
    with RateLimitedChatServer(rpm=2400, tpm=None, latency=0.05) as server:
        session.register_provider("goodput-test", OpenAICompatibleProvider(server.base_url, api_key="k",
                                                                          name="goodput-test", max_retries=0))
        envelope = asyncio.run(session.flow(fanout_of_calls(120, "goodput-test/m"), max_concurrent=120))
        counts = server.counts
    statuses = list(envelope["operation_statuses"].values())
    assert envelope["status"] == "completed" and statuses.count("completed") == 120
    assert counts.accepted == 120 and counts.rejected > 0  # it was rate-limited, and waited it out
    assert counts.early_retries == 0
    deadline = time.monotonic() + 10
    while True:  # settlements are fire-and-forget from the workers: a bounded wait for the last ones
        gate = asyncio.run(adaptive_statistics())["goodput-test"]  # the workers' shared gate, read from here
        if gate["in_flight"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert gate["granted"] > 0 and gate["rate"] is not None  # after their 429s the calls were paced
    assert gate["in_flight"] == 0 and gate["succeeded"] + gate["rate_limited"] + gate["failed"] == gate["granted"]
