"""Signing the run log an older opgraph wrote, on the operator's word (``opgraph store migrate --trust-existing``).

Owns the one place that reads an unsigned pickle from the database: rows written before
runtime schema 4, read only when the operator has said nobody else could have written
them. Each is written again as this opgraph writes it (headers without keys, pickles
signed); a row already in the new form is left as it is. A run whose header cannot be
carried over is ended with the reason, its header and records dropped.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
from ray import cloudpickle

from opgraph.kernel import LOG_SCHEMA_VERSION, SIGNED, CodecError, OpGraphError

from .backends import Connection
from .codec import encode
from .headers import encode_header

__all__ = ["sign_existing_rows"]

_LEGACY_LOG_VERSION = 1
_EXT_PICKLED = 9
_PICKLE_PROTOCOL_MARK = b"\x80"  # how a pickle of protocol 2 or later begins: an old header


def sign_existing_rows(connection: Connection) -> dict[str, int]:
    """Write every row of the older format again, signed, in the caller's transaction; how many of
    each kind (``headers``, ``batches``, ``envelopes``, ``messages``, ``unrecoverable`` runs)."""
    counts = {"headers": 0, "batches": 0, "envelopes": 0, "messages": 0, "unrecoverable": 0}
    for (run_id,) in connection.execute("SELECT run_id FROM runtime_run_headers").fetchall():
        (blob,) = connection.execute("SELECT header FROM runtime_run_headers WHERE run_id = ?", (run_id,)).fetchone()
        if bytes(blob[:1]) != _PICKLE_PROTOCOL_MARK:
            continue
        try:
            header = _header_again(bytes(blob), run_id)
        except (OpGraphError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError) as exc:
            _retire(connection, run_id, f"{type(exc).__name__}: {exc}")
            counts["unrecoverable"] += 1
            continue
        connection.execute("UPDATE runtime_run_headers SET header = ? WHERE run_id = ?", (header, run_id))
        counts["headers"] += 1
    for run_id, seq in connection.execute("SELECT run_id, seq FROM runtime_run_records").fetchall():
        (blob,) = connection.execute("SELECT batch FROM runtime_run_records WHERE run_id = ? AND seq = ?",
                                     (run_id, seq)).fetchone()
        again = _signed_again(bytes(blob))
        if again is not None:
            connection.execute("UPDATE runtime_run_records SET batch = ? WHERE run_id = ? AND seq = ?",
                               (again, run_id, seq))
            counts["batches"] += 1
    for (run_id,) in connection.execute("SELECT run_id FROM runtime_runs WHERE envelope IS NOT NULL").fetchall():
        (blob,) = connection.execute("SELECT envelope FROM runtime_runs WHERE run_id = ?", (run_id,)).fetchone()
        again = _signed_again(bytes(blob))
        if again is not None:
            connection.execute("UPDATE runtime_runs SET envelope = ? WHERE run_id = ?", (again, run_id))
            counts["envelopes"] += 1
    for key in connection.execute("SELECT owner, shard, record_id, seq FROM runtime_branch_messages").fetchall():
        (blob,) = connection.execute("SELECT message FROM runtime_branch_messages WHERE owner = ? AND shard = ? "
                                     "AND record_id = ? AND seq = ?", tuple(key)).fetchone()
        again = _signed_again(bytes(blob))
        if again is not None:
            connection.execute("UPDATE runtime_branch_messages SET message = ? WHERE owner = ? AND shard = ? "
                               "AND record_id = ? AND seq = ?", (again, *key))
            counts["messages"] += 1
    return counts


def _header_again(blob: bytes, run_id: str) -> bytes:
    """An old header (a cloudpickle of graph, options, started) as this opgraph writes one."""
    from ..providers.http import HTTPChatProvider

    graph, options, started = cloudpickle.loads(blob)
    for provider in options.resources.providers.values():
        if isinstance(provider, HTTPChatProvider) and not hasattr(provider, "settings"):
            provider.settings = _settings_of(provider)  # an older provider kept them in its client only
    return encode_header(graph, options, started, run_id=run_id)


def _settings_of(provider: Any) -> dict[str, Any]:
    client = provider._http
    return {"timeout": client.timeout, "max_tokens": provider.max_tokens, "max_retries": client.retry.max_retries,
            "backoff": client.retry.backoff, "max_delay": client.retry.max_delay, "concurrency": client.concurrency,
            "adaptive": client.adaptive, "requests_per_minute": client.budget.requests_per_minute,
            "tokens_per_minute": client.budget.tokens_per_minute,
            "rate_limit_patience": client.retry.rate_limit_patience}


def _signed_again(blob: bytes) -> bytes | None:
    """An old run-log blob (schema 1: pickles unsigned) encoded as now; None for a blob already new."""
    if blob[:1] == SIGNED:
        return None
    try:
        version, _ = msgpack.unpackb(blob, ext_hook=_unread, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise CodecError(f"a run-log row is not one any opgraph wrote: {exc}") from exc
    if version == LOG_SCHEMA_VERSION:
        return None
    if version != _LEGACY_LOG_VERSION:
        raise CodecError(f"a run-log row has schema version {version}, which this opgraph cannot carry over")
    _, value = msgpack.unpackb(blob, ext_hook=_trusted, raw=False, strict_map_key=False)
    return encode(value)


def _unread(code: int, data: bytes) -> None:
    return None  # the version is all this first look wants: nothing is unpickled


def _trusted(code: int, data: bytes) -> Any:
    if code != _EXT_PICKLED:
        raise CodecError(f"unknown run-log extension type {code}")
    return cloudpickle.loads(data)  # on the operator's word: --trust-existing


def _retire(connection: Connection, run_id: str, reason: str) -> None:
    """A run whose header could not be carried over: it ends with the reason, and nothing of its log
    stays to be read (its envelope, if it has one, is carried over on its own)."""
    connection.execute("DELETE FROM runtime_run_headers WHERE run_id = ?", (run_id,))
    connection.execute("DELETE FROM runtime_run_records WHERE run_id = ?", (run_id,))
    connection.execute("UPDATE runtime_runs SET status = CASE WHEN status = 'live' THEN 'error' ELSE status END, "
                       "error = COALESCE(error, ?) WHERE run_id = ?",
                       (f"not carried over to signed run log: {reason}", run_id))
