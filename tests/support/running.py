"""Driving a test's coroutine from synchronous test code, within a bound.

A run that hangs fails its test at the bound instead of stalling the whole suite.
"""

from __future__ import annotations

import asyncio
from typing import Any

FLOW_TIMEOUT = 60.0  # a flow on the shared session
ENGINE_TIMEOUT = 120.0  # an engine run: many agent turns, each a model call on a worker


def run(coroutine: Any, timeout: float = FLOW_TIMEOUT) -> Any:
    """Drive ``coroutine`` to its end; a run that takes longer than ``timeout`` fails the test."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def run_engine(coroutine: Any) -> Any:
    """``run`` with the bound of an engine run."""
    return run(coroutine, ENGINE_TIMEOUT)
