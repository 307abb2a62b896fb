"""The run store's errors, and the one problem shape every refusal of a definition or request uses.

Owns ``problem()`` (``{error, node_id, edge_id}``) and the store's typed errors; what a
lane finds wrong with its own definitions is raised as ``WorkflowValidationError`` or a
subclass of ``WorkflowDefinitionError`` it defines (the fixed lane's compile error)::

    OpGraphError
    ├── WorkflowDefinitionError        a definition cannot be stored or run; ``.errors`` lists every problem
    │   └── WorkflowValidationError    a definition (or its name) breaks the rules, refused before it is written (422)
    ├── ProvenanceError                a run's provenance payload breaks the ADR-0068 D4 shape or its lane's rules
    └── WorkflowStoreError             the database failed, or the store is closed
        ├── StoreSchemaError           the file's schema is newer than this code knows
        ├── WorkflowNameConflictError  a live workflow already has the name (409)
        ├── WorkflowNotFoundError      no live workflow by that name or id (404)
        │   └── WorkflowVersionNotFoundError   the workflow exists, the version does not
        ├── RunNotFoundError           no run with that id
        ├── RunConflictError           a run with that id already exists
        ├── RunNotResumableError       the run is not recorded as orphaned, so it cannot be resumed
        ├── EngineRunNotFoundError     no engine run with that id
        ├── MapJobNotFoundError        no dataset job with that id (or id prefix)
        └── MapJobBusyError            another live process is running the dataset job
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from opgraph.kernel import OpGraphError

__all__ = [
    "EngineRunNotFoundError",
    "MapJobBusyError",
    "MapJobNotFoundError",
    "ProvenanceError",
    "RunConflictError",
    "RunNotFoundError",
    "RunNotResumableError",
    "StoreSchemaError",
    "WorkflowDefinitionError",
    "WorkflowNameConflictError",
    "WorkflowNotFoundError",
    "WorkflowStoreError",
    "WorkflowValidationError",
    "WorkflowVersionLimitError",
    "WorkflowVersionNotFoundError",
    "problem",
]


def problem(error: str, *, node_id: str | None = None, edge_id: str | None = None) -> dict[str, Any]:
    """One structured problem, the public ``{error, node_id, edge_id}`` shape."""
    return {"error": error, "node_id": node_id, "edge_id": edge_id}


# -- definitions ------------------------------------------------------------------------
class WorkflowDefinitionError(OpGraphError):
    """A workflow definition cannot be stored or run; ``.errors`` lists every problem found.

    ``message``, ``node_id`` and ``edge_id`` are those of the first problem, so ``str()``
    points somewhere useful; callers presenting errors (422 bodies, CLI output) should
    print ``.errors``. Fix each listed node or edge and submit the definition again.
    """

    def __init__(
        self,
        errors: Sequence[Mapping[str, Any]] | str,
        *,
        node_id: str | None = None,
        edge_id: str | None = None,
    ) -> None:
        if isinstance(errors, str):
            errors = [problem(errors, node_id=node_id, edge_id=edge_id)]
        self.errors: list[dict[str, Any]] = [
            problem(str(e["error"]), node_id=e.get("node_id"), edge_id=e.get("edge_id")) for e in errors
        ]
        if not self.errors:
            raise ValueError(f"{type(self).__name__} needs at least one problem")
        first = self.errors[0]
        message = first["error"]
        if len(self.errors) > 1:
            message = f"{message} (and {len(self.errors) - 1} more problem(s); see .errors)"
        super().__init__(message, node_id=first["node_id"], edge_id=first["edge_id"])

    def to_dict(self) -> dict[str, Any]:
        """The first problem, in the record's ``to_dict`` shape."""
        return dict(self.errors[0])


class WorkflowValidationError(WorkflowDefinitionError):
    """The definition's JSON (or its name) breaks a storage rule (ADR-0073 D1), so nothing was written."""


class ProvenanceError(OpGraphError):
    """A provenance payload breaks the ADR-0068 D4 shape or its lane's rules; the message lists what is wrong."""


