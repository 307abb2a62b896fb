"""Read deadlines for `opgraph serve`'s connections: a client that trickles a request is cut off.

Owns ``DeadlineProtocol``, uvicorn's h11 protocol with two timers: from the moment a
connection opens (or the first byte of a later request arrives) its request head must be
complete within ``head_timeout`` seconds, and once the head is in, its body within
``body_timeout``. uvicorn's own ``timeout_keep_alive`` only runs between requests, so a
client that sends one header byte every few seconds (slowloris) held its connection forever.
A head that misses its deadline is answered 408 and closed; a body that misses it is closed
(the route sees the client leave). It changes nothing else in how uvicorn speaks HTTP.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import DEFAULT_BODY_TIMEOUT, DEFAULT_HEAD_TIMEOUT

__all__ = ["DEFAULT_BODY_TIMEOUT", "DEFAULT_HEAD_TIMEOUT", "DeadlineProtocol", "deadline_protocol"]


Stage = Literal["head", "body"]
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: 27\r\nconnection: close\r\n\r\nthe request came too slowly")


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's head and on its body."""

    def __init__(self, *args: Any, head_timeout: float = DEFAULT_HEAD_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout, self.body_timeout = head_timeout, body_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self._stage: Stage | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("head")  # a connection that sends nothing at all is a slow head too

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Between requests uvicorn's keep-alive timer governs; the next request's first byte
        # starts its head deadline (data_received), and a pipelined one is already in.
        self._disarm()
        if self.conn.their_state is h11.SEND_BODY:
            self._arm("body")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Keep the timer that matches where the client is in its request."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._stage != "head" and (self.cycle is None or self.cycle.response_complete):
                self._arm("head")
        elif state is h11.SEND_BODY:
            if self._stage != "body":
                self._arm("body")
        else:  # the request is in whole (the route runs as long as it needs), or the connection ends
            self._disarm()

    def _arm(self, stage: Stage) -> None:
        self._disarm()
        timeout = self.head_timeout if stage == "head" else self.body_timeout
        self._stage = stage
        self._deadline = self.loop.call_later(timeout, self._expired, stage)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._stage = None, None

    def _expired(self, stage: Stage) -> None:
        self._deadline, self._stage = None, None
        if self.transport.is_closing():
            return
        if stage == "head" and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_TIMED_OUT)  # no response is under way: one may be sent, then the end
        self.transport.close()


def deadline_protocol(head_timeout: float = DEFAULT_HEAD_TIMEOUT,
                      body_timeout: float = DEFAULT_BODY_TIMEOUT) -> Any:
    """What ``uvicorn.Config(http=...)`` takes: ``DeadlineProtocol`` with these deadlines."""
    for name, value in (("head_timeout", head_timeout), ("body_timeout", body_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return functools.partial(DeadlineProtocol, head_timeout=head_timeout, body_timeout=body_timeout)
