"""Run provenance (ADR-0068 D4): what exact definition produced a run's graph, for every lane.

Owns the payload's typed model and its shape rules shared by every lane (a pinned hash
is ``sha256:`` and 64 hex digits, a version starts at 1), and the error a replay raises when
the pinned source no longer hashes as it did. A lane's own rules (the fixed lane's required
hash, no planner) are its adapter's ``check_provenance``; the registry applies both
(``validate_provenance``). It must not run, store or queue anything.

    OpGraphError
    └── PinnedSourceChangedError   a replay found the run's pinned source changed; nothing ran
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from opgraph.kernel import OpGraphError

from ..store import CONTENT_HASH, ProvenanceError

__all__ = [
    "SOURCE_KINDS",
    "Admission",
    "PinnedSourceChangedError",
    "PlannerUse",
    "ProvenanceError",
    "ReactiveSettings",
    "RunProvenance",
    "SourceKind",
    "SourceRef",
]

# ADR-0068 D2's source kinds, plus ``workflow_file``: a fixed definition read from a file
# (no version; the hash is of the validated bytes that were compiled).
SourceKind = Literal["playbook", "prompt", "flow_spec", "checkpoint", "workflow_def", "workflow_file"]
SOURCE_KINDS: tuple[str, ...] = SourceKind.__args__


class PinnedSourceChangedError(OpGraphError):
    """A replay (checkpoint resume) found the run's pinned source hashing otherwise than the run
    recorded: the recorded provenance would no longer say what produced the graph, so nothing ran.
    ``ref``, ``expected`` and ``found`` say which source and both hashes. Restore the source, or
    start a new run of the current one."""

    def __init__(self, run_id: str, ref: str, expected: str | None, found: str | None) -> None:
        super().__init__(f"run {run_id}'s source {ref!r} changed since the run pinned it (pinned {expected}, now "
                         f"{found}); it is not replayed: restore that source, or start a new run",
                         run_id=run_id)
        self.ref, self.expected, self.found = ref, expected, found


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class SourceRef(_Frozen):
    """What exact definition produced the graph: its kind, reference, pinned version and hash.

    ``path`` is where a resolved source was read (a playbook file); ``resumed_from`` the run
    a checkpoint replay continues (D4: the replay records the original run as well as its own).
    """

    kind: SourceKind
    ref: str
    version: int | None = None
    content_hash: str | None = None
    path: str | None = None
    resumed_from: str | None = None


class PlannerUse(_Frozen):
    used: bool = False


class ReactiveSettings(_Frozen):
    enabled: bool = False
    max_ops: int = 0


class Admission(_Frozen):
    task_id: str | None = None
    lease_attempt: int | None = None


class RunProvenance(_Frozen):
    """The provenance payload every run persists (ADR-0068 D4); ``to_payload`` is its JSON.

    ``lane`` is the selected adapter's kind, never inferred later.
    """

    lane: str = Field(min_length=1)
    source: SourceRef
    planner: PlannerUse = PlannerUse()
    reactive: ReactiveSettings = ReactiveSettings()
    admission: Admission = Admission()

    @model_validator(mode="after")
    def _shared_rules(self) -> RunProvenance:
        source = self.source
        if source.content_hash is not None and not CONTENT_HASH.fullmatch(source.content_hash):
            raise ValueError(f"content_hash must be 'sha256:' and 64 hex digits, got {source.content_hash!r}")
        if source.version is not None and source.version < 1:
            raise ValueError(f"source version must be at least 1, got {source.version}")
        return self

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> RunProvenance:
        """Parse a stored payload against the shared rules; a malformed one is a ``ProvenanceError``."""
        try:
            return cls.model_validate(payload)
        except ValidationError as exc:
            details = "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'payload'}: {err['msg']}" for err in exc.errors()
            )
            raise ProvenanceError(f"invalid run provenance: {details}") from exc

    def to_payload(self) -> dict[str, Any]:
        payload = self.model_dump(mode="json")
        for optional in ("path", "resumed_from"):  # only the sources that have them carry them
            if payload["source"][optional] is None:
                del payload["source"][optional]
        return payload
