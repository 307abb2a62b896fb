"""The model-call contract shared by providers and branch verbs.

Owns the provider-neutral request/response types, model identity (``provider/model``),
the provider error tree and the per-run provider registry that operations reach through
their branch handle. Concrete providers live in ``actors/providers/``; verbs in
``actors/verbs/``. Nothing here performs I/O.

    ProviderError (ExecutionError)
    ├── ModelIdentityError     "gpt-4" instead of "openai/gpt-4"
    ├── ProviderConfigError    missing key / base URL / unknown provider
    ├── ProviderTimeout        the call exceeded its timeout
    ├── ProviderRateLimited    429 after every retry
    ├── ProviderUnavailable    connection refused / reset, 5xx after every retry
    ├── ProviderHTTPError      any other non-2xx status
    ├── ProviderResponseError  a malformed or unparseable body
    │   └── ProviderTruncated  a structured reply cut off at max_tokens (finish_reason 'length')
    └── ProviderRefusal        the model declined to answer; ``refusal`` holds its words
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from opgraph.kernel import ExecutionError

__all__ = [
    "ChatRequest",
    "ChatResponse",
    "ModelIdentityError",
    "ModelProvider",
    "ProviderConfigError",
    "ProviderError",
    "ProviderHTTPError",
    "ProviderRateLimited",
    "ProviderRefusal",
    "ProviderResponseError",
    "ProviderTimeout",
    "ProviderTruncated",
    "ProviderUnavailable",
    "ToolCall",
    "Usage",
    "parse_model_id",
]


class ProviderError(ExecutionError):
    """A model provider call failed; ``provider`` and ``status`` say where and how."""

    def __init__(self, message: str, *, provider: str | None = None, status: int | None = None,
                 node_id: str | None = None, branch_id: str | None = None, edge_id: str | None = None) -> None:
        super().__init__(message, node_id=node_id, branch_id=branch_id, edge_id=edge_id)
        self.provider = provider
        self.status = status


class ModelIdentityError(ProviderError):
    """A model id without a provider prefix; the expected form is ``provider/model``."""


class ProviderConfigError(ProviderError):
    """The provider is unknown or not configured (no key, no base URL)."""


class ProviderTimeout(ProviderError):
    """The model call exceeded its timeout."""


class ProviderRateLimited(ProviderError):
    """The provider kept answering 429 after every retry."""


class ProviderUnavailable(ProviderError):
    """The provider could not be reached, or kept failing with 5xx."""


class ProviderHTTPError(ProviderError):
    """A non-retryable non-2xx answer."""


class ProviderResponseError(ProviderError):
    """The provider's body could not be parsed into a ChatResponse."""


class ProviderTruncated(ProviderResponseError):
    """The model stopped at ``max_tokens`` (finish_reason ``length``) before a structured reply
    was whole: it is not parsed as if it were. Raise ``max_tokens``, or ask for less."""


class ProviderRefusal(ProviderError):
    """The model refused the request (OpenAI's ``refusal``, Anthropic's ``refusal`` stop reason).

    ``refusal`` is the model's own explanation (may be empty). Not retried: the same
    request is refused again; rephrase the instruction or choose another model.
    """

    def __init__(self, message: str, *, refusal: str = "", provider: str | None = None, status: int | None = None,
                 node_id: str | None = None, branch_id: str | None = None, edge_id: str | None = None) -> None:
        super().__init__(message, provider=provider, status=status, node_id=node_id, branch_id=branch_id,
                         edge_id=edge_id)
        self.refusal = refusal


def parse_model_id(model: str) -> tuple[str, str]:
    """Split ``provider/model`` (the model part may itself contain '/'). ADR-0073 D4."""
    if not isinstance(model, str) or "/" not in model:
        raise ModelIdentityError(
            f"model {model!r} has no provider prefix; expected 'provider/model', e.g. 'openai/gpt-4.1-mini'"
        )
    provider, _, name = model.partition("/")
    if not provider or not name:
        raise ModelIdentityError(f"model {model!r} must be 'provider/model' with both parts non-empty")
    return provider, name


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class Usage:
    """Tokens of one call. ``prompt_tokens`` counts every input token, cached or not;
    ``cache_read_tokens`` and ``cache_creation_tokens`` say how many of them were read from,
    or written to, the provider's prompt cache (Anthropic bills these apart; OpenAI reports
    cached reads as ``prompt_tokens_details.cached_tokens``)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_read_tokens: int = 0
    cache_creation_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class ChatRequest:
    """One chat-completion call. ``messages`` use the OpenAI role/content shape.

    ``tools`` are OpenAI function schemas; ``response_format`` is an OpenAI-style
    ``{"type": "json_schema", "json_schema": {...}}`` or ``{"type": "json_object"}``.
    ``stream`` asks a provider that can to read the answer as it is generated (server-sent
    events); the reply is the same whole ``ChatResponse``, with ``first_token_seconds`` set.
    ``stop`` lists sequences at which the model stops (not included in the reply).
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    timeout: float | None = None
    stream: bool = False
    stop: list[str] | None = None


@dataclass(slots=True)
class ChatResponse:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    model: str = ""
    provider: str = ""
    finish_reason: str | None = None
    retries: int = 0
    first_token_seconds: float | None = None  # a streamed call: from sending the request to its first chunk


@runtime_checkable
class ModelProvider(Protocol):
    """Anything that can answer a ChatRequest. Implementations translate their own errors."""

    name: str

    async def complete(self, request: ChatRequest) -> ChatResponse: ...
