"""The lane seam (ADR-0068 D2-D4): the registry, per-invocation capabilities, controls, provenance, the store.

A tiny lane that exists only in this module, ``test_echo`` (``root -> a, b``: each node
echoes its instruction), is registered in the lane registry for the tests that need a
second lane and unregistered after; its capabilities depend on the invocation
(``reactive_mode="off"`` gives no reactive growth, as D3's example of ``--reactive off``).
Pure tests use SQLite files under ``tmp_path``; the ``session`` tests run on the shared
Ray instance with real actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import sqlite3
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from api_server import free_port, serve
from workflow_specs import draft_spec

from opgraph.cluster.cli import main as cli_main
from opgraph.cluster.http import create_app
from opgraph.cluster.lanes import (
    FIXED_WORKFLOW,
    LaneAdapter,
    LaneCapabilities,
    LaneCapabilityError,
    LaneEntry,
    LaneInvocation,
    LaneRunControl,
    PreparedLaneRun,
    ProvenanceError,
    ReactiveSettings,
    RunHooks,
    RunProvenance,
    SourceRef,
    UnknownLaneError,
    check_control,
    lane_adapter,
    lane_entry,
    lane_kinds,
    open_store,
    recorded_recovery,
    register_lane,
    run_prepared,
    submit_prepared,
    unregister_lane,
    validate_provenance,
)
from opgraph.cluster.store import SCHEMA_VERSION, RunStore, WorkflowStoreError, migrate
from opgraph.kernel import OperationGraphBuilder

ECHO = "test_echo"
RUN_DEADLINE = 30.0  # seconds for a run on the shared runtime to end


# -- a lane of this module's own ----------------------------------------------------------------
async def echo(branch: Any, instruction: str = "", seconds: float = 0.0, **parameters: Any) -> str:
    await asyncio.sleep(seconds)
    return instruction.upper()


class EchoLane:
    """``root -> a, b``: every node echoes its instruction. No planner, no store definitions."""

    lane = ECHO

    def __init__(self, store: RunStore | None = None) -> None:
        self.store = store

    def capabilities(self, invocation: LaneInvocation | None = None) -> LaneCapabilities:
        growth = invocation is not None and invocation.reactive_mode != "off"
        return LaneCapabilities(planner=False, reactive_growth=growth, live_pause=True, live_message=False,
                                checkpoint_resume=False, leased_admission=False, cancel=True)

    def check_provenance(self, provenance: RunProvenance) -> None:
        if provenance.source.kind != "prompt":
            raise ProvenanceError(f"an {ECHO} run's source is a prompt, not a {provenance.source.kind}")

    def invocation(self, target: str, **options: Any) -> LaneInvocation:
        return LaneInvocation(lane=ECHO, source_ref=target, source_kind="prompt", source_content_hash=None,
                              **options)  # type: ignore[arg-type]

    async def prepare(self, invocation: LaneInvocation) -> PreparedLaneRun:
        builder = OperationGraphBuilder()
        seconds = float(invocation.inputs.get("seconds", 0.0))
        root = builder.add_operation("echo", instruction=invocation.source_ref, seconds=seconds)
        branches = [builder.add_operation("echo", depends_on=[root], instruction=f"{invocation.source_ref} {part}",
                                          seconds=seconds) for part in "ab"]
        graph = builder.get_graph()
        labels = dict(zip([root, *branches], ["root", "a", "b"], strict=True))
        provenance = RunProvenance(lane=ECHO, source=SourceRef(kind="prompt", ref=invocation.source_ref),
                                   reactive=ReactiveSettings(enabled=invocation.reactive_mode != "off"))
        run_id = invocation.run_id or f"echo-{uuid.uuid4()}"
        return PreparedLaneRun(graph=graph, context={}, invocation=dataclasses.replace(invocation, run_id=run_id),
                               recovery={"labels": labels}, run_id=run_id, provenance=provenance,
                               capabilities=self.capabilities(invocation), labels=labels, label=invocation.source_ref)

    async def execute(self, prepared: PreparedLaneRun, *, session: Any, hooks: RunHooks | None = None) -> Any:
        recovery = {"labels": dict(prepared.labels)}
        return await run_prepared(prepared, session=session, store=self.store, hooks=hooks,
                                  present=lambda envelope: self.present(envelope, recovery))

    async def submit(self, prepared: PreparedLaneRun, *, session: Any) -> str:
        return await submit_prepared(prepared, session=session, store=self.store)

    def present(self, envelope: Mapping[str, Any], recovery: Mapping[str, Any]) -> Any:
        labels = recovery["labels"]
        outputs = {labels[node]: result for node, result in envelope["operation_results"].items()}
        statuses = {labels[node]: status for node, status in envelope["operation_statuses"].items()}
        return envelope["status"], outputs, {}, statuses

    def check_replay(self, record: Any) -> None:
        """A prompt is its own source: nothing can have changed."""


ECHO_ENTRY = LaneEntry(kind=ECHO, factory=EchoLane, capabilities=EchoLane().capabilities())


@pytest.fixture
def echo_lane():
    register_lane(ECHO_ENTRY)
    yield ECHO
    unregister_lane(ECHO)


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "opgraph.db") as opened:
        yield opened


def echo_record(store: RunStore, run_id: str, *, reactive_mode: str = "off", status: str = "running") -> Any:
    """An echo-lane run row, as its adapter would write it, without running it."""
    adapter = EchoLane(store)
    invocation = adapter.invocation("hello", reactive_mode=reactive_mode, run_id=run_id)
    prepared = asyncio.run(adapter.prepare(invocation))
    return store.create_run(run_id, session_id="s", provenance=prepared.provenance.to_payload(), inputs={},
                            capabilities=prepared.capabilities.as_metadata(), recovery=recorded_recovery(prepared),
                            status=status)


SPEC = draft_spec("Draft a note.")


# -- the registry -------------------------------------------------------------------------------
def test_the_registry_resolves_the_fixed_lane_by_kind(store):
    assert FIXED_WORKFLOW in lane_kinds()
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    assert isinstance(adapter, LaneAdapter) and adapter.lane == FIXED_WORKFLOW
    entry = lane_entry(FIXED_WORKFLOW)
    assert entry.capabilities.as_metadata() == adapter.capabilities().as_metadata()
    assert entry.examples["support-triage"].is_file()
    assert entry.definition_rules is not None  # the fixed lane keeps its definitions in the store


def test_an_unknown_lane_kind_is_a_typed_error_that_names_the_known_ones():
    with pytest.raises(UnknownLaneError) as caught:
        lane_adapter("no_such_lane")
    assert caught.value.lane == "no_such_lane" and FIXED_WORKFLOW in caught.value.known
    assert {"planned_reactive_flow", "reactive_play"} <= set(caught.value.known)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert (copy.lane, copy.known) == (caught.value.lane, caught.value.known)
    with pytest.raises(LaneCapabilityError, match="no declared capability matrix"):
        check_control("no-such-lane", "cancel")


def test_a_registered_lane_is_resolved_and_unregistered(echo_lane):
    assert ECHO in lane_kinds() and isinstance(lane_adapter(ECHO), EchoLane)
    with pytest.raises(ValueError, match="already registered"):
        register_lane(ECHO_ENTRY)
    unregister_lane(ECHO)
    with pytest.raises(UnknownLaneError):
        lane_adapter(ECHO)
    register_lane(ECHO_ENTRY)  # the fixture unregisters it again


# -- capabilities (D3) ----------------------------------------------------------------------------
class RecordingControl:
    """Stands in for the executor's RunControl: notes each control that reaches it."""

    def __init__(self) -> None:
        self.received: list[str] = []

    async def pause(self) -> bool:
        self.received.append("pause")
        return True

    async def inject(self, *args: Any, **kwargs: Any) -> bool:
        self.received.append("inject")
        return True

    async def send_operator_message(self, text: str) -> bool:
        self.received.append("message")
        return True


