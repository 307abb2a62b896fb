"""The direct call channel (actors/workers/channel.py): frames both ways, the secret, and failure.

Most tests run a ChannelServer in this process against a stand-in worker (no Ray actor):
what is under test is the wire, not the operations. The last test checks that a real
runtime's executor sends its calls that way.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

import ray

from opgraph.actors.errors import call_failure
from opgraph.actors.protocol import ACKNOWLEDGED
from opgraph.actors.workers.channel import ChannelLost, ChannelServer, WorkerChannels, WorkerRaised
from opgraph.kernel import OperationGraphBuilder
from opgraph.kernel.failures import OUTCOME_LOST, WORKER_DIED, WORKER_ERROR


def row(node_id: str, result: Any = None) -> tuple:
    return (node_id, 1, "completed", result, None, None, [], 0.0, 0.0)


class StandIn:
    """What ChannelServer calls on a worker: ``run_one`` and ``batches``, and its address."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.server = ChannelServer(self)

    async def channel_address(self):
        return await self.server.address()

    def start_one(self, run_id: str, call: tuple, slot: int = 0, shipped: bytes | None = None, *, answer) -> bool:
        """The worker's fast path: only for "direct" calls here; the others go through run_one."""
        if call[0] != "direct":
            return False
        asyncio.get_running_loop().call_soon(answer, [row("direct", run_id)])
        return True

    async def run_one(self, run_id: str, call: tuple, slot: int = 0, shipped: bytes | None = None) -> list:
        if call[0] == "raise":
            raise KeyError("a bug in the worker")
        if call[0] == "hold":
            await self.release.wait()
        return [row(call[0], (run_id, slot, lambda: "a lambda travels by cloudpickle"))]

    async def batches(self, run_id: str, calls: list, slot: int = 0):
        yield ACKNOWLEDGED
        for call in calls:
            yield [row(call[0], call[3])]


class Handle:
    """An actor handle's shape, for WorkerChannels: ``handle.channel_address.remote()``."""

    def __init__(self, worker: StandIn) -> None:
        self._actor_id = id(worker)
        self.channel_address = self
        self.worker = worker

    def remote(self):
        return asyncio.ensure_future(self.worker.channel_address())


def test_calls_and_streams_travel_both_ways_and_a_worker_bug_comes_back_typed():
    async def go():
        worker = StandIn()
        channels = WorkerChannels()
        channel = await channels.get(Handle(worker), "stand-in")
        rows = await channel.call_one("run-1", ("n1", 1, "op", {}, None, 0), 3)
        direct = await channel.call_one("run-2", ("direct", 1, "op", {}, None, 0), 0)
        streamed = [item async for item in channel.stream("run-1", [("a", 1, "op", "A"), ("b", 1, "op", "B")], 0)]
        try:
            await channel.call_one("run-1", ("raise",), 0)
        except WorkerRaised as exc:
            raised = exc
        again = await channels.get(Handle(worker), "stand-in")
        stats = channels.statistics()
        channels.close_all("the test is over")
        worker.server.close()
        return rows, direct, streamed, raised, again is channel, stats

    rows, direct, streamed, raised, reused, stats = asyncio.run(go())
    assert direct == [row("direct", "run-2")]
    node_id, _, status, (run_id, slot, made), *_ = rows[0]
    assert (node_id, status, run_id, slot, made()) == ("n1", "completed", "run-1", 3, "a lambda travels by cloudpickle")
    assert streamed == [ACKNOWLEDGED, [row("a", "A")], [row("b", "B")]]
    assert "KeyError" in str(raised)
    assert call_failure(raised, "w0", "the operation").error_type == WORKER_ERROR
    assert reused and stats["opened"] == 1 and stats["open"] == 1


def test_a_peer_without_the_secret_is_refused_before_anything_is_unpickled(tmp_path):
    marker = tmp_path / "unpickled"

    class Bomb:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    async def go():
        worker = StandIn()
        host, port, secret = await worker.server.address()
        reader, writer = await asyncio.open_connection(host, port)
        wrong = bytes(len(secret))
        writer.write(struct.pack("!I", len(wrong)) + wrong)
        body = pickle.dumps((1, 1, Bomb()))
        writer.write(struct.pack("!I", len(body)) + body)
        closed = await asyncio.wait_for(reader.read(), 5)  # the worker hangs up: b""
        writer.close()
        await writer.wait_closed()
        worker.server.close()
        return closed, worker.server.refused

    closed, refused = asyncio.run(go())
    assert closed == b"" and refused == 1
    assert not marker.exists()


def test_a_broken_channel_fails_the_calls_waiting_on_it_and_the_next_get_reconnects():
    async def go():
        worker = StandIn()
        channels = WorkerChannels()
        handle = Handle(worker)
        channel = await channels.get(handle, "stand-in")
        waiting = asyncio.ensure_future(channel.call_one("run-1", ("hold",), 0))
        await asyncio.sleep(0.05)
        channels.close(handle, "the worker was found dead")
        try:
            await asyncio.wait_for(waiting, 5)
        except ChannelLost as exc:
            lost = exc
        fresh = await channels.get(handle, "stand-in")
        worker.release.set()
        answered = await fresh.call_one("run-1", ("n2",), 0)
        channels.close_all("the test is over")
        worker.server.close()
        return lost, fresh is not channel, answered

    lost, reconnected, answered = asyncio.run(go())
    assert "stand-in" in str(lost) and "found dead" in str(lost)
    assert reconnected and answered[0][0] == "n2"
    # Why the channel broke is Ray's to say: a dead worker's calls are retried, a live one's outcome was lost.
    assert call_failure(lost, "w0", "the operation", died=True).error_type == WORKER_DIED
    assert call_failure(lost, "w0", "the operation", died=False).error_type == OUTCOME_LOST


def test_channels_turned_off_send_every_call_through_ray():
    async def go():
        return await WorkerChannels(enabled=False).get(Handle(StandIn()), "stand-in")

    assert asyncio.run(go()) is None


async def echo(branch: Any, value: int = 0, **parameters: Any) -> int:
    return value


def test_a_runtime_sends_its_calls_on_direct_channels(session):
    session.register_operation("channel_echo", echo, record_turn=False)
    builder = OperationGraphBuilder()
    for index in range(20):
        builder.add_operation("channel_echo", depends_on=[], value=index)
    envelope = asyncio.run(session.flow(builder.get_graph(), max_concurrent=5))
    stats = ray.get(session.runtime.executor.statistics.remote())
    workers = [ray.get(worker.statistics.remote()) for worker in session.runtime.workers]
    assert envelope["status"] == "completed" and sorted(envelope["operation_results"].values()) == list(range(20))
    assert stats["channels"]["enabled"] and stats["channels"]["opened"] >= 1 and stats["channels"]["failed"] == 0
    assert sum(worker["channel"]["connections"] for worker in workers if worker["channel"]) >= 1
