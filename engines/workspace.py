"""A workspace sandbox: a copy of the caller's folder, on a worker, that model edits and gates touch.

Owns the worker-side operations (make the copy, write a model's edits into it with path
confinement, run a gate in it, diff it against the original, remove it), the driver's
handle that calls them through the engine's port (``Sandbox``), the read-only file tools
an agent may be given, and ``apply_changes``, which writes an accepted patch into the
original folder. The original is never touched until the caller applies.

Where it runs: the copy is made by whichever worker takes the turn, under its temporary
folder, and later turns may land on another worker; so the workers and the caller share
the file system holding the workspace and the copy (one machine, or a shared mount). A
copy a worker cannot see is a typed ``SandboxError``, never a silent miss.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from opgraph.actors import TurnError
from opgraph.actors.verbs import (
    GateError,
    PathEscapeError,
    SandboxError,
    Tool,
    delete_confined,
    gate_environment,
    list_confined,
    read_confined,
    run_gate,
    write_confined,
)
from opgraph.actors.verbs.confinement import relative_parts

from .errors import WorkspaceConflictError

__all__ = [
    "SANDBOX_PREFIX",
    "WORKSPACE_OPERATIONS",
    "FileChange",
    "FileEdit",
    "Sandbox",
    "WorkspaceReader",
    "apply_changes",
    "register_workspace_operations",
]

SANDBOX_PREFIX = "opgraph-sandbox-"
_MARKER = ".opgraph-sandbox"  # in the sandbox root, beside (not inside) the copy
_SNAPSHOT_FILE_CHARS = 20_000
_SNAPSHOT_LISTING = 500
_TURN_MARGIN_S = 60.0  # a gate turn's bound beyond the gate's own timeout and kill grace


class FileEdit(BaseModel):
    """One edit a model proposes: the whole new text of ``path`` (relative), or its deletion."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="the file's path relative to the workspace root, with / separators")
    content: str = Field("", description="the file's complete new text (ignored when delete is true)")
    delete: bool = False


class FileChange(BaseModel):
    """One file the result changes, against the original workspace.

    ``status`` is ``added``, ``modified`` or ``deleted``; ``diff`` is its unified diff with
    git's header (``git apply`` reads the joined diffs); ``base_sha256`` is the original's
    hash (None for an added file), checked before applying; ``content`` is the new text.
    """

    model_config = ConfigDict(extra="forbid")

    path: str
    status: str
    diff: str
    base_sha256: str | None = None
    content: str | None = None
    binary: bool = False
    diff_truncated: bool = False


# -- the worker side --------------------------------------------------------------------------
def _sandbox_root(sandbox: str) -> str:
    """``sandbox`` checked to be a sandbox this module made and this worker can see."""
    if not isinstance(sandbox, str) or not os.path.isabs(sandbox) \
            or not os.path.basename(sandbox.rstrip(os.sep)).startswith(SANDBOX_PREFIX):
        raise SandboxError(f"{sandbox!r} is not a workspace sandbox")
    if not os.path.isfile(os.path.join(sandbox, _MARKER)):
        raise SandboxError(f"the workspace copy {sandbox} is not on this worker's file system (or was removed); "
                           "the workers and the caller must share the file system holding the workspace")
    return sandbox


