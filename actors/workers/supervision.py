"""Supervision of one kind of actor (workers, or branch stores) by the executor that uses them.

Owns a pool's handles, which of them are alive, and their replacement. Death is
noticed on the next call that fails (``mark_dead``) and by a periodic probe, so an idle
actor's death is noticed too. A dead actor is replaced by a new one under the next
generation's name, never by the dead handle found again, and the replacement is fully
constructed (``start``) and set up (``setup``) before ``live()`` hands it out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..calls import ActorStub, ping
from ..errors import RuntimeLostError, is_actor_death

__all__ = ["REPLACEMENT_ATTEMPTS", "ActorPool"]

log = logging.getLogger(__name__)
REPLACEMENT_ATTEMPTS = 20  # starts tried for one slot (about half a minute) before it is given up


class ActorPool:
    """``size`` actors of one kind; index ``i`` always names the same slot, whatever its generation.

    ``start(index, generation)`` creates (or, for generation 0, finds) the actor of a slot;
    ``setup(index, handle)`` prepares it before it takes work. Both run on the executor's
    loop. ``on_replaced(index, handle)`` is told once the replacement is ready.

    ``newest(index)`` (blocking; run off the loop) is the newest generation of the slot
    that exists anywhere: when several executors (a pool) supervise the same actors, the
    first to notice a death starts the replacement and the others adopt it (``start``
    finds an existing name) instead of starting one each.
    """

    def __init__(self, kind: str, handles: list[Any], names: list[str], *,
                 start: Callable[[int, int], Any], setup: Callable[[int, Any], Awaitable[Any]] | None = None,
                 on_replaced: Callable[[int, Any], Awaitable[Any]] | None = None,
                 newest: Callable[[int], int | None] | None = None) -> None:
        self.kind = kind
        self.handles = list(handles)
        self.names = list(names)
        self.generations = [0] * len(handles)
        self.alive = [True] * len(handles)
        self.died_at = [0.0] * len(handles)  # time.monotonic() of the latest death noticed
        self._start, self._setup, self._on_replaced, self._newest = start, setup, on_replaced, newest
        self._replacing: dict[int, asyncio.Future] = {}
        self._probing: set[asyncio.Future] = set()
        self.given_up: set[int] = set()  # slots whose replacement failed REPLACEMENT_ATTEMPTS times
        self._next = 0
        self.deaths = 0
        self.replacements = 0
        self.probe_failures = 0
        # Told ``(index, handle)`` when a death is first noticed, before the replacement starts.
        self.on_dead: Callable[[int, Any], Any] | None = None

    def __len__(self) -> int:
        return len(self.handles)

    # -- who is alive ------------------------------------------------------------------
    def name_of(self, index: int) -> str:
        return self.names[index]

    def is_current(self, index: int, handle: Any) -> bool:
        return self.handles[index] is handle

    def mark_dead(self, index: int, handle: Any, reason: str = "") -> bool:
        """Record that ``handle`` (slot ``index``) died; start its replacement. True on first notice."""
        if not self.is_current(index, handle) or not self.alive[index]:
            return False
        self.alive[index] = False
        self.died_at[index] = time.monotonic()
        self.deaths += 1
        log.warning("opgraph %s %s died%s; starting a replacement", self.kind, self.names[index],
                    f": {reason}" if reason else "")
        if self.on_dead is not None:
            self.on_dead(index, handle)
        self._replacement(index)
        return True

    def next_live(self) -> int | None:
        """The next live slot, round robin; None while every slot is being replaced."""
        count = len(self.handles)
        for _ in range(count):
            index = self._next % count
            self._next += 1
            if self.alive[index]:
                return index
        return None

    async def live(self, index: int | None = None) -> tuple[int, Any]:
        """A live (slot, handle): ``index``'s, or the next one round robin, waiting for a
        replacement when none is live. Raises RuntimeLostError once no slot can come back."""
        while True:
            chosen = self.next_live() if index is None else (index if self.alive[index] else None)
            if chosen is not None:
                return chosen, self.handles[chosen]
            if index is None:
                waiting = list(self._replacing.values())
            elif index in self.given_up:
                waiting = []
            else:
                waiting = [self._replacement(index)]
            if not waiting:
                raise RuntimeLostError(f"no live opgraph {self.kind}: replacing it failed "
                                       f"{REPLACEMENT_ATTEMPTS} times", actor=self.names[index or 0])
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)

    async def settled(self) -> None:
        """Return once no probe or replacement is under way (each finished, or was given up)."""
        while self._replacing or self._probing:
            await asyncio.wait([*self._replacing.values(), *self._probing])

    def check(self, timeout: float) -> None:
        """Probe soon (a call elsewhere suggests a death); ``settled()`` waits for the answer."""
        if not self._probing:
            task = asyncio.ensure_future(self.probe(timeout))
            self._probing.add(task)
            task.add_done_callback(self._probing.discard)

    # -- replacement -------------------------------------------------------------------
    def _replacement(self, index: int) -> asyncio.Future:
        future = self._replacing.get(index)
        if future is None:
            future = self._replacing[index] = asyncio.ensure_future(self._replace(index))
        return future

    async def _replace(self, index: int) -> None:
        attempt = 0
        try:
            while True:
                attempt += 1
                if attempt > REPLACEMENT_ATTEMPTS:
                    self.given_up.add(index)
                    log.error("opgraph %s slot %d: giving up after %d failed replacements",
                              self.kind, index, REPLACEMENT_ATTEMPTS)
                    return
                generation = self.generations[index] + 1
                if self._newest is not None:
                    try:
                        listed = await asyncio.to_thread(self._newest, index)
                    except Exception:  # noqa: BLE001 - no listing: start the next generation as usual
                        listed = None
                    if listed is not None and listed > generation:
                        generation = listed
                try:
                    handle = self._start(index, generation)
                    if self._setup is not None:
                        await self._setup(index, handle)
                    else:
                        await ActorStub(handle).ping()
                except Exception as exc:  # noqa: BLE001 - a replacement that fails to start: try the next generation
                    self.generations[index] = generation
                    log.warning("opgraph %s replacement %d for slot %d failed (%s: %s); retrying",
                                self.kind, generation, index, type(exc).__name__, exc)
                    await asyncio.sleep(min(2.0, 0.1 * attempt))
                    continue
                self.generations[index] = generation
                self.handles[index] = handle
                self.names[index] = self._name_of_generation(index, generation)
                self.alive[index] = True
                self.replacements += 1
                if self._on_replaced is not None:
                    await self._on_replaced(index, handle)
                return
        finally:
            self._replacing.pop(index, None)

    def _name_of_generation(self, index: int, generation: int) -> str:
        base = self.names[index].split(".g")[0]
        return base if generation == 0 else f"{base}.g{generation}"

    # -- the probe -----------------------------------------------------------------------
    async def probe(self, timeout: float) -> int:
        """Ping every live actor once; mark those that are gone. Returns how many died."""
        slots = [(index, handle) for index, handle in enumerate(self.handles) if self.alive[index]]
        if not slots:
            return 0
        results = await asyncio.gather(*(ping(ActorStub(handle, self.names[index]), timeout)
                                         for index, handle in slots))
        died = 0
        for (index, handle), error in zip(slots, results, strict=True):
            if error is None:
                continue
            if is_actor_death(error):
                died += self.mark_dead(index, handle, "noticed by the liveness probe")
            else:
                self.probe_failures += 1
        return died

    def statistics(self) -> dict[str, Any]:
        return {"size": len(self.handles), "alive": sum(self.alive), "deaths": self.deaths,
                "replacements": self.replacements, "names": list(self.names)}

