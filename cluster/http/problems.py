"""Every error answer of the HTTP API: one status and one body shape per typed error, and their OpenAPI.

Owns the mapping from typed errors (and FastAPI's own request errors) to HTTP statuses,
the one error body every non-2xx answer has (``{"error": first message, "errors": [problem,
...]}`` plus a few fields per kind), and how each route documents those answers so the
OpenAPI document says what the server does. It must not decide anything about a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from opgraph.kernel import OpGraphError, RunLogIntegrityError

from ..control import ControlError, ControlInputError, ScheduleNotFoundError, TaskNotFoundError, TaskStateError
from ..lanes import LaneCapabilityError
from ..store import (
    RunNotFoundError,
    WorkflowDefinitionError,
    WorkflowNameConflictError,
    WorkflowNotFoundError,
    WorkflowStoreError,
    WorkflowVersionLimitError,
    problem,
)
from .guard import STATE_CHANGING

__all__ = [
    "ErrorBody",
    "Problem",
    "RunCapacityError",
    "RunStateConflictError",
    "RuntimeUnavailableError",
    "UnknownNameError",
    "error_body",
    "errors",
    "install_error_handlers",
    "links",
    "run_links",
]

class RunStateConflictError(OpGraphError):
    """The request conflicts with the run's state (terminal, still running, or owned by
    another process); ``status`` says which. Poll the run, or start a new one."""

    def __init__(self, message: str, run_id: str, status: str) -> None:
        super().__init__(message)
        self.run_id, self.status = run_id, status


class RunCapacityError(OpGraphError):
    """The server already runs as many runs as it admits (``opgraph serve --max-runs``); nothing was started.
    HTTP 429, with ``Retry-After: retry_after`` seconds."""

    def __init__(self, message: str, *, limit: int, retry_after: int) -> None:
        super().__init__(message)
        self.limit, self.retry_after = limit, retry_after


class UnknownNameError(OpGraphError):
    """The path names something the server cannot find outside the store (a playbook); 404, nothing ran."""


class RuntimeUnavailableError(OpGraphError):
    """The Session (Ray and the runtime actors) could not be started; no run was created."""


# -- the documented shapes ------------------------------------------------------------
class Problem(BaseModel):
    """One problem: what is wrong, and the definition's node or edge it concerns, if any."""

    error: str
    node_id: str | None = None
    edge_id: str | None = None


class ErrorBody(BaseModel):
    """Every error answer: the first problem's message, every problem, and per-kind fields
    (``name`` on a name conflict; ``run_id``, ``status`` and ``links`` on a run conflict;
    ``request_kind``, ``lane`` and ``lane_capabilities`` on a control the lane refuses)."""

    model_config = ConfigDict(extra="allow")

    error: str
    errors: list[Problem]