def _copy_tree(source: str, target: str, *, max_bytes: int) -> tuple[int, int, list[str]]:
    """Copy ``source`` into the new folder ``target``: folders, regular files, links as links.

    Other kinds (sockets, FIFOs, devices) are skipped and named. SandboxError past ``max_bytes``.
    """
    files = total = 0
    skipped: list[str] = []
    for folder, folders, names, _ in os.fwalk(source, follow_symlinks=False):
        relative = os.path.relpath(folder, source)
        destination = target if relative == "." else os.path.join(target, relative)
        for name in list(folders):
            full = os.path.join(folder, name)
            if os.path.islink(full):  # a link to a folder: copied as the link, never walked
                os.symlink(os.readlink(full), os.path.join(destination, name))
                folders.remove(name)
            else:
                os.mkdir(os.path.join(destination, name), 0o755)
        for name in names:
            full = os.path.join(folder, name)
            found = os.lstat(full)
            if stat.S_ISLNK(found.st_mode):
                os.symlink(os.readlink(full), os.path.join(destination, name))
            elif stat.S_ISREG(found.st_mode):
                total += found.st_size
                if total > max_bytes:
                    raise SandboxError(f"the workspace {source} holds more than {max_bytes} bytes "
                                       "(max_workspace_bytes); give a smaller folder")
                shutil.copy2(full, os.path.join(destination, name), follow_symlinks=False)
                files += 1
            else:
                skipped.append(os.path.relpath(full, source))
    return files, total, skipped


def _snapshot(root: str, max_chars: int) -> tuple[list[str], dict[str, str]]:
    """The copy's file list and the text of its files, up to ``max_chars`` in all."""
    listing = list_confined(root, limit=_SNAPSHOT_LISTING)
    texts: dict[str, str] = {}
    left = max_chars
    for path in sorted(listing, key=lambda item: (item.count("/"), item)):
        if left <= 0:
            break
        try:
            data = read_confined(root, path, limit=min(left, _SNAPSHOT_FILE_CHARS) * 4)
        except SandboxError:
            continue
        if data is None or b"\0" in data[:4096]:
            continue
        text = data.decode("utf-8", errors="replace")[: min(left, _SNAPSHOT_FILE_CHARS)]
        texts[path] = text
        left -= len(text)
    return listing, texts


def _open_sync(source: str, max_bytes: int, snapshot_chars: int) -> dict[str, Any]:
    if not os.path.isdir(source):
        raise SandboxError(f"the workspace {source} is not a folder this worker can see; the workers and the "
                           "caller must share the file system holding it")
    sandbox = tempfile.mkdtemp(prefix=SANDBOX_PREFIX)
    try:
        copy = os.path.join(sandbox, "work")
        for name in ("work", "home", "tmp"):
            os.mkdir(os.path.join(sandbox, name), 0o700)
        with open(os.path.join(sandbox, _MARKER), "w", encoding="utf-8") as marker:
            marker.write(source)
        files, total, skipped = _copy_tree(source, copy, max_bytes=max_bytes)
        listing, texts = _snapshot(copy, snapshot_chars)
    except BaseException:
        _remove(sandbox)
        raise
    return {"sandbox": sandbox, "copy": copy, "files": files, "bytes": total, "skipped": skipped,
            "listing": listing, "texts": texts}


async def workspace_open(branch: Any, source: str = "", max_bytes: int = 512 * 2**20, snapshot_chars: int = 60_000,
                         **_: Any) -> dict[str, Any]:
    """Operation: copy ``source`` into a new sandbox; its paths, size and a text snapshot."""
    return await asyncio.to_thread(_open_sync, source, max_bytes, snapshot_chars)


def _precheck(root: str, path: str) -> None:
    """Refuse a path that is lexically out, or passes a link that exists now (before any write)."""
    parts = relative_parts(path, root)
    current = root
    for part in parts:
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise PathEscapeError(f"the path {path!r} passes through the symbolic link "
                                  f"{os.path.relpath(current, root)!r}; writes never follow links",
                                  path=path, root=root)
        if not os.path.exists(current):
            return


