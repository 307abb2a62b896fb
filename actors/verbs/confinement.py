"""Path confinement: reads and writes that cannot leave a root folder, whatever the path says.

Owns the one check every file-touching tool, workspace copy and engine shares. A path
is refused before anything is written when it is absolute, climbs out with ``..``, or
passes through a symbolic link (one made earlier by a test command included): every
component is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a link
swapped in between the check and the write cannot redirect it. A file is replaced by a
rename within its folder, so a hard link into the copy cannot carry a write outside.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import PathEscapeError, SandboxError

__all__ = [
    "check_inside",
    "delete_confined",
    "list_confined",
    "read_confined",
    "relative_parts",
    "write_confined",
]

_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def relative_parts(path: str, root: str = "") -> tuple[str, ...]:
    """``path`` as components below ``root``; PathEscapeError when it is not plainly inside.

    Lexical only (no file system access): absolute paths, ``..``, NUL bytes and the
    empty path are refused; ``.`` and repeated slashes are dropped.
    """
    if not isinstance(path, str):
        raise PathEscapeError(f"a path must be text, got {type(path).__name__}", path=repr(path), root=root)
    if "\0" in path:
        raise PathEscapeError(f"the path {path!r} contains a NUL byte", path=path, root=root)
    if os.path.isabs(path):
        raise PathEscapeError(f"the path {path!r} is absolute; paths must be relative to the workspace",
                              path=path, root=root)
    parts = tuple(part for part in path.split("/") if part not in ("", "."))
    if ".." in parts:
        raise PathEscapeError(f"the path {path!r} climbs out of the workspace with '..'", path=path, root=root)
    if not parts:
        raise PathEscapeError(f"the path {path!r} names the workspace itself, not a file in it", path=path, root=root)
    return parts


def check_inside(root: str, path: str) -> str:
    """The absolute path ``path`` names inside ``root`` (relative to it, or absolute within it).

    Refuses with PathEscapeError a path that leads out, lexically or through a symbolic
    link that exists now. For checking a tool's argument before the tool runs; the
    writes and reads below do not depend on it staying true.
    """
    if not isinstance(path, str) or "\0" in path:
        raise PathEscapeError(f"the path {path!r} is not a usable path", path=repr(path), root=root)
    real_root = os.path.realpath(root)
    if os.path.isabs(path):
        candidate = path
    else:
        parts = [part for part in path.split("/") if part not in ("", ".")]
        if ".." in parts:
            raise PathEscapeError(f"the path {path!r} climbs out of {root} with '..'", path=path, root=root)
        candidate = os.path.join(real_root, *parts)  # "." or "" is the root itself
    resolved = os.path.realpath(candidate)
    if resolved != real_root and not resolved.startswith(real_root.rstrip(os.sep) + os.sep):
        raise PathEscapeError(f"the path {path!r} leads outside {root} (to {resolved})", path=path, root=root)
    return resolved


def _open_root(root: str) -> int:
    try:
        # The root itself is trusted (it may sit under a linked /tmp): followed once, here.
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SandboxError(f"the workspace folder {root} cannot be opened: {exc.strerror}") from None


def _is_link(name: str, parent: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=parent).st_mode)
    except OSError:
        return False


@contextmanager
def _parent(root: str, path: str, *, create: bool) -> Iterator[tuple[int | None, str, tuple[str, ...]]]:
    """The descriptor of the folder holding ``path`` and its last component.

    Each folder is opened without following links; missing folders are made when
    ``create``, else the descriptor is None (the file cannot exist).
    """
    parts = relative_parts(path, root)
    current = _open_root(root)
    opened = [current]
    try:
        for index, part in enumerate(parts[:-1]):
            try:
                current = os.open(part, _DIRECTORY_FLAGS, dir_fd=current)
            except FileNotFoundError:
                if not create:
                    yield None, parts[-1], parts
                    return
                os.mkdir(part, 0o755, dir_fd=current)
                current = os.open(part, _DIRECTORY_FLAGS, dir_fd=current)
            except OSError as exc:
                where = "/".join(parts[: index + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, current):
                    raise PathEscapeError(f"the path {path!r} passes through the symbolic link {where!r}; "
                                          "writes never follow links", path=path, root=root) from None
                raise SandboxError(f"the path {path!r}: {where!r} is not a folder ({exc.strerror})") from None
            opened.append(current)
        yield current, parts[-1], parts
    finally:
        for descriptor in reversed(opened):
            os.close(descriptor)


def write_confined(root: str, path: str, content: bytes, *, mode: int = 0o644) -> int:
    """Write ``content`` to ``path`` under ``root``; returns the bytes written.

    A new file gets ``mode``; a replaced one keeps its own permissions.

    Refused (PathEscapeError, nothing written) when the path leads out or its file or any
    folder on the way is a symbolic link. The file is written beside its target and
    renamed over it, so an existing hard link is replaced, never written through.
    """
    with _parent(root, path, create=True) as (parent, name, _):
        assert parent is not None  # create=True makes every folder
        try:
            existing = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            existing = None
        if existing is not None and stat.S_ISLNK(existing.st_mode):
            raise PathEscapeError(f"the path {path!r} is a symbolic link; writes never follow links",
                                  path=path, root=root)
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise SandboxError(f"the path {path!r} is a folder, not a file")
        if existing is not None:
            mode = stat.S_IMODE(existing.st_mode)  # a replaced file keeps its permissions
        temporary = f".{name}.{uuid.uuid4().hex[:12]}.opgraph-write"
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | getattr(os, "O_CLOEXEC", 0), mode, dir_fd=parent)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(content)
                os.fchmod(handle.fileno(), mode)  # exactly ``mode``, whatever the umask
            os.rename(temporary, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=parent)
            except FileNotFoundError:
                pass
            raise
        return len(content)


def delete_confined(root: str, path: str) -> bool:
    """Remove the file (or link) ``path`` under ``root``; False when it did not exist.

    Removing a link removes the link, never what it points at; a folder is refused.
    """
    with _parent(root, path, create=False) as (parent, name, _):
        if parent is None:
            return False
        try:
            found = os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(found.st_mode):
            raise SandboxError(f"the path {path!r} is a folder; only files can be deleted")
        os.unlink(name, dir_fd=parent)
        return True


def read_confined(root: str, path: str, *, limit: int | None = None) -> bytes | None:
    """The bytes of the file ``path`` under ``root`` (at most ``limit``), or None when missing.

    A symbolic link on the way or at the end is refused (PathEscapeError), whether or
    not it points inside.
    """
    with _parent(root, path, create=False) as (parent, name, _):
        if parent is None:
            return None
        try:
            descriptor = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=parent)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP or _is_link(name, parent):
                raise PathEscapeError(f"the path {path!r} is a symbolic link; reads never follow links",
                                      path=path, root=root) from None
            raise SandboxError(f"the path {path!r} cannot be read: {exc.strerror}") from None
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise SandboxError(f"the path {path!r} is not a regular file")
            return handle.read() if limit is None else handle.read(limit)


def list_confined(root: str, path: str = ".", *, limit: int = 2000, hidden: bool = False) -> list[str]:
    """Regular files under ``root/path`` (relative to ``root``), sorted, at most ``limit``.

    Links are listed as files are not: the walk never follows one. Hidden entries
    (a leading dot) are left out unless ``hidden``.
    """
    start = "." if path in ("", ".") else "/".join(relative_parts(path, root))
    top = os.path.join(root, start)
    if start != "." and (os.path.islink(top) or not os.path.isdir(top)):
        check_inside(root, start)  # a link out is refused, named; a missing folder lists nothing
        return []
    found: list[str] = []
    for folder, folders, files, _ in os.fwalk(top, follow_symlinks=False):
        if not hidden:
            folders[:] = [name for name in folders if not name.startswith(".")]
        folders.sort()
        relative = os.path.relpath(folder, root)
        for name in sorted(files):
            if not hidden and name.startswith("."):
                continue
            full = os.path.join(folder, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            found.append(name if relative == "." else f"{relative}/{name}")
            if len(found) >= limit:
                return found
    return found
