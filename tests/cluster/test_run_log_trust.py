"""Reading runs never runs a planted pickle, and an older database is refused until the operator trusts it.

    GET /api/runs/ID          a detached run whose logged envelope is a planted pickle: a 503
                              naming the run and the integrity check; nothing ran
    an older database         (runtime schema 3: a header pickled with a provider's key, batches,
                              an envelope and a message with unsigned pickles) is refused with
                              the way out; `opgraph store migrate --trust-existing` signs it, the
                              key and the password leave the file, and every run reads back
"""

from __future__ import annotations

import os
import pickle
import time
import uuid

import msgpack
from api_server import serve
from ray import cloudpickle
from workflow_specs import draft_spec

from opgraph.actors import RunOptions, RunResources
from opgraph.actors.persistence import Database, RunLog, database_path
from opgraph.actors.persistence.backends import describe, is_postgres
from opgraph.actors.persistence.branchlog import load_shard
from opgraph.actors.persistence.headers import read_header
from opgraph.actors.providers import OpenAICompatibleProvider, ScriptedProvider
from opgraph.cluster.cli import main as cli_main
from opgraph.cluster.http import create_app
from opgraph.cluster.lanes import FIXED_WORKFLOW, lane_adapter, open_store, recorded_recovery
from opgraph.kernel import LOG_SCHEMA_VERSION, OperationGraphBuilder


class Planted:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_reading_a_detached_run_whose_envelope_is_planted_is_a_503_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    store = open_store(tmp_path / "runs.db")
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    pinned = store.create_workflow(f"planted-{uuid.uuid4().hex[:6]}", draft_spec("Draft a note."))
    prepared = adapter.prepare_now(adapter.invocation(pinned.name))
    run_id = prepared.run_id
    # Recorded as a detached run nobody follows (no owner process): reading it settles it from the run log.
    store.create_run(run_id, session_id="elsewhere", provenance=prepared.provenance.to_payload(), inputs={},
                     workflow=prepared.workflow, status="running", capabilities=prepared.capabilities.as_metadata(),
                     recovery=recorded_recovery(prepared), owned=False)
    evil = msgpack.ExtType(9, pickle.dumps(Planted(str(marker))))
    RunLog(database_path()).database.transaction([
        ("INSERT INTO runtime_runs (run_id, executor, status, started, finished, envelope) VALUES (?, ?, ?, ?, ?, ?)",
         (run_id, "opgraph-executor-gone", "completed", time.time(), time.time(),
          msgpack.packb([LOG_SCHEMA_VERSION, [[evil]]], use_bin_type=True)))])

    served = serve(create_app(store, session_factory=lambda: None, start_runtime=False))
    try:
        with served.client() as http:
            reply = http.get(f"/api/runs/{run_id}")
    finally:
        served.stop()
        store.close()
    assert reply.status_code == 503, reply.text
    body = reply.json()
    assert body["run_id"] == run_id and "not signed" in body["error"] and run_id in body["error"]
    assert not marker.exists()


# -- a database an older opgraph wrote ----------------------------------------------------
OLD_KEY, OLD_PASSWORD = "sk-OLDSENTINEL-0123456789", "OLDSENTINELPW"


def _legacy(value) -> bytes:
    """A run-log blob as runtime schema 3 wrote it: schema 1 of the log codec, pickles unsigned."""
    def default(item):
        return msgpack.ExtType(9, cloudpickle.dumps(item))
    return msgpack.packb([1, value], default=default, use_bin_type=True)


