"""Per-provider concurrency caps and adaptive admission shared across the cluster, and
per-process usage totals.

Owns the ``ProviderLimiter`` actor (one per namespace, named ``opgraph-provider-limiter``),
the ``provider_slot`` context manager that holds one of its permits, ``adaptive_slot``
(one admission through its ``AdaptiveGate``, reporting how the call went), and the token,
call and retry counters every provider updates. It makes no model calls itself.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import ray

from opgraph.kernel import OpGraphError

from ..calls import ProviderLimiterStub, ask, start
from ..models import ProviderConfigError, ProviderUnavailable, Usage
from ..statistics import LatencyHistogram
from .adaptive import AdaptiveGate, RateBudget

__all__ = [
    "LIMITER_NAME",
    "AdmissionTicket",
    "adaptive_slot",
    "adaptive_statistics",
    "PermitTable",
    "ProviderLimiter",
    "estimate_tokens",
    "provider_slot",
    "latency_totals",
    "record_call",
    "record_failure",
    "record_retry",
    "reset_usage_totals",
    "usage_totals",
]

LIMITER_NAME = "opgraph-provider-limiter"
LIMITER_CONCURRENCY = 100_000  # every waiting acquire occupies one slot of the async actor


# -- permits -------------------------------------------------------------------------------


@dataclass
class _ProviderPermits:
    limit: int
    holders: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)
    waiting: int = 0
    granted: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class PermitTable:
    """At most ``limit`` holders per provider; every permit is named by a caller's token.

    Tokens make release idempotent and cancel-safe: a caller that gives up while its
    acquire is still queued releases the token anyway, and the table marks it abandoned
    so the late acquire hands the permit straight back instead of leaking it.
    Runs on one event loop (inside the limiter actor, or in-process without Ray).
    """

    def __init__(self) -> None:
        self._providers: dict[str, _ProviderPermits] = {}

    def _permits(self, provider: str, limit: int) -> _ProviderPermits:
        permits = self._providers.get(provider)
        if permits is None:
            permits = self._providers[provider] = _ProviderPermits(limit)
        # The latest caller's limit wins, so a changed setting applies without a restart.
        permits.limit = limit
        return permits

    async def acquire(self, provider: str, limit: int, token: str) -> bool:
        """Wait for a permit; False when the token was released before it was granted."""
        permits = self._permits(provider, limit)
        async with permits.changed:
            if token in permits.abandoned:
                permits.abandoned.discard(token)
                return False
            permits.waiting += 1
            try:
                await permits.changed.wait_for(
                    lambda: len(permits.holders) < permits.limit or token in permits.abandoned
                )
            finally:
                permits.waiting -= 1
            if token in permits.abandoned:
                permits.abandoned.discard(token)
                permits.changed.notify_all()
                return False
            permits.holders.add(token)
            permits.granted += 1
            return True

    async def release(self, provider: str, token: str) -> bool:
        """Give back ``token``'s permit; True when it was held (releasing twice is harmless)."""
        permits = self._providers.get(provider)
        if permits is None:
            return False
        async with permits.changed:
            if token in permits.holders:
                permits.holders.discard(token)
                permits.changed.notify_all()
                return True
            # Not granted yet (or never will be): remember it so the acquire backs out.
            permits.abandoned.add(token)
            permits.changed.notify_all()
            return False

    def statistics(self) -> dict[str, dict[str, int]]:
        return {
            provider: {
                "limit": permits.limit,
                "in_use": len(permits.holders),
                "waiting": permits.waiting,
                "granted": permits.granted,
            }
            for provider, permits in self._providers.items()
        }


@ray.remote(num_cpus=0)
class ProviderLimiter:
    """The cluster-wide holder of every provider's permits (an async actor)."""

    def __init__(self) -> None:
        self._table = PermitTable()
        self._gate = AdaptiveGate()

    async def acquire(self, provider: str, limit: int, token: str) -> bool:
        return await self._table.acquire(provider, limit, token)

    async def release(self, provider: str, token: str) -> bool:
        return await self._table.release(provider, token)

    async def statistics(self) -> dict[str, dict[str, int]]:
        return self._table.statistics()

    async def admit(self, provider: str, budget: RateBudget, tokens: int, token: str) -> tuple[float, float] | None:
        return await self._gate.acquire(provider, budget, tokens, token)

    async def settle(self, provider: str, token: str, outcome: str, retry_after: float | None = None,
                     reported: int | None = None) -> bool:
        return self._gate.settle(provider, token, outcome, retry_after, reported)

    async def adaptive_statistics(self) -> dict[str, dict[str, Any]]:
        return self._gate.statistics()


