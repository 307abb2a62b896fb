"""The engine kinds a user can name (``opgraph engine run KIND``), and building one by name.

Owns the name -> engine class table; an unknown name is bad input, refused before any
run state exists. Every domain engine registers here.
"""

from __future__ import annotations

from typing import Any

from .coding import CodingEngine
from .engine import Engine
from .errors import EngineInputError
from .hypothesis import HypothesisEngine
from .planning import PlanningEngine
from .research import ResearchEngine
from .review import ReviewEngine

__all__ = ["ENGINE_KINDS", "engine_for"]

ENGINE_KINDS: dict[str, type[Engine]] = {"planning": PlanningEngine, "review": ReviewEngine, "coding": CodingEngine,
                                         "research": ResearchEngine, "hypothesis": HypothesisEngine}


def engine_for(kind: str, **settings: Any) -> Engine:
    """An engine of ``kind`` configured with ``settings``; EngineInputError for an unknown kind."""
    engine_class = ENGINE_KINDS.get(str(kind).strip().lower()) if isinstance(kind, str) else None
    if engine_class is None:
        raise EngineInputError(f"unknown engine kind {kind!r}; known kinds: {', '.join(sorted(ENGINE_KINDS))}")
    return engine_class(**settings)
