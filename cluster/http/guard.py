"""The one gate every request to `opgraph serve` passes: token, Host, Origin and content type, in that order.

Owns ``AccessPolicy`` (the token, and the hosts and origins the server answers besides its own
loopback names) and ``AccessGuard``, the ASGI middleware that wraps the whole app, so that
every route (the API, the OpenAPI document and docs, a stream, and any route or mounted app
added later, such as a console) is checked the same way before it runs:

1. 401 without ``Authorization: Bearer TOKEN`` (compared in constant time); the exceptions
   are ``GET /?token=TOKEN``, the sign-in URL the server prints, which also gives a browser the
   console's session cookie (``HttpOnly``, ``SameSite=Strict``, derived from the token), and a
   request carrying that cookie. A browser asking for a page without either gets the sign-in
   page (still a 401);
2. 421 when ``Host`` is not one of the server's names (DNS rebinding);
3. 403 when a state-changing request (POST, PUT, PATCH, DELETE) carries an ``Origin`` that
   is not the server's own or an allowed one (cross-site request forgery);
4. 415 when a state-changing request's body is not declared ``application/json`` (a form or
   ``text/plain`` post, which a browser sends cross-site without asking first);
5. 403 when a state-changing request signed in by the cookie lacks the console's CSRF token
   (``X-CSRF-Token``, which the console's pages carry); a bearer token needs none.

A refusal reads no body: an unauthenticated 100 MB upload is a 401, not a 413. It must not
know any route: what a request may do once it passes is the routes' business.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..store import problem

__all__ = ["CSRF_HEADER", "SESSION_COOKIE", "SIGN_IN_PATH", "STATE_CHANGING", "AccessGuard", "AccessPolicy",
           "RedactTokens", "redact_in", "split_host"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SIGN_IN_PATH = "/"
SESSION_COOKIE = "opgraph_session"
CSRF_HEADER = "x-csrf-token"
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def split_host(value: str, default_port: int | None = None) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` too) as a lower-case name without brackets and a port; ``("", None)``
    when it is no host."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else "bad")
    elif value.count(":") == 1:
        name, _, port_text = value.partition(":")
    else:
        name, port_text = value, ""
    if not name or (port_text and not port_text.isdigit()):
        return "", None
    return name.rstrip("."), int(port_text) if port_text else default_port


def _is_unspecified(name: str) -> bool:
    """0.0.0.0 and :: name every interface: a bind address, never a name a client may use."""
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        return False


@dataclass(frozen=True)
class AccessPolicy:
    """Who may call the server and through which names.

    ``token`` is required as a bearer token on every request (None: ``--no-auth``, no token
    at all). A ``Host`` is accepted when it is ``localhost``, ``127.0.0.1``, ``[::1]``,
    ``bound_host`` or the address the connection reached, with the port it reached; or one
    of ``allowed_hosts`` (``name`` for any port, ``name:port`` for one). An ``Origin`` on a
    state-changing request is accepted when it is the origin of an accepted host, or one of
    ``allowed_origins`` (``scheme://host[:port]``).
    """

    token: str | None
    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    _hosts: tuple[tuple[str, int | None], ...] = field(init=False, repr=False, compare=False)
    _origins: frozenset[str] = field(init=False, repr=False, compare=False)
    _secret: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # What the console's cookie and CSRF token are derived from: the token, else (--no-auth) a secret
        # of this process's.
        object.__setattr__(self, "_secret", self.token.encode("utf-8") if self.token is not None
                           else secrets.token_bytes(32))
        hosts = []
        for allowed in self.allowed_hosts:
            name, port = split_host(allowed)
            if not name:
                raise ValueError(f"an allowed host is a name or address with an optional port, got {allowed!r}")
            hosts.append((name, port))
        origins = []
        for allowed in self.allowed_origins:
            parts = urlsplit(allowed.strip())
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
                raise ValueError(f"an allowed origin is scheme://host[:port], got {allowed!r}")
            origins.append(_origin(parts.scheme, parts.netloc))
        object.__setattr__(self, "_hosts", tuple(hosts))
        object.__setattr__(self, "_origins", frozenset(origins))

    def _derived(self, purpose: str) -> str:
        return hmac.new(self._secret, f"opgraph console {purpose}".encode(), hashlib.sha256).hexdigest()

    @property
    def session_value(self) -> str:
        """The console's session cookie value: derived from the token, so it changes when the token does."""
        return self._derived("session")

    @property
    def csrf_token(self) -> str:
        """What a state-changing request signed in by the cookie must carry in ``X-CSRF-Token``."""
        return self._derived("csrf")

    def credential(self, scope: Scope) -> str | None:
        """How the request is signed in: ``bearer``, ``query`` (the sign-in URL), ``cookie`` or ``none``
        (a server without a token); None when it is not."""
        if self.token is None:
            return "none"
        expected = self.token.encode("utf-8")
        cookie = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), expected):
                    return "bearer"
            elif name == b"cookie":
                for part in value.split(b";"):
                    key, _, offered = part.strip().partition(b"=")
                    if key == SESSION_COOKIE.encode() and hmac.compare_digest(offered,
                                                                             self.session_value.encode()):
                        cookie = "cookie"
        if scope.get("method") == "GET" and scope.get("path") == SIGN_IN_PATH:
            for key, offered in parse_qsl(scope.get("query_string", b"").decode("latin-1")):
                if key == "token" and hmac.compare_digest(offered.encode("latin-1"), expected):
                    return "query"
        return cookie

    def authenticated(self, scope: Scope) -> bool:
        """The request carries the token, or the console's cookie (or the server has none)."""
        return self.credential(scope) is not None

    def host_allowed(self, host: str, scope: Scope, default_port: int | None = None) -> bool:
        """``host`` (a ``Host`` header, or an origin's ``host[:port]``) names this server."""
        name, port = split_host(host, default_port)
        if not name:
            return False
        server = scope.get("server") or (None, None)
        own = set(_LOOPBACK_NAMES)
        for address in (self.bound_host, server[0]):
            if address and not _is_unspecified(address.strip("[]")):
                own.add(address.strip("[]").lower())
        if name in own and port == server[1]:
            return True
        return any(name == allowed and (allowed_port is None or port == allowed_port)
                   for allowed, allowed_port in self._hosts)

    def origin_allowed(self, origin: str, scope: Scope) -> bool:
        parts = urlsplit(origin.strip())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed frame, a file), or no origin at all
        if _origin(parts.scheme, parts.netloc) in self._origins:
            return True
        return self.host_allowed(parts.netloc, scope, _DEFAULT_PORTS[parts.scheme])


