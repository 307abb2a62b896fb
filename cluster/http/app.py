"""The HTTP API's routes (ADR-0073 D1/D5, ADR-0068 D3): workflow definitions, and runs of any lane.

Owns the routes and their JSON shapes, one Session started with the server, and the
wiring of a run: the lane is resolved through the lane registry, prepared (pinned and
compiled) before the 202, and executed as one of this server's run tasks (runs.py). It
must not validate, compile, store or execute a definition itself (the lane and the run
store do), nor accept a control the run's capabilities exclude. Choices the records leave open:

- A run is admitted, not awaited: the 202 comes once the version is pinned, the graph
  compiled and the run task started (ADR-0073 D5 awaited the whole run behind its 202).
- ``message``/``pause``/``resume`` are checked against the run's own recorded capability
  matrix (D3: the invocation's, not the lane's): outside it they are 409 with the
  LaneCapabilityError message; nothing is queued and the run is untouched.
- ``/results`` is 409 until the run is terminal; progress is the run and its ``/signals``.
- Inside the matrix (a planned or play run), they reach the run: a run this server started
  through its own handle, a run another process started on this server's runtime (a shared
  cluster) by attaching to it; a run on no runtime this server reaches is 409.
- ``POST /api/flows/runs`` plans (the planner's call) before its 202, so a plan the planner
  could not make is 422 and no run; ``POST /api/playbooks/NAME/runs`` resolves the playbook
  first (404 for an unknown name, 422 for a bad arg).
- Every request passes the access guard first (guard.py: token, Host, Origin, content type),
  then the body guard (body.py); a route added to the app later passes them too.
- A client chooses no path on the server's disk: a run's containment root for coding ``cwd``
  is the server's ``workflow_root`` (``opgraph serve --workflow-root``), and no answer says
  whether a path exists there. Names in paths are the store's (``NAME_PATTERN``), else 422.
- At most ``max_runs`` runs are in flight at once (429 with ``Retry-After`` past it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParameter
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from opgraph.engines import PlanError
from opgraph.kernel import OpGraphError

from ..control.relay import RelaySettings
from ..lanes import (
    FIXED_WORKFLOW,
    PLANNED_REACTIVE_FLOW,
    REACTIVE_PLAY,
    LaneCapabilities,
    LaneInvocation,
    LaneRunControl,
    RunHooks,
    UnknownLaneError,
    check_capabilities,
    follow_submitted,
    lane_adapter,
    open_store,
    replaying_lanes,
    resume_recorded,
    settle_from_log,
)
from ..store import (
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    RunRecord,
    RunStore,
    WorkflowVersion,
    WorkflowVersionNotFoundError,
)
from .auth import ServerToken, check_bind, server_token
from .body import DEFAULT_MAX_BODY_BYTES, RequestBodyGuard
from .console import Console, LiveFeeds
from .control import add_control_routes
from .deadlines import DEFAULT_BODY_TIMEOUT, DEFAULT_HEAD_TIMEOUT, deadline_protocol
from .guard import SIGN_IN_PATH, AccessGuard, AccessPolicy, redact_in
from .problems import (
    ErrorBody,
    RunStateConflictError,
    RuntimeUnavailableError,
    UnknownNameError,
    errors,
    install_error_handlers,
    links,
    run_links,
)
from .retention import RetentionSchedule, ScheduledPruning
from .runs import CANCEL_GRACE_SECONDS, DEFAULT_MAX_RUNS, RunTasks, SessionSlot, say
from .webhooks import RelayTask, add_webhook_routes

__all__ = [
    "CANCEL_GRACE_SECONDS", "CreateWorkflowRequest", "ErrorBody", "RunStateConflictError", "RunTasks",
    "RunWorkflowRequest", "RuntimeUnavailableError", "UpdateWorkflowRequest", "create_app", "serve", "sign_in_url",
]
# The largest integer a request may carry (versions, seq numbers): every JSON client holds
# it exactly (2**53 - 1), where the store's own limit (2**63 - 1) is past a double's precision.
MAX_REQUEST_INTEGER = 2**53 - 1


# -- request bodies (D1 models, with versioning: a PUT appends an immutable version) -------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


# A runnable two-node definition on the built-in simulated provider: the documented example
# of a request body, which also lets a client (or a fuzzer) reach runs from the document alone.
EXAMPLE_SPEC: dict[str, Any] = {
    "version": 1,
    "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}},
              {"id": "draft", "kind": "chat", "pos": {"x": 1, "y": 0},
               "config": {"prompt": "Draft a short note about the topic.", "model": "sim/fast"}}],
    "edges": [{"id": "e1", "from": "in", "to": "draft"}],
    "inputs": ["topic"],
    "outputs": ["draft"],
}


class CreateWorkflowRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"name": "drafts", "description": "one chat node", "spec": EXAMPLE_SPEC}]})

    name: str = Field(min_length=1)
    description: str | None = None
    spec: dict[str, Any] | None


class UpdateWorkflowRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"examples": [{"spec": EXAMPLE_SPEC, "description": "v2"}]})

    spec: dict[str, Any] | None
    description: str | None = None


class RunWorkflowRequest(_Body):
    """A run of a stored workflow. It names no path: a coding node's ``cwd`` is contained in the server's own
    ``--workflow-root``, never in a root the client picks."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"inputs": {"topic": "actors"}}]})

    inputs: dict[str, Any] | None = None
    model: str | None = Field(default=None, pattern=r"^[^/]+/.+$", description="provider/model for every chat node")
    version: int | None = Field(default=None, ge=1, le=MAX_REQUEST_INTEGER)


