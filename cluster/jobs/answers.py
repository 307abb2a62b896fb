"""How one row of a dataset job is answered, on a worker: one prompt, or one structured answer.

Owns the operation a job registers for its rows (``answer_row``, bound to the job's
``RowTask``): the model sees the job's system prompt and the row's prompt, no history (a row
is stateless: it has no branch), and with a JSON Schema the reply goes through the verbs'
structured path (``converse``) with its bounded repair turn. A reply that still does not fit
is an answer that failed, returned with its reason and the usage it cost. It decides nothing
about which rows run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from opgraph.actors.verbs import ParseError
from opgraph.actors.verbs.conversation import BoundModel, system_messages
from opgraph.actors.verbs.structured import converse, json_schema_model, schema_guidance

from .rows import MapInputError

__all__ = ["REPAIR_TURNS", "ROW_OPERATION", "RowTask", "answer_model", "answer_row", "check_schema"]

ROW_OPERATION = "map_row"  # the operation name a job's rows run under
REPAIR_TURNS = 1  # a reply that does not fit the schema is sent back once with the reason, then fails


@dataclass(frozen=True, slots=True)
class RowTask:
    """What every row of one job shares, shipped once with the run's operations: the model
    (None: the run's default), the system prompt, and the answer's JSON Schema (None: text)."""

    model: str | None = None
    system: str | None = None
    schema: dict[str, Any] | None = None
    max_output_tokens: int | None = None

    @property
    def schema_text(self) -> str | None:
        return None if self.schema is None else json.dumps(self.schema, sort_keys=True)


def check_schema(schema: Any, where: str = "the schema") -> dict[str, Any]:
    """``schema`` if it is a JSON Schema (an object its meta-schema accepts); ``MapInputError`` else."""
    import jsonschema

    if not isinstance(schema, dict):
        raise MapInputError(f"{where} is not a JSON Schema: a JSON object is needed, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(part) for part in exc.path) or "(root)"
        raise MapInputError(f"{where} is not valid JSON Schema: at {path}: {exc.message}", column=path) from None
    return schema


# A schema file takes the structured path the verbs take with a pydantic class: the verbs' own
# model made from a JSON Schema (its validation jsonschema's), once per process and schema.
answer_model = json_schema_model


async def answer_row(branch: Any, prompt: str = "", context: Any = None, *, task: RowTask,
                     **parameters: Any) -> str:
    """Answer one row: ``{"answer", "usage", "model"}``, or ``{"failed", "error_type", "usage", "model"}``
    when the reply does not fit the schema after the repair turn, as JSON text. A provider that fails
    raises, as any operation does (the row fails, typed by the runtime). ``context`` is the run's, unused.

    JSON text, not the mapping: a string is a plain result, which the worker need not walk for
    spawn requests nor the scheduler for a context update, and which crosses every process and
    the run log as one value (a dict per row cost the worker a walk and each hop its pickling)."""
    del context, parameters
    options = {} if task.max_output_tokens is None else {"max_tokens": task.max_output_tokens}
    bound = BoundModel(branch, task.model, options, "map")
    model_class = None if task.schema is None else answer_model(task.schema_text)
    content = prompt if model_class is None else f"{prompt}\n\n{schema_guidance(model_class)}"
    conversation = system_messages(task.system) + [{"role": "user", "content": content}]
    try:
        exchange = await converse(bound, conversation, recorded=[], verb="map", response_format=model_class,
                                  parse_retries=REPAIR_TURNS)
    except ParseError as error:
        return _json({"failed": error.message, "error_type": "ParseError", "usage": _usage(bound.usage),
                      "model": bound.model_id})
    answer = exchange.parsed.root if model_class is not None else exchange.text
    return _json({"answer": answer, "usage": _usage(bound.usage), "model": bound.model_id})


def _usage(tally: Any) -> list[int]:
    """(calls, prompt tokens, completion tokens): what a row's record keeps of its usage."""
    return [tally.calls, tally.prompt_tokens, tally.completion_tokens]


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
