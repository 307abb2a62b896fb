"""Adaptive admission of model calls per provider: a learned concurrency window, the
provider's own ``Retry-After`` pauses, and an optional requests/tokens-per-minute budget.

Owns ``RateBudget`` (what a user configures), ``AdaptiveLimit`` (one provider's learned
state, pure: time is passed in) and ``AdaptiveGate`` (a FIFO of waiting calls on one event
loop, woken by releases and by a timer). The gate runs inside the cluster-wide
``ProviderLimiter`` actor (see ``limits``), so every worker of a runtime shares what one
429 taught; it makes no model calls and no HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any

from ..models import ProviderConfigError

__all__ = ["AdaptiveGate", "AdaptiveLimit", "RateBudget"]

# A server that rate-limits passes about its limit while we offer more, so the rate of
# successes over this window, times RATE_MARGIN, is where pacing starts after the first 429.
OK_RATE_SECONDS = 2.0
RATE_MARGIN = 0.9
# Later 429s (once per round, as TCP counts losses) cut the rate by this factor...
DECREASE = 0.85
# ...and every success grows it by this fraction of a request/s: 10% a second at any rate,
# so a cut is recovered in under two seconds, before the server's burst allowance refills.
INCREASE_PER_SUCCESS = 0.1
# Until the first cut of a paced rate, every success adds two requests/s (the rate grows
# e^2-fold a second: slow start), so a low first guess is left behind within two seconds.
PROBE_INCREASE_PER_SUCCESS = 2.0
MIN_RATE = 0.5  # requests/s
INITIAL_RATE = 8.0  # requests/s, when nothing was measured yet
# Calls in flight are capped at this many times (rate x latency) (Little's law, with room),
# so a provider that slows down is not buried under calls the rate alone would allow.
WINDOW_FACTOR = 2.0
MIN_WINDOW = 4
MAX_WINDOW = 10_000
# A budget bucket holds this many seconds of its rate, so a short idle spell is not lost.
BUDGET_BURST_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class RateBudget:
    """A provider's configured limits; every field None means "learn from the server alone".

    ``requests_per_minute`` and ``tokens_per_minute`` are spent as calls are admitted
    (tokens estimated from the request, corrected by the usage the server reports);
    ``max_concurrency`` caps the learned window.
    """

    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ProviderConfigError(f"RateBudget.{name} must be a number above 0 or None, got {value!r}")

    @property
    def configured(self) -> bool:
        return any(value is not None for value in (self.requests_per_minute, self.tokens_per_minute,
                                                   self.max_concurrency))


class _Bucket:
    """A token bucket refilled at ``rate`` per second up to ``capacity``; it may run into debt."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, per_minute: float, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate * BUDGET_BURST_SECONDS)
        self.level = self.capacity
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` may be spent (0 now); an amount above capacity needs a full bucket."""
        self.refill(now)
        needed = min(amount, self.capacity)
        return 0.0 if self.level >= needed else (needed - self.level) / self.rate


class AdaptiveLimit:
    """One provider's admission state: learned rate and window, pause, and budget buckets.

    A provider gated by its budget alone is not paced until its first 429; one gated
    because it answered 429 starts paced at ``INITIAL_RATE``. The first 429 sets the rate to what the
    server was letting through (successes over the last seconds, with a margin), or a
    low guess that grows fast (slow start, e^2-fold a second) until the next 429.
    Each later round of 429s cuts it by ``DECREASE``, to at most the measured pass rate
    and never below its margin, and every success then grows it by 10% a second. Calls
    start evenly spaced at that rate, so a ``Retry-After`` pause (which stops every
    admission) ends without a burst. The window (calls in flight) follows the rate times
    the measured latency. A round is told apart by grant time: a 429 for a call granted
    before the last cut says nothing new.
    """

    def __init__(self, budget: RateBudget, now: float) -> None:
        self.budget = budget
        # requests/s; None: not paced. Without a budget a provider is gated only once it
        # has answered 429, so it starts paced, from a low guess grown by slow start.
        self.rate: float | None = None if budget.configured else INITIAL_RATE
        self.latency: float | None = None  # seconds from grant to settle, smoothed
        self.next_start = 0.0
        self.in_flight = 0
        self.paused_until = 0.0
        self.last_decrease = -1.0
        self.probing = True
        self.recent_successes: collections.deque[float] = collections.deque()
        self.requests = _Bucket(budget.requests_per_minute, now) if budget.requests_per_minute else None
        self.tokens = _Bucket(budget.tokens_per_minute, now) if budget.tokens_per_minute else None
        self.token_correction = 0.0  # learned (reported - estimated) tokens per call
        self.counts = dict.fromkeys(("granted", "succeeded", "rate_limited", "failed", "decreases"), 0)

    def reconfigure(self, budget: RateBudget, now: float) -> None:
        """The latest caller's budget wins, so a changed setting applies without a restart."""
        if budget == self.budget:
            return
        self.budget = budget
        self.requests = _Bucket(budget.requests_per_minute, now) if budget.requests_per_minute else None
        self.tokens = _Bucket(budget.tokens_per_minute, now) if budget.tokens_per_minute else None

    @property
    def window(self) -> int:
        cap = self.budget.max_concurrency or MAX_WINDOW
        if self.rate is None or self.latency is None:
            return cap
        return min(cap, max(MIN_WINDOW, int(WINDOW_FACTOR * self.rate * self.latency) + 1))

    def estimate(self, tokens: int) -> float:
        return max(1.0, tokens + self.token_correction)

    def wait_for(self, tokens: int, now: float) -> float | None:
        """0 when a call of ``tokens`` may start now, seconds to wait, or None (wait for a release)."""
        if now < self.paused_until:
            return self.paused_until - now
        if self.in_flight >= self.window:
            return None
        wait = 0.0
        if self.rate is not None:
            wait = max(wait, self.next_start - now)
        if self.requests is not None:
            wait = max(wait, self.requests.wait_for(1.0, now))
        if self.tokens is not None:
            wait = max(wait, self.tokens.wait_for(self.estimate(tokens), now))
        return wait

    def grant(self, tokens: int, now: float) -> float:
        """Admit one call (``wait_for`` said 0); returns what its budget was charged in tokens."""
        self.in_flight += 1
        self.counts["granted"] += 1
        if self.rate is not None:
            self.next_start = max(self.next_start, now) + 1.0 / self.rate
        if self.requests is not None:
            self.requests.level -= 1.0
        charged = 0.0
        if self.tokens is not None:
            charged = self.estimate(tokens)
            self.tokens.level -= charged
        return charged

    def _success_rate(self, now: float) -> float | None:
        while self.recent_successes and self.recent_successes[0] < now - OK_RATE_SECONDS:
            self.recent_successes.popleft()
        if len(self.recent_successes) < 4:
            return None
        return len(self.recent_successes) / OK_RATE_SECONDS

    def settle(self, *, granted_at: float, outcome: str, retry_after: float | None, estimated: int,
               charged: float, reported: int | None, now: float) -> None:
        """A granted call ended: ``ok`` (with the tokens the server reported), ``rate_limited``, or ``failed``."""
        self.in_flight = max(0, self.in_flight - 1)
        if outcome == "ok":
            self.counts["succeeded"] += 1
            self.recent_successes.append(now)
            took = now - granted_at
            self.latency = took if self.latency is None else self.latency + 0.1 * (took - self.latency)
            if self.rate is not None:
                self.rate += PROBE_INCREASE_PER_SUCCESS if self.probing else INCREASE_PER_SUCCESS
            if reported is not None:
                self.token_correction += 0.1 * ((reported - estimated) - self.token_correction)
                if self.tokens is not None:
                    self.tokens.refill(now)
                    self.tokens.level += charged - reported  # credit an over-estimate, charge an under-estimate
        elif outcome == "rate_limited":
            self.counts["rate_limited"] += 1
            if granted_at >= self.last_decrease:
                self.counts["decreases"] += 1
                if self.rate is None:
                    passed = self._success_rate(now)
                    self.rate = max(MIN_RATE, RATE_MARGIN * passed) if passed else INITIAL_RATE
                else:
                    # Never below what the server is passing now: while we offer more than
                    # its limit, that is its limit, and cutting under it only idles it.
                    # Far above it, drop to it at once rather than by many cuts of 429s.
                    rate = self.rate * DECREASE
                    passed = self._success_rate(now)
                    if passed is not None:
                        rate = max(min(rate, passed), RATE_MARGIN * passed)
                    self.rate = max(MIN_RATE, rate)
                    self.probing = False
                self.last_decrease = now
            if retry_after is not None:
                self.paused_until = max(self.paused_until, now + retry_after)
            if self.tokens is not None and charged:
                self.tokens.refill(now)
                self.tokens.level += charged  # the server spent nothing on it
            if self.requests is not None:
                self.requests.refill(now)
                self.requests.level += 1.0
        else:
            self.counts["failed"] += 1

    def statistics(self, now: float) -> dict[str, Any]:
        return {
            "rate": None if self.rate is None else round(self.rate, 2),
            "window": self.window,
            "latency": None if self.latency is None else round(self.latency, 4),
            "in_flight": self.in_flight,
            "paused_for": round(max(0.0, self.paused_until - now), 3),
            **self.counts,
        }


@dataclass
class _Waiter:
    token: str
    tokens: int
    future: asyncio.Future


class AdaptiveGate:
    """FIFO admission for every gated provider, on one event loop.

    ``acquire`` waits for its turn and returns a grant (granted_at, charged tokens), or
    None when its token was released (given up) before the grant. ``settle`` ends a grant
    with its outcome. A timer wakes the queue when a pause or budget wait ends. Tokens make
    settling idempotent and cancel-safe, as in ``PermitTable``.
    """

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._limits: dict[str, AdaptiveLimit] = {}
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        self._granted: dict[str, tuple[str, float, int, float]] = {}  # token -> (provider, at, estimated, charged)
        self._abandoned: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def _limit(self, provider: str, budget: RateBudget) -> AdaptiveLimit:
        now = self._clock()
        limit = self._limits.get(provider)
        if limit is None:
            limit = self._limits[provider] = AdaptiveLimit(budget, now)
            self._queues[provider] = collections.deque()
        else:
            limit.reconfigure(budget, now)
        return limit

    async def acquire(self, provider: str, budget: RateBudget, tokens: int, token: str) -> tuple[float, float] | None:
        if token in self._abandoned:
            self._abandoned.discard(token)
            return None
        self._limit(provider, budget)
        future = asyncio.get_running_loop().create_future()
        self._queues[provider].append(_Waiter(token, tokens, future))
        self._pump(provider)
        return await future

    def settle(self, provider: str, token: str, outcome: str, retry_after: float | None = None,
               reported: int | None = None) -> bool:
        """End ``token``'s grant; True when it was held. Releasing a queued token withdraws it."""
        grant = self._granted.pop(token, None)
        if grant is None:
            queue = self._queues.get(provider, ())
            for waiter in queue:
                if waiter.token == token:
                    queue.remove(waiter)
                    if not waiter.future.done():
                        waiter.future.set_result(None)
                    return False
            self._abandoned.add(token)  # the acquire has not arrived yet: it backs out when it does
            return False
        _, granted_at, estimated, charged = grant
        limit = self._limits[provider]
        limit.settle(granted_at=granted_at, outcome=outcome, retry_after=retry_after, estimated=estimated,
                     charged=charged, reported=reported, now=self._clock())
        self._pump(provider)
        return True

    def _pump(self, provider: str) -> None:
        limit = self._limits[provider]
        queue = self._queues[provider]
        while queue:
            waiter = queue[0]
            if waiter.future.done():  # its caller was cancelled
                queue.popleft()
                continue
            now = self._clock()
            wait = limit.wait_for(waiter.tokens, now)
            if wait is None:
                return  # a settle pumps again
            if wait > 0:
                self._wake_in(provider, wait)
                return
            queue.popleft()
            charged = limit.grant(waiter.tokens, now)
            self._granted[waiter.token] = (provider, now, waiter.tokens, charged)
            waiter.future.set_result((now, charged))

    def _wake_in(self, provider: str, seconds: float) -> None:
        timer = self._timers.get(provider)
        if timer is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        self._timers[provider] = loop.call_later(seconds, self._pump, provider)

    def statistics(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        return {provider: {**limit.statistics(now), "waiting": len(self._queues[provider])}
                for provider, limit in self._limits.items()}
