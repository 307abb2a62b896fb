"""The database is not a way in: a pickle planted in any run-log row is refused unread, with the run it names.

    planted as a header        RunLog.load gives the row back, reading it (recovery, a replay) refuses it
    planted in a batch         RunLog.load refuses it, naming the run
    planted as an envelope     RunLog.envelope refuses it, naming the run
    planted as a message       a branch store's shard load, and an adoption, refuse it
    executor recovery          resume_run of a planted run: a typed recovery error, the run ended "error"

Every plant is a pickle whose unpickling would create a marker file; no test finds the marker.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import time

import msgpack
import pytest

from opgraph.actors import RunControl, RunOptions
from opgraph.actors.persistence import Database, RunLog, database_path
from opgraph.actors.persistence.branchlog import load_shard, read_branch
from opgraph.actors.persistence.headers import encode_header, read_header
from opgraph.kernel import LOG_SCHEMA_VERSION, SIGNED, ExecutionError, OperationGraphBuilder, RunLogIntegrityError


class Planted:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def planted_batch(marker) -> bytes:
    """A run-log blob as an attacker writes it: the current schema, a pickled value, no signature."""
    evil = msgpack.ExtType(9, pickle.dumps(Planted(str(marker))))
    return msgpack.packb([LOG_SCHEMA_VERSION, [["finished", 1.0, "n1", 1, "completed", evil, None, None]]],
                         use_bin_type=True)


def forged(marker) -> bytes:
    """The same, dressed as signed: a tag made up without the key."""
    return SIGNED + os.urandom(32) + planted_batch(marker)


def plant_run(log: RunLog, run_id: str, *, header: bytes, batch: bytes | None = None,
              envelope: bytes | None = None, status: str = "live") -> None:
    log.database.transaction([
        ("INSERT INTO runtime_runs (run_id, executor, status, started, envelope) VALUES (?, ?, ?, ?, ?)",
         (run_id, "opgraph-executor-nobody", status, time.time(), envelope)),
        ("INSERT INTO runtime_run_headers (run_id, header) VALUES (?, ?)", (run_id, header)),
    ])
    if batch is not None:
        log.database.transaction([("INSERT INTO runtime_run_records (run_id, seq, batch) VALUES (?, 1, ?)",
                                   (run_id, batch))])


def genuine_header() -> bytes:
    """A header this runtime wrote (signed under this machine's key), for a graph of one noop."""
    builder = OperationGraphBuilder("genuine")
    builder.add_operation("noop", depends_on=[])
    return encode_header(builder.get_graph(), RunOptions(durable=True), time.time())


def test_a_planted_header_batch_or_envelope_is_refused_naming_its_run(tmp_path):
    marker = tmp_path / "ran"
    log = RunLog(tmp_path / "log.db")
    plant_run(log, "bad-header", header=pickle.dumps(Planted(str(marker))))
    plant_run(log, "forged-header", header=forged(marker))
    plant_run(log, "bad-batch", header=genuine_header(), batch=planted_batch(marker))
    plant_run(log, "forged-batch", header=genuine_header(), batch=forged(marker))
    plant_run(log, "bad-envelope", header=genuine_header(), envelope=planted_batch(marker), status="completed")

    for run_id in ("bad-header", "forged-header"):
        logged = log.load(run_id)  # the header comes back as bytes: only reading it would decode it
        with pytest.raises(RunLogIntegrityError):
            read_header(logged.header)
    for run_id in ("bad-batch", "forged-batch", "bad-envelope"):
        with pytest.raises(RunLogIntegrityError) as caught:
            log.load(run_id)
        assert caught.value.run_id == run_id and run_id in str(caught.value)
    with pytest.raises(RunLogIntegrityError, match="bad-envelope"):
        log.envelope("bad-envelope")
    assert read_header(genuine_header()).graph.name == "genuine"
    assert not marker.exists()


def test_a_planted_branch_message_is_refused_by_a_shard_load_and_an_adoption(tmp_path):
    marker = tmp_path / "ran"
    database = Database(tmp_path / "branches.db")
    database.transaction([
        ("INSERT INTO runtime_branch_records VALUES ('owner-a', 0, 1, NULL, 0)", ()),
        ("INSERT INTO runtime_branch_heads (owner, branch_id, shard, record_id) VALUES ('owner-a', 'b1', 0, 1)", ()),
        ("INSERT INTO runtime_branch_messages VALUES ('owner-a', 0, 1, 0, ?)", (planted_batch(marker),)),
    ])
    with pytest.raises(RunLogIntegrityError, match="shard 0"):
        load_shard(database, 0, "owner-a")
    with pytest.raises(RunLogIntegrityError) as caught:
        read_branch(database, "b1", besides="owner-b")
    assert caught.value.branch_id == "b1"
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["header", "batch"])
def test_executor_recovery_of_a_planted_run_is_a_typed_error_and_runs_nothing(session, tmp_path, plant):
    """An orphan planted in the runtime's own run log and resumed: the executor refuses to rebuild it,
    says why, and ends it "error"; the marker is never made."""
    marker = tmp_path / "ran"
    run_id = f"planted-{plant}"
    log = RunLog(database_path())
    if plant == "header":
        plant_run(log, run_id, header=forged(marker))
    else:
        plant_run(log, run_id, header=genuine_header(), batch=planted_batch(marker))

    with pytest.raises(ExecutionError, match="RunLogIntegrityError"):
        asyncio.run(asyncio.wait_for(RunControl.resume_from_log(run_id, session), 60))

    entry = log.entry(run_id)
    assert entry.status == "error" and "RunLogIntegrityError" in entry.error
    assert not marker.exists()
