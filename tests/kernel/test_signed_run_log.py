"""The run log's codec is not a way in: a pickle is read only from a blob signed under the run-log key.

    plain records            no key needed, no signature, read back as they were
    a pickled value          the blob is signed (HMAC-SHA256), read back only under the same key
    planted, unsigned        a pickled value in an unsigned blob: refused unread, nothing runs
    forged or tampered       a wrong tag, a changed body, another key: refused unread, nothing runs
"""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest

from opgraph.kernel import (
    LOG_SCHEMA_VERSION,
    SIGNED,
    CodecError,
    Pickled,
    RunLogIntegrityError,
    decode_records,
    encode_records,
)


def key() -> bytes:
    return b"the key of this test's machine, 32+ chars"


def other_key() -> bytes:
    return b"another machine's key, also 32+ characters"


class Planted:
    """What an attacker writes into a row: unpickling it creates ``marker`` (a shell command would do worse)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_plain_records_need_no_key_and_carry_no_signature():
    batch = [["finished", 1.0, "n1", 1, "completed", {"text": "hi", "n": [1, 2]}, None, None]]
    data = encode_records(batch)
    assert data[:1] != SIGNED
    assert decode_records(data) == batch


def test_a_pickled_value_is_signed_and_reads_back_only_under_the_same_key():
    batch = [["values", {1, 2}, Pickled(pickle.dumps(complex(1, 2)))]]
    with pytest.raises(CodecError, match="no run-log key"):
        encode_records(batch)
    data = encode_records(batch, key=key)
    assert data[:1] == SIGNED
    assert decode_records(data, key=key) == [["values", {1, 2}, complex(1, 2)]]
    with pytest.raises(RunLogIntegrityError, match="does not match"):
        decode_records(data, key=other_key)
    with pytest.raises(RunLogIntegrityError, match="no run-log key"):
        decode_records(data)


def _planted_body(marker) -> bytes:
    evil = msgpack.ExtType(9, pickle.dumps(Planted(str(marker))))
    return msgpack.packb([LOG_SCHEMA_VERSION, [["finished", 1.0, "n1", 1, "completed", evil, None, None]]],
                         use_bin_type=True)


def test_a_pickle_planted_in_an_unsigned_row_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(RunLogIntegrityError, match="not signed"):
        decode_records(_planted_body(marker), key=key)
    assert not marker.exists()


def test_a_forged_or_tampered_signature_is_refused_before_anything_is_read(tmp_path):
    marker = tmp_path / "ran"
    body = _planted_body(marker)
    forged = SIGNED + bytes(32) + body
    with pytest.raises(RunLogIntegrityError, match="does not match"):
        decode_records(forged, key=key)
    genuine = encode_records([["values", Pickled(pickle.dumps(3))]], key=key)
    tampered = genuine[:33] + body  # a real tag on another body
    with pytest.raises(RunLogIntegrityError, match="does not match"):
        decode_records(tampered, key=key)
    truncated = SIGNED + genuine[1:10]
    with pytest.raises(RunLogIntegrityError):
        decode_records(truncated, key=key)
    assert not marker.exists()


def test_a_bare_pickle_where_a_row_belongs_is_refused_unread(tmp_path):
    """An older opgraph's header was a bare pickle: so is an attacker's simplest plant."""
    marker = tmp_path / "ran"
    with pytest.raises(RunLogIntegrityError, match="not a run-log row"):
        decode_records(pickle.dumps(Planted(str(marker))), key=key)
    assert not marker.exists()


def test_the_integrity_error_is_a_codec_error_and_pickles_with_its_run():
    error = RunLogIntegrityError("changed", run_id="r1")
    assert isinstance(error, CodecError)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.run_id, str(copy)) == (RunLogIntegrityError, "r1", "changed [run=r1]")
