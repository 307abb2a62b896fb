"""A package's public names loaded on first use (PEP 562), for packages whose imports are costly.

Owns the one ``__getattr__``/``__dir__`` pair that ``opgraph.actors`` and ``opgraph.cluster.http``
share: a name is looked up in its package's table of (name -> submodule), imported then, and
kept in the package's namespace, so the next use costs nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, module_of: Mapping[str, str],
               names: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``, while it is being
    imported): ``module_of`` maps each lazy name to its submodule; ``names`` is its ``__all__``."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