def test_capabilities_are_those_of_the_invocation_not_only_the_lane(echo_lane):
    adapter = lane_adapter(ECHO)
    off = asyncio.run(adapter.prepare(adapter.invocation("hi", reactive_mode="off")))
    grows = asyncio.run(adapter.prepare(adapter.invocation("hi", reactive_mode="all")))
    assert (off.capabilities.reactive_growth, grows.capabilities.reactive_growth) == (False, True)
    assert off.provenance.reactive.enabled is False and grows.provenance.reactive.enabled is True

    async def control(prepared: PreparedLaneRun) -> tuple[list[str], list[str]]:
        executor = RecordingControl()
        handle = LaneRunControl(executor, prepared.capabilities, lane=ECHO, run_id=prepared.run_id)
        refused = []
        for name, call in (("pause", handle.pause()), ("inject", handle.inject("node")),
                           ("message", handle.send_operator_message("hurry"))):
            try:
                await call
            except LaneCapabilityError as exc:
                assert exc.run_id == prepared.run_id and exc.capabilities == prepared.capabilities.as_metadata()
                refused.append(name)
        return executor.received, refused

    assert asyncio.run(control(off)) == (["pause"], ["inject", "message"])  # never reached the executor
    assert asyncio.run(control(grows)) == (["pause", "inject"], ["message"])


