"""The outside programs some tests run, where each is found, and the one command that fetches it.

    prometheus    Debian's ``prometheus`` package, unpacked into the test cache (no service, no install)
    postgresql    PostgreSQL's server binaries (initdb, pg_ctl, postgres), Debian's ``postgresql``
    chromium      Debian's ``chromium`` browser (``/usr/bin/chromium``), which the console's Playwright tests drive
    bare-python   a virtual environment with Ray and opgraph's dependencies but not opgraph

``python tests/support/components.py fetch NAME|all`` fetches them (``.ci/run`` runs it with
``all``); ``where NAME`` prints where one is. A test that needs one calls ``require(NAME)``:
on a machine without it the test is skipped with that command in the message, except under
CI (``CI`` or ``OPGRAPH_REQUIRE_ALL`` set to anything but 0/false/no), where a missing
component fails the test, so CI skips nothing. Tests never fetch: a fresh machine's
``pytest -q`` downloads nothing.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMPONENTS", "Component", "cache_folder", "missing_fails", "require"]

FETCH_SCRIPT = "tests/support/components.py"
BARE_PYTHON_DEADLINE = 900.0  # seconds to build the bare environment from PyPI, the first time on a machine


def cache_folder() -> Path:
    """Where fetched components live: ``OPGRAPH_TEST_CACHE``, else ``opgraph-test-cache`` in the temp folder."""
    configured = os.environ.get("OPGRAPH_TEST_CACHE")
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "opgraph-test-cache"


def missing_fails() -> bool:
    """Under CI (``CI`` or ``OPGRAPH_REQUIRE_ALL``), a missing component is a failure, not a skip."""
    return any(os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")
               for name in ("CI", "OPGRAPH_REQUIRE_ALL"))


# -- prometheus -----------------------------------------------------------------------------------------
def _unpacked_prometheus() -> Path:
    return cache_folder() / "prometheus" / "usr" / "bin" / "prometheus"


def _locate_prometheus() -> str | None:
    """``OPGRAPH_PROMETHEUS`` when set (a path that is not there counts as missing), else the unpacked
    package in the cache, else one on PATH."""
    configured = os.environ.get("OPGRAPH_PROMETHEUS")
    if configured is not None:
        return configured if os.access(configured, os.X_OK) else None
    unpacked = _unpacked_prometheus()
    if os.access(unpacked, os.X_OK):
        return str(unpacked)
    return shutil.which("prometheus")


def _apt_get(*arguments: str, cwd: Path | None = None) -> None:
    """``apt-get ARGUMENTS``, after ``apt-get update`` should the package lists be missing (a fresh machine)."""
    if subprocess.run(["apt-get", *arguments], cwd=cwd, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], check=True)
        subprocess.run(["apt-get", *arguments], cwd=cwd, check=True)


def _fetch_prometheus() -> str:
    download = cache_folder() / "download"
    download.mkdir(parents=True, exist_ok=True)
    if not list(download.glob("prometheus_*.deb")):
        _apt_get("download", "prometheus", cwd=download)
    (package,) = download.glob("prometheus_*.deb")
    subprocess.run(["dpkg", "-x", str(package), str(cache_folder() / "prometheus")], check=True)
    return str(_unpacked_prometheus())


# -- postgresql ------------------------------------------------------------------------------------------
def _locate_postgresql() -> str | None:
    """The folder holding initdb, pg_ctl and postgres: ``OPGRAPH_POSTGRES_BIN`` when set (a folder without
    pg_ctl counts as missing), else the newest of Debian's ``/usr/lib/postgresql/*/bin``, else PATH's."""
    configured = os.environ.get("OPGRAPH_POSTGRES_BIN")
    if configured is not None:
        return configured if os.access(os.path.join(configured, "pg_ctl"), os.X_OK) else None
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda path: int(path.split("/")[-3]) if path.split("/")[-3].isdigit() else 0)
    if found:
        return os.path.dirname(found[-1])
    pg_ctl = shutil.which("pg_ctl")
    return os.path.dirname(os.path.realpath(pg_ctl)) if pg_ctl else None


def _fetch_postgresql() -> str:
    os.environ.setdefault("DEBIAN_FRONTEND", "noninteractive")
    _apt_get("install", "-y", "postgresql")
    located = _locate_postgresql()
    if located is None:
        raise RuntimeError("apt-get installed postgresql, but no pg_ctl was found (is OPGRAPH_POSTGRES_BIN set?)")
    return located


# -- chromium ----------------------------------------------------------------------------------------------
def _locate_chromium() -> str | None:
    """Debian's Chromium: ``OPGRAPH_CHROMIUM`` when set, else ``/usr/bin/chromium``, else PATH's."""
    explicit = os.environ.get("OPGRAPH_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    if os.access("/usr/bin/chromium", os.X_OK):
        return "/usr/bin/chromium"
    return shutil.which("chromium")


def _fetch_chromium() -> str:
    os.environ.setdefault("DEBIAN_FRONTEND", "noninteractive")
    _apt_get("install", "-y", "chromium")
    located = _locate_chromium()
    if located is None:
        raise RuntimeError("apt-get installed chromium, but no chromium binary was found (is OPGRAPH_CHROMIUM set?)")
    return located


# -- the bare Python ----------------------------------------------------------------------------------------
def bare_requirements() -> list[str]:
    """opgraph's runtime dependencies, with Ray pinned to this process's version (a client and its
    cluster must run the same Ray)."""
    import re
    import tomllib

    import ray

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    pinned = []
    for requirement in project["dependencies"]:
        name = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0]
        pinned.append(f"ray[default]=={ray.__version__}" if name == "ray" else requirement)
    return pinned


def _bare_folder() -> Path:
    """The bare environment of these requirements: one per Python version and requirement set."""
    key = hashlib.sha256(json.dumps([sys.version, bare_requirements()]).encode()).hexdigest()[:12]
    return cache_folder() / f"bare-python-{key}"


def _locate_bare_python() -> str | None:
    folder = _bare_folder()
    return str(folder / "bin" / "python") if (folder / "ready").is_file() else None


def _fetch_bare_python() -> str:
    folder, requirements = _bare_folder(), bare_requirements()
    python = folder / "bin" / "python"
    shutil.rmtree(folder, ignore_errors=True)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(folder)], check=True, timeout=120)  # no system site packages
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements],
                   check=True, timeout=BARE_PYTHON_DEADLINE)
    (folder / "ready").write_text("\n".join(requirements))
    return str(python)


# -- the table ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    """An outside program tests run: what it is, where it is found (None: not here), how it is fetched."""

    name: str
    what: str
    locate: Callable[[], str | None]
    fetch: Callable[[], str]

    @property
    def fetch_command(self) -> str:
        return f"python {FETCH_SCRIPT} fetch {self.name}"

    def fetched(self) -> str:
        """Where it is, fetched first unless this machine has it already."""
        return self.locate() or self.fetch()


COMPONENTS: dict[str, Component] = {component.name: component for component in (
    Component("prometheus", "Prometheus (Debian's prometheus package, unpacked into the test cache)",
              _locate_prometheus, _fetch_prometheus),
    Component("postgresql", "the PostgreSQL server (Debian's postgresql package)",
              _locate_postgresql, _fetch_postgresql),
    Component("chromium", "Chromium (Debian's chromium package), for the console's browser tests",
              _locate_chromium, _fetch_chromium),
    Component("bare-python", "the bare Python (Ray and opgraph's dependencies, not opgraph; built in the test "
              "cache)", _locate_bare_python, _fetch_bare_python),
)}


def require(name: str) -> str:
    """Where component ``name`` is; a test that asks for one this machine lacks is skipped, saying
    the command that fetches it, or fails under CI (``missing_fails``)."""
    import pytest  # local: the fetch command runs without pytest

    component = COMPONENTS[name]
    located = component.locate()
    if located is not None:
        return located
    message = f"{component.what} is not on this machine; fetch it with `{component.fetch_command}`"
    if missing_fails():
        pytest.fail(f"{message} (CI or OPGRAPH_REQUIRE_ALL is set: a missing component fails the test)",
                    pytrace=False)
    pytest.skip(message)


def main(arguments: list[str]) -> int:
    names = ", ".join(COMPONENTS)
    if len(arguments) != 2 or arguments[0] not in ("fetch", "where") or (
            arguments[1] not in COMPONENTS and not (arguments[0] == "fetch" and arguments[1] == "all")):
        print(f"usage: python {FETCH_SCRIPT} fetch {{{names},all}} | where {{{names}}}", file=sys.stderr)
        return 2
    action, name = arguments
    if action == "where":
        located = COMPONENTS[name].locate()
        if located is None:
            print(f"{name} is not on this machine; fetch it with `{COMPONENTS[name].fetch_command}`",
                  file=sys.stderr)
            return 1
        print(located)
        return 0
    for component in COMPONENTS.values() if name == "all" else [COMPONENTS[name]]:
        print(f"{component.name}: {component.fetched()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
