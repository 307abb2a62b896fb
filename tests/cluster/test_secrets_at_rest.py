"""No secret at rest: runs made with sentinel keys in the environment leave none of them in the data directory.

    a process whose environment holds OPENAI_API_KEY, ANTHROPIC_API_KEY (sentinels) and an
    OPENAI_BASE_URL with user:SENTINELPW@ pointing at a local OpenAI-compatible server runs,
    with the providers the CLI builds from that environment:
      a fixed workflow      in -> n1 -> n2 on openai/echo
      a planned flow        the planner and its ops on openai/structured
      a recovered run       4 chats on openai/slow; the executor is killed while they are in
                            flight, and its replacement rebuilds the run from the log, the
                            providers from its environment
    then every byte under the data directory (databases, WALs, keys: OPGRAPH_HOME holds them
    all) is searched for the sentinels, and every file there must be 0600, every folder 0700.
"""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
from openai_server import OpenAIChatServer

from opgraph.cluster.processes import run_command

DEADLINE = 240.0
OPENAI_KEY = "sk-SENTINEL-openai-7f3a9c1e5b"
ANTHROPIC_KEY = "sk-ant-SENTINEL-anthropic-2d8e4b6a"
PASSWORD = "SENTINELPW-9c4f2a"
SENTINELS = (OPENAI_KEY, ANTHROPIC_KEY, PASSWORD)

RUNS = r"""
import asyncio, json, os, sys
import ray
from opgraph.cluster.connection import open_session
from opgraph.cluster.lanes import FIXED_WORKFLOW, PLANNED_REACTIVE_FLOW, lane_adapter, open_store
from opgraph.kernel import OperationGraphBuilder

data, spec = sys.argv[1], sys.argv[2]
session = open_session()  # as every command: the providers this environment configures, keys and all
store = open_store(os.path.join(data, "runs.db"))
report = {"providers": sorted(session.providers)}

async def main():
    fixed = lane_adapter(FIXED_WORKFLOW, store)
    prepared = await fixed.prepare(fixed.invocation(spec, inputs={"topic": "keys"}, model="openai/echo"))
    report["fixed"] = (await fixed.execute(prepared, session=session)).status
    planned = lane_adapter(PLANNED_REACTIVE_FLOW, store)
    prepared = await planned.prepare(planned.invocation("plan a note", model="openai/structured", synthesis=False),
                                     session=session)
    report["planned"] = (await planned.execute(prepared, session=session)).status

    builder = OperationGraphBuilder("recovered")
    for index in range(4):
        builder.add_operation("chat", depends_on=[], instruction=f"slow {index}", model="openai/slow")
    started = asyncio.Event()
    count = 0

    def progress(node_id, name, status, elapsed):
        nonlocal count
        count += status == "started"
        if count >= 4:
            started.set()

    executor = session.runtime.executor
    flow = asyncio.create_task(session.flow(builder.get_graph(), run_id="recovered-run", max_concurrent=4,
                                            on_progress=progress))
    await asyncio.wait_for(started.wait(), 60)
    ray.kill(executor)
    envelope = await flow
    report["recovered"] = envelope["status"]
    statistics = await session.runtime.executor.statistics.remote()
    report["recovered_runs"] = statistics["recovered_runs"]

asyncio.run(main())
print(json.dumps(report), flush=True)
"""


def _chain_spec() -> dict:
    nodes = [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}},
             {"id": "n1", "kind": "chat", "pos": {"x": 1, "y": 0}, "config": {"prompt": "Step one"}},
             {"id": "n2", "kind": "chat", "pos": {"x": 2, "y": 0}, "config": {"prompt": "Step two"}}]
    edges = [{"id": "e1", "from": "in", "to": "n1"}, {"id": "e2", "from": "n1", "to": "n2"}]
    return {"version": 1, "nodes": nodes, "edges": edges, "inputs": ["topic"], "outputs": ["n2"]}


@pytest.mark.ray
def test_runs_with_sentinel_keys_leave_no_secret_and_no_readable_file_in_the_data_directory(tmp_path):
    data = tmp_path / "home"  # made by the runs: opgraph creates it 0700
    spec = tmp_path / "chain.json"
    spec.write_text(json.dumps(_chain_spec()))
    with OpenAIChatServer() as server:
        base_url = server.base_url.replace("http://", f"http://operator:{PASSWORD}@")
        environment = {**os.environ, "OPGRAPH_HOME": str(data), "OPGRAPH_DB": str(data / "opgraph.db"),
                       "OPENAI_API_KEY": OPENAI_KEY, "OPENAI_BASE_URL": base_url, "ANTHROPIC_API_KEY": ANTHROPIC_KEY}
        environment.pop("OPGRAPH_RUNLOG_KEY", None)
        done = run_command([sys.executable, "-c", RUNS, str(data), str(spec)], env=environment, timeout=DEADLINE)
        assert done.returncode == 0, done.stderr[-4000:]
        requests = server.requests

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["providers"] == ["anthropic", "openai"]  # both built, keys and all, in the process
    assert (report["fixed"], report["planned"], report["recovered"]) == ("completed", "completed", "completed")
    assert report["recovered_runs"] == ["recovered-run"]
    # The calls really went through the sentinel URL's credentials (httpx sends them as basic auth).
    assert requests and all("authorization" in {name.lower() for name in request.headers} for request in requests)

    found = {}
    for path in data.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            found.update({f"{path.relative_to(data)}: {sentinel}": True for sentinel in SENTINELS
                          if sentinel.encode() in content})
    assert not found, f"secrets at rest: {sorted(found)}"
    files = {str(path.relative_to(data)) for path in data.rglob("*") if path.is_file()}
    assert {"opgraph.db", "runs.db", "runlog.key"} <= files
    modes = {str(path.relative_to(data)) or ".": oct(stat.S_IMODE(path.stat().st_mode))
             for path in [data, *data.rglob("*")]}
    assert all(mode == ("0o700" if (data / name).is_dir() else "0o600") for name, mode in modes.items()), modes