class MessageRequest(_Body):
    text: str = Field(default="", max_length=20_000)  # an operator message, rendered into the next dispatches


class PlannedRunRequest(_Body):
    """A planned reactive flow: the planner plans ``prompt`` for the roster's roles, then the plan runs."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "compare three battery chemistries", "max_ops": 6, "reactive": "all"}]})

    prompt: str = Field(min_length=1, max_length=20_000, pattern=r"\S")
    model: str | None = Field(default=None, pattern=r"^[^/]+/.+$", description="provider/model of the planner and ops")
    reactive: str = Field(default="all", max_length=200, description="all, off, or ROLE,ROLE")
    max_ops: int = Field(default=0, ge=0, le=1000)
    roles: dict[str, str] | None = Field(default=None, max_length=20)
    synthesis: bool = True


class PlayRunRequest(_Body):
    """A playbook's run: ``input`` is its positional text, ``args`` its typed args by name."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "solid-state batteries",
                                                               "args": {"words": 200}}]})

    input: str = Field(default="", max_length=20_000)
    args: dict[str, str | int | float | bool] | None = None
    model: str | None = Field(default=None, pattern=r"^[^/]+/.+$")
    reactive: str | None = Field(default=None, max_length=200)
    max_ops: int | None = Field(default=None, ge=0, le=1000)


class ControlAccepted(BaseModel):
    """A live control handed to the run: ``accepted`` is what the run's executor answered."""

    run_id: str
    action: str
    accepted: bool
    links: dict[str, str]


# -- JSON shapes ------------------------------------------------------------------------
def _version_json(version: WorkflowVersion, *, spec: bool = True) -> dict[str, Any]:
    body = asdict(version)
    body = {"id": body.pop("workflow_id"), "ref": version.ref, **body}
    if not spec:
        body.pop("spec")
    return body


def _capabilities(record: RunRecord) -> LaneCapabilities:
    """The matrix the run's invocation published (D3); a run that recorded none honours nothing."""
    return LaneCapabilities.from_metadata(record.capabilities or {})


def _check_control(record: RunRecord, request_kind: str) -> None:
    """``LaneCapabilityError`` (409) unless the run's own matrix includes ``request_kind``."""
    check_capabilities(_capabilities(record), request_kind, lane=record.lane, run_id=record.run_id)


def _attach(run_id: str, namespace: str) -> Any:
    """The RunControl of ``run_id`` on the runtime this process joined, or None when no executor has it."""
    from opgraph.actors import RunControl  # local: definitions never need Ray

    try:
        control = RunControl.attach(run_id, address=None, namespace=namespace)
    except OpGraphError:
        return None
    return control if control.executor is not None else None


def _run_json(record: RunRecord) -> dict[str, Any]:
    body = {
        "run_id": record.run_id, "status": record.status, "workflow": record.workflow_name or record.source_ref,
        "workflow_id": record.workflow_id, "version": record.version, "content_hash": record.content_hash,
        "lane": record.lane, "lane_capabilities": _capabilities(record).as_metadata(),
        "provenance": record.provenance, "inputs": record.inputs, "session_id": record.session_id,
        "created_at": record.created_at, "started_at": record.started_at, "finished_at": record.finished_at,
        "links": run_links(record.run_id),
    }
    if record.terminal:
        body.update(outputs=record.outputs, errors=record.error)
    return body


