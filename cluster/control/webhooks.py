"""Webhook endpoints: where the outbox is delivered, which targets are allowed, and how a body is signed.

Owns the endpoint rows (added, listed, enabled, tested, their deliveries read back), the
allow-list every target URL is checked against (private, loopback and link-local addresses
are refused unless allowed; host names are resolved first), the signing secrets' references
(an environment variable, a ``0600`` file, or a name in the ``0600`` ``webhook-secrets`` file
of the opgraph home: never a row), and the Standard Webhooks signature. Sending is the
relay's (relay.py); nothing here opens a connection to a receiver::

    OpGraphError
    └── WebhookError                 a webhook endpoint cannot be used as asked; ``endpoint`` names it
        ├── WebhookTargetError       the URL is malformed or outside the allow-list (nothing stored or sent)
        ├── WebhookSecretError       the signing secret's reference is malformed, or names no usable secret
        ├── WebhookNotFoundError     no endpoint by that name
        └── WebhookNameConflictError an endpoint already has that name
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets as random_source
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from opgraph.actors.secrets import private_directory, private_file
from opgraph.actors.settings import opgraph_home
from opgraph.kernel import OpGraphError

from ..store import MAX_NAME_LENGTH, NAME_PATTERN, StoreDatabase
from .outbox import TEST_EVENT, record

__all__ = [
    "ALLOWED_NETWORKS_ENV",
    "SECRETS_FILE_NAME",
    "AllowList",
    "WebhookEndpoint",
    "WebhookError",
    "WebhookNameConflictError",
    "WebhookNotFoundError",
    "WebhookSecretError",
    "WebhookTargetError",
    "Webhooks",
    "check_target",
    "check_target_async",
    "delivery_statistics",
    "generate_secret",
    "resolve_secret",
    "sign",
    "store_secret",
]

ALLOWED_NETWORKS_ENV = "OPGRAPH_WEBHOOK_ALLOWED_NETWORKS"
SECRETS_FILE_NAME = "webhook-secrets"
SECRET_PREFIX = "whsec_"
_SECRET_BYTES = (24, 64)  # a key's length in bytes, least and most
_NAME = re.compile(NAME_PATTERN)
_SECRET_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,120}$")
_EVENT_PATTERN = re.compile(r"^(\*|[a-z][a-z0-9_]*(\.[a-z0-9_]+)*(\.\*)?)$")
MAX_URL_LENGTH = 2000
DEFAULT_EVENTS = ("run.*",)


# -- errors ------------------------------------------------------------------------------------------
class WebhookError(OpGraphError):
    """A webhook endpoint cannot be used as asked; ``endpoint`` names it (None before it has a name)."""

    def __init__(self, message: str, *, endpoint: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint


class WebhookTargetError(WebhookError):
    """The endpoint's URL is malformed, or resolves to an address outside the allow-list
    (``OPGRAPH_WEBHOOK_ALLOWED_NETWORKS``); nothing was stored or sent."""


class WebhookSecretError(WebhookError):
    """The signing secret's reference is malformed, or names no usable ``whsec_`` secret; nothing was signed."""


class WebhookNotFoundError(WebhookError):
    """No webhook endpoint has that name (`opgraph webhook list` shows them)."""


class WebhookNameConflictError(WebhookError):
    """A webhook endpoint already has that name; pick another one."""


# -- the allow-list --------------------------------------------------------------------------------
_NAMED_NETWORKS = {
    "loopback": ("127.0.0.0/8", "::1/128"),
    "private": ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"),
    "link-local": ("169.254.0.0/16", "fe80::/10"),
}
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class AllowList:
    """Networks a webhook may target besides the public internet: by default none, so a webhook cannot
    be aimed at the server's own loopback, private network or cloud metadata address.

    Entries are ``loopback``, ``private``, ``link-local``, an address or a CIDR network.
    """

    networks: tuple[Network, ...] = ()
    entries: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        networks: list[Network] = []
        kept: list[str] = []
        for entry in (item.strip() for item in entries):
            if not entry:
                continue
            kept.append(entry)
            if entry.lower() in _NAMED_NETWORKS:
                networks.extend(ipaddress.ip_network(text) for text in _NAMED_NETWORKS[entry.lower()])
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"a webhook allow-list entry is loopback, private, link-local, an address or a "
                                 f"CIDR network, got {entry!r}") from None
        return cls(tuple(networks), tuple(kept))

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> AllowList:
        """``OPGRAPH_WEBHOOK_ALLOWED_NETWORKS`` (comma-separated), else nothing beyond public addresses."""
        return cls.parse((os.environ if environ is None else environ).get(ALLOWED_NETWORKS_ENV, "").split(","))

    def permits(self, address: Address) -> bool:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_global or any(address in network for network in self.networks)

    def describe(self) -> str:
        return ", ".join(self.entries) if self.entries else "public addresses only"


