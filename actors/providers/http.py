"""The HTTP boundary of the model providers: one JSON POST with timeouts, retries and typed errors.

Owns httpx: clients (one per event loop), per-attempt deadlines, exponential backoff with
jitter on 429/5xx and dropped connections, ``Retry-After``, and the translation of every
httpx failure into a ``ProviderError`` (``raise ProviderX(...) from exc``). It knows no
provider's wire format (``HTTPChatProvider`` leaves that to subclasses); callers never see
an httpx type.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any

import httpx

from ..models import (
    ChatRequest,
    ChatResponse,
    ProviderConfigError,
    ProviderError,
    ProviderHTTPError,
    ProviderRateLimited,
    ProviderResponseError,
    ProviderTimeout,
    ProviderUnavailable,
    parse_model_id,
)
from .limits import provider_slot, record_call, record_failure, record_retry

__all__ = [
    "DEFAULT_TIMEOUT", "RETRYABLE_STATUSES", "HTTPChatProvider", "JSONReply", "ProviderHTTPClient", "RetryPolicy",
    "check_max_tokens", "retry_after_seconds",
]

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
BODY_EXCERPT = 300  # characters of an error body quoted in messages
# Seconds one attempt may take: the official openai and anthropic SDKs' 10 minutes, since
# a model (a local one on a CPU above all) may generate for minutes. 60 s failed real nodes.
DEFAULT_TIMEOUT = 600.0


def check_max_tokens(value: int | None, provider: str) -> int | None:
    """``value`` when it is None or a positive int; otherwise a ProviderConfigError."""
    if value is not None and (type(value) is not int or value < 1):
        raise ProviderConfigError(f"{provider}: max_tokens must be a positive integer, got {value!r}",
                                  provider=provider)
    return value


def retry_after_seconds(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header: delta-seconds or an HTTP date; None if absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass  # not delta-seconds: try the HTTP-date form below
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how long to wait: ``max_retries`` after the first attempt.

    The n-th retry waits ``backoff * 2**n`` seconds, jittered to between half and all of
    it, unless the server sent ``Retry-After``; every wait is capped at ``max_delay``.
    """

    max_retries: int = 3
    backoff: float = 0.5
    max_delay: float = 20.0
    statuses: frozenset[int] = RETRYABLE_STATUSES

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_delay)
        base = min(self.backoff * (2 ** retry), self.max_delay)
        return base * (0.5 + rng.random() / 2)


@dataclass(frozen=True, slots=True)
class JSONReply:
    """A parsed 2xx body and how many retries it took."""

    body: Any
    status: int
    retries: int