# -- provenance (D4) and the store ----------------------------------------------------------------
def test_provenance_is_checked_by_the_shared_rules_then_by_its_own_lane(echo_lane):
    payload = RunProvenance(lane=ECHO, source=SourceRef(kind="prompt", ref="hi")).to_payload()
    assert validate_provenance(payload).lane == ECHO
    with pytest.raises(ProvenanceError, match="source is a prompt"):
        validate_provenance({**payload, "source": {"kind": "workflow_file", "ref": "x.json"}})
    with pytest.raises(ProvenanceError, match="64 hex"):
        validate_provenance({**payload, "source": {"kind": "prompt", "ref": "hi", "content_hash": "sha256:x"}})
    with pytest.raises(ProvenanceError, match="a new planned run is planned by the planner"):
        validate_provenance({**payload, "lane": "planned_reactive_flow"})
    with pytest.raises(ProvenanceError, match="no lane 'no_such_lane'"):
        validate_provenance({**payload, "lane": "no_such_lane"})


def test_the_store_records_a_run_of_another_lane(echo_lane, store):
    record = echo_record(store, "echo-1", reactive_mode="all")
    assert (record.lane, record.source_kind, record.source_ref, record.content_hash) == (ECHO, "prompt", "hello", None)
    assert (record.workflow_id, record.version) == (None, None)
    assert record.capabilities["reactive_growth"] is True and record.capabilities["live_message"] is False
    assert set(record.recovery) == {"labels"} and sorted(record.recovery["labels"].values()) == ["a", "b", "root"]
    store.record_progress("echo-1", signals=[{"node_id": "n", "spec_node_id": "root", "kind": "completed"}],
                          nodes=[{"node_id": "n", "spec_node_id": "root", "status": "completed", "result": "HI"}])
    assert store.finish_run("echo-1", "completed", outputs={"root": "HI"})
    finished = store.get_run("echo-1")
    assert (finished.status, finished.outputs) == ("completed", {"root": "HI"})
    assert [n["result"] for n in store.run_nodes("echo-1")] == ["HI"]
    assert [r.run_id for r in store.list_runs(lane=ECHO)] == ["echo-1"]
    assert store.list_runs(lane=FIXED_WORKFLOW) == []


