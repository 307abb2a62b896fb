"""How the runtime encodes what it keeps: the kernel's run-log codec, pickling the Ray way.

Owns the one choice of pickler for values msgpack cannot hold: cloudpickle, as Ray uses
to ship them, so a value that could cross to a worker can also be recorded.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ray import cloudpickle

from opgraph.kernel import decode_records, encode_records

__all__ = ["decode", "encode"]

_DUMPS = functools.partial(cloudpickle.dumps, protocol=5)


def encode(batch: Sequence[Sequence[Any]]) -> bytes:
    return encode_records(batch, dumps=_DUMPS)


def decode(data: bytes) -> list[list[Any]]:
    return decode_records(data)
