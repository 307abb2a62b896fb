"""Direct call channels: an executor's calls to a worker, and their outcomes, over one socket.

Owns the wire of the data path between an executor and an operation worker (``run_one``
and ``run_batch``), and between a worker and a branch store (``BranchStore.serve``, the
store's server answering ``run_one`` frames; see workers/branch_calls.py). Ray still
starts, names, places, probes and replaces the actors; only the calls and their outcomes
travel here.

Why: a Ray actor call costs 2-3 ms of latency on a 2-core machine (measured: an actor
awaiting another's ``asyncio.sleep(0.01)`` 200 times in a row spent 3.2-3.6 ms a link
outside the sleep), where a length-prefixed frame on a TCP socket between the same two
processes costs about 0.1 ms. A chain pays that latency twice on every link: a chain of
1,000 x 10 ms took 1.5x its ideal on Ray calls alone. (DESIGN.md has every message go
through Ray; this is a deliberate improvement on the data path only. Setting
``OPGRAPH_DIRECT_CALLS=0`` sends the calls through Ray as before.)

The wire: each frame is a 4-byte big-endian length and a pickle (cloudpickle when plain
pickle cannot). The executor's first frame is the worker's secret, handed out by the
worker's ``channel_address`` actor method over Ray's authenticated channel: the worker
unpickles nothing from a peer that has not shown it. Then the executor sends
``(request_id, kind, args)`` and the worker answers ``(request_id, item, last)``; a
``run_batch`` answer streams its items (``ACKNOWLEDGED`` first) and ends with an empty last
frame.

Failure, as on Ray: a lost connection fails every call still waiting on it with
``ChannelLost``. Whether the worker died (its calls are retried, or re-dispatched when
not yet acknowledged) or only the connection did (the outcome is lost) is asked of Ray
(a ping), in the shell. A worker that supervision marks dead has its channel closed, so
a call never waits on a socket to a machine that is gone.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import ray
from ray import cloudpickle

__all__ = ["BATCH", "ONE", "ChannelLost", "ChannelServer", "WorkerChannels", "WorkerRaised"]

log = logging.getLogger(__name__)

ONE, BATCH = 1, 2
_LENGTH = struct.Struct("!I")
SECRET_BYTES = 16
CONNECT_TIMEOUT_SECONDS = 5.0
HIGH_WATER_BYTES = 1 << 20  # a sender waits for the peer to drain beyond this much buffered
_END = object()


class ChannelLost(ConnectionError):
    """The channel to a worker broke before a call's answer came: the caller asks Ray why."""

    def __init__(self, message: str, *, worker: str = "") -> None:
        super().__init__(message)
        self.worker = worker


class WorkerRaised(RuntimeError):
    """The worker's own code raised while answering a call (an opgraph bug, not an operation's
    failure, which is an outcome row): the channel's counterpart of Ray's RayTaskError."""


def _encode(value: Any) -> bytes:
    try:
        body = pickle.dumps(value, protocol=5)
    except Exception:  # noqa: BLE001 - not picklable by value: cloudpickle handles local classes, lambdas
        body = cloudpickle.dumps(value)
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return await reader.readexactly(length)


async def _send(writer: asyncio.StreamWriter, frame: bytes) -> None:
    if writer.is_closing():
        raise ConnectionResetError("the channel is closed")
    writer.write(frame)
    if writer.transport.get_write_buffer_size() > HIGH_WATER_BYTES:
        await writer.drain()


# -- the worker's side ----------------------------------------------------------------------------
class ChannelServer:
    """A worker's listening socket: answers ``run_one`` and ``run_batch`` frames from executors.

    ``worker`` is the OperationWorker instance; its methods are called directly, on its
    own event loop, exactly as Ray would call them.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._server: asyncio.AbstractServer | None = None
        self._address: tuple[str, int] | None = None
        self._starting: asyncio.Lock | None = None
        self.connections = 0
        self.refused = 0
        self.unanswered = 0  # answers whose executor had gone: the calls ran, nobody read them

    async def address(self) -> tuple[str, int, bytes]:
        """``(host, port, secret)``, listening from the first ask on."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None:
                host = ray.util.get_node_ip_address()
                self._server = await asyncio.start_server(self._serve, host=host, port=0)
                self._address = (host, self._server.sockets[0].getsockname()[1])
        host, port = self._address
        return host, port, self.secret

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answers: set[asyncio.Task] = set()
        try:
            shown = await asyncio.wait_for(_read_frame(reader), CONNECT_TIMEOUT_SECONDS)
            if not hmac.compare_digest(shown, self.secret):
                self.refused += 1
                return
            self.connections += 1
            while True:
                request_id, kind, args = pickle.loads(await _read_frame(reader))
                if kind == ONE and self.worker.start_one(*args, answer=partial(self._answered, writer, request_id)):
                    continue
                task = asyncio.ensure_future(self._answer(writer, request_id, kind, args))
                answers.add(task)
                task.add_done_callback(answers.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, struct.error):
            pass  # the executor closed the channel (or died); its calls still run to their end
        finally:
            writer.close()

    def _answered(self, writer: asyncio.StreamWriter, request_id: int, rows: Any) -> None:
        """A single call's outcome rows (or the worker's own exception), sent as it ends."""
        if isinstance(rows, BaseException):
            rows = WorkerRaised(f"{type(rows).__name__}: {rows}")
        try:
            frame = _encode((request_id, rows, True))
        except Exception as exc:  # noqa: BLE001 - the caller must hear something: the worker's failure
            frame = _encode((request_id, WorkerRaised(f"the outcome could not be encoded: {exc}"), True))
        if writer.is_closing():
            self.unanswered += 1
            return
        writer.write(frame)

    async def _answer(self, writer: asyncio.StreamWriter, request_id: int, kind: int, args: tuple) -> None:
        try:
            if kind == ONE:
                await _send(writer, _encode((request_id, await self.worker.run_one(*args), True)))
                return
            async for item in self.worker.batches(*args):
                await _send(writer, _encode((request_id, item, False)))
            await _send(writer, _encode((request_id, None, True)))
        except ConnectionError:
            self.unanswered += 1
        except Exception as exc:  # noqa: BLE001 - the worker's own failure travels, typed as such, to the caller
            try:
                await _send(writer, _encode((request_id, WorkerRaised(f"{type(exc).__name__}: {exc}"), True)))
            except ConnectionError:
                self.unanswered += 1

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


