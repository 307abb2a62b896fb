"""How the runtime encodes what it keeps: the kernel's run-log codec, pickling the Ray way, signed.

Owns the one choice of pickler for values msgpack cannot hold: cloudpickle's rules, as Ray
uses to ship them, so a value that could cross to a worker can also be recorded; and the
key a blob with a pickled value is signed with and checked against (``secrets.runlog_key``).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from ray import cloudpickle

from opgraph.kernel import decode_records, encode_records

from ..secrets import runlog_key, runlog_key_reader

__all__ = ["decode", "encode", "pickle_value"]


def pickle_value(value: Any) -> bytes:
    """``value`` pickled by the standard pickler where that gives what cloudpickle would give.

    cloudpickle runs Python code for every object it meets (is its class importable, is it
    registered to travel by value), where the standard pickler runs in C: a spawned node's
    Operation and its request cost a 1,000-spawn run 46 ms of its admission, on the path
    its children wait on (issue #18). Both pickle an importable class or function by
    reference; what only cloudpickle can hold (a lambda, a class defined in a function or
    in a script's ``__main__``, which the standard pickler cannot find by name in this
    process) makes the standard one raise, and cloudpickle takes it. So does anything from
    a module registered to travel by value (``cloudpickle.register_pickle_by_value``): a
    reference to it names its module in the pickle, which is searched for each such name.
    """
    try:
        data = pickle.dumps(value, protocol=5)
    except Exception:  # noqa: BLE001 - anything the standard pickler refuses, cloudpickle may hold
        return cloudpickle.dumps(value, protocol=5)
    by_value = cloudpickle.list_registry_pickle_by_value()
    if by_value and any(name.encode() in data for name in by_value):
        return cloudpickle.dumps(value, protocol=5)  # named (or a string equal to the name): by value
    return data


def encode(batch: Sequence[Sequence[Any]]) -> bytes:
    """``batch`` as the run log keeps it: signed with the run-log key if anything in it is pickled."""
    return encode_records(batch, dumps=pickle_value, key=runlog_key)


def decode(data: bytes) -> list[list[Any]]:
    """What ``encode`` wrote; a pickled value is read only from a blob whose signature holds
    (``RunLogIntegrityError`` otherwise, with nothing of the blob read)."""
    return decode_records(data, key=runlog_key_reader, loads=cloudpickle.loads)
