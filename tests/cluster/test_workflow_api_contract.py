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
import secrets
import signal
import sys
from pathlib import Path

from opgraph.cluster.processes import free_port, http_body, run_command, start_server

SERVE_DEADLINE = 120.0  # seconds for the server to join the head and listen
FUZZ_TIMEOUT = 300.0  # seconds schemathesis may take (about 10 s here)
MAX_EXAMPLES = 20  # test cases per operation and phase
SEED = 1
CONFIG = Path(__file__).with_name("schemathesis.toml")


def _schemathesis() -> list[str]:
    return [str(Path(sys.executable).with_name("schemathesis"))]


def test_schemathesis_finds_nothing_against_the_live_server(ray_head, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    token = secrets.token_urlsafe(32)
    signed = {"authorization": f"Bearer {token}"}
    with start_server([sys.executable, "-m", "opgraph.cluster.cli", "serve", "--port", str(port), "--store",
                       str(tmp_path / "opgraph.db"), "--address", ray_head.address],
                      ready=lambda: http_body(f"{url}/openapi.json", headers=signed, timeout=5),
                      timeout=SERVE_DEADLINE, what="opgraph serve", log_path=log,
                      env={**ray_head.env(), "OPGRAPH_TOKEN": token}) as server:
        document = json.loads(server.ready)
        # The runtime started with the server, before it listened.
        started = log.read_text()
        assert "runtime ready in" in started and started.index("runtime ready") < started.index("Uvicorn running")

        # The token as every client sends it; schemathesis's ignored_auth check also sends requests
        # without it (the document declares the bearer scheme) and expects them refused.
        command = [*_schemathesis(), "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all",
                   "--header", f"Authorization: Bearer {token}",
                   "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--seed", str(SEED),
                   "--generation-database", "none", "--no-color"]
        # In tmp_path: schemathesis keeps a cache of what it found in its working directory.
        fuzzed = run_command(command, timeout=FUZZ_TIMEOUT, env={**os.environ, "NO_COLOR": "1"}, cwd=tmp_path)
        # The figures for the closing note (-s), the token blanked.
        print(f"$ {' '.join(command).replace(token, '***')}\n{fuzzed.stdout[-3000:]}")
        assert fuzzed.returncode == 0, fuzzed.stdout[-6000:] + fuzzed.stderr[-2000:]
        summary = fuzzed.stdout[fuzzed.stdout.rindex("SUMMARY"):]
        assert "Tested: 39" in summary and "failure" not in summary.lower(), summary
        server.stop(signal.SIGINT)

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
    assert document["security"] == [{"bearer": []}]  # every operation needs the token
    assert "HTTPValidationError" not in json.dumps(paths)  # FastAPI's {detail} 422 is documented nowhere
