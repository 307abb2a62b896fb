"""The lane registry (ADR-0068 D2, D5): lane kind -> adapter, the one way surfaces reach a lane.

Owns the registered lanes (each a ``LaneEntry``: its adapter factory, declared capability
matrix, definition rules and bundled examples), loading the built-in lanes by module name
only when first asked for, so no surface imports a lane's internals, and the checks
that need a lane by name (controls, provenance). It must not run or store anything itself.

    OpGraphError
    └── UnknownLaneError   no adapter is registered under that lane kind; ``known`` lists those that are
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ..lazy_registry import LazyRegistry
from ..store import DefinitionRules, ProvenanceError, RunStore
from .base import LaneAdapter
from .capabilities import LaneCapabilities, LaneCapabilityError, check_capabilities
from .provenance import RunProvenance

__all__ = [
    "BUILTIN_LANES",
    "LANES",
    "LaneEntry",
    "LaneRegistry",
    "UnknownLaneError",
    "check_control",
    "lane_adapter",
    "lane_entry",
    "lane_kinds",
    "open_store",
    "register_lane",
    "replaying_lanes",
    "unregister_lane",
    "validate_provenance",
]

# The built-in lanes, by the module whose ``LANE`` is their entry: imported on first use.
BUILTIN_LANES: Mapping[str, str] = {"fixed_workflow": "opgraph.cluster.lanes.fixed",
                                    "planned_reactive_flow": "opgraph.cluster.lanes.planned",
                                    "reactive_play": "opgraph.cluster.lanes.play"}


@dataclass(frozen=True)
class LaneEntry:
    """One lane as the registry holds it.

    ``factory(store)`` makes the adapter for one run store (None: runs are not recorded).
    ``capabilities`` is the matrix a default invocation publishes, for help text and for
    checks by lane name; each invocation's own comes from its adapter. A lane whose
    definitions live in the run store gives their ``definition_rules``; ``examples``
    names its bundled definitions. ``replays_ended_runs``: a run of this lane that ended
    failed or cancelled can still be replayed from its checkpoint (``opgraph o flow
    --resume``), so retention keeps it as resumable until another run replays it.
    """

    kind: str
    factory: Callable[[RunStore | None], LaneAdapter]
    capabilities: LaneCapabilities
    definition_rules: DefinitionRules | None = None
    examples: Mapping[str, Path] = field(default_factory=dict)
    replays_ended_runs: bool = False


class UnknownLaneError(OpGraphError):
    """No lane adapter is registered under ``lane``; ``known`` lists the lane kinds that are."""

    def __init__(self, lane: str, known: tuple[str, ...]) -> None:
        super().__init__(f"no lane {lane!r}; known lanes: {', '.join(known) or 'none'}")
        self.lane, self.known = lane, known


class LaneRegistry(LazyRegistry[LaneEntry]):
    """Lane kind -> ``LaneEntry``; built-in lanes (``builtin``: kind -> module) load on first use."""

    def __init__(self, builtin: Mapping[str, str] = BUILTIN_LANES) -> None:
        super().__init__(builtin)

    def register(self, entry: LaneEntry, *, replace: bool = False) -> None:
        """Add a lane; registering a kind twice is an error unless ``replace``."""
        self._put(entry.kind, entry, replace=replace,
                  refusal=f"lane {entry.kind!r} is already registered; pass replace=True to replace it")

    def entry(self, kind: str) -> LaneEntry:
        return self._get(kind, lambda module: importlib.import_module(module).LANE,
                         lambda: UnknownLaneError(str(kind), self.kinds()))

    def adapter(self, kind: str, store: RunStore | None = None) -> LaneAdapter:
        """The adapter of lane ``kind`` for ``store``; ``UnknownLaneError`` for a kind nobody registered."""
        return self.entry(kind).factory(store)

    def capabilities(self, kind: str) -> LaneCapabilities:
        return self.entry(kind).capabilities

    def replaying_lanes(self) -> frozenset[str]:
        """The lanes whose ended (failed or cancelled) runs can still be replayed: what retention keeps."""
        return frozenset(kind for kind in self.kinds() if self.entry(kind).replays_ended_runs)

    def check_control(self, lane: str | LaneCapabilities, request_kind: str) -> None:
        """Return when ``lane`` (a lane kind, or an invocation's matrix) honours ``request_kind``,
        else raise ``LaneCapabilityError``: an undeclared lane honours nothing."""
        if isinstance(lane, LaneCapabilities):
            check_capabilities(lane, request_kind)
            return
        try:
            capabilities = self.capabilities(lane)
        except UnknownLaneError:
            raise LaneCapabilityError(f"lane {lane!r} has no declared capability matrix here; declared lanes: "
                                      f"{', '.join(self.kinds())}", lane=str(lane),
                                      request_kind=str(request_kind)) from None
        check_capabilities(capabilities, request_kind, lane=lane)

    def validate_provenance(self, payload: Mapping[str, Any]) -> RunProvenance:
        """Parse a D4 payload: the rules every lane shares, then its lane's own (``ProvenanceError``)."""
        provenance = RunProvenance.from_payload(payload)
        try:
            adapter = self.adapter(provenance.lane)
        except UnknownLaneError as exc:
            raise ProvenanceError(f"invalid run provenance: {exc.message}") from exc
        adapter.check_provenance(provenance)
        return provenance

    def definition_rules(self) -> DefinitionRules | None:
        """The rules of the lane whose definitions the run store keeps (one lane does: the fixed workflow)."""
        rules = [entry.definition_rules for entry in map(self.entry, self.kinds()) if entry.definition_rules]
        if len(rules) > 1:
            raise ValueError("more than one lane declares definition rules; the run store keeps one kind")
        return rules[0] if rules else None

    def open_store(self, path: str | Path | None = None, **options: Any) -> RunStore:
        """The run store at ``path`` (default ``OPGRAPH_DB``), writing definitions under the lanes' rules."""
        return RunStore(path, validate_definition=self.definition_rules(), **options)


LANES = LaneRegistry()


def register_lane(entry: LaneEntry, *, replace: bool = False) -> None:
    LANES.register(entry, replace=replace)


def unregister_lane(kind: str) -> None:
    LANES.unregister(kind)


def lane_kinds() -> tuple[str, ...]:
    return LANES.kinds()


def lane_entry(kind: str) -> LaneEntry:
    return LANES.entry(kind)


def replaying_lanes() -> frozenset[str]:
    return LANES.replaying_lanes()


def lane_adapter(kind: str, store: RunStore | None = None) -> LaneAdapter:
    return LANES.adapter(kind, store)


def check_control(lane: str | LaneCapabilities, request_kind: str) -> None:
    LANES.check_control(lane, request_kind)


def validate_provenance(payload: Mapping[str, Any]) -> RunProvenance:
    return LANES.validate_provenance(payload)


def open_store(path: str | Path | None = None, **options: Any) -> RunStore:
    return LANES.open_store(path, **options)
