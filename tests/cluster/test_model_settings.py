"""Model-call settings reach the model the same way from every entry point, on real actors.

    workflow: in -> classify -> reply   (chat nodes on openai/, a loopback chat server)
    example:  plan -> (draft-a, draft-b) -> merge   (python -m opgraph.cluster.example_three_nodes)

What the server receives is the evidence: a chat node's config.timeout and
config.max_tokens, the prompt naming the predecessor by its authored id (never a node id,
never a record's bookkeeping), and OPENAI_MAX_CONCURRENCY holding in the example.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import openai_server as srv

from opgraph.actors.providers import OpenAICompatibleProvider, environment_providers
from opgraph.cluster import example_three_nodes
from opgraph.cluster.lanes.fixed import WorkflowSource, compile_workflow, content_hash, run_workflow

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _chat(node_id: str, prompt: str, **config: Any) -> dict[str, Any]:
    return {"id": node_id, "kind": "chat", "pos": {"x": 0, "y": 0},
            "config": {"prompt": prompt, "model": "openai/local", **config}}


SPEC = {
    "version": 1,
    "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}},
              _chat("classify", "Classify the ticket.", max_tokens=16),
              _chat("reply", "Draft the reply.", timeout=45, max_tokens=300)],
    "edges": [{"id": "e1", "from": "in", "to": "classify"}, {"id": "e2", "from": "classify", "to": "reply"}],
    "inputs": ["ticket"],
    "outputs": ["reply"],
}


def test_a_chat_nodes_timeout_and_max_tokens_reach_its_request_and_its_prompt_names_the_predecessor(session):
    compiled = compile_workflow(SPEC, inputs={"ticket": "login fails"})
    reply = compiled.graph.nodes[compiled.node_ids_by_spec_id["reply"]]
    assert reply.parameters["timeout"] == 45 and reply.parameters["max_tokens"] == 300
    assert reply.parameters["result_names"] == {compiled.node_ids_by_spec_id["classify"]: "classify"}

    source = WorkflowSource(kind="workflow_file", ref="inline", content_hash=content_hash(SPEC), spec=SPEC)
    with srv.OpenAIChatServer() as server:
        server.script(srv.Reply("billing"), srv.Reply("Dear customer"))
        session.register_provider("openai", OpenAICompatibleProvider(server.base_url, max_retries=0))
        result = asyncio.run(run_workflow(session, source, inputs={"ticket": "login fails"}))
        bodies = [request.body for request in server.requests]
    assert result.status == "completed", result.errors
    classify, draft = bodies
    assert classify["max_tokens"] == 16 and draft["max_tokens"] == 300
    shown = draft["messages"][-1]["content"]
    assert 'Results of earlier steps:\n{"classify":"billing"}' in shown
    assert 'Shared context:\n{"ticket":"login fails"}' in shown
    assert not UUID.search(shown), shown  # no node id reaches the model
    assert '"usage"' not in shown and '"provider"' not in shown


def test_the_three_node_example_honours_openai_max_concurrency(session, monkeypatch):
    """OPENAI_MAX_CONCURRENCY=1: the example builds its own provider, from the same settings as
    every other entry point, so its two drafts reach the server one at a time."""
    with srv.OpenAIChatServer() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        monkeypatch.setenv("OPENAI_MODEL", "local")
        monkeypatch.setenv("OPENAI_MAX_CONCURRENCY", "1")
        model, provider = example_three_nodes.model_from_environment()
        assert model == "openai/local" and provider._http.concurrency == 1
        assert environment_providers()["openai"]._http.concurrency == 1  # what `opgraph flow run` registers
        server.script(*[srv.Slow(0.3, srv.Reply(f"part {index}")) for index in range(4)])
        server.reset_peak()
        assert asyncio.run(example_three_nodes.main(session)) == 0
        assert len(server.requests) == 4
        assert server.peak_in_flight == 1, "two model calls were in flight at once"