class ProviderHTTPClient:
    """POSTs JSON to one base URL on behalf of one provider, retrying what is worth retrying.

    Holds one ``httpx.AsyncClient`` per event loop (a Ray worker has one loop, so its
    connections are reused); ``aclose()`` closes the current loop's client. Pickles
    without its clients, so a provider built in the driver ships to the workers.
    ``transport`` (an ``httpx.AsyncBaseTransport`` such as ``httpx.MockTransport``) is
    the test seam. ``concurrency`` caps calls in flight cluster-wide (see ``limits``).
    """

    def __init__(self, provider: str, base_url: str, headers: dict[str, str] | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, concurrency: int | None = None,
                 seed: int | None = None) -> None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ProviderConfigError(f"{provider}: timeout must be a number of seconds above 0, got {timeout!r}",
                                      provider=provider)
        self.provider = provider
        self.base_url = base_url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.transport = transport
        self.concurrency = concurrency
        self._rng = random.Random(seed)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_clients"] = None  # live sockets belong to this process's loops
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clients = weakref.WeakKeyDictionary()

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(transport=self.transport, headers=self.headers)
            self._clients[loop] = client
        return client

    async def aclose(self) -> None:
        """Close this event loop's client and its connections."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def post_json(self, path: str, payload: dict[str, Any], *, timeout: float | None = None) -> JSONReply:
        """POST ``payload`` to ``base_url + path``; return the parsed 2xx body or raise a ProviderError.

        ``timeout`` bounds each attempt (waiting for a concurrency permit and the backoff
        sleeps are not counted). Timeouts are not retried: a model that did not answer in
        time is not likely to answer the same request faster.
        """
        url = self.base_url + path
        limit = self.timeout if timeout is None else timeout
        retries = 0
        while True:
            try:
                async with provider_slot(self.provider, self.concurrency):
                    response = await self._attempt(url, payload, limit)
            except _RetryableFailure as failure:
                if retries >= self.retry.max_retries:
                    raise ProviderUnavailable(
                        f"{self.provider}: {failure.reason} at {url} after {retries + 1} attempts; "
                        "check that the server is running and the base URL is right",
                        provider=self.provider,
                    ) from failure.__cause__
                await self._back_off(retries, None)
                retries += 1
                continue
            status = response.status_code
            if status in self.retry.statuses and retries < self.retry.max_retries:
                await self._back_off(retries, retry_after_seconds(response.headers.get("retry-after")))
                retries += 1
                continue
            if not 200 <= status < 300:
                raise self._status_error(url, response, retries)
            try:
                body = json.loads(response.content)
            except ValueError as exc:
                raise ProviderResponseError(
                    f"{self.provider}: {url} answered {status} with a body that is not JSON: "
                    f"{_excerpt(response)!r}",
                    provider=self.provider, status=status,
                ) from exc
            return JSONReply(body=body, status=status, retries=retries)

    async def _back_off(self, retries: int, retry_after: float | None) -> None:
        record_retry(self.provider)
        await asyncio.sleep(self.retry.delay(retries, retry_after, self._rng))

    async def _attempt(self, url: str, payload: dict[str, Any], timeout: float) -> httpx.Response:
        """One POST, with every httpx failure translated; retryable ones raise _RetryableFailure."""
        try:
            async with asyncio.timeout(timeout):
                return await self._client().post(url, json=payload, timeout=httpx.Timeout(timeout))
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ProviderTimeout(f"{self.provider}: no answer from {url} within {timeout:g} s; give the node a "
                                  f"longer timeout=, or the provider one ({self.provider.upper()}_TIMEOUT for a "
                                  "built-in provider)", provider=self.provider) from exc
        except httpx.UnsupportedProtocol as exc:
            raise ProviderConfigError(
                f"{self.provider}: base URL {self.base_url!r} needs an http:// or https:// scheme",
                provider=self.provider) from exc
        except httpx.TransportError as exc:
            # Refused, reset, or the server hung up mid-answer: worth another try.
            raise _RetryableFailure(f"connection failed ({type(exc).__name__}: {exc})") from exc
        except httpx.InvalidURL as exc:
            raise ProviderConfigError(f"{self.provider}: invalid URL {url!r}: {exc}", provider=self.provider) from exc
        except httpx.HTTPError as exc:
            # What is left: body decoding and redirect loops. Neither improves on a retry.
            raise ProviderResponseError(f"{self.provider}: {url}: {type(exc).__name__}: {exc}",
                                        provider=self.provider) from exc

    def _status_error(self, url: str, response: httpx.Response, retries: int) -> ProviderError:
        status = response.status_code
        tries = f"after {retries + 1} attempts" if retries else "on the first attempt"
        detail = f"{self.provider}: {url} answered {status} {tries}: {_excerpt(response)!r}"
        if status == 429:
            return ProviderRateLimited(detail, provider=self.provider, status=status)
        if status in self.retry.statuses or status >= 500:
            return ProviderUnavailable(detail, provider=self.provider, status=status)
        if status in (401, 403):
            detail += "; check the API key"
        return ProviderHTTPError(detail, provider=self.provider, status=status)


class _RetryableFailure(Exception):
    """Internal: an attempt failed in a way another attempt may fix. Never leaves this module."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _excerpt(response: httpx.Response) -> str:
    text = response.content[:BODY_EXCERPT].decode("utf-8", errors="replace")
    return text + ("..." if len(response.content) > BODY_EXCERPT else "")


class HTTPChatProvider:
    """What every HTTP chat provider shares: the call, its accounting, and closing.

    Subclasses set ``endpoint`` and ``self._http`` and implement ``request_body`` and
    ``parse_body``; ``complete`` posts, parses, and records usage, latency and failures.
    """

    name: str
    endpoint: str
    _http: ProviderHTTPClient

    def request_body(self, request: ChatRequest, model_name: str) -> dict[str, Any]:
        raise NotImplementedError

    def parse_body(self, body: Any, request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        raise NotImplementedError

    async def complete(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        _, model_name = parse_model_id(request.model)
        try:
            reply = await self._http.post_json(self.endpoint, self.request_body(request, model_name),
                                               timeout=request.timeout)
            response = self.parse_body(reply.body, request, status=reply.status)
        except ProviderError:
            record_failure(self.name)
            raise
        response.retries = reply.retries
        record_call(self.name, response.usage, time.perf_counter() - started)
        return response

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
