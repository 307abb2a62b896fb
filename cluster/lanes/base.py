"""The lane seam (ADR-0068 D2): what a lane is invoked with, what it prepares, and what it must offer.

Owns ``LaneInvocation``, ``PreparedLaneRun``, the ``LaneAdapter`` protocol and the shape
every lane's run ends with (``LaneRunResult``). A lane adapter resolves and pins its
definition, validates its inputs, builds the graph, stamps provenance and picks the
capabilities of the invocation in ``prepare``; ``execute`` runs the prepared graph
through ``Session.flow``. Nothing here resolves, runs or stores anything.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from opgraph.kernel import Graph, OpGraphError

from .capabilities import LaneCapabilities
from .provenance import RunProvenance, SourceKind

__all__ = [
    "FIXED_WORKFLOW",
    "PLANNED_REACTIVE_FLOW",
    "PUBLIC_LANES",
    "REACTIVE_PLAY",
    "LaneAdapter",
    "LaneInvocation",
    "LaneKind",
    "LaneRunResult",
    "PreparedLaneRun",
    "RunHooks",
    "parse_inputs",
]

# Exactly three public lanes (ADR-0068 D1). The registry takes other kinds too, so a test
# or an extension can add an adapter, but only these are public contracts.
LaneKind = Literal["reactive_play", "planned_reactive_flow", "fixed_workflow"]
PUBLIC_LANES: tuple[str, ...] = LaneKind.__args__
REACTIVE_PLAY: LaneKind = "reactive_play"
PLANNED_REACTIVE_FLOW: LaneKind = "planned_reactive_flow"
FIXED_WORKFLOW: LaneKind = "fixed_workflow"


@dataclass(frozen=True)
class LaneInvocation:
    """One request to run a lane: ADR-0068 D2's fields, then the flow options opgraph adds.

    ``source_content_hash`` is None until the lane pins its source (``prepare`` returns
    the pinned invocation); given beforehand it is a pin to check, as a resume does.
    ``source_version`` pins a registry source to a version (None: the latest, pinned by
    ``prepare``). ``model`` is a ``provider/model`` for every model node, ``run_id`` the
    id to record the run under (None: ``prepare`` makes one), ``max_concurrent`` the
    flow's capacity, ``durable`` whether the run is kept in the run log (and so whether it
    can be resumed: a lane's ``checkpoint_resume`` follows it). ``base_dir`` is the folder a
    coding node's ``cwd`` must be inside; it comes from the caller's own configuration (the
    CLI's ``--base-dir``, the server's ``--workflow-root``), never from a remote request.
    """

    lane: LaneKind
    source_ref: str
    source_kind: SourceKind
    source_content_hash: str | None
    inputs: dict[str, Any] = field(default_factory=dict)
    base_dir: Path | None = None
    reactive_mode: str = "off"
    max_ops: int = 0
    source_version: int | None = None
    model: str | None = None
    run_id: str | None = None
    max_concurrent: int | None = 5
    durable: bool = True


@dataclass(frozen=True)
class PreparedLaneRun:
    """A graph ready for ``Session.flow``: ADR-0068 D2's fields, then what the run records and shows.

    ``invocation`` is pinned (its hash and version filled in). ``recovery`` is JSON the
    lane needs to present or resume the run from another process; it is recorded with
    the run. ``graph`` is fresh and single-use. ``labels`` maps graph node ids to the
    lane's own names (authored node ids) for progress and results; ``label`` says what
    runs (``triage@2``, a file path). ``workflow`` is the store's pinned definition
    version for a registry source, else None. ``lane_state`` is the adapter's own.
    """

    graph: Graph
    context: dict[str, Any]
    invocation: LaneInvocation
    recovery: dict[str, Any]
    run_id: str
    provenance: RunProvenance
    capabilities: LaneCapabilities
    flow_options: Mapping[str, Any] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    label: str = ""
    workflow: Any = None
    lane_state: Any = None


@dataclass
class RunHooks:
    """How a caller follows one run: ``on_progress(label, name, status, elapsed)`` per lifecycle
    signal (once committed, when recorded); ``control`` (a dict) receives ``"run_id"`` at once
    and ``"control"`` (a ``LaneRunControl``) once the executor admitted the run;
    ``on_admitted`` (a future) gets the run's status once its row is written, or the
    error that came first."""

    on_progress: Callable[[str, str, str, float], Any] | None = None
    control: dict[str, Any] | None = None
    on_admitted: asyncio.Future | None = None


@dataclass(frozen=True, slots=True)
class LaneRunResult:
    """What a lane's run ends with; ``outputs``/``errors``/``statuses`` use the lane's labels.

    ``envelope`` is the kernel's result envelope (ADR-0068 D2: shared results keep the
    kernel shape); ``to_dict`` is the presentation the CLI, jobs and API print.
    """

    run_id: str
    lane: str
    status: str  # completed | failed | cancelled
    source: str
    content_hash: str | None
    capabilities: LaneCapabilities
    outputs: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    elapsed: float = 0.0
    envelope: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "lane": self.lane, "status": self.status, "source": self.source,
            "content_hash": self.content_hash, "outputs": self.outputs, "errors": self.errors,
            "statuses": self.statuses, "provenance": self.provenance,
            "lane_capabilities": self.capabilities.as_metadata(), "elapsed": round(self.elapsed, 3),
        }


@runtime_checkable
class LaneAdapter(Protocol):
    """One lane's adapter (ADR-0068 D2), made by the registry for one store.

    ``capabilities(invocation)`` is the matrix of that invocation (D3); ``invocation``
    turns a command line's target (a name, a file, a prompt) and options into one;
    ``prepare``
    resolves, pins, validates and compiles, failing before any run exists;
    ``execute`` records and runs the prepared graph through ``Session.flow`` and never
    schedules anything itself; ``submit`` records it and admits it as a detached run
    (``Session.submit``), returning its id. ``present(envelope, recovery)`` is how a
    finished run's envelope reads in this lane (status, outputs, errors and statuses by the
    lane's labels), from the ``recovery`` the run recorded, in any process.
    ``check_provenance`` raises ``ProvenanceError`` for a payload that breaks this lane's
    rules (D4); ``check_replay(record)`` raises ``PinnedSourceChangedError`` when a recorded
    run's pinned source no longer hashes as it did, before a checkpoint resume.
    """

    lane: str

    def capabilities(self, invocation: LaneInvocation | None = None) -> LaneCapabilities: ...

    def invocation(self, target: str, **options: Any) -> LaneInvocation: ...

    def check_provenance(self, provenance: RunProvenance) -> None: ...

    async def prepare(self, invocation: LaneInvocation) -> PreparedLaneRun: ...

    async def execute(self, prepared: PreparedLaneRun, *, session: Any,
                      hooks: RunHooks | None = None) -> LaneRunResult: ...

    async def submit(self, prepared: PreparedLaneRun, *, session: Any) -> str: ...

    def present(self, envelope: Mapping[str, Any], recovery: Mapping[str, Any]) -> Any: ...

    def check_replay(self, record: Any) -> None: ...


def parse_inputs(pairs: list[str] | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs of a command line; a value that parses as JSON (5, true, [1]) is that value, else text."""
    inputs: dict[str, Any] = {}
    for pair in pairs or []:
        key, separator, text = pair.partition("=")
        if not separator or not key.strip():
            raise OpGraphError(f"--input expects KEY=VALUE, got {pair!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        inputs[key.strip()] = value
    return inputs
