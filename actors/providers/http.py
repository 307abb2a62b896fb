"""The HTTP boundary of the model providers: one JSON POST with timeouts, retries and typed errors.

Owns httpx: clients (one per event loop), per-attempt deadlines, exponential backoff with
jitter on 429/5xx and dropped connections, ``Retry-After``, adaptive admission once a
provider rate-limits (``adaptive.py``: 429s are then waited out, not failed, within a
patience), and the translation of every
httpx failure into a ``ProviderError`` (``raise ProviderX(...) from exc``). It knows no
provider's wire format (``HTTPChatProvider`` leaves that to subclasses); callers never see
an httpx type, and no message shows the password of a ``user:password@`` base URL.
"""

from __future__ import annotations

import asyncio
import atexit
import email.utils
import json
import random
import time
import weakref
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import yarl

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
from ..secrets import redact_credentials, redact_url
from .adaptive import RateBudget
from .limits import adaptive_slot, provider_slot, record_call, record_failure, record_retry

__all__ = [
    "DEFAULT_TIMEOUT", "RETRYABLE_STATUSES", "HTTPChatProvider", "JSONReply", "ProviderHTTPClient", "RetryPolicy",
    "check_max_tokens", "estimated_tokens", "forget_rate_limited_providers", "reported_tokens",
    "retry_after_seconds", "server_wait_seconds",
]

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
# Calls in flight per event loop, beyond which they wait here in an O(1) queue. The default
# client is aiohttp's (about 0.3 ms of CPU a call, and flat up to thousands of connections);
# an injected httpx transport (the tests' seam) keeps httpx's pool of 100: a fan-out of
# thousands queued in httpcore's own pool stalled for seconds on every release.
CONNECTIONS_PER_LOOP = 1000
HTTPX_CONNECTIONS_PER_LOOP = 100
_JSON = {"Content-Type": "application/json"}
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


def server_wait_seconds(headers: Any) -> float | None:
    """How long a 429/503 asks us to wait: ``retry-after-ms`` (sent beside ``Retry-After`` by
    OpenAI-style servers, finer than its whole seconds) or else ``Retry-After``."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds is not None:
        try:
            return max(0.0, float(milliseconds) / 1000.0)
        except ValueError:
            pass  # unreadable: fall back to Retry-After
    return retry_after_seconds(headers.get("retry-after"))


def reported_tokens(body: Any) -> int | None:
    """Tokens a chat body says it used (OpenAI ``usage.total_tokens`` or prompt + completion,
    Anthropic ``input_tokens`` + ``output_tokens``); None when it says nothing readable."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    parts = [usage.get(key) for key in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens")]
    numbers = [part for part in parts if isinstance(part, int)]
    return sum(numbers) if numbers else None


def estimated_tokens(payload: dict[str, Any]) -> int:
    """About how many tokens a chat request will spend: its text at four characters a token,
    plus its ``max_tokens`` when it names one (the gate learns the rest from usage)."""
    characters = 0
    for message in payload.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            characters += len(content)
        elif content is not None:
            characters += len(json.dumps(content, default=str))
    if isinstance(payload.get("system"), str):
        characters += len(payload["system"])
    max_tokens = payload.get("max_tokens")
    return (characters + 3) // 4 + (max_tokens if isinstance(max_tokens, int) else 0)


# Providers this process has seen rate-limit: their calls go through the adaptive gate
# from then on (before that, a provider that never says 429 pays nothing for it).
_rate_limited_providers: set[str] = set()