def _split_target(url: str, endpoint: str | None) -> tuple[str, int]:
    if not isinstance(url, str) or not 0 < len(url) <= MAX_URL_LENGTH:
        raise WebhookTargetError(f"a webhook URL is 1 to {MAX_URL_LENGTH} characters", endpoint=endpoint)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookTargetError(f"the webhook URL {url!r} cannot be read: {exc}", endpoint=endpoint) from None
    if parts.scheme not in ("http", "https"):
        raise WebhookTargetError(f"a webhook URL is http:// or https://, got {url!r}", endpoint=endpoint)
    if not parts.hostname:
        raise WebhookTargetError(f"the webhook URL {url!r} names no host", endpoint=endpoint)
    if parts.username is not None or parts.password is not None:
        raise WebhookTargetError("a webhook URL carries no user or password: it is stored as it is, and a "
                                 "receiver checks the signature instead", endpoint=endpoint)
    if parts.fragment:
        raise WebhookTargetError(f"a webhook URL has no #fragment, got {url!r}", endpoint=endpoint)
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _check_addresses(url: str, host: str, found: Iterable[Any], allow: AllowList, endpoint: str | None) -> None:
    addresses = sorted({info[4][0].split("%")[0] for info in found})
    if not addresses:
        raise WebhookTargetError(f"the webhook host {host!r} resolves to no address", endpoint=endpoint)
    for text in addresses:
        address = ipaddress.ip_address(text)
        if not allow.permits(address):
            raise WebhookTargetError(
                f"the webhook URL {url} resolves to {address}, which is outside the allow-list "
                f"({allow.describe()}); allow it with {ALLOWED_NETWORKS_ENV}=loopback, private, link-local "
                "or a CIDR network, if the server may call it", endpoint=endpoint)


