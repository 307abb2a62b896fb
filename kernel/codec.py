"""The msgpack wire codec for protocol messages, checkpoints and graphs, with a schema version.

Owns the one encoding of kernel values: Operations, Edges, Graphs, the emission
contracts and lifecycle signals travel as msgpack extension types, each holding its
own msgpack payload, and so do tuples. An extension type is a kind of value that user
data cannot spell, so no mapping a model returned can ever be read back as a tuple, a
model or a graph (schema version 1 tagged plain maps, which could). User conditions and
callables do not belong here: they travel the Ray way, by cloudpickle. The run log's own
codec (below) holds them too, pickled, in blobs signed with a key the database never holds.
"""

from __future__ import annotations

import functools
import hmac
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack
from pydantic import BaseModel, ValidationError

from . import contracts, signals
from .errors import CodecError, RunLogIntegrityError
from .graph import Edge, Graph, Operation

__all__ = [
    "CODEC_SCHEMA_VERSION",
    "LOG_SCHEMA_VERSION",
    "SIGNED",
    "Pickled",
    "decode",
    "decode_logged",
    "decode_records",
    "encode",
    "encode_logged",
    "encode_records",
    "register_condition",
    "register_model",
]

CODEC_SCHEMA_VERSION = 2

# msgpack extension type codes, one per kind of value that is not plain data.
_EXT_TUPLE, _EXT_MODEL, _EXT_GRAPH, _EXT_EDGE = 1, 2, 3, 4
_EXT_CODES = frozenset({_EXT_TUPLE, _EXT_MODEL, _EXT_GRAPH, _EXT_EDGE})
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
    signals.NodeCancelled,
    signals.NodePaused,
    signals.NodeSpawned,
    signals.NodeEscalated,
):
    register_model(_model)


def _default(value: Any) -> Any:
    if isinstance(value, Graph):
        return msgpack.ExtType(_EXT_GRAPH, _pack(_graph_payload(value)))
    if isinstance(value, Edge):
        return msgpack.ExtType(_EXT_EDGE, _pack(_edge_payload(value)))
    if isinstance(value, BaseModel):
        name = type(value).__name__
        if _MODELS.get(name) is not type(value):
            raise CodecError(f"model {name} is not registered with the codec")
        return msgpack.ExtType(_EXT_MODEL, _pack([name, value.model_dump(mode="python")]))
    if isinstance(value, tuple):
        return msgpack.ExtType(_EXT_TUPLE, _pack(list(value)))
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


def _ext_hook(code: int, data: bytes) -> Any:
    if code not in _EXT_CODES:  # refused before its payload is read
        raise CodecError(f"unknown extension type {code}")
    payload = _unpack(data)
    if code == _EXT_TUPLE:
        return tuple(payload)
    if code == _EXT_MODEL:
        name, fields = payload
        model = _MODELS.get(name)
        if model is None:
            raise CodecError(f"unknown model tag {name!r}")
        try:
            return model.model_validate(fields)
        except ValidationError as exc:
            raise CodecError(f"invalid {name} payload: {exc}") from exc
    if code == _EXT_EDGE:
        return _edge_from(payload)
    graph = Graph(payload["name"])  # _EXT_GRAPH, the one code left
    for node in payload["nodes"]:
        graph.add_node(node)
    for fields in payload["edges"]:
        graph._attach(_edge_from(fields))
    return graph


def _edge_from(fields: dict[str, Any]) -> Edge:
    return Edge(**{**fields, "condition": _decode_condition(fields["condition"], fields["id"])})


def _pack(value: Any) -> bytes:
    # strict_types: otherwise msgpack silently packs tuples as lists, never asking _default.
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(value: Any) -> bytes:
    """Encode ``value`` with the schema-version envelope."""
    try:
        return _pack({"v": CODEC_SCHEMA_VERSION, "body": value})
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode value: {exc}") from exc


def decode(data: bytes) -> Any:
    """Decode bytes produced by ``encode``; a different schema version is refused."""
    try:
        envelope = _unpack(data)
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


# -- the durable run log -------------------------------------------------------------------
# One batch of run-log records (runlog.py) per message. Records and their plain values
# pack natively, in C: that is the whole per-node cost a durable run pays here. A value
# msgpack cannot hold (an operation's pydantic result, a restored Operation, any object)
# travels pickled in its own extension type, so it comes back as it was. (A tuple inside
# a plain result, which msgpack holds as an array, reads back as a list.)
#
# The log is not a way in (DESIGN.md): whoever can write the database must not be able to
# run code in the process that reads it. So a blob holding a pickled value is signed: it
# is ``SIGNED`` (a byte msgpack never uses, so no plain blob can pass for a signed one), an
# HMAC-SHA256 tag under a key kept outside the database, then the msgpack body. A reader
# checks the tag before it reads a byte of the body, and an unsigned blob with a pickled
# value in it is refused unread. A blob of plain values needs no key and costs nothing more.
LOG_SCHEMA_VERSION = 2
_EXT_PICKLED = 9
SIGNED = b"\xc1"
_TAG_BYTES = 32


