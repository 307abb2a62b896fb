"""Versioned definitions in the run store: immutable, content-hashed, resolved as ``name@version``.

Owns the definition tables' reads and writes, the registry's naming rule, canonical JSON
and its ``sha256:`` hash, reading a definition file, and ``name@version`` references. What
a definition must hold is not its business: the lane that keeps definitions here passes
its rules in (``validate_definition``), and nothing is written until they pass.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opgraph.actors.persistence.backends import Connection, Row
from opgraph.kernel import OpGraphError

from .database import StoreDatabase
from .errors import (
    WorkflowNameConflictError,
    WorkflowNotFoundError,
    WorkflowStoreError,
    WorkflowValidationError,
    WorkflowVersionLimitError,
    WorkflowVersionNotFoundError,
    problem,
)
from .schema import MAX_VERSION

__all__ = [
    "CONTENT_HASH",
    "DEFAULT_MAX_VERSIONS",
    "MAX_NAME_LENGTH",
    "NAME_PATTERN",
    "DefinitionRules",
    "Definitions",
    "WorkflowSummary",
    "WorkflowVersion",
    "canonical_json",
    "digest",
    "is_unicode_text",
    "normalise_name",
    "parse_ref",
    "read_definition_file",
    "validate_name",
]

# The store's own bound since its first schema (CHECK length(name) BETWEEN 1 AND 120).
MAX_NAME_LENGTH = 120
# What a name may hold: it is a path segment of the HTTP API (/api/workflows/NAME), a file
# name stem (NAME.playbook.yaml) and the left of NAME@VERSION, so no '/', '@', space or control
# character; a name of dots alone ('.', '..') is a path step, not a name.
NAME_PATTERN = r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$"  # and at most MAX_NAME_LENGTH long
_NAME = re.compile(NAME_PATTERN)
# How many versions one workflow may have (OPGRAPH_MAX_VERSIONS; `opgraph serve --max-versions`):
# each PUT of a changed spec appends one, so without a bound one client could grow a workflow forever.
DEFAULT_MAX_VERSIONS = 1000
MAX_VERSIONS_ENV = "OPGRAPH_MAX_VERSIONS"
CONTENT_HASH = re.compile(r"sha256:[0-9a-f]{64}")  # every stored hash: the algorithm, then 64 hex digits
# A lane's rules for what a definition holds: every problem found, [] when it may be stored.
DefinitionRules = Callable[[Any], list[dict[str, Any]]]


# -- records ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkflowVersion:
    """One immutable definition version; ``spec`` is decoded afresh, so mutating it changes nothing stored."""

    workflow_id: str
    name: str
    version: int
    content_hash: str
    spec: dict[str, Any] | None
    description: str | None
    created_at: float

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True, slots=True)
class WorkflowSummary:
    """A live workflow and its latest version: ``description`` and ``content_hash`` are that
    version's, and ``updated_at`` is when it was added."""

    id: str
    name: str
    description: str | None
    latest_version: int
    content_hash: str
    created_at: float
    updated_at: float


