"""How the rows of a dataset job are answered, on a worker: one prompt, or one structured answer, a row.

Owns the operation a job registers for its rows (``answer_rows``, bound to the job's
``RowTask``): one operation carries a batch of rows, whose model calls it makes at once; each
row's model sees the job's system prompt and the row's prompt, no history (a row is
stateless: it has no branch), and with a JSON Schema the reply goes through the verbs'
structured path (``converse``) with its bounded repair turn. A reply that still does not fit,
or a model call that fails, is a row that failed, returned with its reason and the usage it
cost; the batch's other rows are not touched. It owns the text a batch's answers travel as
(``encode_answers``, ``decode_answers``) and decides nothing about which rows run.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from json.encoder import encode_basestring  # json.dumps(text, ensure_ascii=False) of a str, without its setup
from typing import Any

from opgraph.actors.errors import clean_text
from opgraph.actors.verbs import ParseError
from opgraph.actors.verbs.conversation import BoundModel, system_messages
from opgraph.actors.verbs.structured import converse, json_schema_model, schema_guidance

from .rows import MapInputError

__all__ = ["REPAIR_TURNS", "ROWS_OPERATION", "ROW_OPERATION", "RowAnswer", "RowTask", "answer_model", "answer_row",
           "answer_rows", "check_schema", "decode_answers", "encode_answers"]

ROWS_OPERATION = "map_rows"  # the operation name a job's batches of rows run under
ROW_OPERATION = "map_row"  # one row an operation, as runs fed before batches were did (adopted, they finish)
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


# One row's answer, as a batch's text carries it: done or not, the answer's JSON text (done) or
# why it failed, its usage (calls, prompt tokens, completion tokens) and the model that answered.
RowAnswer = tuple[bool, str, int, int, int, "str | None"]


async def answer_rows(branch: Any, prompts: list[str] | tuple[str, ...] = (), context: Any = None, *,
                      task: RowTask, **parameters: Any) -> str:
    """Answer a batch of rows, their model calls made at once: their ``RowAnswer``s, in order, as the
    text ``encode_answers`` makes. A row whose reply does not fit the schema after the repair turn,
    or whose model call fails, is a failed row (with the usage it cost); the batch goes on. Only a
    cancellation (or the worker's death) ends the batch, and then every row of it is run again.

    Text, not a list: a string is a plain result, which the worker need not walk for spawn
    requests, which crosses every process and the run log as one value, and whose answers the
    client stores as they are (their JSON is never decoded and encoded again)."""
    del context, parameters
    model_class = None if task.schema is None else answer_model(task.schema_text)
    options = {} if task.max_output_tokens is None else {"max_tokens": task.max_output_tokens}
    if len(prompts) == 1:
        timed = [await _answer_one(branch, task, options, model_class, prompts[0])]
    else:
        timed = await asyncio.gather(*[_answer_one(branch, task, options, model_class, prompt)
                                       for prompt in prompts])
    return encode_answers([answer for answer, _ in timed], [seconds for _, seconds in timed])


async def _answer_one(branch: Any, task: RowTask, options: dict[str, Any], model_class: Any,
                      prompt: str) -> tuple[RowAnswer, float]:
    """The row's answer, and the seconds its model calls took (the feeder's batch sizer reads them)."""
    started = time.perf_counter()
    bound = BoundModel(branch, task.model, options, "map")
    content = prompt if model_class is None else f"{prompt}\n\n{schema_guidance(model_class)}"
    conversation = system_messages(task.system) + [{"role": "user", "content": content}]
    try:
        if model_class is None:  # a text answer: one call, its reply as it is (what converse does without a schema)
            ok, text = True, encode_basestring((await bound.complete(conversation)).content or "")
        else:
            exchange = await converse(bound, conversation, recorded=[], verb="map", response_format=model_class,
                                      parse_retries=REPAIR_TURNS)
            ok, text = True, _json(exchange.parsed.root)
    except ParseError as error:
        ok, text = False, error.message
    except Exception as exc:  # noqa: BLE001 - the row's model call failed: that row failed, with why
        ok, text = False, f"{type(exc).__name__}: {clean_text(str(exc) or type(exc).__name__)}"
    tally = bound.usage
    return (ok, text, tally.calls, tally.prompt_tokens, tally.completion_tokens, bound.model_id), \
        time.perf_counter() - started


def encode_answers(answers: list[RowAnswer], seconds: list[float] | None = None) -> str:
    """A batch's answers as one text: a JSON header line, ``[done (1/0), length, calls, prompt tokens,
    completion tokens, model, milliseconds]`` a row (the milliseconds its calls took, when known),
    then each row's text (answer JSON or reason) back to back."""
    timed = seconds if seconds is not None else [None] * len(answers)
    header = [[1 if ok else 0, len(text), calls, prompt, completion, model]
              + ([] if took is None else [round(took * 1000, 1)])
              for (ok, text, calls, prompt, completion, model), took in zip(answers, timed, strict=True)]
    return _json(header) + "\n" + "".join(answer[1] for answer in answers)


def decode_answers(text: str, seconds: list[float] | None = None) -> list[RowAnswer]:
    """``encode_answers``' answers back: one JSON decode for the batch; each row's text is sliced out.
    Each row's call time, where the header has it, is appended to ``seconds``."""
    head, _, body = text.partition("\n")
    answers, start = [], 0
    for ok, length, calls, prompt, completion, model, *took in json.loads(head):
        end = start + length
        answers.append((ok == 1, body[start:end], calls, prompt, completion, model))
        start = end
        if took and seconds is not None:
            seconds.append(took[0] / 1000)
    return answers