# -- the app ----------------------------------------------------------------------------
def _name_parameter(what: str) -> Any:
    """A name in a path: the store's rule (letters, digits, '.', '_', '-'; 1 to MAX_NAME_LENGTH), else 422."""
    return PathParameter(pattern=NAME_PATTERN, min_length=1, max_length=MAX_NAME_LENGTH,
                         description=f"{what}: 1 to {MAX_NAME_LENGTH} of A-Z a-z 0-9 . _ - (not dots alone)")


_WORKFLOW_NAME = _name_parameter("the workflow's name or id")
_PLAYBOOK_NAME = _name_parameter("the playbook's name")
# OpenAPI links: how a client (or a fuzzer's stateful phase) gets from what one answer
# holds to the next request, so generated clients and tests reach runs, not only 404s.
_WORKFLOW_LINKS = links(201, "The workflow's first version", {
    operation: {"name": "$response.body#/name"}
    for operation in ("get_workflow", "list_versions", "add_version", "start_run", "delete_workflow")})
_RUN_LINKS = links(202, "The admitted run, with its id and links", {
    operation: {"run_id": "$response.body#/run_id"}
    for operation in ("get_run", "run_signals", "run_results", "cancel_run", "message_run", "pause_run",
                      "resume_run", "recover_run")})


def _session_factory(address: str | None = None) -> Callable[[], Any]:
    def start() -> Any:
        from opgraph.cluster.connection import open_session  # local: it loads Ray, which definitions never need

        # Through an address the runtime is detached (shared by name): the runs this server
        # submits go on without it, and another server or `opgraph run result` reads their end.
        return open_session(address, detached=None)

    return start


