"""The version-1 fixed-workflow definition (ADR-0073 D1): its typed model, validation and hash.

Owns the storage rules a definition must pass before it is saved or compiled (the rules
the run store applies to this lane's definitions), one structured error per problem, and
the content hash of a valid definition. It must not compile, resolve engines, touch the
filesystem or run anything: that is compiler.py. The definition errors are the store's
(``WorkflowDefinitionError``, ``WorkflowValidationError``) plus this lane's own::

    WorkflowDefinitionError (cluster/store/errors.py)
    └── WorkflowCompileError      a valid shape cannot become a fixed graph (compiler.py)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opgraph.actors.models import ModelIdentityError, parse_model_id
from opgraph.kernel import ExpressionCondition, UnsafeExpressionError

from ...store import (
    MAX_NAME_LENGTH,
    WorkflowDefinitionError,
    WorkflowValidationError,
    canonical_json,
    digest,
    is_unicode_text,
    normalise_name,
    problem,
    validate_name,
)

__all__ = [
    "MAX_DEPTH",
    "MAX_EDGES",
    "MAX_NAME_LENGTH",
    "MAX_NODES",
    "REMOVED_NODE_KINDS",
    "SPEC_VERSION",
    "STORED_NODE_KINDS",
    "WorkflowCompileError",
    "WorkflowDefinition",
    "WorkflowDefinitionError",
    "WorkflowEdge",
    "WorkflowNode",
    "WorkflowValidationError",
    "canonical_json",
    "content_hash",
    "is_unicode_text",
    "load_definition",
    "normalise_name",
    "problem",
    "validate_definition",
    "validate_name",
]

SPEC_VERSION = 1
# The caps bound canvas and compiler work; the record gives no measurement behind them.
MAX_DEPTH = 64  # JSON nesting levels a definition may use
MAX_NODES = 200
MAX_EDGES = 400
MAX_STOP_SEQUENCES = 4  # as OpenAI's chat completions allows
STORED_NODE_KINDS: tuple[str, ...] = ("input", "chat", "parse", "fanout", "engine")
REMOVED_NODE_KINDS: frozenset[str] = frozenset({"gate"})


# -- errors ----------------------------------------------------------------------------
class WorkflowCompileError(WorkflowDefinitionError):
    """A stored definition cannot compile to a fixed graph (ADR-0073 D2-D4)."""


# -- the typed model -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkflowNode:
    id: str
    kind: str
    x: float
    y: float
    config: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class WorkflowEdge:
    id: str
    source: str  # the JSON "from"
    target: str  # the JSON "to"
    condition: str | None
    label: str | None


@dataclass(frozen=True, slots=True)
class WorkflowDefinition:
    """A validated version-1 definition; ``data`` is a private copy of the validated JSON."""

    data: Mapping[str, Any]
    nodes: tuple[WorkflowNode, ...]
    edges: tuple[WorkflowEdge, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    @property
    def content_hash(self) -> str:
        return digest(self.data)

    def node(self, node_id: str) -> WorkflowNode:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)


def load_definition(data: Any) -> WorkflowDefinition:
    """Validate ``data`` and return the typed model, or raise ``WorkflowValidationError``.

    ``None`` (a row saved without a spec) is valid storage but not a definition: it
    raises ``WorkflowCompileError``, as the record's runner does.
    """
    if data is None:
        raise WorkflowCompileError("workflow definition has no spec_json to run")
    errors = validate_definition(data)
    if errors:
        raise WorkflowValidationError(errors)
    data = copy.deepcopy(dict(data))
    nodes = tuple(
        WorkflowNode(
            id=node["id"],
            kind=node["kind"],
            x=node["pos"]["x"],
            y=node["pos"]["y"],
            config=node.get("config") or {},
        )
        for node in data.get("nodes", [])
    )
    edges = tuple(
        WorkflowEdge(
            id=edge["id"],
            source=edge["from"],
            target=edge["to"],
            condition=edge.get("condition"),
            label=edge.get("label"),
        )
        for edge in data.get("edges", [])
    )
    return WorkflowDefinition(
        data=data,
        nodes=nodes,
        edges=edges,
        inputs=tuple(data.get("inputs", [])),
        outputs=tuple(data.get("outputs", [])),
    )


# -- validation ------------------------------------------------------------------------
def validate_definition(data: Any) -> list[dict[str, Any]]:
    """Every D1 storage problem in ``data``, in document order; ``[]`` when it is valid.

    Collects rather than stops at the first problem. ``None`` is valid (a row may be
    saved without a spec); it simply cannot run. Beyond the record's rules, the whole
    value must be plain JSON (finite numbers, string keys, valid Unicode), because it is
    hashed, and every edge condition must compile under the safe grammar: ideal over
    retrospective, a condition that could never run is refused when it is stored, not
    when the definition first runs (ADR-0073 D3 compiles it only then).
    """
    if data is None:
        return []
    if not isinstance(data, Mapping):
        return [problem(f"a workflow definition must be a JSON object, got {type(data).__name__}")]
    errors: list[dict[str, Any]] = []
    _check_plain_json(data, "definition", errors)
    version = data.get("version")
    if type(version) is not int or version != SPEC_VERSION:
        errors.append(
            problem(f"the definition must have \"version\": {SPEC_VERSION}, got {version!r}")
        )
    if "base_dir" in data:
        errors.append(
            problem(
                "a definition may not set a top-level base_dir: the containment root is chosen "
                "by whoever runs it (--base-dir / the run request)"
            )
        )
    node_ids = _validate_nodes(data.get("nodes", []), errors)
    _validate_edges(data.get("edges", []), node_ids, errors)
    for key in ("inputs", "outputs"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            errors.append(problem(f"{key!r} must be an array of strings"))
    return errors


def _check_plain_json(value: Any, path: str, errors: list[dict[str, Any]], depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        errors.append(problem(f"{path} nests deeper than {MAX_DEPTH} levels"))
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(problem(f"{path} has a non-string key {key!r}"))
                continue
            if not is_unicode_text(key):
                errors.append(problem(f"{path} has a key that is not valid Unicode (a lone surrogate)"))
                continue
            _check_plain_json(item, f"{path}.{key}", errors, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_plain_json(item, f"{path}[{index}]", errors, depth + 1)
    elif isinstance(value, str):
        if not is_unicode_text(value):
            errors.append(problem(f"{path} is not valid Unicode text (it holds a lone surrogate such as "
                                  "\\ud800); the definition is stored and hashed as UTF-8"))
    elif isinstance(value, float):
        if not math.isfinite(value):
            errors.append(problem(f"{path} is {value!r}; JSON numbers must be finite"))
    elif not isinstance(value, (int, bool, type(None))):
        errors.append(problem(f"{path} is a {type(value).__name__}, which is not a JSON value"))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _identified(items: Any, what: str, cap: int,
                errors: list[dict[str, Any]]) -> tuple[list[tuple[Mapping[str, Any], str | None]], set[str]] | None:
    """What nodes and edges share: an array under ``cap`` of objects with unique string ids.

    Returns each object with its id (None when missing) and the unique ids,
    or None when the array itself is unusable. The cap bounds validation work too: over
    it, the items themselves are not inspected.
    """
    plural, key = f"{what}s", f"{what}_id"
    if not isinstance(items, list):
        errors.append(problem(f"{plural!r} must be an array, got {type(items).__name__}"))
        return None
    if len(items) > cap:
        errors.append(problem(f"a definition holds at most {cap} {plural}, got {len(items)}"))
        return None
    seen: dict[str, int] = {}
    entries: list[tuple[Mapping[str, Any], str | None]] = []
    for index, item in enumerate(items):
        where = f"{plural}[{index}]"
        if not isinstance(item, Mapping):
            errors.append(problem(f"{where} must be an object, got {type(item).__name__}"))
            continue
        item_id = item.get("id")
        if not isinstance(item_id, str) or not item_id:
            errors.append(problem(f"{where} needs a non-empty string id, got {item_id!r}"))
            item_id = None
        elif item_id in seen:
            errors.append(problem(f"duplicate {what} id {item_id!r} ({plural}[{seen[item_id]}] and {where})",
                                  **{key: item_id}))
        else:
            seen[item_id] = index
        entries.append((item, item_id))
    return entries, set(seen)


def _validate_nodes(nodes: Any, errors: list[dict[str, Any]]) -> set[str] | None:
    """Check each node; return the stored ids, or None when they cannot be trusted."""
    identified = _identified(nodes, "node", MAX_NODES, errors)
    if identified is None:
        return None
    entries, node_ids = identified
    for node, node_id in entries:
        kind = node.get("kind")
        if kind in REMOVED_NODE_KINDS:
            errors.append(
                problem(
                    f"{kind!r} nodes were removed; move the condition onto the outgoing edges "
                    "(\"condition\") and delete the node",
                    node_id=node_id,
                )
            )
        elif kind not in STORED_NODE_KINDS:
            errors.append(
                problem(
                    f"unknown node kind {kind!r}; admitted kinds: {', '.join(STORED_NODE_KINDS)}",
                    node_id=node_id,
                )
            )
        pos = node.get("pos")
        if not isinstance(pos, Mapping) or not (_is_number(pos.get("x")) and _is_number(pos.get("y"))):
            errors.append(problem("a node needs numeric pos.x and pos.y", node_id=node_id))
        config = node.get("config")
        if config is not None and not isinstance(config, Mapping):
            errors.append(problem("a node's config must be an object", node_id=node_id))
        elif kind == "chat":
            _validate_chat_config(config or {}, node_id, errors)
    return node_ids


def _validate_chat_config(config: Mapping[str, Any], node_id: str | None, errors: list[dict[str, Any]]) -> None:
    prompt = config.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        errors.append(problem("a chat node needs a non-empty string config.prompt", node_id=node_id))
    if config.get("model") is not None:
        try:
            parse_model_id(config["model"])
        except ModelIdentityError as exc:
            errors.append(problem(f"config.model: {exc.message}", node_id=node_id))
    timeout = config.get("timeout")
    if timeout is not None and (not _is_number(timeout) or not timeout > 0):
        errors.append(problem(f"config.timeout is seconds one model call may take, above 0; got {timeout!r}",
                              node_id=node_id))
    max_tokens = config.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        errors.append(problem(f"config.max_tokens must be a whole number from 1, got {max_tokens!r}",
                              node_id=node_id))
    stop = config.get("stop")
    if stop is not None and (not isinstance(stop, list) or not 1 <= len(stop) <= MAX_STOP_SEQUENCES
                             or not all(isinstance(item, str) and item for item in stop)):
        errors.append(problem(f"config.stop must be a list of 1 to {MAX_STOP_SEQUENCES} non-empty strings, "
                              f"got {stop!r}", node_id=node_id))
    schema = config.get("schema")
    if schema is not None:
        errors.extend(problem(message, node_id=node_id) for message in _schema_problems(schema))


def _schema_problems(schema: Any) -> list[str]:
    """Why ``schema`` is not a JSON Schema a chat node's reply can be held to (none: it is one)."""
    import jsonschema

    if not isinstance(schema, Mapping):
        return [f"config.schema must be a JSON Schema object, got {type(schema).__name__}"]
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return [f"config.schema is not a valid JSON Schema: {exc.message}"]
    return []