def check_target(url: str, allow: AllowList, *, endpoint: str | None = None,
                 resolve: Callable[..., Any] = socket.getaddrinfo) -> None:
    """``WebhookTargetError`` unless ``url`` is http(s) and every address its host resolves to is allowed."""
    host, port = _split_target(url, endpoint)
    try:
        found = resolve(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:  # ValueError: a NUL in the name
        raise WebhookTargetError(f"the webhook host {host!r} cannot be resolved: {exc}", endpoint=endpoint) from None
    _check_addresses(url, host, found, allow, endpoint)


async def check_target_async(url: str, allow: AllowList, *, endpoint: str | None = None) -> None:
    """``check_target`` on the running loop's resolver: a relay checks again at each send, since a name
    may resolve elsewhere by then."""
    host, port = _split_target(url, endpoint)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:  # ValueError: a NUL in the name
        raise WebhookTargetError(f"the webhook host {host!r} cannot be resolved: {exc}", endpoint=endpoint) from None
    _check_addresses(url, host, found, allow, endpoint)


# -- secrets ---------------------------------------------------------------------------------------
def generate_secret() -> str:
    """A new signing secret, ``whsec_`` and 32 random bytes in base64 (the Standard Webhooks form)."""
    return SECRET_PREFIX + base64.b64encode(random_source.token_bytes(32)).decode()


def _secret_key(secret: str, endpoint: str | None, where: str) -> bytes:
    text = secret.strip()
    if not text.startswith(SECRET_PREFIX):
        raise WebhookSecretError(f"the signing secret in {where} does not start with {SECRET_PREFIX!r}",
                                 endpoint=endpoint)
    try:
        key = base64.b64decode(text[len(SECRET_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise WebhookSecretError(f"the signing secret in {where} is not {SECRET_PREFIX} and base64",
                                 endpoint=endpoint) from None
    if not _SECRET_BYTES[0] <= len(key) <= _SECRET_BYTES[1]:
        raise WebhookSecretError(f"the signing secret in {where} holds {len(key)} bytes; a key is "
                                 f"{_SECRET_BYTES[0]} to {_SECRET_BYTES[1]}", endpoint=endpoint)
    return key


def secrets_file(environ: Mapping[str, str] | None = None) -> Path:
    return opgraph_home(environ) / SECRETS_FILE_NAME


def _private_text(path: Path, endpoint: str | None) -> str:
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise WebhookSecretError(f"the secrets file {path} can be read by other users (mode "
                                     f"{stat.S_IMODE(mode):04o}); make it private with `chmod 600 {path}`",
                                     endpoint=endpoint)
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WebhookSecretError(f"cannot read the secrets file {path}: {reason}", endpoint=endpoint) from None


def check_secret_ref(ref: str, *, endpoint: str | None = None) -> str:
    """``ref`` if it is ``env:VARIABLE``, ``file:PATH`` or a NAME in the webhook-secrets file; else an error."""
    if not isinstance(ref, str):
        raise WebhookSecretError("a secret reference is text", endpoint=endpoint)
    if ref.strip().startswith(SECRET_PREFIX):
        raise WebhookSecretError("that is a secret, not where one lives: a row never holds a secret; give "
                                 "env:VARIABLE, file:PATH (a 0600 file) or a NAME in "
                                 f"$OPGRAPH_HOME/{SECRETS_FILE_NAME}", endpoint=endpoint)
    kind, _, name = ref.partition(":")
    if kind == "env" and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,199}", name):
        return ref
    if kind == "file" and name.strip() and len(name) <= 1000:
        return ref
    if not _ and _SECRET_NAME.fullmatch(ref):
        return ref
    raise WebhookSecretError(f"a secret reference is env:VARIABLE, file:PATH (a 0600 file) or a NAME in "
                             f"$OPGRAPH_HOME/{SECRETS_FILE_NAME}, got {ref!r}", endpoint=endpoint)


def resolve_secret(ref: str, *, endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """The signing key ``ref`` names, read now (at send time): the variable, the file, or the line
    ``NAME=whsec_...`` of the opgraph home's ``webhook-secrets`` file (``0600``)."""
    environ = os.environ if environ is None else environ
    check_secret_ref(ref, endpoint=endpoint)
    kind, _, name = ref.partition(":")
    if kind == "env":
        value = environ.get(name)
        if not value:
            raise WebhookSecretError(f"the signing secret's variable {name} is not set in this process",
                                     endpoint=endpoint)
        return _secret_key(value, endpoint, f"the variable {name}")
    if kind == "file":
        path = Path(name).expanduser()
        return _secret_key(_private_text(path, endpoint), endpoint, f"the file {path}")
    path = secrets_file(environ)
    if not path.exists():
        raise WebhookSecretError(f"no secrets file {path} holds the signing secret {ref!r}", endpoint=endpoint)
    for line in _private_text(path, endpoint).splitlines():
        key, separator, value = line.partition("=")
        if separator and key.strip() == ref:
            return _secret_key(value, endpoint, f"{path} ({ref})")
    raise WebhookSecretError(f"the secrets file {path} has no line {ref}=...", endpoint=endpoint)


def store_secret(name: str, secret: str, *, environ: Mapping[str, str] | None = None) -> Path:
    """Add (or replace) ``name=secret`` in the opgraph home's ``webhook-secrets`` file, kept ``0600``."""
    if not _SECRET_NAME.fullmatch(name):
        raise WebhookSecretError(f"a secret's name is 1 to 120 of A-Z a-z 0-9 . _ -, got {name!r}")
    _secret_key(secret, None, "the given secret")
    path = secrets_file(environ)
    private_directory(path.parent)
    private_file(path)
    lines = [line for line in _private_text(path, None).splitlines() if line.partition("=")[0].strip() != name]
    draft = path.with_name(f".{path.name}.{os.getpid()}.{random_source.token_hex(4)}")
    handle = os.open(draft, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(handle, ("\n".join([*lines, f"{name}={secret}"]) + "\n").encode())
        os.fsync(handle)
    finally:
        os.close(handle)
    os.replace(draft, path)
    return path


def sign(key: bytes, message_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header: ``v1,`` and the base64 HMAC-SHA256 of ``id.timestamp.body``."""
    mac = hmac.new(key, f"{message_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


# -- endpoints -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WebhookEndpoint:
    endpoint_id: str
    name: str
    url: str
    secret_ref: str
    event_types: tuple[str, ...]
    description: str | None
    enabled: bool
    disabled_reason: str | None
    disabled_at: float | None
    consecutive_failures: int
    created_at: float
    counts: dict[str, int] = field(default_factory=dict)  # deliveries by status, when asked for

    def subscribed(self, event_type: str) -> bool:
        return subscribed(self.event_types, event_type)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "endpoint_id": self.endpoint_id, "url": self.url, "secret_ref": self.secret_ref,
                "events": list(self.event_types), "description": self.description, "enabled": self.enabled,
                "disabled_reason": self.disabled_reason, "disabled_at": self.disabled_at,
                "consecutive_failures": self.consecutive_failures, "created_at": self.created_at,
                "deliveries": dict(self.counts)}


def subscribed(patterns: Iterable[str], event_type: str) -> bool:
    """Whether ``event_type`` matches one of ``patterns``: ``*``, an exact type, or ``prefix.*``."""
    return any(pattern == "*" or pattern == event_type
               or (pattern.endswith(".*") and event_type.startswith(pattern[:-1])) for pattern in patterns)


def check_events(events: Iterable[str] | None, *, endpoint: str | None = None) -> tuple[str, ...]:
    chosen = tuple(DEFAULT_EVENTS if events is None else events)
    if not chosen or len(chosen) > 50 or not all(isinstance(event, str) and len(event) <= 100
                                                 and _EVENT_PATTERN.fullmatch(event) for event in chosen):
        raise WebhookError(f"events are 1 to 50 event types or patterns (run.completed, run.*, *), got "
                           f"{list(chosen)!r}", endpoint=endpoint)
    return chosen


def _endpoint(row: Any) -> WebhookEndpoint:
    return WebhookEndpoint(row["endpoint_id"], row["name"], row["url"], row["secret_ref"],
                           tuple(json.loads(row["event_types"])), row["description"], bool(row["enabled"]),
                           row["disabled_reason"], row["disabled_at"], int(row["consecutive_failures"]),
                           row["created_at"])


_ENDPOINT = ("SELECT endpoint_id, name, url, secret_ref, event_types, description, enabled, disabled_reason,"
             " disabled_at, consecutive_failures, created_at FROM webhook_endpoints")


def iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class Webhooks:
    """The webhook endpoints of one store (its ``StoreDatabase``): add, read, enable, test, deliveries."""

    def __init__(self, db: StoreDatabase, *, allow: AllowList | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.allow = AllowList.from_environment() if allow is None else allow
        self._clock = clock

    def add(self, name: str, url: str, *, secret_ref: str, events: Iterable[str] | None = None,
            description: str | None = None) -> WebhookEndpoint:
        """A new endpoint; its URL is checked against the allow-list (host names resolved) first."""
        if not isinstance(name, str) or len(name) > MAX_NAME_LENGTH or not _NAME.fullmatch(name):
            raise WebhookError(f"a webhook name is 1 to {MAX_NAME_LENGTH} of A-Z a-z 0-9 . _ - (not dots alone), "
                               f"got {name!r}")
        check_secret_ref(secret_ref, endpoint=name)
        chosen = check_events(events, endpoint=name)
        check_target(url, self.allow, endpoint=name)
        with self.db.transaction(write=True) as tx:
            if tx.execute("SELECT 1 FROM webhook_endpoints WHERE name = ?", (name,)).fetchone():
                raise WebhookNameConflictError(f"a webhook named {name!r} already exists", endpoint=name)
            tx.execute("INSERT INTO webhook_endpoints (endpoint_id, name, url, secret_ref, event_types, description,"
                       " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                       (f"ep_{uuid.uuid4().hex[:16]}", name, url, secret_ref, json.dumps(list(chosen)), description,
                        self._clock()))
            return self._get(tx, name)

    @staticmethod
    def _get(tx: Any, name: str) -> WebhookEndpoint:
        row = tx.execute(_ENDPOINT + " WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise WebhookNotFoundError(f"no webhook named {name!r}; `opgraph webhook list` shows them", endpoint=name)
        return _endpoint(row)

    def get(self, name: str) -> WebhookEndpoint:
        with self.db.transaction() as tx:
            endpoint = self._get(tx, name)
            counts = {row[0]: int(row[1]) for row in tx.execute(
                "SELECT status, COUNT(*) FROM webhook_deliveries WHERE endpoint_id = ? GROUP BY status",
                (endpoint.endpoint_id,))}
        return WebhookEndpoint(**{**endpoint.__dict__, "counts": counts})

    def list(self) -> list[WebhookEndpoint]:
        with self.db.transaction() as tx:
            return [_endpoint(row) for row in tx.execute(_ENDPOINT + " ORDER BY name")]

    def enable(self, name: str) -> WebhookEndpoint:
        """Enable a disabled endpoint again: its failure count starts over, and its pending deliveries go on."""
        with self.db.transaction(write=True) as tx:
            self._get(tx, name)
            tx.execute("UPDATE webhook_endpoints SET enabled = 1, disabled_reason = NULL, disabled_at = NULL,"
                       " consecutive_failures = 0 WHERE name = ?", (name,))
            return self._get(tx, name)

    def disable(self, name: str, reason: str) -> WebhookEndpoint:
        with self.db.transaction(write=True) as tx:
            self._get(tx, name)
            tx.execute("UPDATE webhook_endpoints SET enabled = 0, disabled_reason = ?, disabled_at = ? WHERE name = ?",
                       (reason, self._clock(), name))
            return self._get(tx, name)

    def test(self, name: str) -> str:
        """Queue a ``webhook.test`` event for this endpoint alone (the relay sends it); return its event id."""
        with self.db.transaction(write=True) as tx:
            endpoint = self._get(tx, name)
            if not endpoint.enabled:
                raise WebhookError(f"the webhook {name!r} is disabled ({endpoint.disabled_reason}); `opgraph webhook "
                                   f"enable {name}` first", endpoint=name)
            now = self._clock()
            return record(tx, TEST_EVENT, endpoint.endpoint_id, {"webhook": name, "sent_at": iso(now)}, at=now,
                          endpoint_id=endpoint.endpoint_id)

    def deliveries(self, name: str, *, limit: int = 20) -> list[dict[str, Any]]:
        """The endpoint's newest deliveries, each with every attempt (outcome, HTTP status, latency, error)."""
        if type(limit) is not int or not 1 <= limit <= 1000:
            raise ValueError(f"limit is a whole number from 1 to 1000, got {limit!r}")
        with self.db.transaction() as tx:
            endpoint = self._get(tx, name)
            rows = [dict(row) for row in tx.execute(
                "SELECT d.delivery_id, d.event_id, o.event_type, o.subject_id, d.status, d.attempts,"
                " d.next_attempt_at, d.last_error, d.created_at, d.finished_at FROM webhook_deliveries d"
                " JOIN outbox o ON o.event_id = d.event_id WHERE d.endpoint_id = ?"
                " ORDER BY d.delivery_id DESC LIMIT ?", (endpoint.endpoint_id, limit))]
            for row in rows:
                row["attempt_log"] = [dict(attempt) for attempt in tx.execute(
                    "SELECT attempt, at, outcome, status_code, latency, error FROM webhook_attempts"
                    " WHERE delivery_id = ? ORDER BY attempt", (row["delivery_id"],))]
                if row["status"] != "pending":
                    row["next_attempt_at"] = None
        return rows


OUTCOMES = ("delivered", "failed", "timeout", "error", "refused")


def delivery_statistics(db: StoreDatabase) -> dict[str, Any]:
    """What /metrics shows: attempts by outcome (counted as they are recorded), deliveries given up,
    deliveries pending and endpoints disabled. Read in a few rows, whatever the history's size."""
    with db.transaction() as tx:
        counted = {row[0]: int(row[1]) for row in tx.execute("SELECT outcome, attempts FROM webhook_outcomes")}
        pending = tx.execute("SELECT COUNT(*) FROM webhook_deliveries WHERE status = 'pending'").fetchone()[0]
        disabled = tx.execute("SELECT COUNT(*) FROM webhook_endpoints WHERE enabled = 0").fetchone()[0]
    return {"attempts": {outcome: counted.get(outcome, 0) for outcome in OUTCOMES},
            "dead": counted.get("dead", 0), "pending": int(pending), "disabled_endpoints": int(disabled)}
