"""Fixtures for the actor tests: one shared Ray instance per session.

Ray starts once (``session``), every test module gets one ``Gauge`` actor that
operations use to report what is in flight, and each test module is pickled by value
so that operations defined here can run inside the worker processes.
"""

from __future__ import annotations

import asyncio
import sys
import uuid

import gauged_operations
import pytest
import ray
from ray import cloudpickle

# First: sets the test clusters' Ray options before Ray is imported anywhere.
from ray_session import _pickle_test_module_by_value, _restore_registrations, session  # noqa: F401

# pytest imports this file under a name Ray's worker processes cannot import, so the
# Gauge actor class below must travel by value too, and so must the shared operations.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(gauged_operations)


@ray.remote
class Gauge:
    """Counts operations in flight per key; remembers the peak, the total and who ran what.

    An async actor, so waits block on a condition instead of polling: operations call
    ``enter``/``exit`` and the test awaits ``wait_entered``. It is also a latch: an
    operation can ``wait_released`` until the test calls ``release``, which pins an
    operation in flight for exactly as long as the test needs it there.
    """

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.entered: dict[str, int] = {}
        self.workers: dict[str, dict[str, str]] = {}  # key -> label -> worker actor id
        self.released: set[str] = set()
        self.changed = asyncio.Condition()

    async def enter(self, key: str, label: str | None = None, worker: str | None = None) -> int:
        async with self.changed:
            current = self.in_flight.get(key, 0) + 1
            self.in_flight[key] = current
            self.peak[key] = max(self.peak.get(key, 0), current)
            self.entered[key] = self.entered.get(key, 0) + 1
            if label is not None:
                self.workers.setdefault(key, {})[label] = worker
            self.changed.notify_all()
            return current

    async def exit(self, key: str) -> int:
        async with self.changed:
            self.in_flight[key] -= 1
            self.changed.notify_all()
            return self.in_flight[key]

    async def wait_entered(self, key: str, count: int) -> int:
        """Return once ``count`` operations under ``key`` have entered (the caller bounds the wait)."""
        async with self.changed:
            await self.changed.wait_for(lambda: self.entered.get(key, 0) >= count)
            return self.entered[key]

    async def release(self, key: str) -> None:
        async with self.changed:
            self.released.add(key)
            self.changed.notify_all()

    async def wait_released(self, key: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: key in self.released)

    async def snapshot(self, key: str) -> dict[str, int]:
        return {
            "in_flight": self.in_flight.get(key, 0),
            "peak": self.peak.get(key, 0),
            "entered": self.entered.get(key, 0),
        }

    async def worker_of(self, key: str) -> dict[str, str]:
        return dict(self.workers.get(key, {}))


@pytest.fixture(scope="module")
def gauge(session):  # noqa: F811 - the fixture imported above, requested by name
    """One Gauge actor per test module; tests keep apart by using their own key."""
    handle = Gauge.options(name=f"gauge-{uuid.uuid4()}").remote()
    yield handle
    ray.kill(handle)