def test_the_store_checks_the_shared_shape_only(store):
    with pytest.raises(ProvenanceError, match="lane: a lane name is needed"):
        store.create_run("x", session_id="s", provenance={"source": {"kind": "prompt", "ref": "r"}}, inputs={})
    with pytest.raises(ProvenanceError, match="version"):
        store.create_run("x", session_id="s", inputs={},
                         provenance={"lane": "any", "source": {"kind": "prompt", "ref": "r", "version": 0}})
    assert store.list_runs() == []


def test_a_store_without_definition_rules_reads_definitions_but_never_writes_one(tmp_path):
    path = tmp_path / "opgraph.db"
    with open_store(path) as ruled:
        ruled.create_workflow("flow", SPEC)
    with RunStore(path) as bare:
        assert bare.resolve("flow").spec == SPEC
        with pytest.raises(WorkflowStoreError, match="without definition rules"):
            bare.create_workflow("other", SPEC)
        assert [w.name for w in bare.list_workflows()] == ["flow"]


def test_a_version_5_store_opens_with_its_runs_kept_and_takes_any_lane(echo_lane, tmp_path):
    path = tmp_path / "v5.db"
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        assert migrate(connection, target=5) == 5
        connection.execute("INSERT INTO runs (run_id, session_id, lane, content_hash, source_kind, source_ref,"
                           " provenance, inputs, status, created_at) VALUES ('old', 's', 'fixed_workflow', ?,"
                           " 'workflow_file', '/f.json', '{}', '{}', 'completed', 1.0)", ("sha256:" + "a" * 64,))
        connection.execute("INSERT INTO run_signals VALUES ('old', 1, 'n', 'draft', 'completed', 0.1, 2.0)")
    finally:
        connection.close()
    with open_store(path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        old = store.get_run("old")
        assert (old.status, old.source_ref, old.capabilities["cancel"], old.capabilities["live_pause"]) == (
            "completed", "/f.json", True, False)
        assert [s["kind"] for s in store.run_signals("old")] == ["completed"]  # its references still resolve
        assert echo_record(store, "new").content_hash is None
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        check.close()


# -- runs on the shared runtime ---------------------------------------------------------------
@pytest.mark.ray
def test_the_fixed_lane_persists_its_provenance_and_capabilities(session, store):
    pinned = store.create_workflow("notes", SPEC)
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    prepared = asyncio.run(adapter.prepare(adapter.invocation("notes", inputs={"topic": "lanes"})))
    assert (prepared.invocation.source_content_hash, prepared.invocation.source_version) == (pinned.content_hash, 1)
    result = asyncio.run(adapter.execute(prepared, session=session))
    assert result.status == "completed" and result.lane == FIXED_WORKFLOW and set(result.outputs) == {"draft"}
    record = store.get_run(result.run_id)
    assert record.provenance == {
        "lane": FIXED_WORKFLOW,
        "source": {"kind": "workflow_def", "ref": "notes", "version": 1, "content_hash": pinned.content_hash},
        "planner": {"used": False},
        "reactive": {"enabled": False, "max_ops": 0},
        "admission": {"task_id": None, "lease_attempt": None},
    }
    assert record.capabilities == adapter.capabilities().as_metadata() == result.to_dict()["lane_capabilities"]
    assert set(record.recovery["labels"].values()) == {"draft"} and record.recovery["workflow_id"] == pinned.workflow_id
    assert record.recovery["declared_outputs"] == ["draft"]


@pytest.mark.ray
def test_another_lane_runs_through_the_registry_and_is_recorded_with_its_controls(echo_lane, session, store):
    session.register_operation("echo", echo)
    adapter = lane_adapter(ECHO, store)
    prepared = asyncio.run(adapter.prepare(adapter.invocation("ping", inputs={"seconds": 0.3}, reactive_mode="off")))

    async def run() -> tuple[Any, list[str]]:
        control: dict[str, Any] = {}
        task = asyncio.ensure_future(adapter.execute(prepared, session=session, hooks=RunHooks(control=control)))
        deadline = time.monotonic() + RUN_DEADLINE
        while "control" not in control:
            assert time.monotonic() < deadline and not task.done(), "the run never published its control"
            await asyncio.sleep(0.01)
        handle, refused = control["control"], []
        for request in (lambda: handle.send_operator_message("hurry"), lambda: handle.inject("x")):
            try:
                await request()
            except LaneCapabilityError as exc:
                refused.append(exc.request_kind)
        assert await handle.pause() is True and (await handle.status())["paused"] is True
        assert await handle.resume() is True
        return await asyncio.wait_for(task, RUN_DEADLINE), refused

    result, refused = asyncio.run(run())
    assert refused == ["message", "spawn"]
    assert result.status == "completed" and result.outputs == {"root": "PING", "a": "PING A", "b": "PING B"}
    record = store.get_run(prepared.run_id)
    assert (record.lane, record.status, record.content_hash) == (ECHO, "completed", None)
    assert record.capabilities == prepared.capabilities.as_metadata()
    assert sorted(row["spec_node_id"] for row in store.run_nodes(prepared.run_id)) == ["a", "b", "root"]


# -- control rejection on the surfaces --------------------------------------------------------
def test_the_cli_rejects_a_control_outside_the_runs_capabilities_before_reaching_ray(echo_lane, store, capsys):
    """The run's recorded matrix decides; an allowed control goes on to the cluster (nothing answers here)."""
    echo_record(store, "echo-cli")
    fixed = store.create_run("fixed-cli", session_id="s", inputs={}, **_fixed_run_fields(store))
    unreachable = f"127.0.0.1:{free_port()}"
    for run_id, action in (("echo-cli", "message"), ("fixed-cli", "pause"), ("fixed-cli", "resume")):
        extra = ["hurry"] if action == "message" else []
        code = cli_main(["run", action, run_id, *extra, "--store", store.path, "--address", unreachable])
        error = capsys.readouterr().err
        assert code == 1 and "rejected and not queued" in error and run_id in error, error
    assert fixed.capabilities["cancel"] is True
    for run_id, action in (("echo-cli", "pause"), ("fixed-cli", "cancel"), ("never-recorded", "pause")):
        code = cli_main(["run", action, run_id, "--store", store.path, "--address", unreachable])
        assert code == 3, capsys.readouterr().err  # allowed: it went on, and found no cluster


def _fixed_run_fields(store: RunStore) -> dict[str, Any]:
    adapter = lane_adapter(FIXED_WORKFLOW, store)
    pinned = store.create_workflow(f"cli-{uuid.uuid4().hex[:6]}", SPEC)
    prepared = adapter.prepare_now(adapter.invocation(pinned.name))
    return {"provenance": prepared.provenance.to_payload(), "workflow": prepared.workflow,
            "capabilities": prepared.capabilities.as_metadata(), "recovery": recorded_recovery(prepared)}


def test_the_http_api_answers_each_control_from_the_runs_own_capabilities(echo_lane, store):
    echo_record(store, "echo-http")
    served = serve(create_app(store, session_factory=lambda: None, start_runtime=False))
    try:
        with served.client() as http:
            run = http.get("/api/runs/echo-http").json()
            assert run["lane"] == ECHO and run["lane_capabilities"]["live_pause"] is True
            refused = http.post("/api/runs/echo-http/message", json={"text": "hurry"})
            assert refused.status_code == 409
            body = refused.json()
            assert (body["lane"], body["request_kind"]) == (ECHO, "message")
            assert body["lane_capabilities"] == run["lane_capabilities"] and "not queued" in body["error"]
            allowed = http.post("/api/runs/echo-http/pause")  # allowed, but no runtime here runs it
            assert allowed.status_code == 409 and allowed.json()["status"] == "running"
            assert "no runtime this server reaches" in allowed.json()["error"]
            assert "request_kind" not in allowed.json()
    finally:
        served.stop()
    assert store.get_run("echo-http").status == "running"  # nothing reached it
