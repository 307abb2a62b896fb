"""What the runtime keeps from other eyes: the opgraph home, private files, the run-log key, credentials in URLs.

Owns the opgraph home (``$OPGRAPH_HOME``, else ``~/.opgraph``, a ``0700`` folder), files
created ``0600`` (databases, keys), the run log's signing key, cutting the password out
of a URL before it is printed or stored, and finding an environment secret in bytes about
to be stored. No Ray, no event loop.
"""

from __future__ import annotations

import os
import re
import secrets as random_source
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from opgraph.kernel import RunLogIntegrityError

from .settings import opgraph_home

__all__ = [
    "RUNLOG_KEY_FILE",
    "RUNLOG_KEY_VARIABLE",
    "find_secret",
    "private_directory",
    "private_file",
    "redact_credentials",
    "redact_url",
    "runlog_key",
    "runlog_key_reader",
    "secret_values",
]

RUNLOG_KEY_VARIABLE = "OPGRAPH_RUNLOG_KEY"
RUNLOG_KEY_FILE = "runlog.key"
MIN_KEY_CHARS = 32  # a key given in the environment must be at least this long
_KEY_CHARS = 64  # a key made here: 32 random bytes, as hex text
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def private_directory(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder, created ``0700`` if it is missing (its parents as usual). The opgraph
    home is made ``0700`` even if it was not: it holds the database and the keys."""
    folder = Path(path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.resolve() == opgraph_home().resolve():
        _tighten(folder, 0o700)
    return folder


def private_file(path: str | os.PathLike[str], *, companions: tuple[str, ...] = ()) -> bool:
    """Make sure ``path`` is readable by its owner alone: created empty and ``0600`` if missing
    (True), else narrowed to ``0600`` if it was wider and is ours (and ``path + companion`` for
    each companion that exists, such as SQLite's ``-wal``). SQLite gives the ``-wal`` and
    ``-shm`` it creates the mode of the database file, so a database created here keeps them
    private too."""
    created = False
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        created = True
    except FileExistsError:
        _tighten(Path(path), 0o600)
    for companion in companions:
        _tighten(Path(f"{os.fspath(path)}{companion}"), 0o600)
    return created


def _tighten(path: Path, mode: int) -> None:
    try:
        found = path.stat()
    except FileNotFoundError:
        return
    if found.st_uid == os.getuid() and stat.S_IMODE(found.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(found.st_mode) & mode)


# -- the run log's key -------------------------------------------------------------------------
_keys: dict[tuple[str | None, str], bytes] = {}
_keys_lock = threading.Lock()


def runlog_key(*, create: bool = True) -> bytes:
    """The key the run log signs its pickled rows with (HMAC-SHA256), never stored in the database.

    ``OPGRAPH_RUNLOG_KEY`` (at least 32 characters) if set: give every machine of a cluster
    the same one. Else ``runlog.key`` in the opgraph home, made ``0600`` on first use (with
    ``create``); a reader that finds none raises ``RunLogIntegrityError``.
    """
    given = os.environ.get(RUNLOG_KEY_VARIABLE) or None
    home = os.environ.get("OPGRAPH_HOME", "")
    found = _keys.get((given, home))
    if found is not None:
        return found
    with _keys_lock:
        key = _keys[(given, home)] = _given_key(given) if given is not None else _key_file(create)
    return key


def runlog_key_reader() -> bytes:
    """``runlog_key`` for a reader: it never makes a key (one made now could check nothing)."""
    return runlog_key(create=False)


def _given_key(text: str) -> bytes:
    if len(text) < MIN_KEY_CHARS:
        raise RunLogIntegrityError(f"{RUNLOG_KEY_VARIABLE} must be at least {MIN_KEY_CHARS} characters long")
    return text.encode()


def _key_file(create: bool) -> bytes:
    path = opgraph_home() / RUNLOG_KEY_FILE
    if not path.exists():
        if not create:
            raise RunLogIntegrityError(f"this row is signed, and there is no run-log key here ({path}, or "
                                       f"{RUNLOG_KEY_VARIABLE}) to check it with: was the database copied from "
                                       "another machine? Bring that machine's key")
        _make_key_file(path)
    _tighten(path, 0o600)
    text = path.read_text().strip()
    if len(text) < MIN_KEY_CHARS:
        raise RunLogIntegrityError(f"the run-log key in {path} is shorter than {MIN_KEY_CHARS} characters")
    return text.encode()


def _make_key_file(path: Path) -> None:
    """A new key, written whole to a private file and linked in place: of several processes
    making one at once, the first link wins and every process reads that one."""
    private_directory(path.parent)
    draft = path.with_name(f".{path.name}.{os.getpid()}.{random_source.token_hex(4)}")
    handle = os.open(draft, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(handle, random_source.token_hex(_KEY_CHARS // 2).encode() + b"\n")
        os.fsync(handle)
    finally:
        os.close(handle)
    try:
        os.link(draft, path)
    except FileExistsError:
        pass  # another process made it first: its key is the one
    finally:
        os.unlink(draft)


# -- credentials in URLs -----------------------------------------------------------------------
# scheme://user:password@host: the password goes, the user stays (it says which account).
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/?#@]*):(?P<password>[^\s/?#@]*)@")


def redact_url(url: str) -> str:
    """``url`` with the password of its ``user:password@`` part replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\g<head>:***@", url)


def redact_credentials(text: str) -> str:
    """``text`` (a message) with the password of every URL in it replaced by ``***``."""
    return _URL_PASSWORD.sub(r"\g<head>:***@", text)


# -- secrets about to be stored ------------------------------------------------------------------
_SECRET_NAME = re.compile(r"(API_?KEY|_KEY$|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)", re.IGNORECASE)
# Shorter values are not looked for: a graph of a megabyte holds many short strings by chance
# (a password "opgraph" in a run about opgraph), and a false find would refuse every run.
MIN_SECRET_CHARS = 12


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """Secrets this process's environment holds, by where they come from: the value of every
    variable named like a key, token, secret or password, and the password in any URL-valued
    variable (``OPENAI_BASE_URL=https://user:password@host``)."""
    environ = os.environ if environ is None else environ
    found: dict[str, bytes] = {}
    for name, value in environ.items():
        if _SECRET_NAME.search(name) and len(value) >= MIN_SECRET_CHARS:
            found[name] = value.encode()
        for match in _URL_PASSWORD.finditer(value):
            if len(match.group("password")) >= MIN_SECRET_CHARS:
                found[f"the password in {name}"] = match.group("password").encode()
    return found


def find_secret(data: bytes, secrets: Mapping[str, bytes]) -> str | None:
    """Where the first of ``secrets`` found in ``data`` came from (``secret_values``), else None."""
    for name, value in secrets.items():
        if value in data:
            return name
    return None
