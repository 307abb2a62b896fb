"""The HTTP API (`opgraph serve`): the FastAPI app, its request-body guard and its error answers.

Routes resolve lanes through the lane registry and read runs from the run store; nothing
here compiles or executes a definition.
"""

from .app import CANCEL_GRACE_SECONDS, RunTasks, create_app, serve
from .body import DEFAULT_MAX_BODY_BYTES, MAX_JSON_DEPTH, RequestBodyGuard
from .problems import ErrorBody, RunStateConflictError, RuntimeUnavailableError

__all__ = [
    "CANCEL_GRACE_SECONDS",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "ErrorBody",
    "RequestBodyGuard",
    "RunStateConflictError",
    "RunTasks",
    "RuntimeUnavailableError",
    "create_app",
    "serve",
]