_limiter_stub: ProviderLimiterStub | None = None
_local_tables: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PermitTable] = weakref.WeakKeyDictionary()
_local_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AdaptiveGate] = weakref.WeakKeyDictionary()


def _limiter() -> ProviderLimiterStub:
    """The namespace's limiter, found by name or started. Its tells (releases, settlements) go
    unwatched: nothing supervises the limiter, and a caller that gave up must not wait on it."""
    global _limiter_stub
    if _limiter_stub is None:
        # Detached: the limiter must outlive whichever worker happened to create it.
        options = {"name": LIMITER_NAME, "get_if_exists": True, "lifetime": "detached",
                   "max_concurrency": LIMITER_CONCURRENCY}
        _limiter_stub = ProviderLimiterStub(start(ProviderLimiter, options), LIMITER_NAME)
    return _limiter_stub


def _local_table() -> PermitTable:
    loop = asyncio.get_running_loop()
    table = _local_tables.get(loop)
    if table is None:
        table = _local_tables[loop] = PermitTable()
    return table


@asynccontextmanager
async def provider_slot(provider: str, limit: int | None) -> AsyncIterator[None]:
    """Hold one of ``provider``'s ``limit`` permits for the body; no-op when ``limit`` is None.

    With Ray running the permits live in the ``ProviderLimiter`` actor, so the cap holds
    across every worker process; without Ray they are per event loop in this process.
    """
    global _limiter_stub
    if limit is None:
        yield
        return
    if not isinstance(limit, int) or limit < 1:
        raise ProviderConfigError(f"concurrency limit for {provider!r} must be a positive int or None, got {limit!r}",
                                  provider=provider)
    token = uuid.uuid4().hex
    if not ray.is_initialized():
        table = _local_table()
        # Same loop: a cancelled acquire never holds the permit, so nothing to undo here.
        await table.acquire(provider, limit, token)
        try:
            yield
        finally:
            await asyncio.shield(table.release(provider, token))
        return

    limiter = _limiter()
    try:
        granted = await ask(limiter, ProviderLimiterStub.acquire, provider, limit, token)
    except OpGraphError as exc:
        _limiter_stub = None  # look the actor up again next time
        raise ProviderUnavailable(f"provider limiter unreachable while acquiring a permit for {provider!r}: {exc}",
                                  provider=provider) from exc
    except BaseException:
        # Cancelled while queued: the remote acquire may still be granted later. Calls from
        # one caller reach an actor in order, so this release lands after it and undoes it.
        limiter.release(provider, token)
        raise
    if not granted:
        raise ProviderUnavailable(f"permit for {provider!r} was abandoned before it was granted", provider=provider)
    try:
        yield
    finally:
        # A tell: awaiting here could be cancelled again and leak the permit.
        limiter.release(provider, token)


@dataclass
class AdmissionTicket:
    """How one admitted call went, filled in by the caller before the slot closes.

    ``outcome`` is ``ok`` (with ``reported`` tokens when the server said), ``rate_limited``
    (with the server's ``retry_after``), or ``failed`` (anything else: it teaches nothing).
    """

    outcome: str = "failed"
    retry_after: float | None = None
    reported: int | None = None