_DESCRIPTIONS = {
    400: "The request is malformed",
    401: "The request lacks the server's token (Authorization: Bearer TOKEN)",
    403: "The request's Origin may not change anything here (opgraph serve --allowed-origin)",
    404: "No such workflow, version, run or playbook",
    405: "The path does not take this method",
    409: "The request conflicts with the workflow's or run's state, or the lane's capabilities, or the workflow "
         "has as many versions as the server keeps",
    413: "The request body is larger than the server's limit (opgraph serve --max-body-bytes)",
    415: "The request body is not declared application/json",
    421: "The request's Host is not a name of this server (opgraph serve --allowed-host)",
    422: "The request or the definition it carries is invalid; ``errors`` lists every problem",
    429: "The server already runs as many runs as it admits (opgraph serve --max-runs); retry after Retry-After "
         "seconds",
    503: "The store or the runtime is unavailable; retry later",
}
# What the access guard (guard.py) answers before any route runs: every operation may get these.
_GUARD_STATUSES = (421,)  # and 401 on a server with a token
_GUARD_STATE_CHANGING_STATUSES = (403, 415)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that may answer ``statuses`` (503 always: the store may fail)."""
    return {status: {"model": ErrorBody, "description": _DESCRIPTIONS[status]}
            for status in sorted({*statuses, 503})}


def links(status: int, description: str, targets: dict[str, dict[str, str]]) -> dict[int | str, dict[str, Any]]:
    """A success response that links to ``targets`` ({operation_id: {parameter: runtime expression}})."""
    return {status: {"description": description,
                     "links": {operation: {"operationId": operation, "parameters": parameters}
                               for operation, parameters in targets.items()}}}


# -- the bodies ---------------------------------------------------------------------------
def error_body(message: str, problems: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    problems = problems or [problem(message)]
    return {"error": message, "errors": problems, **fields}


def run_links(run_id: str) -> dict[str, str]:
    base = f"/api/runs/{run_id}"
    return {"self": base, "signals": f"{base}/signals", "results": f"{base}/results", "cancel": f"{base}/cancel"}


def _request_problem(item: dict[str, Any]) -> dict[str, Any]:
    return problem(f"{'.'.join(str(part) for part in item.get('loc', ()))}: {item.get('msg')}")


def _definition(exc: WorkflowDefinitionError) -> dict[str, Any]:
    return error_body(exc.errors[0]["error"], exc.errors)


def _request(exc: RequestValidationError) -> dict[str, Any]:
    problems = [_request_problem(item) for item in exc.errors()] or [problem("the request is invalid")]
    return error_body(problems[0]["error"], problems)


# Every typed error is one HTTP status and body, here and nowhere else; the most specific
# class wins. Malformed requests get our problem list, not FastAPI's {"detail": [...]}.
_ERROR_RESPONSES: dict[type[Exception], tuple[int, Callable[[Any], dict[str, Any]]]] = {
    WorkflowDefinitionError: (422, _definition),
    RequestValidationError: (422, _request),
    WorkflowNameConflictError: (409, lambda exc: error_body(exc.message, name=exc.name)),
    WorkflowVersionLimitError: (409, lambda exc: error_body(exc.message, name=exc.name, limit=exc.limit)),
    RunCapacityError: (429, lambda exc: error_body(exc.message, limit=exc.limit)),
    LaneCapabilityError: (409, lambda exc: error_body(exc.message, request_kind=exc.request_kind,
                                                      lane=exc.lane, lane_capabilities=exc.capabilities)),
    RunStateConflictError: (409, lambda exc: error_body(exc.message, run_id=exc.run_id, status=exc.status,
                                                        links=run_links(exc.run_id))),
    WorkflowNotFoundError: (404, lambda exc: error_body(exc.message)),  # WorkflowVersionNotFoundError too
    RunNotFoundError: (404, lambda exc: error_body(exc.message)),
    UnknownNameError: (404, lambda exc: error_body(exc.message)),
    WorkflowStoreError: (503, lambda exc: error_body(exc.message)),  # the database failed or is closed
    # A run-log row that fails its integrity check (planted, changed, or signed elsewhere): unread.
    RunLogIntegrityError: (503, lambda exc: error_body(str(exc), run_id=exc.run_id)),
    RuntimeUnavailableError: (503, lambda exc: error_body(exc.message)),
    # The control plane (schedules, tasks): bad input names its field; a state conflict names the state.
    ControlInputError: (422, lambda exc: error_body(exc.message, field=exc.field)),
    ScheduleNotFoundError: (404, lambda exc: error_body(exc.message)),
    TaskNotFoundError: (404, lambda exc: error_body(exc.message)),
    TaskStateError: (409, lambda exc: error_body(exc.message, task_id=exc.task_id, state=exc.state)),
    ControlError: (503, lambda exc: error_body(exc.message)),
}


async def _error_response(_: Request, exc: Exception) -> JSONResponse:
    status, body = next(_ERROR_RESPONSES[cls] for cls in type(exc).__mro__ if cls in _ERROR_RESPONSES)
    headers = {"retry-after": str(exc.retry_after)} if isinstance(exc, RunCapacityError) else None
    return JSONResponse(body(exc), status_code=status, headers=headers)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own answers (an unknown path, a method the path does not take) in our shape."""
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names the methods of the first route that matched the path; a path
        # served by several routes (GET, PUT, DELETE) takes all of theirs.
        methods = {method for route in request.app.router.routes
                   if isinstance(route, Route) and route.matches(request.scope)[0] is not Match.NONE
                   for method in route.methods or ()}
        headers["allow"] = ", ".join(sorted(methods))
    return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code, headers=headers)


def install_error_handlers(app: FastAPI, *, authenticated: bool = True) -> None:
    """Answer every error as an ErrorBody, and document it so: FastAPI's own ``{detail}``
    422, which it adds to every route with parameters, is replaced by ErrorBody; the access
    guard's answers (401 and 421 anywhere, 403 and 415 on a state-changing request) are
    added to every operation, and, when the server has a token (``authenticated``), the
    bearer scheme every operation requires."""
    for error_type in _ERROR_RESPONSES:
        app.add_exception_handler(error_type, _error_response)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = generate()
            error_content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
            for methods in document.get("paths", {}).values():
                for method, operation in methods.items():
                    responses = operation.setdefault("responses", {})
                    invalid = responses.get("422")
                    if invalid is not None and "HTTPValidationError" in str(invalid):
                        responses["422"] = {"description": _DESCRIPTIONS[422], "content": error_content}
                    guarded = ((401,) if authenticated else ()) + _GUARD_STATUSES + (
                        _GUARD_STATE_CHANGING_STATUSES if method.upper() in STATE_CHANGING else ())
                    for status in guarded:
                        responses.setdefault(str(status), {"description": _DESCRIPTIONS[status],
                                                           "content": error_content})
            components = document.setdefault("components", {})
            if authenticated:  # every operation needs the bearer token: the guard checks it before any route
                components.setdefault("securitySchemes", {})["bearer"] = {
                    "type": "http", "scheme": "bearer",
                    "description": "The server's token: OPGRAPH_TOKEN, its token file, or the one it generated "
                                   "(its sign-in URL)"}
                document["security"] = [{"bearer": []}]
            schemas = components.get("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
