"""What a job takes to the cluster: opgraph itself, as a ``py_modules`` directory of Ray's runtime environment.

Owns staging the running opgraph's code (its ``kernel``, ``actors``, ``engines`` and
``cluster`` folders, wherever they are installed, editable or not) as one ``opgraph/``
folder, and the runtime environment that names it. Ray uploads the folder with the job and
puts it on the path of the job's driver and of every worker process the job starts (the
executor, workers and branch stores too, detached or not), so a cluster whose nodes have
only Ray and opgraph's dependencies runs opgraph's jobs. It does not submit anything:
``opgraph job submit`` does.

A folder, not the wheel: Ray installs a ``py_modules`` wheel with ``pip install`` and its
dependencies, Ray included, on every node.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["PACKAGE_FOLDERS", "opgraph_runtime_env", "source_folders", "stage_opgraph"]

PACKAGE_FOLDERS = ("kernel", "actors", "engines", "cluster")
_IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")


def source_folders() -> dict[str, Path]:
    """Where each ``opgraph.<folder>`` package of this interpreter lives (found without importing it)."""
    folders = {}
    for name in PACKAGE_FOLDERS:
        spec = importlib.util.find_spec(f"opgraph.{name}")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"opgraph.{name} is not importable here: install opgraph (pip install -e .)")
        folders[name] = Path(list(spec.submodule_search_locations)[0])
    return folders


def _fingerprint(folders: Mapping[str, Path]) -> str:
    digest = hashlib.sha256()
    for name, folder in sorted(folders.items()):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                digest.update(f"{name}/{path.relative_to(folder)}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def default_stage_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "opgraph" / "runtime-env"


def stage_opgraph(root: str | os.PathLike[str] | None = None) -> Path:
    """The ``opgraph/`` folder holding this interpreter's opgraph code, under ``root``.

    Staged once per content (``root/<fingerprint>/opgraph``): the same code gives the same
    folder, and Ray, which names an upload by its content, uploads it once.
    """
    folders = source_folders()
    target = Path(root) if root is not None else default_stage_root()
    package = target / _fingerprint(folders) / "opgraph"
    if package.is_dir():
        return package
    partial = package.parent / f"opgraph.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    for name, folder in folders.items():
        shutil.copytree(folder, partial / name, ignore=_IGNORED)
    try:
        partial.rename(package)
    except OSError:  # another process staged the same content first
        shutil.rmtree(partial, ignore_errors=True)
    return package


def opgraph_runtime_env(runtime_env: Mapping[str, Any] | str | None = None, *,
                        root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``runtime_env`` (a dict or its JSON) with the staged opgraph folder added to its ``py_modules``."""
    env = json.loads(runtime_env) if isinstance(runtime_env, str) else dict(runtime_env or {})
    staged = str(stage_opgraph(root))
    modules = [module for module in env.get("py_modules", []) if module != staged]
    env["py_modules"] = [*modules, staged]
    return env
