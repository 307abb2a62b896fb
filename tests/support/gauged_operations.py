"""Operations the actor tests register: they report to the test module's ``Gauge`` actor.

They run inside Ray's worker processes, which cannot import this folder: tests/actors/conftest.py
registers this module to be pickled by value.
"""

from __future__ import annotations

import asyncio
from typing import Any


def gauged_operation(gauge: Any, seconds: float):
    """An operation that holds a Gauge slot under its ``key`` for ``seconds``."""

    async def gauged(branch: Any, key: str, **parameters: Any) -> str:
        entered = gauge.enter.remote(key)  # submitted now, so exit always pairs with it
        try:
            await entered
            await asyncio.sleep(seconds)
        finally:
            await gauge.exit.remote(key)
        return "done"

    return gauged
