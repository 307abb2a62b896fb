"""A Python with Ray and opgraph's runtime dependencies, but not opgraph: the jobs-ship-opgraph tests' head.

A virtual environment without system site packages holding only ``ray[default]`` (the
running Ray's version) and opgraph's runtime dependencies, read from pyproject.toml. Built
once per machine under the test cache and reused while its requirements are the same.
``.ci/run`` builds it before the tests (``python tests/support/bare_python.py``), so the
suite's time does not include it; run alone, the test session builds it on first use.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import ray

REPOSITORY = Path(__file__).resolve().parents[2]
VENV_DEADLINE = 900.0  # seconds to build the bare environment from PyPI, the first time on a machine


def bare_requirements() -> list[str]:
    """opgraph's runtime dependencies, with Ray pinned to this process's version (a client and its
    cluster must run the same Ray)."""
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    pinned = []
    for requirement in project["dependencies"]:
        name = re.split(r"[\[<>=!~ ]", requirement, maxsplit=1)[0]
        pinned.append(f"ray[default]=={ray.__version__}" if name == "ray" else requirement)
    return pinned


def bare_python() -> str:
    """The bare environment's python, built first if this machine has none for these requirements."""
    requirements = bare_requirements()
    cache = Path(os.environ.get("OPGRAPH_TEST_CACHE") or "/tmp/opgraph-test-cache")
    key = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()[:12]
    folder = cache / f"bare-python-{key}"
    python = folder / "bin" / "python"
    if not (folder / "ready").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(folder)], check=True, timeout=120)  # no system site packages
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        *requirements], check=True, timeout=VENV_DEADLINE)
        (folder / "ready").write_text("\n".join(requirements))
    return str(python)


if __name__ == "__main__":
    print(bare_python())
