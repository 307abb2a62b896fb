"""`opgraph serve` against its own OpenAPI document: schemathesis fuzzes the live server.

    opgraph serve --address HEAD (subprocess, its store in a temp dir)  <-  schemathesis run URL/openapi.json

Every check schemathesis has (server errors, documented statuses, content types, response
schemas, negative data rejected, positive data accepted, Allow headers, stateful links)
runs with a fixed seed and a bounded number of examples per operation; the one allowance
is written in ``schemathesis.toml`` beside this file, with its reason. The server joins
the shared local head, so its runs execute for real on the built-in ``sim/`` provider.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from api_server import free_port

SERVE_DEADLINE = 120.0  # seconds for the server to join the head and listen
FUZZ_TIMEOUT = 300.0  # seconds schemathesis may take (about 10 s here)
MAX_EXAMPLES = 20  # test cases per operation and phase
SEED = 1
CONFIG = Path(__file__).with_name("schemathesis.toml")


def _schemathesis() -> list[str]:
    return [str(Path(sys.executable).with_name("schemathesis"))]


def _wait_listening(server: subprocess.Popen, url: str, log: Path) -> dict:
    deadline = time.monotonic() + SERVE_DEADLINE
    while True:
        assert server.poll() is None, f"opgraph serve exited with {server.returncode}:\n{log.read_text()}"
        try:
            return httpx.get(f"{url}/openapi.json", timeout=5).json()
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, \
            f"opgraph serve did not listen within {SERVE_DEADLINE} s:\n{log.read_text()}"
        time.sleep(0.2)


def test_schemathesis_finds_nothing_against_the_live_server(ray_head, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as output:
        server = subprocess.Popen(
            [sys.executable, "-m", "opgraph.cluster.cli", "serve", "--port", str(port), "--store",
             str(tmp_path / "opgraph.db"), "--address", ray_head.address],
            env=ray_head.env(), stdout=output, stderr=subprocess.STDOUT)
    try:
        document = _wait_listening(server, url, log)
        # The runtime started with the server, before it listened.
        started = log.read_text()
        assert "runtime ready in" in started and started.index("runtime ready") < started.index("Uvicorn running")

        command = [*_schemathesis(), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all",
                   "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--seed", str(SEED),
                   "--generation-database", "none", "--no-color"]
        # In tmp_path: schemathesis keeps a cache of what it found in its working directory.
        fuzzed = subprocess.run(command, capture_output=True, text=True, timeout=FUZZ_TIMEOUT, check=False,
                                env={**os.environ, "NO_COLOR": "1"}, cwd=tmp_path)
        print(f"$ {' '.join(command)}\n{fuzzed.stdout[-3000:]}")  # the figures for the closing note (-s)
        assert fuzzed.returncode == 0, fuzzed.stdout[-6000:] + fuzzed.stderr[-2000:]
        summary = fuzzed.stdout[fuzzed.stdout.rindex("SUMMARY"):]
        assert "Tested: 17" in summary and "failure" not in summary.lower(), summary
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    # What the document promises, stated once more by hand for the answers this issue fixed.
    paths = document["paths"]
    for control in ("message", "pause", "resume"):
        statuses = set(paths[f"/api/runs/{{run_id}}/{control}"]["post"]["responses"])
        # 202 for a run whose capabilities allow the control (a planned or play run), 409 otherwise.
        assert statuses >= {"202", "404", "409", "503"}
    for path, methods in paths.items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)
    assert "413" in paths["/api/workflows"]["post"]["responses"]
    assert "HTTPValidationError" not in json.dumps(paths)  # FastAPI's {detail} 422 is documented nowhere
