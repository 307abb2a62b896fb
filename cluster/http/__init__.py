"""The HTTP API (`opgraph serve`): the FastAPI app, the gates every request passes, its error answers, and a client.

Routes resolve lanes through the lane registry and read runs from the run store; nothing
here compiles or executes a definition. Every request passes the access guard (token, Host,
Origin, content type) and the body guard before any route; connections are held to read
deadlines; ``ServerClient`` calls the API with the token ``client_token`` finds. Names load lazily
(PEP 562), so `opgraph serve`'s parser reads its defaults without loading FastAPI or Ray.
"""

from opgraph.actors.lazy_names import lazy_names

_SOURCES = {
    "app": ("CANCEL_GRACE_SECONDS", "RunTasks", "create_app", "serve", "sign_in_url"),
    "auth": ("TOKEN_ENV", "TOKEN_FILE_ENV", "BindRefusedError", "ServerToken", "ServerTokenError", "check_bind",
             "client_token", "home_token_path", "is_loopback", "server_token"),
    "body": ("DEFAULT_MAX_BODY_BYTES", "MAX_JSON_DEPTH", "RequestBodyGuard"),
    "client": ("ServerClient", "ServerRequestError"),
    "deadlines": ("DEFAULT_BODY_TIMEOUT", "DEFAULT_HEAD_TIMEOUT", "DeadlineProtocol", "deadline_protocol"),
    "guard": ("AccessGuard", "AccessPolicy"),
    "problems": ("ErrorBody", "RunCapacityError", "RunStateConflictError", "RuntimeUnavailableError"),
    "runs": ("DEFAULT_MAX_RUNS", "RETRY_AFTER_SECONDS"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [
    "CANCEL_GRACE_SECONDS",
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HEAD_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_RUNS",
    "MAX_JSON_DEPTH",
    "RETRY_AFTER_SECONDS",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "AccessGuard",
    "AccessPolicy",
    "BindRefusedError",
    "DeadlineProtocol",
    "ErrorBody",
    "RequestBodyGuard",
    "RunCapacityError",
    "RunStateConflictError",
    "RunTasks",
    "RuntimeUnavailableError",
    "ServerClient",
    "ServerRequestError",
    "ServerToken",
    "ServerTokenError",
    "check_bind",
    "client_token",
    "create_app",
    "deadline_protocol",
    "home_token_path",
    "is_loopback",
    "serve",
    "server_token",
    "sign_in_url",
]


__getattr__, __dir__ = lazy_names(__name__, _MODULE_OF, __all__)