class Pickled:
    """A value already pickled (``data``), recorded as the pickled value it is: the blob is signed,
    and a reader gets the value back, not these bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _log_default(dumps: Any, pickled: list) -> Any:
    def default(value: Any) -> Any:
        pickled.append(True)
        if type(value) is Pickled:
            return msgpack.ExtType(_EXT_PICKLED, value.data)
        try:
            return msgpack.ExtType(_EXT_PICKLED, dumps(value))
        except Exception as exc:  # an unpicklable value (it raises anything): the run cannot be made durable
            raise CodecError(f"cannot record a value of type {type(value).__name__}: {exc}") from exc

    return default


_PICKLE_DUMPS = functools.partial(pickle.dumps, protocol=5)


def _signed_ext(loads: Any) -> Any:
    def ext_hook(code: int, data: bytes) -> Any:
        if code != _EXT_PICKLED:
            raise CodecError(f"unknown run-log extension type {code}")
        return loads(data)

    return ext_hook


def _unsigned_ext(code: int, data: bytes) -> Any:
    if code == _EXT_PICKLED:  # refused before its bytes are read
        raise RunLogIntegrityError("a run-log row holds a pickled value but is not signed: it was not written by "
                                   "this runtime, and nothing of it was read")
    raise CodecError(f"unknown run-log extension type {code}")


def encode_logged(value: Any, *, dumps: Any = None, key: Callable[[], bytes] | None = None) -> bytes:
    """``value`` as the run log keeps it, with the log's schema version; signed if anything in it is pickled.

    ``dumps`` pickles what msgpack cannot hold (default ``pickle.dumps``; the runtime passes
    one that also holds classes defined in scripts and tests). ``key`` returns the run-log
    key, asked for only when a value had to be pickled; without one such a value is refused."""
    pickled: list = []
    try:
        body = msgpack.packb([LOG_SCHEMA_VERSION, value], default=_log_default(dumps or _PICKLE_DUMPS, pickled),
                             use_bin_type=True)
    except CodecError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode run-log records: {exc}") from exc
    if not pickled:
        return body
    if key is None:
        raise CodecError("a value that only pickle holds is recorded only signed, and no run-log key was given")
    return SIGNED + hmac.digest(key(), body, "sha256") + body


def decode_logged(data: bytes, *, key: Callable[[], bytes] | None = None, loads: Any = None) -> Any:
    """The value ``encode_logged`` wrote. A signed blob's tag is checked under ``key()`` before
    anything is read; a pickled value anywhere else is refused (``RunLogIntegrityError``)."""
    signed = data[:1] == SIGNED
    if signed:
        body = _authenticated(bytes(data), key)
        ext_hook = _signed_ext(loads or pickle.loads)
    else:
        body, ext_hook = data, _unsigned_ext
    try:
        version, value = msgpack.unpackb(body, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        if signed:  # signed by this runtime, yet unreadable: a bug, not a plant
            raise CodecError(f"cannot decode run-log records: {exc}") from exc
        # A bare pickle (an older opgraph's header, or a plant) lands here, unread.
        raise RunLogIntegrityError(f"a row where the run log expects one of its own is not a run-log row "
                                   f"({type(exc).__name__}); nothing of it was read") from None
    if version != LOG_SCHEMA_VERSION:
        raise CodecError(f"run-log schema version {version} is not supported (expected {LOG_SCHEMA_VERSION})")
    return value


def _authenticated(data: bytes, key: Callable[[], bytes] | None) -> bytes:
    """The body of a signed blob, once its tag is found right under ``key()``."""
    if key is None:
        raise RunLogIntegrityError("a signed run-log row, and no run-log key to check it with: nothing of it was read")
    tag, body = data[1:1 + _TAG_BYTES], data[1 + _TAG_BYTES:]
    if len(tag) != _TAG_BYTES or not hmac.compare_digest(tag, hmac.digest(key(), body, "sha256")):
        raise RunLogIntegrityError("a run-log row's signature does not match this machine's run-log key: it was "
                                   "changed, or written under another key; nothing of it was read")
    return body


def encode_records(batch: Sequence[Sequence[Any]], *, dumps: Any = None,
                   key: Callable[[], bytes] | None = None) -> bytes:
    """One batch of run-log records (``encode_logged``)."""
    return encode_logged(batch, dumps=dumps, key=key)


def decode_records(data: bytes, *, key: Callable[[], bytes] | None = None, loads: Any = None) -> list[list[Any]]:
    """The records ``encode_records`` wrote (``decode_logged``)."""
    return decode_logged(data, key=key, loads=loads)
