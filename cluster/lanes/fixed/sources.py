"""Where a fixed run's definition comes from, pinned before anything runs (ADR-0068 D4, ADR-0073 D5).

Owns source resolution: a registry name pinned to a version and its hash, or a file
whose validated bytes are hashed once; and compiling a pinned source. Ideal over
retrospective (ADR-0073 delta 1): a run pins ``name@version`` and its ``sha256:`` hash
before execution, so a definition edited mid-run does not change it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opgraph.kernel import OpGraphError

from ...store import RunStore, parse_ref, read_definition_file
from .compiler import CompiledWorkflow, compile_workflow
from .spec import WorkflowCompileError, WorkflowValidationError, load_definition, validate_definition

__all__ = ["WorkflowSource", "compile_source", "file_source", "is_file_target", "registry_source", "resolve_source"]


@dataclass(frozen=True, slots=True)
class WorkflowSource:
    """The exact definition a run compiles: where it came from, pinned, and its spec."""

    kind: str  # "workflow_def" (registry) or "workflow_file"
    ref: str  # the registry name, or the file's path as recorded
    content_hash: str
    spec: Mapping[str, Any] | None
    version: int | None = None
    workflow: Any = None  # the store's WorkflowVersion for registry sources

    @property
    def label(self) -> str:
        return f"{self.ref}@{self.version}" if self.version is not None else self.ref


def registry_source(store: RunStore, name: str, version: int | None = None) -> WorkflowSource:
    """Pin ``name`` (latest when ``version`` is None) before anything runs."""
    pinned = store.resolve(name, version)
    return WorkflowSource(kind="workflow_def", ref=pinned.name, content_hash=pinned.content_hash,
                          spec=pinned.spec, version=pinned.version, workflow=pinned)


def file_source(path: str | Path, *, ref: str | None = None) -> WorkflowSource:
    """Read a definition file once; its validated bytes are what is hashed and compiled.

    The run records ``ref`` as its source (default: the file's resolved path): a Ray job
    reads a temporary copy of the file and records the path its user gave instead.
    Raises ``WorkflowValidationError`` (a problem list) for unreadable JSON or a spec
    that breaks a storage rule, so a bad file never reaches the runtime.
    """
    spec, raw, resolved = read_definition_file(path)
    problems = validate_definition(spec)
    if problems:
        raise WorkflowValidationError(problems)
    return WorkflowSource(kind="workflow_file", ref=ref or str(resolved),
                          content_hash="sha256:" + hashlib.sha256(raw).hexdigest(), spec=spec)


def resolve_source(target: str, store: RunStore | None) -> WorkflowSource:
    """``target`` is a file path (it exists, or ends in .json), ``name`` or ``name@VERSION``."""
    if is_file_target(target):
        return file_source(target)
    if store is None:
        raise OpGraphError(f"{target!r} is no workflow file, and no store was given to resolve it by name")
    name, version = parse_ref(target)
    return registry_source(store, name, version)


def is_file_target(target: str) -> bool:
    """A target names a file when it ends in ``.json`` or a file by that name exists."""
    return target.endswith(".json") or Path(target).expanduser().is_file()


def compile_source(source: WorkflowSource, *, inputs: Mapping[str, Any] | None = None,
                   base_dir: str | Path | None = None, model: str | None = None) -> CompiledWorkflow:
    """Compile a pinned source; a definition stored without a spec cannot run."""
    if source.spec is None:
        raise WorkflowCompileError("workflow definition has no spec_json to run")
    definition = load_definition(source.spec)
    return compile_workflow(definition, inputs=inputs, model_override=model, base_dir=base_dir,
                            name=source.label)
