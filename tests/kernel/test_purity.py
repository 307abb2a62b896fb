"""The kernel stands alone (STYLE habit 1): no async, network or metrics library, no clock.

The import check runs in a fresh interpreter, because this test process has already
loaded whatever pytest and its plugins pulled in. The source checks read the syntax
tree rather than grepping text, so a docstring that *mentions* ``async def`` is fine.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import opgraph.kernel

KERNEL_DIR = Path(opgraph.kernel.__file__).parent
KERNEL_SOURCES = sorted(KERNEL_DIR.glob("*.py"))

# Modules whose presence after importing the kernel means a layer leaked inwards.
FORBIDDEN_MODULES = (
    "ray",
    "asyncio",
    "anyio",
    "trio",
    "httpx",
    "httpcore",
    "http.client",
    "urllib3",
    "requests",
    "aiohttp",
    "grpc",
    "prometheus_client",
)

# Dotted call suffixes that read a clock; the kernel takes time only from event.now.
CLOCK_CALLS = (
    "time.time",
    "time.time_ns",
    "time.monotonic",
    "time.monotonic_ns",
    "time.perf_counter",
    "time.perf_counter_ns",
    "time.process_time",
    "datetime.now",
    "datetime.utcnow",
    "datetime.today",
    "date.today",
)
CLOCK_FUNCTIONS = frozenset(call.rsplit(".", 1)[1] for call in CLOCK_CALLS if call.startswith("time."))

_IMPORT_EVERY_KERNEL_MODULE = """
import importlib, json, pkgutil, sys
import opgraph.kernel
forbidden = json.loads(sys.argv[1])
names = sorted(module.name for module in pkgutil.iter_modules(opgraph.kernel.__path__))
for name in names:
    importlib.import_module(f"opgraph.kernel.{name}")
loaded = sorted(
    module
    for module in forbidden
    if any(key == module or key.startswith(module + ".") for key in sys.modules)
)
print(json.dumps({"modules": names, "loaded": loaded}))
"""


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_importing_every_kernel_module_in_a_fresh_interpreter_loads_no_async_network_or_metrics_library(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_KERNEL_MODULE, json.dumps(FORBIDDEN_MODULES)],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # nothing importable by accident from the working directory
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    # Guard against a vacuous pass: discovery must have found the real modules.
    assert {"scheduler", "graph", "events", "context", "contracts"} <= set(report["modules"])
    assert report["loaded"] == [], f"kernel import loaded {report['loaded']}"


def test_the_kernel_sources_are_all_found():
    names = {path.stem for path in KERNEL_SOURCES}
    assert {"__init__", "scheduler", "graph", "events", "context", "contracts"} <= names


def test_no_kernel_source_defines_or_awaits_a_coroutine():
    found = []
    for path in KERNEL_SOURCES:
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)):
                found.append(f"{path.name}:{node.lineno} {type(node).__name__}")
    assert found == []


def test_no_kernel_source_reads_a_clock():
    found = []
    for path in KERNEL_SOURCES:
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if any(called == clock or called.endswith("." + clock) for clock in CLOCK_CALLS):
                    found.append(f"{path.name}:{node.lineno} {called}()")
            elif isinstance(node, ast.ImportFrom) and node.module == "time":
                for alias in node.names:
                    if alias.name in CLOCK_FUNCTIONS or alias.name == "*":
                        found.append(f"{path.name}:{node.lineno} from time import {alias.name}")
    assert found == []