def _origin(scheme: str, netloc: str) -> str:
    name, port = split_host(netloc, _DEFAULT_PORTS.get(scheme))
    return f"{scheme}://{name}:{port}"


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return value.decode("latin-1")
    return None


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


def _is_json_media(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


@dataclass(frozen=True)
class _Refusal:
    status: int
    message: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


class AccessGuard:
    """ASGI middleware: refuse what ``policy`` does not let in, in the order token, Host, Origin, content type.

    Every refusal is the API's error body. WebSocket handshakes get the first three checks
    (a browser sends any Origin there) and are closed with code 1008 when refused.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, policy: AccessPolicy,
                 sign_in_page: Callable[[], bytes] | None = None) -> None:
        self.app = app
        self.policy = policy
        self.sign_in_page = sign_in_page  # the HTML a browser gets instead of the 401's JSON

    def refusal(self, scope: Scope) -> _Refusal | None:
        """Why the request may not pass, or None."""
        policy = self.policy
        credential = policy.credential(scope)
        if credential is None:
            return _Refusal(401, "this server needs its token: send the header `Authorization: Bearer TOKEN`, "
                                 "with the token `opgraph serve` was given (OPGRAPH_TOKEN or its token file) or "
                                 "generated (its sign-in URL, and the server-token file in the opgraph home of "
                                 "its machine)", ((b"www-authenticate", b'Bearer realm="opgraph"'),))
        host = _header(scope, b"host")
        if host is None or not policy.host_allowed(host, scope):
            shown = "no Host header" if host is None else f"Host {host[:100]!r}"
            return _Refusal(421, f"this server does not answer to {shown}; it answers to its own address and "
                                 "localhost, and to the names given with `opgraph serve --allowed-host NAME`")
        method = scope.get("method", "GET")
        if scope["type"] == "websocket" or method in STATE_CHANGING:
            origin = _header(scope, b"origin")
            if origin is not None and not policy.origin_allowed(origin, scope):
                return _Refusal(403, f"a {method} from the origin {origin[:100]!r} is refused: only this server's "
                                     "own pages and the origins given with `opgraph serve --allowed-origin "
                                     "ORIGIN` may change anything")
        if scope["type"] == "http" and method in STATE_CHANGING:
            content_type = _header(scope, b"content-type")
            if (content_type is None and _has_body(scope)) or (content_type is not None
                                                               and not _is_json_media(content_type)):
                shown = "no content type" if content_type is None else f"content type {content_type[:100]!r}"
                return _Refusal(415, f"a {method} body must be JSON, sent with `Content-Type: application/json`; "
                                     f"this one has {shown}")
            offered = _header(scope, CSRF_HEADER.encode())
            if credential == "cookie" and not (offered and hmac.compare_digest(offered, policy.csrf_token)):
                return _Refusal(403, f"a {method} signed in by the console's cookie needs the page's CSRF token in "
                                     "the X-CSRF-Token header; reload the console page and try again")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is None:
            if scope["type"] == "http" and self.policy.credential(scope) == "query":
                await self._sign_in(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": refused.message[:120]})
        elif refused.status == 401 and self.sign_in_page is not None and _wants_page(scope):
            await _page(send, 401, self.sign_in_page(), refused.headers)
        else:
            await _answer(send, refused)

    async def _sign_in(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The sign-in URL: the session cookie, then a browser goes to ``/`` (the token leaves its address
        bar); any other client gets the answer it asked for, with the cookie."""
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = (f"{SESSION_COOKIE}={self.policy.session_value}; Path=/; HttpOnly; SameSite=Strict{secure}"
                  ).encode("latin-1")
        if _wants_page(scope):
            await send({"type": "http.response.start", "status": 303, "headers": [
                (b"location", SIGN_IN_PATH.encode()), (b"set-cookie", cookie), (b"content-length", b"0"),
                (b"cache-control", b"no-store")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"set-cookie", cookie)]}
            await send(message)

        await self.app(scope, receive, with_cookie)


def _wants_page(scope: Scope) -> bool:
    """A browser's GET for a page (``Accept`` names ``text/html``)."""
    accept = _header(scope, b"accept") or ""
    return scope.get("method") in ("GET", "HEAD") and "text/html" in accept.lower()


async def _page(send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _answer(send: Send, refused: _Refusal) -> None:
    body = json.dumps({"error": refused.message, "errors": [problem(refused.message)]}).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *refused.headers]
    # The body (if any) was not read, so the connection cannot carry another request.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_TOKEN_IN_QUERY = re.compile(r"(?i)([?&]token=)[^&\s\"]*")


class RedactTokens(logging.Filter):
    """A logging filter that blanks ``token=...`` in a record's message and arguments (uvicorn's access log
    prints each request's path with its query, and the sign-in URL carries the token there)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: _redacted(value) for key, value in record.args.items()}
        record.msg = _redacted(record.msg)
        return True


def _redacted(value: Any) -> Any:
    return _TOKEN_IN_QUERY.sub(r"\1***", value) if isinstance(value, str) else value


def redact_in(loggers: Iterable[str]) -> None:
    """Add ``RedactTokens`` to each named logger once."""
    for name in loggers:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, RedactTokens) for existing in logger.filters):
            logger.addFilter(RedactTokens())
