"""The webhook relay: delivers committed outbox events to their endpoints, signed, retried, every attempt recorded.

Owns one pass (``run_once``: fan each new outbox event out to one delivery per subscribed
endpoint, claim the deliveries that are due under a lease, send them, record each attempt)
and the loop `opgraph serve` and `opgraph webhook relay` run. Several relays may share a
store: fan-out and claims are write transactions, and a claim is leased, so a delivery is
sent by one relay at a time; a relay killed mid-send leaves a lease that lapses, and the
delivery is sent again with the same ``webhook-id`` (at least once, never lost). It never
changes a run's or task's status: a failed notification cannot undo the fact it reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..store import StoreDatabase
from .outbox import event_body
from .webhooks import (
    AllowList,
    WebhookSecretError,
    WebhookTargetError,
    check_target_async,
    iso,
    resolve_secret,
    sign,
    subscribed,
)

__all__ = ["DEFAULT_SCHEDULE", "AttemptResult", "RelayPass", "RelaySettings", "WebhookRelay"]

# Seconds before each attempt: the first at once, then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h.
DEFAULT_SCHEDULE: tuple[float, ...] = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
RELAY_ENV = "OPGRAPH_WEBHOOK_RELAY"
TIMEOUT_ENV = "OPGRAPH_WEBHOOK_TIMEOUT"
MAX_ATTEMPTS_ENV = "OPGRAPH_WEBHOOK_MAX_ATTEMPTS"
DISABLE_AFTER_ENV = "OPGRAPH_WEBHOOK_DISABLE_AFTER"
SCHEDULE_ENV = "OPGRAPH_WEBHOOK_SCHEDULE"  # the retry schedule: seconds, comma-separated ("0,5,300,...")
_ERROR_TEXT = 300  # characters of a receiver's answer kept with a failed attempt


@dataclass(frozen=True)
class RelaySettings:
    """How the relay retries and when it gives up.

    ``schedule[n]`` is the wait before attempt n + 1 (the last one repeats); a delivery that
    failed ``max_attempts`` times is dead. An endpoint is disabled, with its reason, when one
    of its deliveries dies or ``disable_after`` attempts in a row failed. A send gets
    ``timeout`` seconds in all (a receiver that hangs is a failed attempt, ``timeout``). A claimed
    delivery is leased for ``timeout + lease_margin`` seconds: a relay killed mid-send leaves it to
    another one after that.
    """

    schedule: tuple[float, ...] = DEFAULT_SCHEDULE
    max_attempts: int = len(DEFAULT_SCHEDULE)
    timeout: float = 10.0
    disable_after: int = 20
    batch: int = 100
    concurrency: int = 16
    poll_interval: float = 1.0
    lease_margin: float = 30.0
    allow: AllowList = field(default_factory=AllowList.from_environment)

    def __post_init__(self) -> None:
        if not self.schedule or any(not 0 <= delay < float("inf") for delay in self.schedule):
            raise ValueError(f"a retry schedule is one or more delays in seconds, 0 or more, got {self.schedule!r}")
        for name in ("max_attempts", "disable_after", "batch", "concurrency"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} is a whole number from 1, got {getattr(self, name)!r}")
        if not 0 < self.timeout < 3600 or not 0 < self.poll_interval < 3600 or not 0 < self.lease_margin < 3600:
            raise ValueError("timeout, poll_interval and lease_margin are seconds above 0 (and under an hour)")

    @classmethod
    def from_environment(cls, environ: Any = None) -> RelaySettings | None:
        """The settings `opgraph serve` and `opgraph webhook relay` start with: ``OPGRAPH_WEBHOOK_TIMEOUT``
        (seconds), ``OPGRAPH_WEBHOOK_MAX_ATTEMPTS``, ``OPGRAPH_WEBHOOK_DISABLE_AFTER``,
        ``OPGRAPH_WEBHOOK_SCHEDULE`` (the retry delays, comma-separated seconds) and the allow-list;
        None when ``OPGRAPH_WEBHOOK_RELAY=0`` (this process sends nothing)."""
        environ = os.environ if environ is None else environ
        if environ.get(RELAY_ENV, "1").strip() == "0":
            return None
        values: dict[str, Any] = {"allow": AllowList.from_environment(environ)}
        for variable, name, kind in ((TIMEOUT_ENV, "timeout", float), (MAX_ATTEMPTS_ENV, "max_attempts", int),
                                     (DISABLE_AFTER_ENV, "disable_after", int)):
            text = environ.get(variable, "").strip()
            if text:
                try:
                    values[name] = kind(text)
                except ValueError:
                    raise ValueError(f"{variable} must be a number, got {text!r}") from None
        text = environ.get(SCHEDULE_ENV, "").strip()
        if text:
            try:
                values["schedule"] = tuple(float(part) for part in text.split(","))
            except ValueError:
                raise ValueError(f"{SCHEDULE_ENV} is seconds, comma-separated (0,5,300), got {text!r}") from None
        return cls(**values)

    @property
    def lease(self) -> float:
        """How long a claimed delivery is this relay's: past its send's timeout, with room to record it."""
        return self.timeout + self.lease_margin

    def delay_after(self, attempts: int) -> float:
        """Seconds from the ``attempts``-th failed attempt to the next one."""
        return self.schedule[min(attempts, len(self.schedule) - 1)]


@dataclass(frozen=True)
class _Claim:
    delivery_id: int
    event_id: str
    event_type: str
    created_at: float
    payload: str
    endpoint_id: str
    name: str
    url: str
    secret_ref: str


@dataclass(frozen=True)
class AttemptResult:
    """One send: ``outcome`` is delivered (2xx), failed (another status), timeout, error (no answer:
    connection refused, reset) or refused (not sent: the target left the allow-list, the secret is missing)."""

    delivery_id: int
    endpoint_id: str
    name: str
    url: str
    outcome: str
    status_code: int | None
    latency: float
    error: str | None


@dataclass
class RelayPass:
    """What one pass did: events fanned out, deliveries attempted, and the attempts by outcome."""

    fanned_out: int = 0
    attempted: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    disabled: list[str] = field(default_factory=list)


class WebhookRelay:
    """Delivers the outbox of ``db`` under ``settings``; ``clock`` schedules retries (tests pass a fake
    one and never sleep). The signature's timestamp is always the wall clock: a receiver checks it
    against its own. ``transport`` is httpx's seam (None: real sockets)."""

    def __init__(self, db: StoreDatabase, settings: RelaySettings | None = None, *,
                 clock: Callable[[], float] = time.time, transport: httpx.AsyncBaseTransport | None = None,
                 environ: Any = None) -> None:
        self.db = db
        self.settings = settings or RelaySettings()
        self._clock = clock
        self._transport = transport
        self._environ = environ
        self.passes = 0
        self.totals: dict[str, int] = {}

    def statistics(self) -> dict[str, Any]:
        return {"passes": self.passes, "attempts": dict(self.totals)}

    # -- one pass ------------------------------------------------------------------------------
    async def run_once(self) -> RelayPass:
        """Fan out new events, then send every delivery due now (one batch), and record the attempts."""
        done = RelayPass()
        done.fanned_out = await asyncio.to_thread(self._fan_out)
        claims = await asyncio.to_thread(self._claim)
        if claims:
            limit = asyncio.Semaphore(self.settings.concurrency)
            async with httpx.AsyncClient(transport=self._transport, follow_redirects=False,
                                         timeout=httpx.Timeout(self.settings.timeout)) as client:

                async def bounded(claim: _Claim) -> AttemptResult:
                    async with limit:
                        return await self._send(client, claim)

                results = await asyncio.gather(*(bounded(claim) for claim in claims))
            done.disabled = await asyncio.to_thread(self._record, results)
            done.attempted = len(results)
            for result in results:
                done.outcomes[result.outcome] = done.outcomes.get(result.outcome, 0) + 1
                self.totals[result.outcome] = self.totals.get(result.outcome, 0) + 1
        self.passes += 1
        return done

    async def run(self, stop: asyncio.Event, *, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Pass after pass until ``stop`` is set: at once while a pass finds a full batch, else every
        ``poll_interval`` seconds. A pass the store fails is reported to ``on_error`` and tried again."""
        from opgraph.kernel import OpGraphError

        while not stop.is_set():
            busy = False
            try:
                done = await self.run_once()
                busy = done.attempted >= self.settings.batch or done.fanned_out >= self.settings.batch
            except (OpGraphError, OSError) as exc:  # the store failed: said, and the next pass tries again
                if on_error is not None:
                    on_error(exc)
            if not busy:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.settings.poll_interval)

    # -- the store's side (in a worker thread) -------------------------------------------------
    def _fan_out(self) -> int:
        with self.db.transaction() as tx:  # a read first: an idle relay never takes the write lock
            if tx.execute("SELECT 1 FROM outbox WHERE dispatched_at IS NULL LIMIT 1").fetchone() is None:
                return 0
        now = self._clock()
        with self.db.transaction(write=True) as tx:
            events = tx.execute("SELECT seq, event_id, event_type, endpoint_id, created_at FROM outbox"
                                " WHERE dispatched_at IS NULL ORDER BY seq LIMIT ?", (self.settings.batch,)).fetchall()
            endpoints = tx.execute("SELECT endpoint_id, event_types, created_at FROM webhook_endpoints"
                                   " WHERE enabled = 1").fetchall()
            subscriptions = [(row[0], json.loads(row[1]), row[2]) for row in endpoints]
            rows = []
            for event in events:
                if event["endpoint_id"] is not None:
                    targets = [endpoint for endpoint, _, _ in subscriptions if endpoint == event["endpoint_id"]]
                else:  # an endpoint hears of what happened from its creation on
                    targets = [endpoint for endpoint, patterns, created in subscriptions
                               if subscribed(patterns, event["event_type"]) and event["created_at"] >= created]
                rows.extend((event["event_id"], endpoint, now, now) for endpoint in targets)
            tx.executemany("INSERT INTO webhook_deliveries (event_id, endpoint_id, status, next_attempt_at, created_at)"
                           " VALUES (?, ?, 'pending', ?, ?) ON CONFLICT (event_id, endpoint_id) DO NOTHING", rows)
            seqs = [event["seq"] for event in events]
            if seqs:
                tx.execute(f"UPDATE outbox SET dispatched_at = ? WHERE seq IN ({', '.join('?' * len(seqs))})",
                           (now, *seqs))
        return len(events)

    def _claim(self) -> list[_Claim]:
        now = self._clock()
        due = ("FROM webhook_deliveries d JOIN webhook_endpoints e ON e.endpoint_id = d.endpoint_id"
               " JOIN outbox o ON o.event_id = d.event_id WHERE d.status = 'pending' AND d.next_attempt_at <= ?"
               " AND (d.lease_until IS NULL OR d.lease_until <= ?) AND e.enabled = 1")
        with self.db.transaction() as tx:  # a read first: an idle relay never takes the write lock
            if tx.execute("SELECT 1 " + due + " LIMIT 1", (now, now)).fetchone() is None:
                return []
        with self.db.transaction(write=True) as tx:
            rows = tx.execute("SELECT d.delivery_id, d.event_id, o.event_type, o.created_at, o.payload, e.endpoint_id,"
                              " e.name, e.url, e.secret_ref " + due + " ORDER BY d.next_attempt_at, d.delivery_id"
                              " LIMIT ?", (now, now, self.settings.batch)).fetchall()
            claims = [_Claim(*row) for row in rows]
            if claims:
                ids = [claim.delivery_id for claim in claims]
                tx.execute(f"UPDATE webhook_deliveries SET lease_until = ? WHERE delivery_id IN "
                           f"({', '.join('?' * len(ids))})", (now + self.settings.lease, *ids))
        return claims

    def _record(self, results: list[AttemptResult]) -> list[str]:
        """Each attempt, its delivery's next state and its endpoint's failure count, in one transaction."""
        settings, now, disabled = self.settings, self._clock(), []
        with self.db.transaction(write=True) as tx:
            for result in results:
                row = tx.execute("SELECT attempts, status, event_id FROM webhook_deliveries WHERE delivery_id = ?",
                                 (result.delivery_id,)).fetchone()
                if row is None:  # its run was pruned while it was sent: nothing is left to record it on
                    continue
                attempt = int(row[0]) + 1
                tx.execute("INSERT INTO webhook_attempts (delivery_id, attempt, at, outcome, status_code, latency,"
                           " error) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (result.delivery_id, attempt, now, result.outcome, result.status_code, result.latency,
                            result.error))
                _count(tx, result.outcome)
                if row[1] != "pending":  # another relay settled it while this one sent (a lapsed lease)
                    tx.execute("UPDATE webhook_deliveries SET attempts = ? WHERE delivery_id = ?",
                               (attempt, result.delivery_id))
                    continue
                if result.outcome == "delivered":
                    tx.execute("UPDATE webhook_deliveries SET status = 'delivered', attempts = ?, lease_until = NULL,"
                               " last_error = NULL, finished_at = ? WHERE delivery_id = ?",
                               (attempt, now, result.delivery_id))
                    tx.execute("UPDATE webhook_endpoints SET consecutive_failures = 0 WHERE endpoint_id = ?",
                               (result.endpoint_id,))
                    continue
                dead = attempt >= settings.max_attempts
                if dead:
                    _count(tx, "dead")
                    tx.execute("UPDATE webhook_deliveries SET status = 'dead', attempts = ?, lease_until = NULL,"
                               " last_error = ?, finished_at = ? WHERE delivery_id = ?",
                               (attempt, result.error, now, result.delivery_id))
                else:
                    tx.execute("UPDATE webhook_deliveries SET attempts = ?, lease_until = NULL, last_error = ?,"
                               " next_attempt_at = ? WHERE delivery_id = ?",
                               (attempt, result.error, now + settings.delay_after(attempt), result.delivery_id))
                failures, enabled = tx.execute(
                    "UPDATE webhook_endpoints SET consecutive_failures = consecutive_failures + 1"
                    " WHERE endpoint_id = ? RETURNING consecutive_failures, enabled", (result.endpoint_id,)).fetchone()
                if enabled and (dead or failures >= settings.disable_after):
                    why = (f"a delivery ({row[2]}) failed all {attempt} attempts" if dead
                           else f"{failures} attempts in a row failed")
                    reason = f"disabled {iso(now)}: {why}; the last: {result.error} (POST {result.url})"
                    tx.execute("UPDATE webhook_endpoints SET enabled = 0, disabled_reason = ?, disabled_at = ?"
                               " WHERE endpoint_id = ?", (reason, now, result.endpoint_id))
                    disabled.append(result.name)
        return disabled

    # -- the receiver's side ---------------------------------------------------------------------
    async def _send(self, client: httpx.AsyncClient, claim: _Claim) -> AttemptResult:
        started = time.perf_counter()

        def result(outcome: str, error: str | None, status: int | None = None) -> AttemptResult:
            return AttemptResult(claim.delivery_id, claim.endpoint_id, claim.name, claim.url, outcome, status,
                                 time.perf_counter() - started, error)

        try:
            key = resolve_secret(claim.secret_ref, endpoint=claim.name, environ=self._environ)
            await check_target_async(claim.url, self.settings.allow, endpoint=claim.name)
        except (WebhookSecretError, WebhookTargetError) as exc:
            return result("refused", exc.message)
        body = event_body(claim.event_type, claim.created_at, claim.payload)
        timestamp = int(time.time())
        headers = {"webhook-id": claim.event_id, "webhook-timestamp": str(timestamp),
                   "webhook-signature": sign(key, claim.event_id, timestamp, body),
                   "content-type": "application/json", "user-agent": "opgraph-webhooks/1"}
        try:
            # The whole exchange within the timeout: a receiver that trickles bytes cannot stretch it.
            response = await asyncio.wait_for(client.post(claim.url, content=body, headers=headers),
                                              self.settings.timeout)
        except (TimeoutError, httpx.TimeoutException):
            return result("timeout", f"no answer within {self.settings.timeout:g} s")
        except httpx.HTTPError as exc:
            return result("error", f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT])
        if 200 <= response.status_code < 300:
            return result("delivered", None, response.status_code)
        text = response.text[:_ERROR_TEXT].strip()
        return result("failed", f"HTTP {response.status_code}" + (f": {text}" if text else ""), response.status_code)


def _count(tx: Any, outcome: str) -> None:
    tx.execute("INSERT INTO webhook_outcomes (outcome, attempts) VALUES (?, 1)"
               " ON CONFLICT (outcome) DO UPDATE SET attempts = webhook_outcomes.attempts + 1", (outcome,))