# -- text, hashes and references ----------------------------------------------------------
def is_unicode_text(text: str) -> bool:
    """False for a string UTF-8 cannot encode: JSON's ``"\\ud800"`` escape decodes to a lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def canonical_json(definition: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: equal definitions give equal bytes."""
    return json.dumps(
        definition, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def digest(definition: Any) -> str:
    """``sha256:<hex>`` of ``definition``'s canonical JSON (no rules checked: see the lane's ``content_hash``)."""
    return "sha256:" + hashlib.sha256(canonical_json(definition)).hexdigest()


def validate_name(name: Any) -> list[dict[str, Any]]:
    """Problems with a definition name: once trimmed, 1 to 120 of ``A-Z a-z 0-9 . _ -`` (not dots alone)."""
    if not isinstance(name, str):
        return [problem(f"the workflow name must be a string, got {type(name).__name__}")]
    if not is_unicode_text(name):
        return [problem("the workflow name is not valid Unicode text (it holds a lone surrogate)")]
    trimmed = name.strip()
    if not trimmed:
        return [problem(f"the workflow name is empty; give it 1 to {MAX_NAME_LENGTH} characters")]
    if len(trimmed) > MAX_NAME_LENGTH:
        return [problem(f"the workflow name is {len(trimmed)} characters long; the limit is {MAX_NAME_LENGTH}")]
    if not _NAME.match(trimmed):
        refused = sorted({character for character in trimmed if not (character.isascii() and
                                                                     (character.isalnum() or character in "._-"))})
        what = f"it holds {', '.join(repr(character) for character in refused)}" if refused else "it is dots alone"
        return [problem(f"the workflow name {trimmed!r} may hold only letters A-Z and a-z, digits, '.', '_' and '-', "
                        f"and not be dots alone; {what}")]
    return []


def max_versions_setting() -> int:
    """``OPGRAPH_MAX_VERSIONS`` when it is a positive whole number, else ``DEFAULT_MAX_VERSIONS``."""
    text = os.environ.get(MAX_VERSIONS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_VERSIONS
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{MAX_VERSIONS_ENV} must be a whole number from 1, got {text!r}")
    return int(text)


def normalise_name(name: Any) -> str:
    """The trimmed name, or ``WorkflowValidationError``."""
    errors = validate_name(name)
    if errors:
        raise WorkflowValidationError(errors)
    return name.strip()


def parse_ref(target: str) -> tuple[str, int | None]:
    """``name`` -> (name, None); ``name@VERSION`` -> (name, VERSION), a positive integer."""
    if "@" not in target:
        return target, None
    name, _, version_text = target.rpartition("@")
    if not version_text.isdigit() or int(version_text) < 1:
        raise OpGraphError(f"workflow version in {target!r} must be a positive integer")
    return name, int(version_text)


def read_definition_file(path: str | Path) -> tuple[Any, bytes, Path]:
    """The JSON value of a definition file, the bytes it was read from, and its resolved path.

    The file is read once, so what is hashed is what was parsed. An unreadable file, one
    that is not JSON, or one that holds ``null``, is a ``WorkflowValidationError`` with one problem.
    """
    resolved = Path(path).expanduser().resolve()
    try:
        raw = resolved.read_bytes()
    except OSError as exc:
        raise WorkflowValidationError(
            [problem(f"cannot read workflow file {str(resolved)!r}: {exc.strerror or exc}")]) from exc
    try:
        definition = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkflowValidationError([problem(f"workflow file {str(resolved)!r} is not JSON: {exc}")]) from exc
    except RecursionError as exc:  # the parser's own depth limit, at about 1,000 levels
        raise WorkflowValidationError([problem(f"workflow file {str(resolved)!r} nests deeper than JSON is "
                                               "read here (a definition nests at most 64 levels)")]) from exc
    if definition is None:
        # A workflow may be created without a spec (ADR-0073 D1), but a file is a definition: one
        # holding ``null`` is refused as any other value that is no JSON object is.
        raise WorkflowValidationError([problem("a workflow definition must be a JSON object, got null")])
    return definition, raw, resolved


_VERSIONS_OF = ("SELECT w.id, w.name, v.version, v.content_hash, v.spec_json, v.description, v.created_at"
                " FROM workflows w JOIN workflow_versions v ON v.workflow_id = w.id WHERE w.id = ?")


def _version(row: Row) -> WorkflowVersion:
    return WorkflowVersion(workflow_id=row[0], name=row[1], version=row[2], content_hash=row[3],
                           spec=json.loads(row[4]), description=row[5], created_at=row[6])


# -- the tables ---------------------------------------------------------------------------
class Definitions(StoreDatabase):
    """The definition registry half of the run store (``RunStore`` adds the runs).

    ``validate_definition`` is the rules of the lane whose definitions these are (the
    fixed workflow lane's, through ``opgraph.cluster.lanes.open_store``). Without them
    definitions can be read but not written: a store never accepts a definition nobody
    checked.
    """

    def __init__(self, path: str | Path | None = None, *, validate_definition: DefinitionRules | None = None,
                 max_versions: int | None = None, **options: Any) -> None:
        super().__init__(path, **options)
        self._validate_definition = validate_definition
        self.max_versions = max_versions_setting() if max_versions is None else max_versions
        if type(self.max_versions) is not int or self.max_versions < 1:
            raise ValueError(f"max_versions must be a positive integer, got {self.max_versions!r}")

    def _encode_spec(self, spec: Any, description: Any,
                     problems: Iterable[dict[str, Any]] = ()) -> tuple[str, str]:
        """Canonical JSON and hash of ``spec``, or one ``WorkflowValidationError`` with every problem.

        The stored text is exactly the hashed bytes, so ``content_hash == sha256(spec_json)``.
        """
        if self._validate_definition is None:
            raise WorkflowStoreError(f"the store {self.path} was opened without definition rules, so it cannot "
                                     "write a definition; open it with opgraph.cluster.lanes.open_store()")
        problems = list(problems)
        if description is not None and not isinstance(description, str):
            problems.append(problem(f"the description must be a string, got {type(description).__name__}"))
        problems += self._validate_definition(spec)
        if problems:
            raise WorkflowValidationError(problems)
        return canonical_json(spec).decode("utf-8"), digest(spec)

    def create_workflow(self, name: str, spec: Mapping[str, Any] | None,
                        description: str | None = None) -> WorkflowVersion:
        """Create workflow ``name`` with version 1; nothing is written unless name and spec are valid.

        A ``None`` spec is stored (ADR-0073 D1) but cannot run. A live workflow with the
        same trimmed name raises ``WorkflowNameConflictError``.
        """
        spec_json, hashed = self._encode_spec(spec, description, validate_name(name))
        name = name.strip()
        with self._transaction(write=True) as db:
            if db.execute("SELECT 1 FROM workflows WHERE name = ? AND deleted_at IS NULL", (name,)).fetchone():
                raise WorkflowNameConflictError(name)
            workflow_id = secrets.token_hex(6)
            while db.execute("SELECT 1 FROM workflows WHERE id = ?", (workflow_id,)).fetchone():
                workflow_id = secrets.token_hex(6)
            now = self._clock()
            db.execute("INSERT INTO workflows (id, name, description, created_at) VALUES (?, ?, ?, ?)",
                       (workflow_id, name, description, now))
            return self._insert_version(db, workflow_id, 1, hashed, spec_json, description, now)

    def add_version(self, name_or_id: str, spec: Mapping[str, Any] | None,
                    description: str | None = None) -> WorkflowVersion:
        """Append version N+1 of a live workflow and return it.

        Idempotent: when ``spec`` hashes to the latest version's hash, the latest version
        is returned unchanged and nothing is written (a new description alone does not
        make a version). ``description=None`` carries the latest description forward.
        A ``None`` spec is refused: it would become the latest version, which every run
        by name resolves to, and it cannot run (only a new workflow may start without one).
        """
        missing = [problem("a new version needs a spec: a version without one would become the latest "
                           "and could not run; send the definition as \"spec\"")] if spec is None else []
        spec_json, hashed = self._encode_spec(spec, description, missing)
        with self._transaction(write=True) as db:
            latest = self._resolve(db, name_or_id, None, include_deleted=False)
            if latest.content_hash == hashed:
                return latest
            if latest.version >= self.max_versions:  # versions are numbered 1..N with no gap
                raise WorkflowVersionLimitError(latest.name, self.max_versions)
            return self._insert_version(db, latest.workflow_id, latest.version + 1, hashed, spec_json,
                                        latest.description if description is None else description, self._clock())

    def _insert_version(self, db: Connection, workflow_id: str, version: int, hashed: str,
                        spec_json: str, description: str | None, now: float) -> WorkflowVersion:
        db.execute("INSERT INTO workflow_versions (workflow_id, version, content_hash, spec_json, description,"
                   " created_at) VALUES (?, ?, ?, ?, ?, ?)",
                   (workflow_id, version, hashed, spec_json, description, now))
        return self._resolve(db, workflow_id, version, include_deleted=False)

    def _workflow_row(self, db: Connection, name_or_id: str, include_deleted: bool) -> Row:
        key = name_or_id.strip() if isinstance(name_or_id, str) else name_or_id
        # A live name wins over an id; deleted workflows are reachable by id only, since
        # several deleted workflows may have had the same name.
        row = db.execute("SELECT id, name FROM workflows WHERE name = ? AND deleted_at IS NULL", (key,)).fetchone()
        row = row or db.execute("SELECT id, name FROM workflows WHERE id = ? AND (deleted_at IS NULL OR ?)",
                                (key, include_deleted)).fetchone()
        if row is None:
            raise WorkflowNotFoundError(str(name_or_id))
        return row

    def _resolve(self, db: Connection, name_or_id: str, version: int | None,
                 include_deleted: bool) -> WorkflowVersion:
        workflow = self._workflow_row(db, name_or_id, include_deleted)
        if version is None:
            row = db.execute(_VERSIONS_OF + " ORDER BY v.version DESC LIMIT 1", (workflow["id"],)).fetchone()
        else:
            row = db.execute(_VERSIONS_OF + " AND v.version = ?", (workflow["id"], version)).fetchone()
        if row is None:
            raise WorkflowVersionNotFoundError(workflow["name"], version)
        return _version(row)

    def resolve(self, name_or_id: str, version: int | None = None, *,
                include_deleted: bool = False) -> WorkflowVersion:
        """Pin one version of a live workflow (the latest when ``version`` is None).

        ``include_deleted=True`` also finds a deleted workflow by its id (never by name):
        that is how a run's exact definition is read back after its workflow was deleted.
        """
        if version is not None and (type(version) is not int or version < 1):
            raise ValueError(f"a workflow version is an integer from 1, got {version!r}")
        with self._transaction() as db:
            if version is not None and version > MAX_VERSION:
                # SQLite integers stop at 2**63 - 1: no such version exists, and binding the
                # number would overflow. An unknown workflow is still the plainer 404.
                workflow = self._workflow_row(db, name_or_id, include_deleted)
                raise WorkflowVersionNotFoundError(workflow["name"], version)
            return self._resolve(db, name_or_id, version, include_deleted)

    def versions(self, name_or_id: str, *, include_deleted: bool = False) -> list[WorkflowVersion]:
        """Every version of one workflow, oldest first (deleted ones by id, as for ``resolve``)."""
        with self._transaction() as db:
            workflow = self._workflow_row(db, name_or_id, include_deleted)
            rows = db.execute(_VERSIONS_OF + " ORDER BY v.version", (workflow["id"],))
            return [_version(row) for row in rows]

    def list_workflows(self) -> list[WorkflowSummary]:
        """Every live workflow with its latest version, ordered by name."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT w.id, w.name, v.description, v.version, v.content_hash, w.created_at, v.created_at "
                "FROM workflows w JOIN workflow_versions v ON v.workflow_id = w.id WHERE w.deleted_at IS NULL "
                "AND v.version = (SELECT MAX(version) FROM workflow_versions WHERE workflow_id = w.id) "
                "ORDER BY w.name").fetchall()
        return [WorkflowSummary(*row) for row in rows]

    def delete_workflow(self, name_or_id: str) -> None:
        """Soft-delete a live workflow: its name is free again; its versions stay for old runs."""
        with self._transaction(write=True) as db:
            workflow = self._workflow_row(db, name_or_id, include_deleted=False)
            db.execute("UPDATE workflows SET deleted_at = ? WHERE id = ?", (self._clock(), workflow["id"]))
