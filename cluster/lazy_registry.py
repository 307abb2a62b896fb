"""A registry by kind: items registered at run time, and built-in ones, named by import path, loaded on first use.

Owns the lock, refusing a kind registered twice (unless replaced), and loading a built-in item
once. It must not know what an item is: the action registry (cluster/control/actions.py) and
the lane registry (cluster/lanes/registry.py) are built on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

__all__ = ["LazyRegistry"]

T = TypeVar("T")


class LazyRegistry(Generic[T]):
    """kind -> item; ``builtin`` maps a kind to where its item lives, loaded by ``_get`` when first asked for."""

    def __init__(self, builtin: Mapping[str, str]) -> None:
        self._items: dict[str, T] = {}
        self._builtin = dict(builtin)
        self._lock = threading.Lock()

    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted({*self._items, *self._builtin}))

    def _put(self, kind: str, item: T, *, replace: bool, refusal: str) -> None:
        """Register ``item`` as ``kind``; a kind registered already is a ``ValueError(refusal)`` unless ``replace``."""
        with self._lock:
            if kind in self._items and not replace:
                raise ValueError(refusal)
            self._items[kind] = item

    def unregister(self, kind: str) -> None:
        """Remove a registered item (a built-in one comes back on its next use)."""
        with self._lock:
            self._items.pop(kind, None)

    def _get(self, kind: str, load: Callable[[str], T], unknown: Callable[[], Exception]) -> T:
        """The item of ``kind``: the registered one, else the built-in one loaded from where ``builtin``
        says (``load(where)``, kept from then on); a kind neither knows raises ``unknown()``."""
        with self._lock:
            found = self._items.get(kind)
        if found is not None:
            return found
        where = self._builtin.get(kind) if isinstance(kind, str) else None
        if where is None:
            raise unknown()
        item = load(where)
        with self._lock:
            return self._items.setdefault(kind, item)
