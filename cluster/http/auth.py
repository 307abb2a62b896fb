"""Who may call `opgraph serve`: the token a server requires, where it comes from, and the token a client sends.

Owns where a server's token comes from (``OPGRAPH_TOKEN``; a ``0600`` token file named by
``--token-file`` or ``OPGRAPH_TOKEN_FILE``; else, on loopback, one generated on first start
and kept in ``$OPGRAPH_HOME/server-token``, as Jupyter does), which binds need a token the
operator set (any but loopback), and ``client_token``, the one lookup every client (the CLI,
``ServerClient``, tests) uses to find the token to send. It checks no request itself: the
guard middleware (guard.py) does, with the token this module gives it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from opgraph.actors.settings import opgraph_home
from opgraph.kernel import OpGraphError

__all__ = [
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "TOKEN_FILE_NAME",
    "BindRefusedError",
    "ServerToken",
    "ServerTokenError",
    "check_bind",
    "client_token",
    "home_token_path",
    "is_loopback",
    "read_token_file",
    "server_token",
]

TOKEN_ENV = "OPGRAPH_TOKEN"
TOKEN_FILE_ENV = "OPGRAPH_TOKEN_FILE"
TOKEN_FILE_NAME = "server-token"
# A token the operator chooses must be at least this long: a short one can be guessed over the
# network. A generated token is 43 characters (32 random bytes, URL-safe base64).
MIN_TOKEN_LENGTH = 16
_GENERATED_BYTES = 32

TokenSource = Literal["environment", "file", "home", "none"]


class ServerTokenError(OpGraphError):
    """A token cannot be used: its file is readable by other users, unreadable or empty, or the token is too
    short. ``path`` names the file, when there is one. Nothing was served."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class BindRefusedError(OpGraphError):
    """`opgraph serve` will not listen on ``host`` with these settings (a public bind without a token the
    operator set, or ``--no-auth`` off loopback). Nothing was served."""

    def __init__(self, message: str, *, host: str) -> None:
        super().__init__(message)
        self.host = host


@dataclass(frozen=True)
class ServerToken:
    """The token a server requires, and where it came from.

    ``source`` is ``environment`` (``OPGRAPH_TOKEN``) or ``file`` (``--token-file``,
    ``OPGRAPH_TOKEN_FILE``): set by the operator; ``home``: the generated token in the opgraph
    home (``value`` is None until ``ensure`` made or read it); ``none``: ``--no-auth``.
    """

    value: str | None
    source: TokenSource
    path: Path | None = None

    @property
    def operator_set(self) -> bool:
        return self.source in ("environment", "file")

    def ensure(self) -> ServerToken:
        """This token, with the home file's token read, or generated on first start (a ``0600`` file)."""
        if self.source != "home" or self.value is not None:
            return self
        assert self.path is not None
        return ServerToken(_generated_token(self.path), "home", self.path)


def home_token_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where a loopback server keeps the token it generated: ``$OPGRAPH_HOME/server-token``."""
    return opgraph_home(environ) / TOKEN_FILE_NAME


def _checked(token: str, where: str, path: Path | None = None) -> str:
    token = token.strip()
    if len(token) < MIN_TOKEN_LENGTH or any(character.isspace() or not character.isprintable()
                                            for character in token):
        raise ServerTokenError(f"the token in {where} must be at least {MIN_TOKEN_LENGTH} printable characters "
                               "without spaces (`python -c 'import secrets; print(secrets.token_urlsafe(32))'` "
                               "makes one)", path=None if path is None else str(path))
    return token


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path``; ``ServerTokenError`` when other users may read the file (it must be ``0600``, as
    ssh asks of a key), or it cannot be read, or holds no usable token."""
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ServerTokenError(f"the token file {path} can be read by other users (mode {stat.S_IMODE(mode):04o}); "
                                   f"make it private with `chmod 600 {path}`", path=str(path))
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ServerTokenError(f"cannot read the token file {path}: {reason}", path=str(path)) from None
    return _checked(text, f"the token file {path}", path)


def _generated_token(path: Path) -> str:
    """The token in the home's token file, made on first start: a private folder, then a file created
    ``0600`` in one step (two servers starting at once agree on the first one's token)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(_GENERATED_BYTES)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token_file(path)
    except OSError as exc:
        raise ServerTokenError(f"cannot create the token file {path}: {exc.strerror or exc}",
                               path=str(path)) from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(token + "\n")
    return token


def server_token(*, token_file: str | os.PathLike[str] | None = None, no_auth: bool = False,
                 environ: Mapping[str, str] | None = None) -> ServerToken:
    """The token a server requires: ``--token-file``, else ``OPGRAPH_TOKEN``, else ``OPGRAPH_TOKEN_FILE``, else
    the home's generated token (made by ``ensure``, once the bind is known to be loopback); none with
    ``no_auth``."""
    environ = os.environ if environ is None else environ
    if no_auth:
        return ServerToken(None, "none")
    if token_file:
        return ServerToken(read_token_file(token_file), "file", Path(token_file).expanduser())
    if environ.get(TOKEN_ENV, "").strip():
        return ServerToken(_checked(environ[TOKEN_ENV], TOKEN_ENV), "environment")
    if environ.get(TOKEN_FILE_ENV, "").strip():
        return ServerToken(read_token_file(environ[TOKEN_FILE_ENV]), "file", Path(environ[TOKEN_FILE_ENV]).expanduser())
    return ServerToken(None, "home", home_token_path(environ))


def client_token(explicit: str | None = None, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The token a client sends to `opgraph serve`: ``explicit`` (``--token``), else ``OPGRAPH_TOKEN``, else the
    file ``OPGRAPH_TOKEN_FILE`` names, else the token a server on this machine generated in the opgraph home;
    None when there is none (a server started with ``--no-auth`` needs none)."""
    environ = os.environ if environ is None else environ
    if explicit:
        return explicit.strip()
    if environ.get(TOKEN_ENV, "").strip():
        return environ[TOKEN_ENV].strip()
    if environ.get(TOKEN_FILE_ENV, "").strip():
        return read_token_file(environ[TOKEN_FILE_ENV])
    path = home_token_path(environ)
    return read_token_file(path) if path.exists() else None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost``, 127.0.0.0/8 or ::1 (an empty host binds every
    interface, so it is not)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(name).is_loopback
    return False


def check_bind(host: str, token: ServerToken) -> None:
    """``BindRefusedError`` unless a server may listen on ``host`` with ``token``: any loopback host may; any
    other needs a token the operator set, and never ``--no-auth``."""
    if is_loopback(host):
        return
    if token.source == "none":
        raise BindRefusedError(f"--no-auth would let anyone who reaches {host} start runs on this machine; it is "
                               "only allowed on a loopback address (127.0.0.1, ::1, localhost)", host=host)
    if not token.operator_set:
        raise BindRefusedError(
            f"--host {host} listens beyond this machine, so the server needs a token the operator set: export "
            f"{TOKEN_ENV}=<a long random token> (or give --token-file FILE, a file of mode 0600), then start it "
            "again; a token is only generated for a loopback bind", host=host)
