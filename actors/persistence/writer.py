"""A writer thread: the one thread a process's database writes run on, off its event loop.

Owns ordering and batching of writes from an event loop (the executor's, a branch
store's): callers await their write, writes run one at a time in submission order, and
a slow disk never stalls the loop that schedules runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["Writer"]

T = TypeVar("T")


class Writer:
    """Runs functions on one dedicated thread, in the order they were submitted."""

    def __init__(self, name: str = "opgraph-writer") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        """Run ``function`` after every write submitted so far, without waiting for it."""
        self._pool.submit(function, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
