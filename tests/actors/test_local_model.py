"""A real model in the tests: SmolLM2-135M (the `local` extra) through every path that calls a model.

    `opgraph models serve --port 0` (one per module: the model loaded once, stopped by SIGTERM)
      <- openai/smollm2 over HTTP: a chat call, a streamed call (the official openai client), a
         structured call held to its schema, usage as the server counted it
      <- the support-triage workflow on the Ray workers, end to end, its category from the enum
      <- a planning engine run
    local/smollm2 in this process and in the workers: llama.cpp's own token counts, truncation typed
    a second server killed mid-run: the in-flight node fails with ProviderUnavailable, nothing else

Temperature 0 and a fixed seed (the server's and the provider's): the tests assert structure,
never wording. Without the extra the tests skip, naming the fetch command; under CI they fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from components import require

from opgraph.actors.models import ChatRequest, ProviderConfigError, ProviderTruncated, ProviderUnavailable
from opgraph.actors.providers import OpenAICompatibleProvider
from opgraph.actors.providers.local import LocalModelProvider, check_local_models, local_model
from opgraph.cluster.lanes import FIXED_WORKFLOW, lane_entry
from opgraph.cluster.lanes.fixed import WorkflowSource, content_hash, run_workflow

START_DEADLINE = 120.0  # seconds for `opgraph models serve` to load the model and answer
TRIAGE = json.loads(lane_entry(FIXED_WORKFLOW).examples["support-triage"].read_text())
CLASSIFY = next(node for node in TRIAGE["nodes"] if node["id"] == "classify")["config"]
CATEGORIES = CLASSIFY["schema"]["properties"]["category"]["enum"]
TICKETS = {
    "billing": "I was charged twice for my subscription this month.",
    "outage": "The whole site is down, nobody can log in or pay.",
    "bug": "The export button crashes the app when the list is empty.",
    "account": "Please change the email address on my account.",
    "how-to": "How do I add a second user to my team?",
}
USER = [{"role": "user", "content": "Say hello to the support team in one short sentence."}]


class ModelServer:
    """`opgraph models serve` in a process of its own, on a free loopback port."""

    def __init__(self, *arguments: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "opgraph.cluster.cli", "models", "serve", "--port", "0", *arguments],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.base_url = self._wait_for_url()

    def _wait_for_url(self) -> str:
        found: dict[str, str] = {}

        def read() -> None:
            for line in self.process.stdout:
                self.lines.append(line)
                if line.startswith("export OPENAI_BASE_URL="):
                    found["url"] = line.strip().split("=", 1)[1]

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + START_DEADLINE
        while "url" not in found:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"opgraph models serve did not start: {self.lines} {self.process.stderr.read()}")
            time.sleep(0.05)
        return found["url"]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.process.send_signal(sig)
        return self.wait()

    def wait(self) -> int:
        status = self.process.wait(timeout=30)
        self.errors = self.process.stderr.read()
        self.process.stdout.close()
        self.process.stderr.close()
        return status


@pytest.fixture(scope="module")
def server() -> Iterator[ModelServer]:
    require("local-model")
    served = ModelServer()
    yield served
    status = served.stop()
    assert status == 0, f"SIGTERM did not stop the server cleanly: exit {status}, {served.errors}"


def openai_provider(server: ModelServer, **settings) -> OpenAICompatibleProvider:
    return OpenAICompatibleProvider(server.base_url, max_retries=0, **settings)


def ask(provider, request: ChatRequest):
    """One call, with the provider's HTTP connections closed after it (this test's own event loop)."""
    async def call():
        try:
            return await provider.complete(request)
        finally:
            if hasattr(provider, "aclose"):
                await provider.aclose()

    return asyncio.run(call())


def test_the_server_announces_the_url_to_export_and_lists_its_model(server):
    assert any(line.startswith("serving local/smollm2") for line in server.lines), server.lines
    listed = httpx.get(f"{server.base_url}/models").json()
    assert [model["id"] for model in listed["data"]] == ["smollm2"]


def test_a_chat_call_over_http_counts_the_servers_own_usage(server):
    request = ChatRequest("openai/smollm2", USER, temperature=0, max_tokens=24)
    response = ask(openai_provider(server), request)
    raw = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                     json={"model": "smollm2", "messages": USER, "temperature": 0, "max_tokens": 24}).json()
    assert isinstance(response.content, str) and response.content.strip()
    assert response.finish_reason in ("stop", "length") and response.provider == "openai"
    # The server's own figures, not an estimate: the same request counts the same tokens.
    assert response.usage.prompt_tokens == raw["usage"]["prompt_tokens"] > 0
    assert response.usage.completion_tokens == raw["usage"]["completion_tokens"]
    assert 0 < response.usage.completion_tokens <= 24


def test_a_streamed_call_comes_in_chunks_and_matches_the_whole_reply(server):
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        with client.chat.completions.create(model="smollm2", messages=USER, temperature=0, max_tokens=24,
                                            stream=True) as stream:
            chunks = list(stream)
        whole = client.chat.completions.create(model="smollm2", messages=USER, temperature=0, max_tokens=24)
    pieces = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert sum(1 for piece in pieces if piece) >= 2, pieces  # streamed, not one block
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same reply either way


def test_a_client_gone_mid_stream_frees_its_slot_for_the_next_request(server):
    """A streamed reply abandoned after its first chunk: the one slot comes back, and the next
    request (plain, then streamed) is answered, not left waiting for a slot that never returns."""
    import openai

    long_answer = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        for _ in range(3):
            with client.chat.completions.create(model="smollm2", messages=long_answer, temperature=0,
                                                max_tokens=200, stream=True) as stream:
                next(iter(stream))
        whole = client.chat.completions.create(model="smollm2", messages=USER, temperature=0, max_tokens=8)
        with client.chat.completions.create(model="smollm2", messages=USER, temperature=0, max_tokens=8,
                                            stream=True) as stream:
            streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert whole.choices[0].message.content and streamed
    deadline = time.monotonic() + 30
    while (health := httpx.get(server.base_url.removesuffix("/v1") + "/health").json())["idle"] != 1:
        assert time.monotonic() < deadline, health
        time.sleep(0.05)


def test_a_structured_call_is_held_to_its_schema_over_http_and_in_process(server):
    schema = CLASSIFY["schema"]
    response_format = {"type": "json_schema", "json_schema": {"name": "triage", "schema": schema}}
    for make, model in ((lambda: openai_provider(server), "openai/smollm2"), (LocalModelProvider, "local/smollm2")):
        for ticket in TICKETS.values():
            request = ChatRequest(model, [{"role": "user", "content": f"{CLASSIFY['prompt']}\n\n{ticket}"}],
                                  response_format=response_format, temperature=0, max_tokens=24)
            response = ask(make(), request)
            jsonschema.validate(json.loads(response.content), schema)  # constrained decoding: always valid
            assert response.finish_reason == "stop" and response.usage.completion_tokens > 0


def test_local_smollm2_in_process_counts_llama_cpps_tokens_and_flags_a_cut_off_reply():
    require("local-model")
    provider = LocalModelProvider()
    whole = asyncio.run(provider.complete(ChatRequest("local/smollm2", USER, max_tokens=48)))
    cut = asyncio.run(provider.complete(ChatRequest("local/smollm2", USER, max_tokens=3)))
    assert whole.content.strip() and whole.usage.prompt_tokens > 0 and whole.provider == "local"
    assert cut.finish_reason == "length" and cut.usage.completion_tokens == 3
    assert whole.usage.prompt_tokens == cut.usage.prompt_tokens  # llama.cpp's count of the same prompt
    assert whole.content.startswith(cut.content)  # greedy: the cut reply is the whole one's start


def _source(spec: dict) -> WorkflowSource:
    return WorkflowSource(kind="workflow_file", ref="inline", content_hash=content_hash(spec), spec=spec)


@pytest.mark.parametrize(("priority", "taken", "skipped"), [("high", "escalate", "draft_reply"),
                                                             ("low", "draft_reply", "escalate")])
def test_the_support_triage_workflow_runs_end_to_end_on_the_served_model(session, server, priority, taken,
                                                                        skipped):
    """ticket -> classify (schema: category from the enum) -> escalate | draft_reply -> check."""
    session.register_provider("openai", openai_provider(server))
    result = asyncio.run(run_workflow(session, _source(TRIAGE), model="openai/smollm2",
                                      inputs={"ticket": TICKETS["outage"], "priority": priority}))
    assert result.status == "completed", result.errors
    assert result.statuses == {"classify": "completed", taken: "completed", skipped: "skipped",
                               "check": "completed"}
    classify = result.outputs["classify"]
    assert classify["data"]["category"] in CATEGORIES and classify["model"] == "openai/smollm2"
    for node in (taken, "check"):
        output = result.outputs[node]
        assert output["text"].strip() and output["usage"]["completion_tokens"] > 0
        bound = next(item for item in TRIAGE["nodes"] if item["id"] == node)["config"]["max_tokens"]
        assert output["usage"]["completion_tokens"] <= bound  # every node is bounded


def test_every_ticket_gets_a_category_from_the_enum_on_local_smollm2_in_the_workers(session):
    """One classify node per ticket, side by side, on local/ (llama.cpp loaded once per worker)."""
    require("local-model")
    spec = {"version": 1, "inputs": [], "outputs": list(TICKETS), "edges": [],
            "nodes": [{"id": category, "kind": "chat", "pos": {"x": 0, "y": index},
                       "config": {**CLASSIFY, "prompt": f"{CLASSIFY['prompt']}\n\nTicket: {ticket}",
                                  "model": "local/smollm2"}}
                      for index, (category, ticket) in enumerate(TICKETS.items())]}
    result = asyncio.run(run_workflow(session, _source(spec)))
    assert result.status == "completed", result.errors
    for output in result.outputs.values():
        assert output["data"]["category"] in CATEGORIES and output["provider"] == "local"
        assert output["usage"]["prompt_tokens"] > 0


def test_a_structured_reply_cut_off_at_max_tokens_is_truncated_not_parsed(session):
    require("local-model")
    spec = {"version": 1, "inputs": [], "outputs": ["classify"], "edges": [],
            "nodes": [{"id": "classify", "kind": "chat", "pos": {"x": 0, "y": 0},
                       "config": {**CLASSIFY, "max_tokens": 2, "model": "local/smollm2"}}]}
    result = asyncio.run(run_workflow(session, _source(spec)))
    assert result.status == "failed" and set(result.errors) == {"classify"}
    assert ProviderTruncated.__name__ in json.dumps(result.errors["classify"]), result.errors


def test_a_planning_engine_run_on_the_served_model(session, server):
    from opgraph.engines import PlanningEngine

    session.register_provider("openai", openai_provider(server, max_tokens=96))
    engine = PlanningEngine(model="openai/smollm2", max_assignments=8, max_spawn=0, max_agents=10)
    result = asyncio.run(engine.run("Plan a short welcome email for a new customer.", session=session))
    assert str(result).strip()


def test_a_server_killed_mid_run_fails_the_in_flight_node_with_the_provider_error(session):
    """in -> long (in flight when the server is killed) ; other (sim/, unaffected)."""
    require("local-model")
    doomed = ModelServer()
    session.register_provider("openai", OpenAICompatibleProvider(doomed.base_url, max_retries=1, backoff=0.05))
    spec = {"version": 1, "inputs": [], "outputs": ["long", "other"], "edges": [],
            "nodes": [{"id": "long", "kind": "chat", "pos": {"x": 0, "y": 0},
                       "config": {"prompt": "Count from 1 to 1000, one number a line.", "max_tokens": 1500,
                                  "model": "openai/smollm2"}},
                      {"id": "other", "kind": "chat", "pos": {"x": 0, "y": 1},
                       "config": {"prompt": "hello", "model": "sim/fast"}}]}

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{doomed.base_url.removesuffix('/v1')}/health", timeout=2).json()["idle"] == 0:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        doomed.process.kill()

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    try:
        result = asyncio.run(run_workflow(session, _source(spec)))
    finally:
        killer.join()
        doomed.wait()
    assert result.statuses == {"long": "failed", "other": "completed"}, result.errors
    assert ProviderUnavailable.__name__ in json.dumps(result.errors["long"]), result.errors


def test_a_local_model_not_installed_or_not_gguf_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OPGRAPH_LOCAL_MODELS", str(tmp_path))
    with pytest.raises(ProviderConfigError, match=r"pip install 'opgraph\[local\]'") as missing:
        check_local_models(["sim/fast", "local/nosuch"])
    assert "nosuch" in missing.value.message and "CMAKE_ARGS" in missing.value.message
    (tmp_path / "broken.gguf").write_bytes(b"not a model at all")
    with pytest.raises(ProviderConfigError, match="is not a GGUF model file"):
        local_model("broken")
    with pytest.raises(ProviderConfigError, match="is not a GGUF model file"):
        asyncio.run(LocalModelProvider().complete(ChatRequest("local/broken", USER)))


def test_opgraph_refuses_a_broken_local_model_at_start_with_the_install_hint(tmp_path):
    (tmp_path / "broken.gguf").write_bytes(b"GGML" + bytes(64))
    environment = {**os.environ, "OPGRAPH_LOCAL_MODELS": str(tmp_path), "OPGRAPH_HOME": str(tmp_path / "home")}
    for command in (["models", "serve", "--model", "broken", "--port", "0"],
                    ["flow", "run", str(lane_entry(FIXED_WORKFLOW).examples["support-triage"]), "--model",
                     "local/broken", "--store", str(tmp_path / "runs.db")]):
        done = subprocess.run([sys.executable, "-m", "opgraph.cluster.cli", *command], env=environment,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert "is not a GGUF model file" in done.stderr and "opgraph[local]" in done.stderr
        assert "running " not in done.stderr and "serving " not in done.stdout  # refused before a run or a port