def forget_rate_limited_providers() -> None:
    """Let this process's providers go ungated again until their next 429 (tests, long-lived drivers)."""
    _rate_limited_providers.clear()


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
    With adaptive admission a 429 is not one of the ``max_retries``: it is waited out
    (its ``Retry-After``, in full) until the call has waited ``rate_limit_patience``
    seconds for 429s in all, and only then fails ``ProviderRateLimited``.
    """

    max_retries: int = 3
    backoff: float = 0.5
    max_delay: float = 20.0
    statuses: frozenset[int] = RETRYABLE_STATUSES
    rate_limit_patience: float = 600.0

    def delay(self, retry: int, retry_after: float | None, rng: random.Random) -> float:
        if retry_after is not None:
            return min(retry_after, self.max_delay)
        base = min(self.backoff * (2 ** retry), self.max_delay)
        return base * (0.5 + rng.random() / 2)


@dataclass(frozen=True, slots=True)
class JSONReply:
    """A parsed 2xx body and how many retries it took; a streamed call's body is the list of its
    events (each ``data:`` line's JSON), and ``first_event_seconds`` the time from sending to the first."""

    body: Any
    status: int
    retries: int
    first_event_seconds: float | None = None


class _Reply:
    """What one attempt got back, from either client: status, headers, raw body; a stream's events."""

    __slots__ = ("status_code", "headers", "content", "url", "events", "first_event_seconds")

    def __init__(self, status_code: int, headers: Any, content: bytes, url: str,
                 events: list[Any] | None = None) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content
        self.url = url
        self.events = events
        self.first_event_seconds: float | None = None

    def add_event_line(self, line: bytes, sent: float) -> None:
        """One line of a server-sent-events body: a ``data:`` line's JSON joins ``events``."""
        if not line.startswith(b"data:"):
            return  # blank separators, comments, ``event:`` names
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            return
        if self.first_event_seconds is None:
            self.first_event_seconds = time.perf_counter() - sent
        self.content += line  # kept for an error message, should the events not parse
        assert self.events is not None
        self.events.append(data)


class ProviderHTTPClient:
    """POSTs JSON to one base URL on behalf of one provider, retrying what is worth retrying.

    Holds one ``httpx.AsyncClient`` per event loop (a Ray worker has one loop, so its
    connections are reused); ``aclose()`` closes the current loop's client. Pickles
    without its clients, so a provider built in the driver ships to the workers.
    ``transport`` (an ``httpx.AsyncBaseTransport`` such as ``httpx.MockTransport``) is
    the test seam. ``concurrency`` caps calls in flight cluster-wide (see ``limits``).

    ``adaptive`` (the default) admits calls through the cluster-wide adaptive gate once this
    provider has answered 429 in this process, or from the start when ``budget`` (RPM, TPM)
    or ``concurrency`` is configured: one learned window, every ``Retry-After`` pausing
    all workers, and the budget spent as calls start. ``adaptive=False`` keeps the fixed
    cap and counts 429s among the ``max_retries``.
    """

    def __init__(self, provider: str, base_url: str, headers: dict[str, str] | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, concurrency: int | None = None,
                 seed: int | None = None, adaptive: bool = True, budget: RateBudget | None = None) -> None:
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
        self.adaptive = adaptive
        budget = budget or RateBudget()
        if concurrency is not None and budget.max_concurrency is None:
            budget = RateBudget(budget.requests_per_minute, budget.tokens_per_minute, concurrency)
        self.budget = budget
        if budget.configured and not adaptive and (budget.requests_per_minute or budget.tokens_per_minute):
            raise ProviderConfigError(f"{provider}: an RPM/TPM budget needs adaptive admission (adaptive=True)",
                                      provider=provider)
        self._rng = random.Random(seed)
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )
        self._sending: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_clients"] = None  # live sockets belong to this process's loops
        state["_sending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clients = weakref.WeakKeyDictionary()
        self._sending = weakref.WeakKeyDictionary()

    def _client(self) -> httpx.AsyncClient:
        """This loop's httpx client: only with an injected ``transport``."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(transport=self.transport, headers=self.headers)
            self._clients[loop] = client
        return client

    def _session(self) -> aiohttp.ClientSession:
        """This loop's aiohttp session: the default client. Its deadlines are ``asyncio.timeout``'s."""
        loop = asyncio.get_running_loop()
        session = self._clients.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(limit=CONNECTIONS_PER_LOOP, limit_per_host=0, ttl_dns_cache=300)
            session = aiohttp.ClientSession(
                connector=connector, headers=self.headers, auto_decompress=True,
                timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None))
            self._clients[loop] = session
            _open_sessions.add(session)
            # A provider unpickled for one run is dropped when the run is forgotten: its session goes with it.
            weakref.finalize(self, _let_go, session)
        return session

    def _sender_slots(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        slots = self._sending.get(loop)
        if slots is None:
            size = CONNECTIONS_PER_LOOP if self.transport is None else HTTPX_CONNECTIONS_PER_LOOP
            slots = self._sending[loop] = asyncio.Semaphore(size)
        return slots

    async def aclose(self) -> None:
        """Close this event loop's client and its connections."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if isinstance(client, aiohttp.ClientSession):
            await client.close()
        elif client is not None:
            await client.aclose()

    async def post_json(self, path: str, payload: dict[str, Any], *, timeout: float | None = None,
                        stream: bool = False) -> JSONReply:
        """POST ``payload`` to ``base_url + path``; return the parsed 2xx body or raise a ProviderError.

        ``stream``: the answer is server-sent events; the body returned is the list of their
        ``data:`` JSON objects, read to the end (``[DONE]`` or the connection's close).

        ``timeout`` bounds each attempt (waiting for a concurrency permit and the backoff
        sleeps are not counted). Timeouts are not retried: a model that did not answer in
        time is not likely to answer the same request faster.
        """
        url = self.base_url + path
        limit = self.timeout if timeout is None else timeout
        retries = 0
        rate_limit_waited = 0.0
        rate_limited_in_a_row = 0
        tokens = estimated_tokens(payload)
        while True:
            gated = self.adaptive and (self.budget.configured or self.provider in _rate_limited_providers)
            try:
                if gated:
                    async with adaptive_slot(self.provider, self.budget, tokens) as ticket:
                        response = await self._attempt(url, payload, limit, stream=stream)
                        body = self._note_outcome(ticket, response)
                else:
                    async with provider_slot(self.provider, self.concurrency):
                        response = await self._attempt(url, payload, limit, ungated=self.adaptive, stream=stream)
                    body = _UNREAD
            except _NowRateLimited:
                continue  # another call's 429 arrived while this one queued to send: go through the gate
            except _RetryableFailure as failure:
                if retries >= self.retry.max_retries:
                    raise ProviderUnavailable(
                        f"{self.provider}: {redact_credentials(failure.reason)} at {redact_url(url)} after "
                        f"{retries + 1} attempts; check that the server is running and the base URL is right",
                        provider=self.provider,
                    ) from failure.__cause__
                await self._back_off(retries, None)
                retries += 1
                continue
            status = response.status_code
            if status == 429 and self.adaptive:
                _rate_limited_providers.add(self.provider)
                wait = server_wait_seconds(response.headers)
                if wait is None:  # no hint: back off, doubling while the 429s go on
                    wait = self.retry.delay(rate_limited_in_a_row, None, self._rng)
                if rate_limit_waited + wait > self.retry.rate_limit_patience:
                    raise self._status_error(url, response, retries)
                record_retry(self.provider)
                await asyncio.sleep(wait)  # in full, never capped: the server said when
                rate_limit_waited += wait
                rate_limited_in_a_row += 1
                retries += 1
                continue
            rate_limited_in_a_row = 0
            if status in self.retry.statuses and retries < self.retry.max_retries:
                await self._back_off(retries, server_wait_seconds(response.headers))
                retries += 1
                continue
            if not 200 <= status < 300:
                raise self._status_error(url, response, retries)
            if body is _UNREAD:
                body = self._parse(url, response)
            return JSONReply(body=body, status=status, retries=retries,
                             first_event_seconds=response.first_event_seconds)

    def _parse(self, url: str, response: _Reply) -> Any:
        try:
            if response.events is not None:
                return [json.loads(event) for event in response.events]
            return json.loads(response.content)
        except ValueError as exc:
            raise ProviderResponseError(
                f"{self.provider}: {redact_url(url)} answered {response.status_code} with a body that is not JSON: "
                f"{_excerpt(response)!r}",
                provider=self.provider, status=response.status_code,
            ) from exc

    def _note_outcome(self, ticket: Any, response: _Reply) -> Any:
        """Tell the gate how an admitted call went; returns the parsed body of a 2xx (else _UNREAD)."""
        status = response.status_code
        if status == 429:
            ticket.outcome = "rate_limited"
            ticket.retry_after = server_wait_seconds(response.headers)
            return _UNREAD
        if 200 <= status < 300:
            body = self._parse(url=response.url, response=response)
            ticket.outcome = "ok"
            ticket.reported = reported_tokens(body[-1] if isinstance(body, list) and body else body)
            return body
        return _UNREAD

    async def _back_off(self, retries: int, retry_after: float | None) -> None:
        record_retry(self.provider)
        await asyncio.sleep(self.retry.delay(retries, retry_after, self._rng))

    async def _attempt(self, url: str, payload: dict[str, Any], timeout: float, *,
                       ungated: bool = False, stream: bool = False) -> _Reply:
        """One POST, with every client failure translated; retryable ones raise _RetryableFailure."""
        try:
            async with asyncio.timeout(timeout), self._sender_slots():
                if ungated and self.provider in _rate_limited_providers:
                    raise _NowRateLimited
                if self.transport is None:
                    return await self._send_aiohttp(url, payload, stream)
                return await self._send_httpx(url, payload, timeout, stream)
        except (TimeoutError, httpx.TimeoutException) as exc:
            raise ProviderTimeout(f"{self.provider}: no answer from {redact_url(url)} within {timeout:g} s; give the "
                                  f"node a longer timeout=, or the provider one ({self.provider.upper()}_TIMEOUT for "
                                  "a built-in provider)", provider=self.provider) from exc
        except httpx.UnsupportedProtocol as exc:
            raise self._scheme_error() from exc
        except (httpx.TransportError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            # Refused, reset, or the server hung up mid-answer: worth another try.
            raise _RetryableFailure(f"connection failed ({type(exc).__name__}: {exc})") from exc
        except (httpx.InvalidURL, aiohttp.InvalidURL) as exc:
            raise ProviderConfigError(f"{self.provider}: invalid URL {redact_url(url)!r}: "
                                      f"{redact_credentials(str(exc))}", provider=self.provider) from exc
        except (httpx.HTTPError, aiohttp.ClientError) as exc:
            # What is left: body decoding and redirect loops. Neither improves on a retry.
            raise ProviderResponseError(f"{self.provider}: {redact_url(url)}: {type(exc).__name__}: "
                                        f"{redact_credentials(str(exc))}", provider=self.provider) from exc

    def _scheme_error(self) -> ProviderConfigError:
        return ProviderConfigError(
            f"{self.provider}: base URL {redact_url(self.base_url)!r} needs an http:// or https:// scheme",
            provider=self.provider)

    async def _send_aiohttp(self, url: str, payload: dict[str, Any], stream: bool) -> _Reply:
        if not url.startswith(("http://", "https://")):
            raise self._scheme_error()
        sent = time.perf_counter()
        if "@" in url.split("/", 3)[2]:  # user:password@host: aiohttp refuses it beside the key's header,
            url = str(yarl.URL(url).with_user(None))  # and the provider authenticates with that header
        async with self._session().post(url, data=json.dumps(payload).encode(), headers=_JSON) as response:
            if not (stream and 200 <= response.status < 300):
                return _Reply(response.status, response.headers, await response.read(), url)
            reply = _Reply(response.status, response.headers, b"", url, events=[])
            async for line in response.content:
                reply.add_event_line(line, sent)
            return reply

    async def _send_httpx(self, url: str, payload: dict[str, Any], timeout: float, stream: bool) -> _Reply:
        sent = time.perf_counter()
        if not stream:
            response = await self._client().post(url, json=payload, timeout=httpx.Timeout(timeout))
            return _Reply(response.status_code, response.headers, response.content, url)
        async with self._client().stream("POST", url, json=payload, timeout=httpx.Timeout(timeout)) as response:
            if not 200 <= response.status_code < 300:
                return _Reply(response.status_code, response.headers, await response.aread(), url)
            reply = _Reply(response.status_code, response.headers, b"", url, events=[])
            async for line in response.aiter_lines():
                reply.add_event_line(line.encode(), sent)
            return reply

    def _status_error(self, url: str, response: _Reply, retries: int) -> ProviderError:
        status = response.status_code
        tries = f"after {retries + 1} attempts" if retries else "on the first attempt"
        detail = f"{self.provider}: {redact_url(url)} answered {status} {tries}: {_excerpt(response)!r}"
        if status == 429:
            return ProviderRateLimited(detail, provider=self.provider, status=status)
        if status in self.retry.statuses or status >= 500:
            return ProviderUnavailable(detail, provider=self.provider, status=status)
        if status in (401, 403):
            detail += "; check the API key"
        return ProviderHTTPError(detail, provider=self.provider, status=status)


_UNREAD = object()  # a response body not parsed yet

# Every aiohttp session this process opened. A worker's loop ends with the process, never
# closing them: at exit their sockets are let go here, quietly (aiohttp would otherwise print
# "Unclosed client session" for each, from every worker, on every shutdown).
_open_sessions: weakref.WeakSet[aiohttp.ClientSession] = weakref.WeakSet()


def _let_go(session: aiohttp.ClientSession) -> None:
    connector = session.connector
    if connector is not None and not session.closed:
        connector._close()  # synchronous: closes the sockets; there may be no loop left to await on
        session.detach()


@atexit.register
def _let_go_of_sessions() -> None:
    for session in list(_open_sessions):
        _let_go(session)


class _NowRateLimited(Exception):
    """Internal: an ungated call found its provider rate-limited once it could send. Never leaves this module."""


class _RetryableFailure(Exception):
    """Internal: an attempt failed in a way another attempt may fix. Never leaves this module."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _excerpt(response: _Reply) -> str:
    text = response.content[:BODY_EXCERPT].decode("utf-8", errors="replace")
    return text + ("..." if len(response.content) > BODY_EXCERPT else "")


class HTTPChatProvider:
    """What every HTTP chat provider shares: the call, its accounting, its description, and closing.

    Subclasses set ``kind`` (the built-in it is: its environment's prefix), ``endpoint``,
    ``self._http``, ``self.base_url`` and ``self.settings`` (the constructor's arguments
    that are no secret) and implement ``request_body`` and ``parse_body``; ``complete``
    posts, parses, and records usage, latency and failures.
    """

    kind: str
    name: str
    endpoint: str
    streams = False  # whether a ChatRequest's ``stream`` is sent as such (else the answer comes whole)
    base_url: str
    settings: dict[str, Any]
    _http: ProviderHTTPClient

    def description(self) -> dict[str, Any]:
        """What a durable run's header keeps of this provider: no key, no header, the base URL
        without its password; ``providers.provider_from_description`` builds it again."""
        return {"kind": self.kind, "name": self.name, "base_url": redact_url(self.base_url),
                "settings": dict(self.settings)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, base_url={redact_url(self.base_url)!r})"

    def request_body(self, request: ChatRequest, model_name: str) -> dict[str, Any]:
        raise NotImplementedError

    def parse_body(self, body: Any, request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        raise NotImplementedError

    def parse_events(self, events: list[Any], request: ChatRequest, *, status: int | None = None) -> ChatResponse:
        """A streamed answer's events as one ChatResponse (providers with ``streams = True``)."""
        raise NotImplementedError

    async def complete(self, request: ChatRequest) -> ChatResponse:
        started = time.perf_counter()
        _, model_name = parse_model_id(request.model)
        stream = request.stream and self.streams
        try:
            reply = await self._http.post_json(self.endpoint, self.request_body(request, model_name),
                                               timeout=request.timeout, stream=stream)
            response = (self.parse_events(reply.body, request, status=reply.status) if stream
                        else self.parse_body(reply.body, request, status=reply.status))
        except ProviderError:
            record_failure(self.name)
            raise
        response.retries = reply.retries
        response.first_token_seconds = reply.first_event_seconds
        record_call(self.name, response.usage, time.perf_counter() - started)
        return response

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
