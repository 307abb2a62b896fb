"""Provider usage of a planned task node, measured where its model calls run (an OperationWorker).

Owns ``UsageMeter`` (a branch handle whose providers count tokens per model) and
``engine_operate``, the operation engines register for DAG nodes: a spawnable verb
(``operate`` by default) returning its text and usage. Graph nodes report no usage of
their own (``Session.turn`` does, for single turns), so this is how planned and spawned
work is priced against budgets. It runs inside workers, never in the driver, and
changes nothing about the verb it wraps.
"""

from __future__ import annotations

from typing import Any

from opgraph.actors.verbs import ReAct, VerbParameterError, chat, communicate, operate
from opgraph.kernel import SpawnRequest, extract_requests, to_mapping

__all__ = ["ENGINE_OPERATE", "METERED_VERBS", "UsageMeter", "empty_usage", "engine_operate"]

ENGINE_OPERATE = "engine_operate"
# The verbs a SpawnRequest may name (kernel SPAWN_ALLOWED_OPERATIONS); each runs metered.
METERED_VERBS = {"operate": operate, "chat": chat, "communicate": communicate, "ReAct": ReAct}


def empty_usage() -> dict[str, Any]:
    return {"calls": 0, "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "by_model": {}}


class _CountingProvider:
    """Wraps a provider: every completed call adds its usage to the meter, by model."""

    def __init__(self, inner: Any, meter: UsageMeter) -> None:
        self._inner = inner
        self._meter = meter
        self.name = getattr(inner, "name", "provider")

    async def complete(self, request: Any) -> Any:
        response = await self._inner.complete(request)
        self._meter.add(request.model, response.usage)
        return response


class _MeteredBranch:
    """The worker's branch handle with metered providers; everything else is the branch's own."""

    def __init__(self, branch: Any, meter: UsageMeter) -> None:
        self._branch = branch
        self._meter = meter

    def provider_for(self, model: str) -> Any:
        return _CountingProvider(self._branch.provider_for(model), self._meter)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._branch, name)


class UsageMeter:
    """Token usage of every model call made through ``meter.branch``, in ``TurnResult.usage`` shape."""

    def __init__(self, branch: Any) -> None:
        self.branch = _MeteredBranch(branch, self)
        self.usage = empty_usage()

    def add(self, model: str, usage: Any) -> None:
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        completion = int(getattr(usage, "completion_tokens", 0) or 0)
        totals = self.usage
        totals["calls"] += 1
        totals["prompt_tokens"] += prompt
        totals["completion_tokens"] += completion
        totals["total_tokens"] += prompt + completion
        per_model = totals["by_model"].setdefault(model, {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0})
        per_model["prompt_tokens"] += prompt
        per_model["completion_tokens"] += completion
        per_model["calls"] += 1


def _text_of(response: Any) -> str:
    if isinstance(response, str):
        return response
    text = getattr(response, "text", None)
    if isinstance(text, str):
        return text
    if isinstance(response, dict) and isinstance(response.get("answer"), str):
        return response["answer"]  # ReAct's summary
    return str(to_mapping(response))


async def engine_operate(branch: Any, instruction: str = "", context: Any = None, model: str | None = None, *,
                         inputs: list[str] | None = None, assignee: str | None = None, verb: str = "operate",
                         **options: Any) -> dict[str, Any]:
    """A task node: ``verb`` with usage, returning ``{"text", "usage", "spawn", "assignee"}``.

    ``inputs`` (a TaskAssignment's named inputs) are stated under the instruction, so the
    verb gets only parameters it knows; ``assignee`` (the node's role) is echoed back, so
    spawned nodes, which only the executor knows, report their role too. ``spawn`` holds
    the SpawnRequests of a structured reply, where the worker finds them for reactive growth.
    """
    run_verb = METERED_VERBS.get(verb)
    if run_verb is None:
        raise VerbParameterError(f"engine_operate: {verb!r} is not a spawnable verb; known: "
                                 f"{', '.join(sorted(METERED_VERBS))}", node_id=getattr(branch, "node_id", None),
                                 branch_id=getattr(branch, "id", None))
    if inputs:
        instruction = f"{instruction}\n\nInputs: {', '.join(str(item) for item in inputs)}"
    meter = UsageMeter(branch)
    response = await run_verb(meter.branch, instruction, context, model, **options)
    return {"text": _text_of(response), "usage": meter.usage, "assignee": assignee,
            "spawn": extract_requests(response, (SpawnRequest,))}

