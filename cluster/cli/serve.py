"""`opgraph serve`: its options (who may call it, through which names, and its bounds) and its refusals.

Owns the serve command's parser, every setting a flag with an environment variable and a
default shown in `opgraph serve --help`, and turning a bind the settings forbid or a token
that cannot be used into a usage error before anything (the store, Ray) starts. Serving
itself is opgraph.cluster.http's; nothing here checks a request.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..command_line import RAY_ADDRESS, STORE, TOKEN, ExitCode, SharedOption, add_options, positive_float, positive_int
from ..http.body import DEFAULT_MAX_BODY_BYTES
from ..http.limits import DEFAULT_BODY_TIMEOUT, DEFAULT_HEAD_TIMEOUT, DEFAULT_MAX_RUNS
from ..store import DEFAULT_MAX_VERSIONS
from .runs import add_retention_options, retention_schedule
from .spine import refused, subcommand

__all__ = ["add_serve_parser", "add_token_parser"]

ALLOWED_HOSTS_ENV = "OPGRAPH_ALLOWED_HOSTS"
ALLOWED_ORIGINS_ENV = "OPGRAPH_ALLOWED_ORIGINS"

def _setting(flag: str, variable: str, help_text: str, kind: Any, default: Any, metavar: str) -> SharedOption:
    """One of the server's settings: ``flag``, whose default is ``variable`` when set, else ``default``."""
    shown = f"{default:g}" if isinstance(default, float) else default
    return SharedOption((flag,), f"{help_text} ({variable}, else {shown})",
                        {"type": kind, "default": default, "metavar": metavar}, environment=variable)


# The server's bounds: each a flag whose default comes from its environment variable.
_SETTINGS = (
    _setting("--max-runs", "OPGRAPH_MAX_RUNS", "runs admitted at once; one more is refused with 429 and "
             "Retry-After", positive_int, DEFAULT_MAX_RUNS, "N"),
    _setting("--max-versions", "OPGRAPH_MAX_VERSIONS", "versions one workflow may have; one more is refused with "
             "409", positive_int, DEFAULT_MAX_VERSIONS, "N"),
    _setting("--max-body-bytes", "OPGRAPH_MAX_BODY_BYTES", "largest request body taken; a larger one is refused "
             "with 413 before it is read whole", positive_int, DEFAULT_MAX_BODY_BYTES, "N"),
    _setting("--head-timeout", "OPGRAPH_HEAD_TIMEOUT", "seconds a connection has to send a request's line and "
             "headers, then it is answered 408 and closed", positive_float, DEFAULT_HEAD_TIMEOUT, "SECONDS"),
    _setting("--body-timeout", "OPGRAPH_BODY_TIMEOUT", "seconds a request has to send its body once its headers "
             "are in, then it is closed", positive_float, DEFAULT_BODY_TIMEOUT, "SECONDS"),
)
WORKFLOW_ROOT = SharedOption(
    ("--workflow-root",), "the folder a coding node's cwd must be inside (OPGRAPH_WORKFLOW_ROOT; default: none, and "
                          "such a node cannot run here); a client never picks it",
    {"default": None, "metavar": "DIR"}, environment="OPGRAPH_WORKFLOW_ROOT")


def _listed(given: list[str] | None, variable: str) -> tuple[str, ...]:
    """The values of a repeatable option, then the comma-separated ones of its environment variable."""
    from_environment = [item.strip() for item in os.environ.get(variable, "").split(",") if item.strip()]
    return tuple([*(given or []), *from_environment])


