"""opgraph.actors.providers: the model providers operations call through ``branch.provider_for``.

Owns the built-in providers (``openai``, ``anthropic``, ``sim``, ``local``) and their per-process
cache; a ``scripted`` provider is never built in, it is registered on the Session. Providers
translate every HTTP or SDK failure into the ``ProviderError`` tree of ``models``. An HTTP
provider is described without its key for a durable run's header, and built again from a
description and the environment.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from ..models import ChatRequest, ChatResponse, ModelIdentityError, ModelProvider, ProviderConfigError, parse_model_id
from ..secrets import redact_url
from .adaptive import AdaptiveGate, AdaptiveLimit, RateBudget
from .anthropic import AnthropicProvider
from .http import ProviderHTTPClient, RetryPolicy, forget_rate_limited_providers, retry_after_seconds
from .limits import (
    PermitTable,
    ProviderLimiter,
    adaptive_slot,
    adaptive_statistics,
    provider_slot,
    reset_usage_totals,
    usage_totals,
)
from .local import LocalModelProvider
from .openai import OpenAICompatibleProvider
from .scripted import ScriptedProvider
from .sim import SimulatedProvider, example_from_schema

__all__ = [
    "BUILTIN_PROVIDERS",
    "AdaptiveGate",
    "AdaptiveLimit",
    "RateBudget",
    "adaptive_slot",
    "adaptive_statistics",
    "ENVIRONMENT_SETTINGS",
    "AnthropicProvider",
    "LocalModelProvider",
    "OpenAICompatibleProvider",
    "PermitTable",
    "ProviderHTTPClient",
    "ProviderLimiter",
    "RetryPolicy",
    "ScriptedProvider",
    "SimulatedProvider",
    "UnavailableProvider",
    "builtin_provider",
    "clear_builtin_providers",
    "describe_provider",
    "environment_providers",
    "offers_tools",
    "example_from_schema",
    "forget_rate_limited_providers",
    "provider_from_description",
    "provider_from_environment",
    "provider_slot",
    "reset_usage_totals",
    "retry_after_seconds",
    "usage_totals",
]

BUILTIN_PROVIDERS = ("openai", "anthropic", "sim", "local", "scripted")

_cache: dict[str, ModelProvider] = {}
_cache_lock = threading.Lock()


# The environment of the built-in HTTP providers, read by ``provider_from_environment``
# (the workers' built-ins, and every entry point that builds one in the driver). Unset
# means the default in brackets.
ENVIRONMENT_SETTINGS: dict[str, dict[str, str]] = {
    "openai": {
        "OPENAI_BASE_URL": "server URL [https://api.openai.com/v1; a local vLLM/Ollama/llama.cpp URL needs no key]",
        "OPENAI_API_KEY": "bearer key [required only for api.openai.com]",
        "OPENAI_TIMEOUT": "seconds one attempt may take [600, as the openai SDK]",
        "OPENAI_MAX_TOKENS": "max_tokens of a request that names none [unset: the server's limit]",
        "OPENAI_MAX_CONCURRENCY": "calls in flight at once, cluster-wide [unlimited]",
        "OPENAI_MAX_RPM": "requests per minute, cluster-wide budget [none: learned from 429s]",
        "OPENAI_MAX_TPM": "tokens per minute, cluster-wide budget [none: learned from 429s]",
        "OPENAI_ADAPTIVE": "0 turns off adaptive admission (429s then count as retries) [1]",
    },
    "anthropic": {
        "ANTHROPIC_BASE_URL": "server URL [https://api.anthropic.com]",
        "ANTHROPIC_API_KEY": "key [required for the default URL]",
        "ANTHROPIC_TIMEOUT": "seconds one attempt may take [600, as the anthropic SDK]",
        "ANTHROPIC_MAX_TOKENS": "max_tokens of a request that names none [4096; the API requires one]",
        "ANTHROPIC_MAX_CONCURRENCY": "calls in flight at once, cluster-wide [unlimited]",
        "ANTHROPIC_MAX_RPM": "requests per minute, cluster-wide budget [none: learned from 429s]",
        "ANTHROPIC_MAX_TPM": "tokens per minute, cluster-wide budget [none: learned from 429s]",
        "ANTHROPIC_ADAPTIVE": "0 turns off adaptive admission (429s then count as retries) [1]",
    },
}


def _number(environ: Mapping[str, str], variable: str, kind: type, provider: str) -> Any:
    value = environ.get(variable)
    if not value:
        return None
    try:
        number = kind(value)
    except ValueError as exc:
        raise ProviderConfigError(f"{variable}={value!r} must be a {kind.__name__}", provider=provider) from exc
    if not number > 0:
        raise ProviderConfigError(f"{variable}={value!r} must be above 0", provider=provider)
    return number


def provider_from_environment(name: str, environ: Mapping[str, str] | None = None, **overrides: Any) -> ModelProvider:
    """The ``openai`` or ``anthropic`` provider as ``ENVIRONMENT_SETTINGS`` configures it.

    ``overrides`` (constructor arguments) win over the environment. Every entry point
    builds these providers here, so ``OPENAI_MAX_CONCURRENCY`` or ``OPENAI_TIMEOUT`` mean
    the same in a worker's built-in, in ``opgraph flow run`` and in the examples.
    """
    environ = os.environ if environ is None else environ
    if name not in ENVIRONMENT_SETTINGS:
        raise ProviderConfigError(f"no environment settings for provider {name!r}; "
                                  f"known: {', '.join(ENVIRONMENT_SETTINGS)}", provider=name)
    prefix = name.upper()
    settings: dict[str, Any] = {
        "base_url": environ.get(f"{prefix}_BASE_URL") or None,
        "api_key": environ.get(f"{prefix}_API_KEY"),
        "timeout": _number(environ, f"{prefix}_TIMEOUT", float, name),
        "max_tokens": _number(environ, f"{prefix}_MAX_TOKENS", int, name),
        "concurrency": _number(environ, f"{prefix}_MAX_CONCURRENCY", int, name),
        "requests_per_minute": _number(environ, f"{prefix}_MAX_RPM", float, name),
        "tokens_per_minute": _number(environ, f"{prefix}_MAX_TPM", float, name),
    }
    adaptive = environ.get(f"{prefix}_ADAPTIVE")
    if adaptive:
        if adaptive not in ("0", "1"):
            raise ProviderConfigError(f"{prefix}_ADAPTIVE={adaptive!r} must be 0 or 1", provider=name)
        settings["adaptive"] = adaptive == "1"
    settings = {key: value for key, value in settings.items() if value is not None}
    settings.update(overrides)
    provider_class = OpenAICompatibleProvider if name == "openai" else AnthropicProvider
    return provider_class(**settings)


def environment_providers(environ: Mapping[str, str] | None = None) -> dict[str, ModelProvider]:
    """The HTTP providers this process's environment configures (any of their variables set).

    An entry point registers these on its Session, so the workers call the models with
    the driver's settings even when they did not inherit its environment (a ``ray start``
    head). A provider whose settings are incomplete is left out: a worker's built-in then
    reports the problem on the node that needs it, and runs that never call it still run.
    """
    environ = os.environ if environ is None else environ
    providers = {}
    for name, variables in ENVIRONMENT_SETTINGS.items():
        if any(environ.get(variable) for variable in variables):
            try:
                providers[name] = provider_from_environment(name, environ)
            except ProviderConfigError:
                continue  # reported by the built-in, on the node that calls it
    return providers


def _build(name: str) -> ModelProvider:
    if name in ENVIRONMENT_SETTINGS:
        return provider_from_environment(name)
    if name == "sim":
        return SimulatedProvider()
    if name == "local":
        # Each model is checked and loaded when first named; OPGRAPH_LOCAL_MAX_TOKENS caps a reply
        # whose request names no max_tokens (512).
        max_tokens = _number(os.environ, "OPGRAPH_LOCAL_MAX_TOKENS", int, name) or 512
        return LocalModelProvider(max_tokens=max_tokens)
    if name == "scripted":
        raise ProviderConfigError(
            "a scripted provider has no built-in script; register one on the Session: "
            'session.register_provider("scripted", ScriptedProvider(replies_or_callable))',
            provider=name,
        )
    raise ProviderConfigError(
        f"unknown model provider {name!r}; built-in providers are {', '.join(BUILTIN_PROVIDERS)}, "
        f"others must be registered with session.register_provider({name!r}, provider)",
        provider=name,
    )


def offers_tools(model: str | None, registered: Mapping[str, Any] | None = None) -> bool:
    """Whether tool definitions may be sent to ``model``'s provider.

    A provider says no with ``supports_tools = False`` (``local/`` does: llama.cpp here
    refuses tools, typed). ``registered`` is a Session's own providers, checked first; an
    unregistered prefix is the process's built-in. Unknown or no model: True (the call
    itself reports what is wrong).
    """
    if not model:
        return True
    try:
        name, _ = parse_model_id(model)
    except ModelIdentityError:
        return True
    provider = (registered or {}).get(name)
    if provider is None:
        provider = LocalModelProvider if name == "local" else None
    return bool(getattr(provider, "supports_tools", True))


def builtin_provider(name: str) -> ModelProvider:
    """The process's built-in provider for a ``provider/`` prefix, built on first use.

    ``openai`` and ``anthropic`` read ``ENVIRONMENT_SETTINGS`` (base URL, key, timeout,
    max_tokens, concurrency; no key needed for a local OpenAI-compatible server). The
    environment is read once per process (see ``clear_builtin_providers``). A
    configuration error is raised, never cached.
    """
    with _cache_lock:
        provider = _cache.get(name)
        if provider is None:
            provider = _cache[name] = _build(name)
        return provider


def clear_builtin_providers() -> None:
    """Forget the cached built-ins so the next lookup reads the environment again."""
    with _cache_lock:
        _cache.clear()


# -- providers in a durable run's header ---------------------------------------------------
_DESCRIBED = {"openai": OpenAICompatibleProvider, "anthropic": AnthropicProvider}


def describe_provider(provider: Any) -> dict[str, Any] | None:
    """What a run's header keeps of ``provider``: for the built-in HTTP providers, a description
    with no key and the base URL without its password; None for any other (sim, scripted, a
    class of the caller's own, a subclass), which the header keeps as it is."""
    if type(provider) in _DESCRIBED.values():
        return provider.description()
    return None


def provider_from_description(description: dict[str, Any], environ: Mapping[str, str] | None = None) -> ModelProvider:
    """The provider ``describe_provider`` described, with its key from ``environ`` (this process's
    environment): ``OPENAI_API_KEY`` or ``ANTHROPIC_API_KEY``. A base URL whose password was
    cut out is taken from ``OPENAI_BASE_URL`` (``ANTHROPIC_BASE_URL``) when that is the same URL.
    A provider that cannot be built so is an ``UnavailableProvider``: the nodes that call it
    fail with the reason, and the rest of the run goes on."""
    environ = os.environ if environ is None else environ
    kind, name = description["kind"], description["name"]
    prefix = kind.upper()
    base_url = description["base_url"]
    if ":***@" in base_url:  # redact_url cut its password out
        configured = environ.get(f"{prefix}_BASE_URL") or ""
        if redact_url(configured).rstrip("/") != base_url:
            return UnavailableProvider(name, f"the run's provider {name!r} called {base_url}, whose password is "
                                             f"not kept; set {prefix}_BASE_URL to that URL where the run goes on")
        base_url = configured
    try:
        return _DESCRIBED[kind](base_url=base_url, api_key=environ.get(f"{prefix}_API_KEY"), name=name,
                                **description["settings"])
    except ProviderConfigError as exc:
        return UnavailableProvider(name, exc.message)


class UnavailableProvider:
    """In place of a provider a recovered run could not build here: every call fails with ``reason``."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    async def complete(self, request: ChatRequest) -> ChatResponse:
        raise ProviderConfigError(f"provider {self.name!r} is not available: {self.reason}", provider=self.name)

    def __repr__(self) -> str:
        return f"UnavailableProvider(name={self.name!r}, reason={self.reason!r})"