def _older_database(path) -> None:
    """The tables as they are, at runtime schema 3, holding what that opgraph wrote."""
    database = Database(path)
    provider = OpenAICompatibleProvider(base_url=f"http://operator:{OLD_PASSWORD}@127.0.0.1:9/v1", api_key=OLD_KEY,
                                        timeout=42.0)
    del provider.settings  # an older provider kept its settings in its client only
    builder = OperationGraphBuilder("old")
    first = builder.add_operation("chat", depends_on=[], instruction="first")
    builder.add_operation("chat", depends_on=[first], instruction="second")
    options = RunOptions(durable=True, resources=RunResources(providers={
        "openai": provider, "scripted": ScriptedProvider(["hello"])}))
    header = cloudpickle.dumps((cloudpickle.dumps(builder.get_graph()), options, 5.0))
    assert OLD_KEY.encode() in header  # what the issue found: the key, in plain bytes
    batch = _legacy([["finished", 6.0, first, 1, "completed", complex(1, 2), None, None]])
    envelope = _legacy([[{"status": "completed", "run_id": "old-finished"}]])
    database.transaction([
        ("INSERT INTO runtime_runs (run_id, executor, status, started) VALUES ('old-live', 'x', 'live', 5.0)", ()),
        ("INSERT INTO runtime_run_headers VALUES ('old-live', ?)", (header,)),
        ("INSERT INTO runtime_run_records VALUES ('old-live', 1, ?)", (batch,)),
        ("INSERT INTO runtime_runs (run_id, executor, status, started, finished, envelope) "
         "VALUES ('old-finished', 'x', 'completed', 1.0, 2.0, ?)", (envelope,)),
        ("INSERT INTO runtime_branch_records VALUES ('', 0, 1, NULL, 0)", ()),
        ("INSERT INTO runtime_branch_heads (owner, branch_id, shard, record_id) VALUES ('', 'b1', 0, 1)", ()),
        ("INSERT INTO runtime_branch_messages VALUES ('', 0, 1, 0, ?)",
         (_legacy([[{"role": "user", "content": "hi"}]]),)),
        ("UPDATE opgraph_runtime_schema SET version = 3", ()),
    ])
    database.close()


def _all_bytes(folder) -> bytes:
    return b"".join(path.read_bytes() for path in folder.rglob("*") if path.is_file())


def test_an_older_database_is_refused_until_trusted_then_signed_without_its_keys(database_target, capsys):
    """On SQLite and on PostgreSQL; a SQLite file is also searched, byte by byte, for the old key."""
    path = database_target
    _older_database(path)

    try:
        RunLog(path)
    except Exception as exc:  # noqa: BLE001 - asserted on below
        refusal = str(exc)
    else:
        raise AssertionError("an older run log was opened without the operator's word")
    assert "older opgraph" in refusal and f"opgraph store migrate --trust-existing --store {describe(path)}" in refusal
    assert cli_main(["store", "migrate", "--store", str(path)]) == 2
    assert "--trust-existing" in capsys.readouterr().err

    assert cli_main(["store", "migrate", "--trust-existing", "--store", str(path)]) == 0
    printed = capsys.readouterr().out
    assert '"headers": 1' in printed and '"batches": 1' in printed and '"envelopes": 1' in printed
    assert '"messages": 1' in printed

    if not is_postgres(path):  # (PostgreSQL keeps old row versions until its vacuum: not searched)
        stored = _all_bytes(path.parent)
        assert OLD_KEY.encode() not in stored and OLD_PASSWORD.encode() not in stored
    log = RunLog(path)
    logged = log.load("old-live")
    assert logged.batches[0][0][5] == complex(1, 2)
    header = read_header(logged.header)
    described = header.fields["providers"]["described"]["openai"]
    assert described["base_url"] == "http://operator:***@127.0.0.1:9/v1" and described["settings"]["timeout"] == 42.0
    assert list(header.fields["providers"]["own"]) == ["scripted"] and len(header.graph.nodes) == 2
    assert log.envelope("old-finished") == {"status": "completed", "run_id": "old-finished"}
    assert load_shard(log.database, 0, "").messages == {1: [{"role": "user", "content": "hi"}]}
    assert cli_main(["store", "migrate", "--store", str(path)]) == 0  # current now: nothing more to sign
