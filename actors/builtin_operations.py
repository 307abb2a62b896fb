"""The operations every Session registers by default: the branch verbs, ``noop`` and ``sleep``.

Owns that table, by name. A durable run's header names these operations instead of
pickling them, and a run rebuilt from its log finds them here again: only the operations
a caller registered itself travel pickled (and signed). The verbs load on first use.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from .protocol import RegisteredOperation

__all__ = ["builtin_operations", "is_builtin"]


async def _noop(branch: Any, **parameters: Any) -> Any:
    return parameters.get("result", parameters.get("instruction"))


async def _sleep(branch: Any, seconds: float = 0.0, **parameters: Any) -> Any:
    await asyncio.sleep(seconds)
    return parameters.get("result", "slept")


NOOP = RegisteredOperation(_noop, record_turn=False)
SLEEP = RegisteredOperation(_sleep, record_turn=False)


@functools.cache
def builtin_operations() -> dict[str, RegisteredOperation]:
    """Name -> the built-in operation; the same objects every time (do not change the dict)."""
    from .verbs import VERB_OPERATIONS  # local: the verbs pull in the tool machinery

    return {**VERB_OPERATIONS, "noop": NOOP, "sleep": SLEEP}


def is_builtin(name: str, operation: Any) -> bool:
    """Whether ``operation`` is the built-in registered under ``name`` (not one registered over it).

    Equal, not the same object: options reach the executor pickled, and a built-in's function
    (importable, so pickled by reference) comes back as this process's own."""
    return builtin_operations().get(name) == operation
