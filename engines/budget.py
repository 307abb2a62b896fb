"""Hard run bounds: agents, wall-clock deadline, tokens and cost, and the price table.

Owns the budget arithmetic of one engine run (ADR-0034 D2) and the per-model price
table that turns provider usage into dollars. It decides whether budget is left; the
run decides what to do about it. No I/O; time comes from an injected monotonic clock.

Beyond the record: ``max_tokens`` and ``max_cost_usd`` are hard bounds with the same
semantics as ``max_agents`` (a recursion limit is not a budget). Usage counts when a
turn returns or fails (a failed turn's calls were paid for too), so a turn already in
flight finishes and is counted; the overshoot is bounded by the turns in flight at once
(``max_concurrent``). A call cut off before its usage arrived (a timeout, a cancellation)
is counted at an estimate, kept apart in ``estimated_tokens``: ``tokens_used`` minus
``estimated_tokens`` is what the providers reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import EngineInputError

__all__ = ["BUDGET_REASONS", "DEFAULT_PRICES", "BudgetLimits", "ModelPrice", "PriceTable", "RunBudget"]

BUDGET_REASONS = ("agents", "deadline", "tokens", "cost")


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """US dollars per million prompt and completion tokens."""

    prompt_per_million: float
    completion_per_million: float

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.prompt_per_million + completion_tokens * self.completion_per_million) / 1e6


# The built-in providers that cost nothing; anything else is priced by the user.
DEFAULT_PRICES: dict[str, ModelPrice] = {"sim/*": ModelPrice(0.0, 0.0), "scripted/*": ModelPrice(0.0, 0.0)}


def _price(model: str, value: Any) -> ModelPrice:
    if isinstance(value, ModelPrice):
        return value
    if isinstance(value, Mapping):
        value = (value.get("prompt", value.get("input")), value.get("completion", value.get("output")))
    if isinstance(value, (list, tuple)) and len(value) == 2:
        prompt, completion = value
        if all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) and n >= 0
               for n in (prompt, completion)):
            return ModelPrice(float(prompt), float(completion))
    raise EngineInputError(f"price of {model!r} must be (prompt, completion) dollars per million tokens, "
                           f"both >= 0, got {value!r}")


class PriceTable:
    """Prices by ``provider/model``, or ``provider/*`` for every model of a provider.

    ``prices`` may give ``ModelPrice``, a ``(prompt, completion)`` pair or
    ``{"prompt": ..., "completion": ...}`` per key (dollars per million tokens); the
    free built-ins (``sim/*``, ``scripted/*``) are included unless overridden.
    """

    def __init__(self, prices: Mapping[str, Any] | None = None) -> None:
        if prices is not None and not isinstance(prices, Mapping):
            raise EngineInputError(f"prices must map 'provider/model' to a price, got {type(prices).__name__}")
        self.prices: dict[str, ModelPrice] = dict(DEFAULT_PRICES)
        for model, value in (prices or {}).items():
            if not isinstance(model, str) or "/" not in model:
                raise EngineInputError(f"a price key must be 'provider/model' or 'provider/*', got {model!r}")
            self.prices[model] = _price(model, value)

    def price_for(self, model: str) -> ModelPrice | None:
        exact = self.prices.get(model)
        if exact is not None:
            return exact
        provider = model.partition("/")[0]
        return self.prices.get(f"{provider}/*")

    def cost(self, by_model: Mapping[str, Mapping[str, Any]]) -> tuple[float, list[str]]:
        """Dollars for ``{"provider/model": {"prompt_tokens", "completion_tokens"}}``, and the unpriced models."""
        total, unpriced = 0.0, []
        for model, usage in by_model.items():
            price = self.price_for(model)
            if price is None:
                unpriced.append(model)
                continue
            total += price.cost(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)))
        return total, unpriced

    def as_dict(self) -> dict[str, list[float]]:
        return {model: [price.prompt_per_million, price.completion_per_million] for model, price in self.prices.items()}


def _positive(name: str, value: Any, *, integer: bool) -> Any:
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise EngineInputError(f"{name} must be {kind} or None, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """The hard bounds; ``None`` means unbounded (only ``max_agents`` is always set)."""

    max_agents: int = 50
    deadline_s: float | None = None
    max_tokens: int | None = None
    max_cost_usd: float | None = None

    def __post_init__(self) -> None:
        if self.max_agents is None or isinstance(self.max_agents, bool) or not isinstance(self.max_agents, int) \
                or self.max_agents < 1:
            raise EngineInputError(f"max_agents must be a positive integer, got {self.max_agents!r}")
        _positive("deadline_s", self.deadline_s, integer=False)
        _positive("max_tokens", self.max_tokens, integer=True)
        _positive("max_cost_usd", self.max_cost_usd, integer=False)


class RunBudget:
    """One run's accounting against its ``BudgetLimits``; owned by exactly one EngineRun."""

    def __init__(self, limits: BudgetLimits, prices: PriceTable, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.prices = prices
        self._clock = clock
        self.t0 = clock()
        self.deadline = None if limits.deadline_s is None else self.t0 + limits.deadline_s
        self.agents_made = 0  # every agent, exempt (terminal) ones included
        self.exempt_agents: list[str] = []  # the names of the exempt ones, outside the agent bound
        self.calls = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cost_usd = 0.0
        self.by_model: dict[str, dict[str, int]] = {}
        self.unpriced_models: set[str] = set()
        self.deadline_passed = False  # set by the watchdog, so a late clock read cannot disagree
        self.estimated_calls = 0
        self.estimated_prompt_tokens = 0
        self.estimated_completion_tokens = 0

    @property
    def tokens_used(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def exhausted(self, *, agents: bool = True) -> str | None:
        """Which hard bound is spent (``agents``, ``deadline``, ``tokens``, ``cost``), or None.

        ``agents=False`` leaves the agent bound out: it limits making agents, not the turns
        of agents already made (the last agent the bound allows can still work).
        """
        if agents and self.agents_made >= self.limits.max_agents:
            return "agents"
        if self.deadline_passed or (self.deadline is not None and self._clock() >= self.deadline):
            return "deadline"
        if self.limits.max_tokens is not None and self.tokens_used >= self.limits.max_tokens:
            return "tokens"
        if self.limits.max_cost_usd is not None and (self.cost_usd >= self.limits.max_cost_usd
                                                     or self.unpriced_models):
            return "cost"  # an unpriced model's cost is unknown: the bound cannot hold, so stop
        return None

    def add_usage(self, usage: Mapping[str, Any] | None) -> None:
        """Count one turn's provider usage (the ``TurnResult.usage`` shape)."""
        if not usage:
            return
        self.calls += int(usage.get("calls", 0) or 0)
        self.prompt_tokens += int(usage.get("prompt_tokens", 0) or 0)
        self.completion_tokens += int(usage.get("completion_tokens", 0) or 0)
        by_model = usage.get("by_model") or {}
        for model, counts in by_model.items():
            mine = self.by_model.setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0})
            for key in mine:
                mine[key] += int(counts.get(key, 0) or 0)
        cost, unpriced = self.prices.cost(by_model)
        self.cost_usd += cost
        self.unpriced_models.update(unpriced)

    @property
    def estimated_tokens(self) -> int:
        """Tokens counted at an estimate (calls cut off before their usage arrived)."""
        return self.estimated_prompt_tokens + self.estimated_completion_tokens

    def mean_completion_tokens(self) -> int:
        """Completion tokens per call the providers reported (0 before any)."""
        reported = self.calls - self.estimated_calls
        return (self.completion_tokens - self.estimated_completion_tokens) // reported if reported > 0 else 0

    def add_estimate(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> int:
        """Count one call that was cut off before its usage arrived, at an estimate; returns its tokens.

        Priced as ``model``'s call; with no model known it has no price, so a cost bound
        fails closed (as for any unpriced model).
        """
        prompt, completion = max(0, int(prompt_tokens)), max(0, int(completion_tokens))
        self.estimated_calls += 1
        self.estimated_prompt_tokens += prompt
        self.estimated_completion_tokens += completion
        counts = {"calls": 1, "prompt_tokens": prompt, "completion_tokens": completion}
        self.add_usage({**counts, "by_model": {model or "(unknown model)": counts}})
        return prompt + completion

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - self._clock())

    def snapshot(self) -> dict[str, Any]:
        limits = self.limits
        return {
            "agents_made": self.agents_made,
            "max_agents": limits.max_agents,
            "exempt_agents": list(self.exempt_agents),
            "tokens_used": self.tokens_used,
            "estimated_tokens": self.estimated_tokens,
            "max_tokens": limits.max_tokens,
            "cost_usd": round(self.cost_usd, 6),
            "max_cost_usd": limits.max_cost_usd,
            "elapsed_s": round(self._clock() - self.t0, 3),
            "seconds_left": self.seconds_left(),
            "calls": self.calls,
            "by_model": {model: dict(counts) for model, counts in self.by_model.items()},
            "unpriced_models": sorted(self.unpriced_models),
            "exhausted": self.exhausted(),
        }