def _write_sync(copy: str, edits: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    parsed = [FileEdit.model_validate(edit) for edit in edits]
    try:
        for edit in parsed:  # every path checked before the first write: a refusal writes nothing
            _precheck(copy, edit.path)
        written = []
        for edit in parsed:
            if edit.delete:
                delete_confined(copy, edit.path)
            else:
                write_confined(copy, edit.path, edit.content.encode("utf-8"))
            written.append("/".join(relative_parts(edit.path)))
    except PathEscapeError as exc:
        return {"written": [], "refused": {"path": exc.path, "reason": exc.message, "error_type": "PathEscapeError"}}
    except SandboxError as exc:
        return {"written": [], "refused": {"path": "", "reason": exc.message, "error_type": type(exc).__name__}}
    return {"written": written, "refused": None}


async def workspace_write(branch: Any, sandbox: str = "", edits: Sequence[Mapping[str, Any]] = (),
                          **_: Any) -> dict[str, Any]:
    """Operation: write ``edits`` into the copy, all or none; a refusal names the path."""
    root = _sandbox_root(sandbox)
    return await asyncio.to_thread(_write_sync, os.path.join(root, "work"), list(edits))


async def workspace_gate(branch: Any, sandbox: str = "", command: str | list[str] = "", timeout_s: float = 600.0,
                         kill_grace_s: float = 2.0, max_output_bytes: int = 64 * 1024,
                         keep_env: Sequence[str] = (), **_: Any) -> dict[str, Any]:
    """Operation: run the gate ``command`` in the copy, in its own process group, scrubbed."""
    root = _sandbox_root(sandbox)
    environment = gate_environment(home=os.path.join(root, "home"), tmp=os.path.join(root, "tmp"), keep=keep_env)
    try:
        result = await run_gate(command, os.path.join(root, "work"), timeout_s=timeout_s, env=environment,
                                kill_grace_s=kill_grace_s, max_output_bytes=max_output_bytes)
    except GateError as exc:
        return {"command": command if isinstance(command, str) else " ".join(command), "returncode": None,
                "timed_out": False, "duration_s": 0.0, "output_tail": exc.message, "output_bytes": 0,
                "truncated": False, "killed": False, "notes": ["the command could not be started"],
                "passed": False}
    return result.as_dict()


def _digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def _text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


def _git_mode(root: str, path: str) -> str:
    try:
        executable = os.lstat(os.path.join(root, path)).st_mode & 0o111
    except OSError:
        executable = 0
    return "100755" if executable else "100644"


def _change(source: str, copy: str, path: str, max_diff_chars: int) -> FileChange | None:
    try:
        before = read_confined(source, path)
    except SandboxError:
        before = None  # a link or a folder in the original: compared as absent
    try:
        after = read_confined(copy, path)
    except SandboxError as exc:
        return FileChange(path=path, status="unreadable", diff=f"# {path}: {exc.message}", binary=True)
    if before == after:
        return None
    status = "added" if before is None else "deleted" if after is None else "modified"
    old_text, new_text = _text(before), _text(after)
    binary = (before is not None and old_text is None) or (after is not None and new_text is None)
    # git's header, so `git apply` takes the patch whole, empty added or deleted files included.
    header = f"diff --git a/{path} b/{path}\n"
    if status != "modified":
        mode = _git_mode(copy if after is not None else source, path)
        header += f"{'new' if status == 'added' else 'deleted'} file mode {mode}\n"
    if binary:
        diff = header + f"Binary files a/{path} and b/{path} differ\n"
    else:
        diff = header + "".join(difflib.unified_diff(
            _lines(old_text or ""), _lines(new_text or ""),
            fromfile="/dev/null" if before is None else f"a/{path}",
            tofile="/dev/null" if after is None else f"b/{path}"))
    truncated = len(diff) > max_diff_chars
    if truncated:
        diff = diff[:max_diff_chars] + f"\n# ... diff of {path} truncated at {max_diff_chars} characters\n"
    return FileChange(path=path, status=status, diff=diff, base_sha256=_digest(before), content=new_text,
                      binary=binary, diff_truncated=truncated)


def _changes_sync(source: str, copy: str, paths: Iterable[str], max_diff_chars: int) -> list[dict[str, Any]]:
    changes = []
    for path in sorted(set(paths)):
        change = _change(source, copy, path, max_diff_chars)
        if change is not None:
            changes.append(change.model_dump())
    return changes


async def workspace_changes(branch: Any, sandbox: str = "", source: str = "", paths: Sequence[str] = (),
                            max_diff_chars: int = 200_000, **_: Any) -> list[dict[str, Any]]:
    """Operation: the copy's ``paths`` against the original ``source``, as FileChange dicts."""
    root = _sandbox_root(sandbox)
    return await asyncio.to_thread(_changes_sync, source, os.path.join(root, "work"), list(paths), max_diff_chars)


def _remove(sandbox: str) -> None:
    def writable(function: Any, path: str, _: Any) -> None:
        os.chmod(os.path.dirname(path), 0o700)  # a test may leave read-only folders behind
        function(path)

    if sys.version_info >= (3, 12):
        shutil.rmtree(sandbox, onexc=writable)
    else:
        shutil.rmtree(sandbox, onerror=writable)


async def workspace_close(branch: Any, sandbox: str = "", **_: Any) -> bool:
    """Operation: remove the sandbox (the copy, its home and temporary folders)."""
    try:
        root = _sandbox_root(sandbox)
    except SandboxError:
        return False
    await asyncio.to_thread(_remove, root)
    return True


WORKSPACE_OPERATIONS = {
    "workspace_open": workspace_open,
    "workspace_write": workspace_write,
    "workspace_gate": workspace_gate,
    "workspace_changes": workspace_changes,
    "workspace_close": workspace_close,
}


def register_workspace_operations(session: Any) -> None:
    """Register the sandbox operations on ``session`` once (they run on its workers)."""
    operations = getattr(session, "operations", {})
    for name, function in WORKSPACE_OPERATIONS.items():
        if getattr(operations.get(name), "fn", None) is not function:
            session.register_operation(name, function, record_turn=False)


# -- tools an agent may be given ---------------------------------------------------------------
class WorkspaceReader:
    """Read-only file tools over one folder (a sandbox's copy); paths are confined to it."""

    def __init__(self, root: str, *, max_chars: int = 40_000) -> None:
        self.root = root
        self.max_chars = max_chars

    def read_file(self, path: str) -> str:
        """The text of a file of the workspace (a path relative to its root)."""
        data = read_confined(self.root, path, limit=self.max_chars * 4)
        if data is None:
            return f"no such file: {path}"
        return data.decode("utf-8", errors="replace")[: self.max_chars]

    def list_files(self, folder: str = ".") -> list[str]:
        """The files under a folder of the workspace (relative paths; hidden ones left out)."""
        return list_confined(self.root, folder, limit=1000)

    def tools(self) -> tuple[Tool, ...]:
        return (Tool.from_function(self.read_file, name="read_file", paths=("path",)),
                Tool.from_function(self.list_files, name="list_files", paths=("folder",)))


# -- the driver's handle ---------------------------------------------------------------------
class Sandbox:
    """The caller's handle on one sandbox; every call is a turn on a worker, through ``port``."""

    def __init__(self, port: Any, branch: str, source: str, opened: Mapping[str, Any], *,
                 timeout_s: float) -> None:
        self.port = port
        self.branch = branch
        self.source = source
        self.path = str(opened["sandbox"])
        self.copy = str(opened["copy"])
        self.files = int(opened.get("files", 0))
        self.bytes = int(opened.get("bytes", 0))
        self.skipped = list(opened.get("skipped", []))
        self.listing = list(opened.get("listing", []))
        self.texts = dict(opened.get("texts", {}))
        self.timeout_s = timeout_s
        self.closed = False

    @classmethod
    async def open(cls, port: Any, branch: str, source: str, *, timeout_s: float, max_bytes: int,
                   snapshot_chars: int) -> Sandbox:
        session = getattr(port, "session", None)
        if session is not None:
            register_workspace_operations(session)
        opened = await cls._call(port, branch, "workspace_open", timeout_s, source=source, max_bytes=max_bytes,
                                 snapshot_chars=snapshot_chars)
        return cls(port, branch, source, opened, timeout_s=timeout_s)

    @staticmethod
    async def _call(port: Any, branch: str, operation: str, bound_s: float, /, **parameters: Any) -> Any:
        try:
            result = await port.turn(branch, operation, timeout=bound_s, **parameters)
        except TurnError as exc:
            if exc.error_type in ("SandboxError", "PathEscapeError", "GateError"):
                raise SandboxError(f"{operation}: {exc.message}", node_id=exc.node_id) from None
            raise
        return result.response

    async def write(self, edits: Sequence[FileEdit | Mapping[str, Any]]) -> list[str]:
        """Write ``edits`` into the copy, all or none; PathEscapeError (naming the path) when refused."""
        plain = [edit.model_dump() if isinstance(edit, BaseModel) else dict(edit) for edit in edits]
        for edit in plain:  # refused here already when lexically out: nothing is even sent
            relative_parts(str(edit.get("path", "")), self.source)
        answer = await self._call(self.port, self.branch, "workspace_write", self.timeout_s, sandbox=self.path,
                                  edits=plain)
        refused = answer.get("refused")
        if refused:
            if refused.get("error_type") == "PathEscapeError":
                raise PathEscapeError(refused["reason"], path=refused.get("path", ""), root=self.source)
            raise SandboxError(refused["reason"])
        return list(answer.get("written", []))

    async def gate(self, command: str | list[str], *, timeout_s: float, kill_grace_s: float,
                   max_output_bytes: int, keep_env: Sequence[str] = ()) -> dict[str, Any]:
        """Run the gate in the copy on a worker; the GateResult as a dict."""
        return await self._call(self.port, self.branch, "workspace_gate", timeout_s + kill_grace_s + _TURN_MARGIN_S,
                                sandbox=self.path, command=command, timeout_s=timeout_s,
                                kill_grace_s=kill_grace_s, max_output_bytes=max_output_bytes,
                                keep_env=list(keep_env))

    async def changes(self, paths: Iterable[str], *, max_diff_chars: int = 200_000) -> list[FileChange]:
        """The copy's ``paths`` that differ from the original, with their diffs."""
        paths = sorted(set(paths))
        if not paths:
            return []
        found = await self._call(self.port, self.branch, "workspace_changes", self.timeout_s, sandbox=self.path,
                                 source=self.source, paths=paths, max_diff_chars=max_diff_chars)
        return [FileChange.model_validate(item) for item in found]

    async def close(self) -> bool:
        if self.closed:
            return False
        self.closed = True
        return bool(await self._call(self.port, self.branch, "workspace_close", self.timeout_s, sandbox=self.path))


# -- applying a result ------------------------------------------------------------------------
def apply_changes(changes: Sequence[FileChange], workspace: str) -> list[str]:
    """Write ``changes`` into ``workspace``; the paths written. All or none.

    Each file must still be what the changes were computed against (``base_sha256``);
    otherwise WorkspaceConflictError names the files and nothing is written. Writes are
    confined to ``workspace`` like the copy's, and binary or unreadable changes are refused.
    """
    workspace = os.path.abspath(workspace)
    conflicts, unusable = [], []
    for change in changes:
        if change.binary or change.status == "unreadable" or (change.status != "deleted" and change.content is None):
            unusable.append(change.path)
            continue
        try:
            current = read_confined(workspace, change.path)
        except SandboxError as exc:
            conflicts.append(f"{change.path} ({exc.message})")
            continue
        if _digest(current) != change.base_sha256:
            conflicts.append(change.path)
    if unusable:
        raise WorkspaceConflictError(f"these changes cannot be applied as text: {', '.join(unusable)}")
    if conflicts:
        raise WorkspaceConflictError(f"the workspace changed since the copy was made; not applied: "
                                     f"{', '.join(conflicts)}")
    written = []
    for change in changes:
        if change.status == "deleted":
            delete_confined(workspace, change.path)
        else:
            write_confined(workspace, change.path, (change.content or "").encode("utf-8"))
        written.append(change.path)
    return written