@asynccontextmanager
async def adaptive_slot(provider: str, budget: RateBudget, tokens: int) -> AsyncIterator[AdmissionTicket]:
    """Wait for ``provider``'s adaptive gate to admit one call of about ``tokens`` tokens.

    With Ray running the gate lives in the ``ProviderLimiter`` actor, so every process
    shares one learned window, pause and budget; without Ray it is per event loop here.
    The ticket's outcome is reported when the body ends (fire-and-forget on Ray, so a
    cancelled caller cannot leak its grant).
    """
    global _limiter_stub
    token = uuid.uuid4().hex
    ticket = AdmissionTicket()
    if not ray.is_initialized():
        loop = asyncio.get_running_loop()
        gate = _local_gates.get(loop)
        if gate is None:
            gate = _local_gates[loop] = AdaptiveGate()
        try:
            await gate.acquire(provider, budget, tokens, token)
        except BaseException:
            gate.settle(provider, token, "failed")
            raise
        try:
            yield ticket
        finally:
            gate.settle(provider, token, ticket.outcome, ticket.retry_after, ticket.reported)
        return

    limiter = _limiter()
    try:
        granted = await ask(limiter, ProviderLimiterStub.admit, provider, budget, tokens, token)
    except OpGraphError as exc:
        _limiter_stub = None
        raise ProviderUnavailable(f"provider limiter unreachable while admitting a call to {provider!r}: {exc}",
                                  provider=provider) from exc
    except BaseException:
        # Cancelled while queued: this settle reaches the actor after the admit and withdraws it.
        limiter.settle(provider, token, "failed")
        raise
    if granted is None:
        raise ProviderUnavailable(f"admission to {provider!r} was withdrawn before it was granted", provider=provider)
    try:
        yield ticket
    finally:
        limiter.settle(provider, token, ticket.outcome, ticket.retry_after, ticket.reported)


async def adaptive_statistics() -> dict[str, dict[str, Any]]:
    """The gate's learned state per provider (window, in flight, pause, counts)."""
    if not ray.is_initialized():
        gate = _local_gates.get(asyncio.get_running_loop())
        return gate.statistics() if gate is not None else {}
    return await ask(_limiter(), ProviderLimiterStub.adaptive_statistics)


# -- usage accounting ----------------------------------------------------------------------

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cache_read_tokens", "cache_creation_tokens", "calls",
                 "retries", "failures")
_usage_lock = threading.Lock()
_usage: dict[str, dict[str, int]] = {}
_latency: dict[str, LatencyHistogram] = {}


def _totals_for(provider: str) -> dict[str, int]:
    totals = _usage.get(provider)
    if totals is None:
        totals = _usage[provider] = dict.fromkeys(_USAGE_FIELDS, 0)
    return totals


def record_call(provider: str, usage: Usage, seconds: float | None = None) -> None:
    """Count one successful call, its tokens and (when given) its duration.

    Retries are counted as they happen; ``seconds`` covers the whole call, retries included.
    """
    with _usage_lock:
        totals = _totals_for(provider)
        totals["prompt_tokens"] += usage.prompt_tokens
        totals["completion_tokens"] += usage.completion_tokens
        totals["cache_read_tokens"] += usage.cache_read_tokens
        totals["cache_creation_tokens"] += usage.cache_creation_tokens
        totals["calls"] += 1
        if seconds is not None:
            histogram = _latency.get(provider)
            if histogram is None:
                histogram = _latency[provider] = LatencyHistogram()
            histogram.observe(seconds)


def latency_totals() -> dict[str, dict[str, Any]]:
    """This process's model-call latency per provider, as histogram snapshots."""
    with _usage_lock:
        return {provider: histogram.snapshot() for provider, histogram in _latency.items()}


def record_retry(provider: str) -> None:
    with _usage_lock:
        _totals_for(provider)["retries"] += 1


def record_failure(provider: str) -> None:
    with _usage_lock:
        _totals_for(provider)["failures"] += 1


def usage_totals() -> dict[str, dict[str, int]]:
    """This process's totals: {provider: {prompt_tokens, completion_tokens, cache_read_tokens,
    cache_creation_tokens, calls, retries, failures}}."""
    with _usage_lock:
        return {provider: dict(totals) for provider, totals in _usage.items()}


def reset_usage_totals() -> None:
    with _usage_lock:
        _usage.clear()
        _latency.clear()


def estimate_tokens(text: str) -> int:
    """A rough token count (about four characters a token) for providers that report none."""
    return (len(text) + 3) // 4 if text else 0
