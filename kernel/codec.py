"""The msgpack wire codec for protocol messages, checkpoints and graphs, with a schema version.

Owns the one encoding of kernel values: Operations, Edges, Graphs, the emission
contracts and lifecycle signals travel as tagged msgpack maps. User conditions and
callables do not belong here: they travel the Ray way, by cloudpickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from . import contracts, signals
from .errors import CodecError
from .graph import Edge, Graph, Operation

__all__ = ["CODEC_SCHEMA_VERSION", "decode", "encode", "register_condition", "register_model"]

CODEC_SCHEMA_VERSION = 1

_MODEL_TAG = "__opgraph_model__"
_GRAPH_TAG = "__opgraph_graph__"
_TUPLE_TAG = "__opgraph_tuple__"
_MODELS: dict[str, type[BaseModel]] = {}


def register_model(model: type[BaseModel]) -> type[BaseModel]:
    """Make a pydantic model encodable by its class name (usable as a decorator)."""
    existing = _MODELS.get(model.__name__)
    if existing is not None and existing is not model:
        raise CodecError(f"another model is already registered as {model.__name__!r}")
    _MODELS[model.__name__] = model
    return model


for _model in (
    Operation,
    contracts.TaskAssignment,
    contracts.SpawnRequest,
    contracts.EscalationRequest,
    signals.NodeQueued,
    signals.NodeStarted,
    signals.NodeCompleted,
    signals.NodeFailed,
    signals.NodeSkipped,
    signals.NodePaused,
    signals.NodeSpawned,
    signals.NodeEscalated,
):
    register_model(_model)


def _default(value: Any) -> Any:
    if isinstance(value, Graph):
        return {_GRAPH_TAG: _graph_payload(value)}
    if isinstance(value, Edge):
        return {_MODEL_TAG: "Edge", "data": _edge_payload(value)}
    if isinstance(value, BaseModel):
        name = type(value).__name__
        if _MODELS.get(name) is not type(value):
            raise CodecError(f"model {name} is not registered with the codec")
        return {_MODEL_TAG: name, "data": value.model_dump(mode="python")}
    if isinstance(value, tuple):
        return {_TUPLE_TAG: list(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    # Packing runs with strict_types (otherwise msgpack silently turns tuples into
    # lists and never asks us), so subclasses of the plain types arrive here too.
    if isinstance(value, Mapping):
        return dict(value)
    for plain in (bool, int, float, str, bytes, list):
        if isinstance(value, plain):
            return plain(value)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise CodecError(f"cannot encode a value of type {type(value).__name__}")


def _edge_payload(edge: Edge) -> dict[str, Any]:
    condition = edge.condition
    if condition is not None:
        to_wire = getattr(condition, "to_wire", None)
        if to_wire is None:
            raise CodecError(
                f"edge condition {type(condition).__name__} has no wire form; "
                "send graphs with Python conditions through Ray (cloudpickle)",
                edge_id=edge.id,
            )
        condition = to_wire()
    return {"id": edge.id, "head": edge.head, "tail": edge.tail, "label": list(edge.label), "condition": condition}


def _graph_payload(graph: Graph) -> dict[str, Any]:
    return {
        "name": graph.name,
        "nodes": list(graph.nodes.values()),
        "edges": [_edge_payload(edge) for edge in graph.edges.values()],
    }


_CONDITION_DECODERS: dict[str, Any] = {}


def register_condition(kind: str, decoder: Any) -> None:
    """Let a condition with ``to_wire() -> {"kind": kind, ...}`` decode from the wire."""
    _CONDITION_DECODERS[kind] = decoder


def _decode_condition(payload: Any, edge_id: str) -> Any:
    if payload is None:
        return None
    kind = payload.get("kind") if isinstance(payload, dict) else None
    decoder = _CONDITION_DECODERS.get(kind)
    if decoder is None:
        raise CodecError(f"unknown edge condition kind {kind!r}", edge_id=edge_id)
    try:
        return decoder(payload)
    except CodecError as exc:
        if exc.edge_id is None:
            raise CodecError(exc.message, edge_id=edge_id) from exc
        raise


def _object_hook(obj: dict[str, Any]) -> Any:
    if _TUPLE_TAG in obj:
        return tuple(obj[_TUPLE_TAG])
    if _GRAPH_TAG in obj:
        payload = obj[_GRAPH_TAG]
        graph = Graph(payload["name"])
        for node in payload["nodes"]:
            graph.add_node(node)
        for edge in payload["edges"]:
            restored = Edge(
                id=edge["id"],
                head=edge["head"],
                tail=edge["tail"],
                label=edge["label"],
                condition=_decode_condition(edge["condition"], edge["id"]),
            )
            graph.edges[restored.id] = restored
            graph._out[restored.head].append(restored.id)
            graph._in[restored.tail].append(restored.id)
        return graph
    if _MODEL_TAG in obj:
        name = obj[_MODEL_TAG]
        if name == "Edge":
            data = obj["data"]
            return Edge(**{**data, "condition": _decode_condition(data["condition"], data["id"])})
        model = _MODELS.get(name)
        if model is None:
            raise CodecError(f"unknown model tag {name!r}")
        try:
            return model.model_validate(obj["data"])
        except ValidationError as exc:
            raise CodecError(f"invalid {name} payload: {exc}") from exc
    return obj


def encode(value: Any) -> bytes:
    """Encode ``value`` with the schema-version envelope."""
    try:
        return msgpack.packb(
            {"v": CODEC_SCHEMA_VERSION, "body": value}, default=_default, use_bin_type=True, strict_types=True
        )
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode value: {exc}") from exc


def decode(data: bytes) -> Any:
    """Decode bytes produced by ``encode``; a different schema version is refused."""
    try:
        envelope = msgpack.unpackb(data, object_hook=_object_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"cannot decode payload: {exc}") from exc
    if not isinstance(envelope, dict) or "v" not in envelope:
        raise CodecError("payload has no schema-version envelope")
    if envelope["v"] != CODEC_SCHEMA_VERSION:
        raise CodecError(
            f"payload schema version {envelope['v']} is not supported (expected {CODEC_SCHEMA_VERSION})"
        )
    return envelope["body"]