def _serve_api(arguments: argparse.Namespace) -> int:
    # Lazy: FastAPI and uvicorn load only for the server.
    from opgraph.kernel import OpGraphError

    from ..http import serve
    from ..http.auth import TOKEN_ENV, BindRefusedError, ServerTokenError, server_token

    try:
        token = server_token(token_file=arguments.token_file, no_auth=arguments.no_auth)
        if arguments.no_auth and (arguments.token_file or os.environ.get(TOKEN_ENV)):
            print(f"opgraph serve: --no-auth: the token ({'--token-file' if arguments.token_file else TOKEN_ENV}) "
                  "is ignored", file=sys.stderr)
        started = serve(arguments.host, arguments.port, store_path=arguments.store, address=arguments.address,
                        max_body_bytes=arguments.max_body_bytes, token=token,
                        allowed_hosts=_listed(arguments.allowed_host, ALLOWED_HOSTS_ENV),
                        allowed_origins=_listed(arguments.allowed_origin, ALLOWED_ORIGINS_ENV),
                        max_runs=arguments.max_runs, max_versions=arguments.max_versions,
                        head_timeout=arguments.head_timeout, body_timeout=arguments.body_timeout,
                        workflow_root=arguments.workflow_root, retention=retention_schedule(arguments))
    except (BindRefusedError, ServerTokenError) as exc:  # refused before the store or Ray started
        print(f"opgraph serve: refused: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except ValueError as exc:  # an allowed host or origin that is none
        print(f"opgraph serve: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except OpGraphError as exc:  # the store cannot be opened: nothing was served
        return refused("opgraph serve", exc, ExitCode.USAGE)
    return ExitCode.OK if started else ExitCode.FAILED


def add_serve_parser(subcommands: Any) -> None:
    api = subcommand(
        subcommands, "serve", "serve the workflow HTTP API (definitions CRUD, 202-admitted runs) until Ctrl-C",
        codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE, ExitCode.RUNTIME),
        description="FastAPI server of the fixed-workflow lane: /api/workflows (CRUD, versions) and "
                    "/api/workflows/NAME/runs (202 admission), /api/runs/ID (status, signals, results, "
                    "cancel). Interactive docs at /docs. The runtime starts with the server (on --address), "
                    "before it takes requests. Every request needs the server's token (Authorization: Bearer "
                    "TOKEN): OPGRAPH_TOKEN, or a token file of mode 0600 (--token-file, OPGRAPH_TOKEN_FILE); "
                    "without one, a loopback server generates one on first start, keeps it in "
                    "$OPGRAPH_HOME/server-token (mode 0600, read by clients on this machine) and prints a sign-in "
                    "URL. Any host but loopback needs a token the operator set.")
    api.add_argument("--host", default="127.0.0.1",
                     help="interface to listen on (127.0.0.1); anything but loopback needs OPGRAPH_TOKEN or "
                          "--token-file")
    api.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    add_options(api, STORE, RAY_ADDRESS)
    api.add_argument("--token-file", default=None, metavar="FILE",
                     help="a file (mode 0600) holding the token every request must send (default: OPGRAPH_TOKEN, "
                          "else the file OPGRAPH_TOKEN_FILE names, else the generated $OPGRAPH_HOME/server-token)")
    api.add_argument("--no-auth", action="store_true",
                     help="require no token (loopback only; a warning is printed): any program or web page that "
                          "reaches the port may start and control runs")
    api.add_argument("--allowed-host", action="append", default=None, metavar="NAME[:PORT]",
                     help=f"a Host this server answers besides its own address and localhost (repeat it; also "
                          f"{ALLOWED_HOSTS_ENV}, comma-separated); any other Host is refused with 421")
    api.add_argument("--allowed-origin", action="append", default=None, metavar="SCHEME://HOST[:PORT]",
                     help=f"a web origin whose pages may change things here besides the server's own (repeat it; "
                          f"also {ALLOWED_ORIGINS_ENV}, comma-separated); any other Origin is refused with 403")
    add_options(api, *_SETTINGS, WORKFLOW_ROOT)
    add_retention_options(api)
    api.set_defaults(handler=_serve_api)


def _print_token(arguments: argparse.Namespace) -> int:
    from ..http.auth import ServerTokenError, client_token

    try:
        token = client_token(arguments.token)
    except ServerTokenError as exc:  # a token file others may read, say
        print(f"opgraph token: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if token is None:
        print("opgraph token: no token here: set OPGRAPH_TOKEN, or start `opgraph serve` on this machine once "
              "(it generates one)", file=sys.stderr)
        return ExitCode.FAILED
    print(token)
    return ExitCode.OK


def add_token_parser(subcommands: Any) -> None:
    """`opgraph token`: what this machine's clients send, for a shell (`curl -H "Authorization: Bearer ..."`)."""
    token = subcommand(subcommands, "token", "print the token clients on this machine send to `opgraph serve`",
                       codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE),
                       description="Print the token the CLI and ServerClient send to `opgraph serve`: --token, "
                                   "else OPGRAPH_TOKEN, else the file OPGRAPH_TOKEN_FILE names, else the token a "
                                   "server on this machine generated in $OPGRAPH_HOME/server-token. For scripts: "
                                   'curl -H "Authorization: Bearer $(opgraph token)" ...')
    add_options(token, TOKEN)
    token.set_defaults(handler=_print_token)