# -- the executor's side --------------------------------------------------------------------------
class _Channel:
    """One open connection to a worker, shared by every call the executor sends it."""

    def __init__(self, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.name = name
        self.writer = writer
        self.waiting: dict[int, asyncio.Queue | asyncio.Future] = {}
        self.next_id = 0
        self.lost: ChannelLost | None = None
        self.reading = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        waiting = self.waiting
        try:
            while True:
                request_id, item, last = pickle.loads(await _read_frame(reader))
                waiter = waiting.get(request_id)
                if waiter is None:
                    continue
                if isinstance(waiter, asyncio.Future):
                    waiting.pop(request_id, None)
                    if not waiter.done():
                        waiter.set_result(item)
                else:
                    if last:
                        waiting.pop(request_id, None)
                    waiter.put_nowait(_END if last and item is None else item)
        except asyncio.CancelledError:
            self._lose("the executor closed it")
            raise
        except Exception as exc:  # noqa: BLE001 - any read failure ends the channel; waiters learn why
            self._lose(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    def _lose(self, why: str) -> None:
        if self.lost is None:
            self.lost = ChannelLost(f"the channel to operation worker {self.name} broke ({why})", worker=self.name)
        self.writer.close()
        waiting, self.waiting = self.waiting, {}
        for waiter in waiting.values():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_exception(self.lost)
            else:
                waiter.put_nowait(self.lost)

    def close(self, why: str) -> None:
        self.reading.cancel()
        self._lose(why)

    def _request(self, kind: int, args: tuple, waiter: asyncio.Queue | asyncio.Future) -> None:
        if self.lost is not None:
            raise self.lost
        self.next_id += 1
        self.waiting[self.next_id] = waiter
        try:
            self.writer.write(_encode((self.next_id, kind, args)))
        except Exception as exc:  # noqa: BLE001 - a dead transport: the channel is lost
            self._lose(f"{type(exc).__name__}: {exc}")
            raise self.lost from None

    async def call_one(self, *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._request(ONE, args, future)
        item = await future
        if isinstance(item, Exception):
            raise item
        return item

    async def stream(self, *args: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue = asyncio.Queue()
        self._request(BATCH, args, queue)
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class WorkerChannels:
    """The executor's channels to its workers, one per worker actor, opened on first use.

    ``get`` returns None for a worker that cannot be reached directly (its address call
    or connection failed, or channels are off): its calls go through Ray instead.
    """

    def __init__(self, enabled: bool = True, stub: Any = None) -> None:
        self.enabled = enabled
        self.stub = stub  # the stub class whose ``channel_address`` the peers answer (None: WorkerStub)
        self._open: dict[Any, _Channel] = {}
        self._opening: dict[Any, asyncio.Future] = {}
        self._unreachable: set[Any] = set()
        self.opened = 0
        self.failed = 0

    @staticmethod
    def key(handle: Any) -> Any:
        """What tells worker actors apart: a replacement has a key of its own."""
        return getattr(handle, "_actor_id", None) or id(handle)

    async def get(self, handle: Any, name: str) -> _Channel | None:
        if not self.enabled:
            return None
        key = self.key(handle)
        channel = self._open.get(key)
        if channel is not None and channel.lost is None:
            return channel
        if key in self._unreachable:
            return None
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.ensure_future(self._connect(key, handle, name))
        return await asyncio.shield(opening)

    async def _connect(self, key: Any, handle: Any, name: str) -> _Channel | None:
        try:
            from ..calls import WorkerStub, ask  # local: the seam's errors import this module

            stub = self.stub or WorkerStub
            host, port, secret = await ask(stub(handle, name), stub.channel_address, timeout=CONNECT_TIMEOUT_SECONDS)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_SECONDS)
            writer.write(_LENGTH.pack(len(secret)) + secret)
        except Exception as exc:  # noqa: BLE001 - no channel: this worker's calls go through Ray
            self.failed += 1
            self._unreachable.add(key)
            log.warning("opgraph: no direct channel to %s (%s: %s); its calls go through Ray",
                        name, type(exc).__name__, exc)
            return None
        finally:
            self._opening.pop(key, None)
        channel = self._open[key] = _Channel(name, reader, writer)
        self.opened += 1
        return channel

    def close(self, handle: Any, why: str) -> None:
        """Fail what waits on ``handle``'s channel (supervision found the worker dead)."""
        key = self.key(handle)
        self._unreachable.discard(key)
        channel = self._open.pop(key, None)
        if channel is not None:
            channel.close(why)

    def close_all(self, why: str) -> None:
        for channel in self._open.values():
            channel.close(why)
        self._open.clear()

    def statistics(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "open": sum(1 for c in self._open.values() if c.lost is None),
                "opened": self.opened, "failed": self.failed}

