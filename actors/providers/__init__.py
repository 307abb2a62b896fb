"""opgraph.actors.providers: the model providers operations call through ``branch.provider_for``.

Owns the built-in providers (``openai``, ``anthropic``, ``sim``) and their per-process
cache; a ``scripted`` provider is never built in, it is registered on the Session.
Providers translate every HTTP or SDK failure into the ``ProviderError`` tree of ``models``.
"""

from __future__ import annotations

import os
import threading

from ..models import ModelProvider, ProviderConfigError
from .anthropic import AnthropicProvider
from .http import ProviderHTTPClient, RetryPolicy, retry_after_seconds
from .limits import PermitTable, ProviderLimiter, provider_slot, reset_usage_totals, usage_totals
from .openai import OpenAICompatibleProvider
from .scripted import ScriptedProvider
from .sim import SimulatedProvider, example_from_schema

__all__ = [
    "BUILTIN_PROVIDERS",
    "AnthropicProvider",
    "OpenAICompatibleProvider",
    "PermitTable",
    "ProviderHTTPClient",
    "ProviderLimiter",
    "RetryPolicy",
    "ScriptedProvider",
    "SimulatedProvider",
    "builtin_provider",
    "clear_builtin_providers",
    "example_from_schema",
    "provider_slot",
    "reset_usage_totals",
    "retry_after_seconds",
    "usage_totals",
]

BUILTIN_PROVIDERS = ("openai", "anthropic", "sim", "scripted")

_cache: dict[str, ModelProvider] = {}
_cache_lock = threading.Lock()


def _concurrency(variable: str) -> int | None:
    value = os.environ.get(variable)
    if not value:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ProviderConfigError(f"{variable}={value!r} must be an integer") from exc


def _build(name: str) -> ModelProvider:
    if name == "openai":
        return OpenAICompatibleProvider(concurrency=_concurrency("OPENAI_MAX_CONCURRENCY"))
    if name == "anthropic":
        return AnthropicProvider(concurrency=_concurrency("ANTHROPIC_MAX_CONCURRENCY"))
    if name == "sim":
        return SimulatedProvider()
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


def builtin_provider(name: str) -> ModelProvider:
    """The process's built-in provider for a ``provider/`` prefix, built on first use.

    ``openai`` reads OPENAI_BASE_URL / OPENAI_API_KEY (no key needed for a local server),
    ``anthropic`` ANTHROPIC_API_KEY / ANTHROPIC_BASE_URL; ``*_MAX_CONCURRENCY`` caps calls
    in flight cluster-wide. The environment is read once per process (see
    ``clear_builtin_providers``). A configuration error is raised, never cached.
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