# -- the store --------------------------------------------------------------------------
class WorkflowStoreError(OpGraphError):
    """The store cannot do what was asked: its database failed, or it was closed.

    ``_fields`` names a subclass's own fields (the root error pickles them with the rest).
    """

    _fields: tuple[str, ...] = ()


class _Templated:
    """Mixin of a store error built from the fields its message names, in the order it names them:
    ``class E(_Templated, WorkflowStoreError, message="no run with id {run_id!r}")`` is raised as
    ``E(run_id)``, keeps ``run_id`` as an attribute and lists it in ``_fields``."""

    _fields: tuple[str, ...]
    _message: str

    def __init_subclass__(cls, *, message: str | None = None, **settings: Any) -> None:
        super().__init_subclass__(**settings)
        if message is not None:
            cls._message = message
            cls._fields = tuple(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(message) if name))

    def __init__(self, *values: Any) -> None:
        fields = dict(zip(self._fields, values, strict=True))
        super().__init__(self._message.format(**fields))
        self.__dict__.update(fields)


class StoreSchemaError(_Templated, WorkflowStoreError, message=(
        "the store {path} has schema version {found}, but this opgraph knows only up to {supported}; "
        "upgrade opgraph or use another store (--store / OPGRAPH_DB)")):
    """The database was written by a newer opgraph; upgrade opgraph, or use another file."""


class WorkflowNameConflictError(_Templated, WorkflowStoreError, message=(
        "a workflow named {name!r} already exists; add a version to it, delete it, or choose another name")):
    """A live workflow already has ``name`` (HTTP 409)."""


class WorkflowVersionLimitError(_Templated, WorkflowStoreError, message=(
        "workflow {name!r} already has {limit} versions, the most this store keeps per workflow "
        "(opgraph serve --max-versions, OPGRAPH_MAX_VERSIONS); create a new workflow instead")):
    """The workflow already has as many versions as the store allows (HTTP 409); nothing was written."""


class WorkflowNotFoundError(_Templated, WorkflowStoreError, message=(
        "no workflow named {name!r} (nor with that id); `opgraph workflows list` shows them")):
    """No live workflow has ``name`` as its name or id (HTTP 404)."""


class WorkflowVersionNotFoundError(WorkflowNotFoundError):
    """The workflow exists but has no ``version``; a pinned version never falls back to latest."""

    _fields = ("name", "version")

    def __init__(self, name: str, version: int | None) -> None:
        which = "versions" if version is None else f"version {version}"
        WorkflowStoreError.__init__(self, f"workflow {name!r} has no {which}; "
                                          f"`opgraph workflows versions {name}` lists them")
        self.name, self.version = name, version


class RunNotFoundError(_Templated, WorkflowStoreError, message="no run with id {run_id!r}"):
    """No run has ``run_id``."""


class RunConflictError(_Templated, WorkflowStoreError, message=(
        "a run with id {run_id!r} already exists; use a fresh run id")):
    """A run with ``run_id`` already exists; run ids are never reused."""


class RunNotResumableError(_Templated, WorkflowStoreError, message=(
        "run {run_id} is {status}, not orphaned: only a run whose owner process died "
        "can be resumed from the run log")):
    """Only a run recorded as orphaned (its owner process died) can be resumed; ``status`` is what it is.

    A run that finished keeps its end; a run still owned by a live process is its owner's;
    a detached run goes on on its cluster (``opgraph run result`` reads it).
    """


class EngineRunNotFoundError(_Templated, WorkflowStoreError, message="no engine run with id {run_id!r}"):
    """No engine run has ``run_id``."""


class MapJobNotFoundError(WorkflowStoreError):
    """No dataset job (``opgraph map``) has ``job_id``, nor starts with it (or several do)."""

    _fields = ("job_id",)

    def __init__(self, job_id: str, detail: str = "") -> None:
        super().__init__(f"no dataset job {job_id!r} in the store{detail}; `opgraph map` prints a job's id "
                         "when it starts")
        self.job_id = job_id


class MapJobBusyError(_Templated, WorkflowStoreError, message=(
        "dataset job {job_id} is being run by {owner}; wait for it, or stop it first")):
    """Another process that is still alive is running the dataset job: one runs a job at a time."""