def create_app(store: RunStore, *, session_factory: Callable[[], Any] | None = None,
               max_concurrent: int = 5, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               start_runtime: bool = True, submit_runs: bool | None = None, access: AccessPolicy | None = None,
               max_runs: int = DEFAULT_MAX_RUNS, workflow_root: str | Path | None = None,
               retention: RetentionSchedule | None = None, webhooks: Any = None,
               relay: Any = None) -> FastAPI:
    """The API over ``store``; runs use one Session from ``session_factory`` (default ``Session()``).

    Every request passes ``access`` first (guard.py): without one, the app makes a policy
    with a fresh random token, so an app is never open by accident (read it from
    ``app.state.access.token``). The Session starts with the app (``start_runtime``), before
    it takes requests, so admission never waits for Ray; a failed start is reported and
    retried by each run (503 until it works). Request bodies over ``max_body_bytes`` are
    refused with 413; past ``max_runs`` runs in flight, a new run is refused with 429. A
    coding node's ``cwd`` is contained in ``workflow_root`` (none: such a node cannot run here).

    ``submit_runs`` (default: when the runtime is detached, joined through an address)
    admits each run with ``Session.submit``: the run goes on if this server exits, this
    server follows it (each settled node and signal recorded as it comes), and a server
    that did not follow it settles its row from the run log when it is read. Otherwise a
    run is driven through ``Session.flow`` by this server, with every lifecycle signal.
    The caller owns ``store`` and the Session; shutting the app down stops following (a
    run it drives through ``flow`` is cancelled and recorded ``cancelled``) but closes neither.
    ``retention`` prunes the store on a schedule, in the background (``ScheduledPruning``).
    ``webhooks`` (a ``control.webhooks.Webhooks``; default: the store's, with the environment's
    allow-list) serves /api/webhooks; ``relay`` (``RelaySettings``) also delivers the outbox
    from a background task (`opgraph serve` passes one; None sends nothing).
    """
    access = access or AccessPolicy(token=secrets.token_urlsafe(32))
    runs = RunTasks(store, max_runs=max_runs)
    sessions = SessionSlot(session_factory or _session_factory())
    root = None if workflow_root is None else Path(workflow_root).expanduser().resolve()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Runs left unfinished by a server (or CLI) process that died are failed now,
        # before anyone asks; reads would settle them too (RunStore._orphaned).
        await asyncio.to_thread(store.reap_orphaned_runs)
        if start_runtime:
            say("starting the runtime (Ray and the opgraph actors)...")
            started = time.monotonic()
            try:
                sessions.start()
            except RuntimeUnavailableError as exc:
                say(f"{exc.message}; serving definitions, and each run will try again")
            else:
                say(f"runtime ready in {time.monotonic() - started:.1f} s")
        pruning = ScheduledPruning(store, retention, replaying_lanes()) if retention is not None else None
        if pruning is not None:
            pruning.start()
        app.state.retention = pruning
        relaying = RelayTask(store, relay) if relay is not None else None
        if relaying is not None:
            relaying.start()
        app.state.relay = relaying
        yield
        await feeds.close()
        if relaying is not None:
            await relaying.stop()
        if pruning is not None:
            await pruning.stop()
        await runs.cancel_all()

    app = FastAPI(title="opgraph fixed workflows", lifespan=lifespan,
                  description="Versioned fixed-workflow definitions (ADR-0073) and their runs. Every request "
                              "needs the server's token (Authorization: Bearer TOKEN). Every error answer is an "
                              "ErrorBody: the first problem's message and the list of problems.")
    app.state.runs = runs
    app.state.access = access
    console = Console(store, access, live_runs=lambda run_id: run_id in runs)
    app.state.console = console
    install_error_handlers(app, authenticated=access.token is not None)
    app.add_middleware(RequestBodyGuard, max_body_bytes=max_body_bytes)
    # Added last, so outermost: nothing (not the body guard, which reads bodies) runs before it.
    # Routes and mounted apps added later pass it; a middleware added later would run before
    # it, so one that answers requests itself must not be added after create_app.
    app.add_middleware(AccessGuard, policy=access, sign_in_page=lambda: console.sign_in_page)

    async def console_watcher(run_id: str) -> Any:
        """The run's settled nodes from its executor's watcher queue (as `opgraph run watch`), or None
        when no runtime this server reaches has the run."""
        handle = await runs.control(run_id)
        if handle is None:
            runtime = getattr(sessions.current, "runtime", None)
            handle = None if runtime is None else await asyncio.to_thread(_attach, run_id, runtime.namespace)
        return None if handle is None else handle.watch()

    feeds = LiveFeeds(store, console, console_watcher)

    @app.get(SIGN_IN_PATH, operation_id="index", responses=errors())
    def index(request: Request, status: Literal["admitted", "running", "completed", "failed", "cancelled", ""] = "",
              lane: str = Query(default="", max_length=200), workflow: str = Query(default="", max_length=400),
              page: int = Query(default=1, ge=1, le=1_000_000)) -> Any:
        """Where a browser lands from the sign-in URL `opgraph serve` prints: the console's runs list for a
        browser (``Accept: text/html``); else what the server offers, as JSON."""
        if "text/html" in request.headers.get("accept", ""):
            return console.html(console.runs_page(status, lane, workflow, page))
        return {"service": "opgraph", "signed_in": True, "docs": "/docs", "openapi": "/openapi.json",
                "links": {"workflows": "/api/workflows", "runs": "/api/runs", "flows": "/api/flows/runs",
                          "schedules": "/api/schedules", "tasks": "/api/tasks", "workers": "/api/workers",
                          "webhooks": "/api/webhooks"}}

    # Definition routes are plain functions: FastAPI runs them in its thread pool, so the
    # synchronous SQLite calls never block the loop that drives the runs.
    @app.post("/api/workflows", status_code=201, operation_id="create_workflow",
              responses={**errors(409, 413, 422), **_WORKFLOW_LINKS})
    def create_workflow(body: CreateWorkflowRequest) -> dict[str, Any]:
        return _version_json(store.create_workflow(body.name, body.spec, body.description))

    @app.get("/api/workflows", operation_id="list_workflows", responses=errors())
    def list_workflows() -> dict[str, Any]:
        return {"workflows": [asdict(summary) for summary in store.list_workflows()]}

    @app.get("/api/workflows/{name}", operation_id="get_workflow", responses=errors(404, 422))
    def get_workflow(name: str = _WORKFLOW_NAME,
                     version: int | None = Query(default=None, ge=1, le=MAX_REQUEST_INTEGER)) -> dict[str, Any]:
        return _version_json(store.resolve(name, version))

    @app.get("/api/workflows/{name}/versions", operation_id="list_versions", responses=errors(404))
    def list_versions(name: str = _WORKFLOW_NAME) -> dict[str, Any]:
        versions = store.versions(name)
        return {"name": versions[0].name, "versions": [_version_json(v, spec=False) for v in versions]}

    @app.put("/api/workflows/{name}", operation_id="add_version", responses=errors(404, 409, 413, 422))
    def add_version(body: UpdateWorkflowRequest, name: str = _WORKFLOW_NAME) -> dict[str, Any]:
        previous = store.resolve(name)
        version = store.add_version(name, body.spec, body.description)
        # An equal hash returns the existing version: versions are immutable and never duplicated.
        return {**_version_json(version), "created": version.version != previous.version}

    @app.delete("/api/workflows/{name}", status_code=204, operation_id="delete_workflow", response_class=Response,
                responses=errors(404))
    def delete_workflow(name: str = _WORKFLOW_NAME) -> Response:
        store.delete_workflow(name)
        return Response(status_code=204)

    @app.post("/api/workflows/{name}/runs", status_code=202, operation_id="start_run",
              responses={**errors(404, 413, 422, 429), **_RUN_LINKS})
    async def start_run(name: str = _WORKFLOW_NAME, body: RunWorkflowRequest | None = None) -> dict[str, Any]:
        body = body or RunWorkflowRequest()
        with runs.admission() as slot:  # 429 before anything is resolved when the server is full
            # A workflow run is the fixed lane's, resolved through the registry; the lane pins
            # and compiles before any run row exists: a compile error is a 422 and no run.
            lane = lane_adapter(FIXED_WORKFLOW, store)
            invocation = LaneInvocation(
                lane=FIXED_WORKFLOW, source_ref=name, source_kind="workflow_def", source_content_hash=None,
                inputs=dict(body.inputs or {}), base_dir=root, source_version=body.version, model=body.model,
                run_id=str(uuid.uuid4()), max_concurrent=max_concurrent)
            try:
                prepared = await lane.prepare(invocation)
            except WorkflowVersionNotFoundError as exc:
                if body.version is None:
                    raise
                # The workflow (the path's resource) exists; the body asks for a version it lacks.
                raise RequestValidationError([{"loc": ("body", "version"), "msg": exc.message,
                                               "type": "value_error"}]) from exc
            session = await sessions.get()
            run_id, control = prepared.run_id, {}
            admitted = asyncio.get_running_loop().create_future()
            if session.runtime.detached if submit_runs is None else submit_runs:
                runs.start(run_id, control, _submitted(lane, prepared, session, control, admitted), slot)
            else:
                runs.start(run_id, control, lane.execute(prepared, session=session,
                                                         hooks=RunHooks(control=control, on_admitted=admitted)), slot)
        # The lane resolves ``admitted`` once the run row is written (or fails with what
        # stopped it first), so a client polling right after the 202 finds the run.
        status = await admitted
        source = prepared.provenance.source
        return {"run_id": run_id, "status": status, "workflow": source.ref, "version": source.version,
                "content_hash": source.content_hash, "lane": prepared.provenance.lane,
                "lane_capabilities": prepared.capabilities.as_metadata(), "links": run_links(run_id)}

    async def _submitted(lane: Any, prepared: Any, session: Any, control: dict[str, Any],
                         admitted: asyncio.Future) -> Any:
        """Admit ``prepared`` detached, then follow it to its end from this server."""
        try:
            await lane.submit(prepared, session=session)
        except BaseException as exc:
            if not admitted.done():
                admitted.set_exception(exc)
            raise
        admitted.set_result("running")
        record = await run_in_threadpool(store.get_run, prepared.run_id)
        return await follow_submitted(lane, record, store=store, hooks=RunHooks(control=control),
                                      namespace=session.runtime.namespace)

    def _read(run_id: str) -> RunRecord:
        """The run's row; a detached run nobody followed is settled from the run log once it ended there."""
        record = store.get_run(run_id)
        if record.terminal or record.owner_pid is not None or run_id in runs:
            return record
        try:
            adapter = lane_adapter(record.lane, store)
        except UnknownLaneError:  # a lane this server does not have: its row stays as recorded
            return record
        return settle_from_log(store, record, adapter)

    console.install(app, _read)

    @app.get("/runs/{run_id}/live", include_in_schema=False)
    async def run_live(run_id: str) -> StreamingResponse:
        """A live run's changes for its console page, as server-sent events (one feed per run)."""
        await run_in_threadpool(store.get_run, run_id)  # 404 for an unknown run
        return StreamingResponse(feeds.stream(run_id), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    @app.get("/api/runs", operation_id="list_runs", responses=errors(422))
    def list_runs(workflow: str | None = None,
                  status: Literal["admitted", "running", "completed", "failed", "cancelled"] | None = None,
                  limit: int = Query(default=50, ge=1, le=1000)) -> dict[str, Any]:
        return {"runs": [_run_json(run) for run in store.list_runs(workflow=workflow, status=status, limit=limit)]}

    @app.get("/api/runs/{run_id}", operation_id="get_run", responses=errors(404))
    def get_run(run_id: str) -> dict[str, Any]:
        return _run_json(_read(run_id))

    @app.get("/api/runs/{run_id}/signals", operation_id="run_signals", responses=errors(404, 422))
    def run_signals(run_id: str, after: int = Query(default=0, ge=0, le=MAX_REQUEST_INTEGER)) -> dict[str, Any]:
        signals = store.run_signals(run_id, after)
        status = _read(run_id).status  # read after the signals: terminal means none are missing
        return {"run_id": run_id, "status": status, "signals": signals,
                "next_after": signals[-1]["seq"] if signals else after}

    @app.get("/api/runs/{run_id}/results", operation_id="run_results", responses=errors(404, 409))
    def run_results(run_id: str) -> dict[str, Any]:
        record = _read(run_id)
        if not record.terminal:
            raise RunStateConflictError(f"run {run_id} is still {record.status}; results exist once it ends "
                                        "(poll the run or its signals)", run_id=run_id, status=record.status)
        nodes: dict[str, str] = {}
        for row in store.run_signals(run_id):
            if row["spec_node_id"] is not None:
                nodes[row["spec_node_id"]] = row["kind"]  # the last lifecycle state wins
        # Every settled node's result, recorded as it settled: what a run whose owner died
        # (recorded failed, without outputs) still has to show.
        settled = {row["spec_node_id"] or row["node_id"]: {"status": row["status"], "result": row["result"]}
                   for row in store.run_nodes(run_id)}
        return {"run_id": run_id, "status": record.status, "workflow": record.workflow_name or record.source_ref,
                "version": record.version, "content_hash": record.content_hash, "outputs": record.outputs or {},
                "errors": record.error, "nodes": nodes, "node_results": settled}

    @app.post("/api/runs/{run_id}/cancel", status_code=202, operation_id="cancel_run", responses=errors(404, 409))
    async def cancel_run(run_id: str) -> dict[str, Any]:
        record = await run_in_threadpool(store.get_run, run_id)
        if record.terminal:
            raise RunStateConflictError(f"run {run_id} already ended {record.status}; there is nothing to cancel",
                                        run_id=run_id, status=record.status)
        _check_control(record, "cancel")
        if run_id not in runs:
            raise RunStateConflictError(
                f"run {run_id} is {record.status} but was not started by this server; only the process "
                "that started it can cancel it", run_id=run_id, status=record.status)
        await runs.cancel(run_id)
        record = await run_in_threadpool(store.get_run, run_id)
        if record.status in ("completed", "failed"):
            raise RunStateConflictError(f"run {run_id} ended {record.status} before the cancel took effect",
                                        run_id=run_id, status=record.status)
        return {"run_id": run_id, "status": record.status, "links": run_links(run_id)}

    async def live_control(run_id: str, request_kind: str) -> Any:
        """The run's control handle, held to its recorded matrix; 409 when it ended, when the matrix
        excludes ``request_kind`` (nothing is queued anywhere), or when no runtime here has the run."""
        record = await run_in_threadpool(store.get_run, run_id)  # an unknown run is a 404 first
        if record.terminal:
            raise RunStateConflictError(f"run {run_id} already ended {record.status}", run_id=run_id,
                                        status=record.status)
        _check_control(record, request_kind)
        handle = await runs.control(run_id)
        if handle is not None:
            return handle
        # Another process's run: found by id on this server's runtime (a shared cluster).
        runtime = getattr(await sessions.get(), "runtime", None)
        found = None if runtime is None else await asyncio.to_thread(_attach, run_id, runtime.namespace)
        if found is None:
            raise RunStateConflictError(
                f"run {run_id} (lane {record.lane}) allows {request_kind!r}, but no runtime this server reaches "
                "runs it; send it to the process that runs it (`opgraph run ...`)", run_id=run_id,
                status=record.status)
        return LaneRunControl(found, _capabilities(record), lane=record.lane, run_id=run_id)

    @app.post("/api/runs/{run_id}/recover", status_code=202, operation_id="recover_run",
              responses=errors(404, 409, 429))
    async def recover_run(run_id: str) -> dict[str, Any]:
        """Continue a durable run whose owner process died (recorded failed with OwnerProcessLost) from the
        run log, where its capabilities include checkpoint resume; settled nodes do not run again."""
        record = await run_in_threadpool(store.get_run, run_id)
        if not record.orphaned:
            raise RunStateConflictError(f"run {run_id} is {record.status}; only a run whose process died "
                                        "(failed with OwnerProcessLost) continues from the run log",
                                        run_id=run_id, status=record.status)
        _check_control(record, "checkpoint_resume")
        with runs.admission() as slot:
            adapter = lane_adapter(record.lane, store)
            session = await sessions.get()
            control: dict[str, Any] = {}
            runs.start(run_id, control, resume_recorded(adapter, record, session=session, store=store,
                                                        hooks=RunHooks(control=control)), slot)
        return {"run_id": run_id, "status": "running", "links": run_links(run_id)}

    accepted = {"status_code": 202, "response_model": ControlAccepted, "responses": errors(404, 409)}

    @app.post("/api/runs/{run_id}/message", operation_id="message_run",
              **{**accepted, "responses": errors(404, 409, 413, 422)})
    async def message_run(run_id: str, body: MessageRequest | None = None) -> dict[str, Any]:
        handle = await live_control(run_id, "message")
        done = await handle.send_operator_message((body or MessageRequest()).text)
        return {"run_id": run_id, "action": "message", "accepted": bool(done), "links": run_links(run_id)}

    @app.post("/api/runs/{run_id}/pause", operation_id="pause_run", **accepted)
    async def pause_run(run_id: str) -> dict[str, Any]:
        done = await (await live_control(run_id, "pause")).pause()
        return {"run_id": run_id, "action": "pause", "accepted": bool(done), "links": run_links(run_id)}

    @app.post("/api/runs/{run_id}/resume", operation_id="resume_run", **accepted)
    async def resume_run(run_id: str) -> dict[str, Any]:
        done = await (await live_control(run_id, "resume")).resume()
        return {"run_id": run_id, "action": "resume", "accepted": bool(done), "links": run_links(run_id)}

    # -- planned flows and plays (ADR-0068 D1): planned before the 202 -------------------------
    async def start_planned(kind: str, make_invocation: Callable[[Any], Any]) -> dict[str, Any]:
        with runs.admission() as slot:  # 429 before any planning when the server is full
            lane = lane_adapter(kind, store)
            try:
                invocation = make_invocation(lane)
            except OpGraphError as exc:
                # Said without the server's folders: the ones searched for an unknown name, or the
                # file of a bad one. A client learns nothing of the server's disk.
                suggestions = getattr(exc, "suggestions", None)
                if suggestions is not None:  # no playbook by that name
                    hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
                    raise UnknownNameError(f"no playbook {getattr(exc, 'name', '')!r} on this server{hint}") from exc
                path = getattr(exc, "path", None)
                message = exc.message.replace(path, "<playbook file>") if path else exc.message
                raise RequestValidationError([{"loc": ("body",), "msg": message, "type": "value_error"}]) from exc
            except ValueError as exc:  # an option the lane cannot take
                raise RequestValidationError([{"loc": ("body",), "msg": str(exc), "type": "value_error"}]) from exc
            session = await sessions.get()
            try:
                prepared = await lane.prepare(invocation, session=session)
            except PlanError as exc:
                raise RequestValidationError([{"loc": ("body", "prompt"), "msg": f"no usable plan: {exc.message}",
                                               "type": "value_error"}]) from exc
            except (OpGraphError, ValueError) as exc:  # the planner's turn failed (an unknown model, say)
                message = getattr(exc, "message", None) or str(exc)
                raise RequestValidationError([{"loc": ("body",), "msg": f"the request could not be planned: "
                                                                       f"{message}", "type": "value_error"}]) from exc
            run_id, control = prepared.run_id, {}
            admitted = asyncio.get_running_loop().create_future()
            runs.start(run_id, control, lane.execute(prepared, session=session,
                                                     hooks=RunHooks(control=control, on_admitted=admitted)), slot)
        status = await admitted
        source = prepared.provenance.source
        return {"run_id": run_id, "status": status, "workflow": source.ref, "version": None,
                "content_hash": source.content_hash, "lane": prepared.provenance.lane,
                "lane_capabilities": prepared.capabilities.as_metadata(), "links": run_links(run_id)}

    @app.post("/api/flows/runs", status_code=202, operation_id="start_flow_run",
              responses={**errors(413, 422, 429), **_RUN_LINKS})
    async def start_flow_run(body: PlannedRunRequest) -> dict[str, Any]:
        return await start_planned(PLANNED_REACTIVE_FLOW, lambda lane: lane.invocation(
            body.prompt, model=body.model, reactive=body.reactive, max_ops=body.max_ops, roles=body.roles,
            synthesis=body.synthesis, max_concurrent=max_concurrent, run_id=str(uuid.uuid4())))

    @app.post("/api/playbooks/{name}/runs", status_code=202, operation_id="start_play_run",
              responses={**errors(404, 413, 422, 429), **_RUN_LINKS})
    async def start_play_run(name: str = _PLAYBOOK_NAME, body: PlayRunRequest | None = None) -> dict[str, Any]:
        body = body or PlayRunRequest()
        return await start_planned(REACTIVE_PLAY, lambda lane: lane.invocation(
            name, text=body.input, args=body.args or {}, model=body.model, reactive=body.reactive,
            max_ops=body.max_ops, run_id=str(uuid.uuid4())))

    add_control_routes(app, store)
    add_webhook_routes(app, store, webhooks)
    return app


def sign_in_url(host: str, port: int, token: str | None) -> str:
    """The URL a browser signs in with (``/?token=...``); without a token, the server's plain URL."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{SIGN_IN_PATH}" + ("" if token is None else f"?token={token}")


class _AnnouncingServer(uvicorn.Server):
    """uvicorn's Server, which says once it listens how to sign in (the port is known only then)."""

    def __init__(self, config: uvicorn.Config, *, host: str, token: ServerToken) -> None:
        super().__init__(config)
        self._host, self._token = host, token

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            _announce(self._host, self.servers[0].sockets[0].getsockname()[1], self._token)


def _announce(host: str, port: int, token: ServerToken) -> None:
    if token.source == "home":
        say(f"the token is in {token.path} (mode 0600); clients on this machine read it from there. Sign in at:\n"
            f"    {sign_in_url(host, port, token.value)}")
    elif token.source == "none":
        say(f"serving WITHOUT authentication (--no-auth) at {sign_in_url(host, port, None)}")
    else:
        where = "OPGRAPH_TOKEN" if token.source == "environment" else f"the token file {token.path}"
        say(f"serving at {sign_in_url(host, port, None)}; every request needs the token in {where} "
            "(Authorization: Bearer TOKEN)")


def serve(host: str = "127.0.0.1", port: int = 8000, store_path: str | None = None,
          address: str | None = None, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          token: ServerToken | None = None, allowed_hosts: tuple[str, ...] = (),
          allowed_origins: tuple[str, ...] = (), max_runs: int = DEFAULT_MAX_RUNS, max_versions: int | None = None,
          head_timeout: float = DEFAULT_HEAD_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
          workflow_root: str | Path | None = None, retention: RetentionSchedule | None = None) -> bool:
    """Serve the API with uvicorn until interrupted (``opgraph serve``); Ray starts with the server.

    ``token`` (default: ``server_token()``, from the environment or the opgraph home) is checked
    against ``host`` first: ``BindRefusedError`` (nothing started) for a public bind without a
    token the operator set, or ``--no-auth`` off loopback. A loopback server without one makes
    one (a ``0600`` file in the opgraph home) and prints its sign-in URL. Each connection's
    request head must arrive within ``head_timeout`` seconds and its body within
    ``body_timeout``. ``retention`` prunes the store on a schedule. False when the server could
    not start listening (a port in use).
    """
    token = server_token() if token is None else token
    check_bind(host, token)
    policy = AccessPolicy(None, bound_host=host, allowed_hosts=tuple(allowed_hosts),
                          allowed_origins=tuple(allowed_origins))  # a bad host or origin: refused before the store
    with open_store(store_path, max_versions=max_versions) as store:
        token = token.ensure()  # a store that cannot be opened leaves no token file behind
        if token.source == "none":
            say("WARNING: --no-auth: any program or web page that can reach this port may start and control runs")
        policy = dataclasses.replace(policy, token=token.value)
        app = create_app(store, session_factory=_session_factory(address), max_body_bytes=max_body_bytes,
                         access=policy, max_runs=max_runs, workflow_root=workflow_root,
                         retention=retention, relay=RelaySettings.from_environment())
        # No WebSocket protocol: no route takes one, and an upgrade is then a plain (guarded) request.
        config = uvicorn.Config(app, host=host, port=port, http=deadline_protocol(head_timeout, body_timeout),
                                ws="none")
        redact_in(("uvicorn.access", "uvicorn.error"))  # after Config, which sets up uvicorn's logging
        server = _AnnouncingServer(config, host=host, token=token)
        with contextlib.suppress(KeyboardInterrupt):
            server.run()
        return bool(server.started)