def _validate_edges(edges: Any, node_ids: set[str] | None, errors: list[dict[str, Any]]) -> None:
    identified = _identified(edges, "edge", MAX_EDGES, errors)
    if identified is None:
        return
    for edge, edge_id in identified[0]:
        for end in ("from", "to"):
            ref = edge.get(end)
            if not isinstance(ref, str) or not ref:
                errors.append(problem(f"edge {end!r} must be a node id, got {ref!r}", edge_id=edge_id))
            elif node_ids is not None and ref not in node_ids:
                errors.append(problem(f"edge {end!r} names the unknown node {ref!r}", edge_id=edge_id))
        condition = edge.get("condition")
        if condition is not None and (not isinstance(condition, str) or not condition.strip()):
            errors.append(
                problem("an edge condition must be a non-empty string when given", edge_id=edge_id)
            )
        elif condition is not None and is_unicode_text(condition):
            # Compiled now, so a condition that could never run is refused when the
            # definition is added, not when it is first run.
            try:
                ExpressionCondition(condition, edge_id=edge_id)
            except UnsafeExpressionError as exc:
                errors.append(problem(exc.message, edge_id=edge_id))
        label = edge.get("label")
        if label is not None and not isinstance(label, str):
            errors.append(problem("an edge label must be a string when given", edge_id=edge_id))


# -- hashing ---------------------------------------------------------------------------
def content_hash(definition: Any) -> str:
    """``sha256:<hex>`` of the validated definition's canonical JSON.

    Accepts the JSON mapping or a ``WorkflowDefinition``; an invalid mapping raises
    ``WorkflowValidationError`` rather than hashing something that could never run.
    """
    if isinstance(definition, WorkflowDefinition):
        return definition.content_hash
    errors = validate_definition(definition)
    if errors:
        raise WorkflowValidationError(errors)
    return digest(definition)
