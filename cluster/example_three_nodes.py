"""The three-node example on real model calls: a plan, two parallel drafts, a merge.

Owns a runnable walk-through of the branch verbs through ``Session.flow``: on ``sim/default``
by default, on any OpenAI-compatible server when OPENAI_BASE_URL is set. It prints each
node's reply and token usage, and exits non-zero when the run fails.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

from opgraph.actors import Session
from opgraph.actors.models import ModelProvider, parse_model_id
from opgraph.actors.providers import provider_from_environment
from opgraph.kernel import Graph, OperationGraphBuilder

__all__ = ["DEFAULT_OPENAI_MODEL", "build_graph", "cli", "main", "model_from_environment", "run_three_nodes"]

DEFAULT_OPENAI_MODEL = "gpt-4.1-mini"
DEFAULT_TOPIC = "why actor systems suit LLM workflows"
REPLY_PREVIEW = 160  # characters of each reply printed

# ``chat_and_record`` is the chat verb (the same turn on the node's branch) returning its
# token usage next to the text; plain ``chat`` returns the text alone.
VERB = "chat_and_record"


def model_from_environment(environ: Mapping[str, str] = os.environ) -> tuple[str, ModelProvider | None]:
    """``sim/default``, or ``openai/<OPENAI_MODEL>`` with a provider for OPENAI_BASE_URL when it is set.

    The provider is built here, in the driver, from the same settings as the built-in
    (``ENVIRONMENT_SETTINGS``), and registered on the session, so the workers reach the
    same server with the same limits even when they did not inherit this environment.
    """
    if not environ.get("OPENAI_BASE_URL"):
        return "sim/default", None
    model = f"openai/{environ.get('OPENAI_MODEL') or DEFAULT_OPENAI_MODEL}"
    # Built as the built-in provider is: OPENAI_MAX_CONCURRENCY, OPENAI_TIMEOUT and
    # OPENAI_MAX_TOKENS hold here as in every other entry point.
    return model, provider_from_environment("openai", environ)


def build_graph(model: str, topic: str = DEFAULT_TOPIC) -> Graph:
    """plan -> (draft-a, draft-b) -> merge, every node a chat turn with ``model``."""
    builder = OperationGraphBuilder("plan-drafts-merge")
    plan = builder.add_operation(
        VERB, node_id="plan", model=model,
        instruction=f"Plan a two-part short essay on {topic}. Reply with two one-line part summaries.",
    )
    drafts = [
        builder.add_operation(
            VERB, node_id=f"draft-{part}", depends_on=[plan], model=model,
            instruction=f"Write part {part.upper()} of the essay from the plan, in at most 80 words.",
        )
        for part in ("a", "b")
    ]
    builder.add_aggregation(
        VERB, node_id="merge", source_node_ids=drafts, model=model,
        instruction="Merge the two parts into one essay of at most 150 words, with a title.",
    )
    return builder.get_graph()


def _report(envelope: dict[str, Any], graph: Graph) -> None:
    results = envelope["operation_results"]
    total = 0
    for node_id, status in envelope["operation_statuses"].items():
        result = results.get(node_id)
        label = graph.nodes[node_id].metadata.get("reference_id", node_id)
        if status == "completed" and isinstance(result, dict):
            usage = result["usage"]
            total += usage["total_tokens"]
            reply = " ".join(str(result["text"]).split())
            if len(reply) > REPLY_PREVIEW:
                reply = reply[:REPLY_PREVIEW - 3] + "..."
            print(f"{label:<8} {status:<9} tokens {usage['prompt_tokens']:>5} in {usage['completion_tokens']:>5} out"
                  f"  {reply}")
        else:
            error = result.get("error") if isinstance(result, dict) else result
            error_type = result.get("error_type", "") if isinstance(result, dict) else ""
            print(f"{label:<8} {status:<9} {error_type}: {error}")
    print(f"run {envelope['status']}: {len(graph.nodes)} nodes, {total} tokens")


async def run_three_nodes(session: Session, model: str, *, topic: str = DEFAULT_TOPIC) -> dict[str, Any]:
    """Run the graph on ``session`` with ``model`` on a fresh branch, print the report, return the envelope."""
    graph = build_graph(model, topic)
    print(f"plan -> (draft-a, draft-b) -> merge on {model}")
    # A fresh conversation per run: the roots would otherwise append to the session's
    # default branch, and a second run's plan would see the first run's history.
    envelope = await session.flow(graph, default_branch=session.new_branch(), max_concurrent=4)
    _report(envelope, graph)
    return envelope


async def main(session: Session, *, model: str | None = None, provider: ModelProvider | None = None) -> int:
    """Run the example on ``session``; 0 when every node completed, 1 otherwise.

    Without ``model`` the environment decides (``model_from_environment``). A ``provider``
    is registered on the session for ``model``'s provider prefix before the run.
    """
    if model is None:
        model, environment_provider = model_from_environment()
        provider = provider or environment_provider
    if provider is not None:
        session.register_provider(parse_model_id(model)[0], provider)
    envelope = await run_three_nodes(session, model)
    return 0 if envelope["status"] == "completed" else 1


def cli() -> int:
    """``python -m opgraph.cluster.example_three_nodes``: start the embedded Ray, run, shut down."""
    import ray

    try:
        session = Session()
        return asyncio.run(main(session))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    raise SystemExit(cli())
