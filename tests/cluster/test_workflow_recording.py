"""A fixed run records as it goes: each settled node's result and each signal reach the
store while the run is in flight, every write on the store's writer thread, so a killed
owner loses nothing it had shown, and no event loop ever waits for SQLite.

    in -> a -> c        (sim/fast: settle at once)
    in -> b             (sim/fast)
    in -> held          (in flight until the test lets it go)
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from typing import Any

import openai_server as srv

from opgraph.actors.providers import OpenAICompatibleProvider
from opgraph.cluster.lanes import open_store
from opgraph.cluster.lanes.fixed import WorkflowSource, content_hash, run_workflow
from opgraph.cluster.processes import run_until
from opgraph.cluster.store import RunStore

DEADLINE = 60.0  # seconds for anything these tests wait on
KILL_TIMEOUT = 120.0  # seconds for the killed owner's process to start and show its nodes
FAST = ("a", "b", "c")


def _node(node_id: str, model: str) -> dict[str, Any]:
    return {"id": node_id, "kind": "chat", "pos": {"x": 0, "y": 0},
            "config": {"prompt": f"step {node_id}", "model": model}}


def _spec(held: list[str], held_model: str) -> dict[str, Any]:
    """in -> a -> c, in -> b, in -> held[0] -> held[1] -> ..."""
    chain = [("in", held[0])] + list(zip(held, held[1:], strict=False))
    return {
        "version": 1,
        "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}}, _node("a", "sim/fast"),
                  _node("b", "sim/fast"), _node("c", "sim/fast"), *[_node(h, held_model) for h in held]],
        "edges": [{"id": "ea", "from": "in", "to": "a"}, {"id": "eb", "from": "in", "to": "b"},
                  {"id": "ec", "from": "a", "to": "c"},
                  *[{"id": f"e-{src}-{dst}", "from": src, "to": dst} for src, dst in chain]],
        "outputs": [*FAST, *held],
    }


class ThreadWatchingStore(RunStore):
    """Notes, for every write, whether the calling thread was running an event loop."""

    WRITES = ("create_run", "mark_running", "finish_run", "record_signals", "record_progress", "record_branch",
              "record_branches")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, bool]] = []

    def __getattribute__(self, name: str) -> Any:
        method = super().__getattribute__(name)
        if name not in ThreadWatchingStore.WRITES:
            return method

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            super(ThreadWatchingStore, self).__getattribute__("writes").append((name, on_loop))
            return method(*args, **kwargs)

        return watched


def test_every_write_of_a_run_happens_off_the_event_loop(session, tmp_path):
    spec = _spec(["d"], "sim/fast")
    source = WorkflowSource(kind="workflow_file", ref="inline", content_hash=content_hash(spec), spec=spec)
    with ThreadWatchingStore(tmp_path / "watched.db") as store:
        result = asyncio.run(run_workflow(session, source, store=store))
        assert result.status == "completed", result.errors
        kinds = {name for name, _ in store.writes}
        assert {"create_run", "mark_running", "finish_run"} <= kinds
        assert kinds & {"record_branch", "record_branches"}  # the branches, one at a time or in one transaction
        assert kinds & {"record_signals", "record_progress"}
        on_loop = [name for name, looping in store.writes if looping]
        assert on_loop == [], f"SQLite writes made on the event loop: {on_loop}"


def test_settled_nodes_are_in_the_store_while_the_run_is_in_flight(session, tmp_path):
    """The held node's request has arrived (the run is in flight): a, b and c are already
    recorded, results included, as completed."""
    spec = _spec(["held"], "openai/hold")
    source = WorkflowSource(kind="workflow_file", ref="inline", content_hash=content_hash(spec), spec=spec)
    with srv.OpenAIChatServer() as server, open_store(tmp_path / "live.db") as store:
        session.register_provider("openai", OpenAICompatibleProvider(base_url=server.base_url, max_retries=0))

        async def scenario() -> Any:
            control: dict[str, Any] = {}
            run = asyncio.ensure_future(run_workflow(session, source, store=store, control=control))
            while not server.requests or len(store.run_nodes(control["run_id"])) < len(FAST):
                assert not run.done(), run.result()
                await asyncio.sleep(0.02)
            recorded = {node["spec_node_id"]: node for node in store.run_nodes(control["run_id"])}
            signals = store.run_signals(control["run_id"])
            server.stop()  # the held call ends unanswered: its node fails and the run ends
            return recorded, signals, await asyncio.wait_for(run, DEADLINE)

        recorded, signals, result = asyncio.run(asyncio.wait_for(scenario(), DEADLINE))
    assert set(recorded) == set(FAST)
    for node_id in FAST:
        assert recorded[node_id]["status"] == "completed"
        assert recorded[node_id]["result"]["model"] == "sim/fast" and recorded[node_id]["result"]["text"]
        assert "completed" in [s["kind"] for s in signals if s["spec_node_id"] == node_id]
    assert [s["kind"] for s in signals if s["spec_node_id"] == "held"] == ["queued", "started"]
    assert result.status == "failed" and set(result.errors) == {"held"}


def test_a_killed_owner_loses_nothing_it_had_shown(ray_head, tmp_path):
    """`opgraph flow run` is SIGKILLed once it has shown a, b and c completed while the held
    chain (five sim/slow nodes, 5 s) runs: the store has all three, results included, and
    the run reads failed (its owner is gone), not running."""
    held = [f"held{index}" for index in range(5)]
    definition = tmp_path / "flow.json"
    definition.write_text(json.dumps(_spec(held, "sim/slow")))
    database = tmp_path / "killed.db"

    def shown_fast(lines: list[str]) -> bool:
        return {words[2] for words in map(str.split, lines) if len(words) == 3 and words[1] == "completed"} \
            == set(FAST)

    killed = run_until(
        [sys.executable, "-m", "opgraph.cluster.cli", "flow", "run", str(definition), "--store", str(database),
         "--plain", "--address", ray_head.address],
        shown_fast, timeout=KILL_TIMEOUT, env=ray_head.env(), stderr=subprocess.STDOUT)
    assert killed.returncode == -signal.SIGKILL
    assert not any(f"completed {node}" in " ".join(line.split()) for line in killed.lines for node in held), \
        "the held chain finished before the kill: nothing was tested"

    with open_store(database) as store:
        (run,) = store.list_runs()  # reading it settles the orphan
        assert run.status == "failed" and run.error["error_type"] == "OwnerProcessLost"
        last = {}
        for signal_row in store.run_signals(run.run_id):
            last[signal_row["spec_node_id"]] = signal_row["kind"]
        assert {node_id: last.get(node_id) for node_id in FAST} == dict.fromkeys(FAST, "completed"), last
        recorded = {node["spec_node_id"]: node for node in store.run_nodes(run.run_id)}
    for node_id in FAST:
        assert recorded[node_id]["status"] == "completed", recorded
        assert recorded[node_id]["result"]["model"] == "sim/fast" and recorded[node_id]["result"]["text"]
    assert not set(held) & {node for node, row in recorded.items() if row["status"] == "completed"}
