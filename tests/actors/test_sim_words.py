"""sim/'s words: replies read as text about the request's topic, never as placeholder ids."""

import asyncio
import json

from pydantic import BaseModel

from opgraph.actors.models import ChatRequest
from opgraph.actors.providers import SimulatedProvider
from opgraph.actors.providers.sim_words import topic_of, words_for


class Finding(BaseModel):
    description: str
    question: str
    sources: list[str]


def test_the_topic_is_the_phrase_a_prompt_names():
    assert topic_of("Research topic: solid-state batteries\nFind what matters.") == "solid-state batteries"
    assert topic_of('Classify this.\n{"ticket": "card payments fail", "priority": "high"}') == "card payments fail"
    assert topic_of("Summarise the quarterly report for the board") == "Summarise quarterly report board"


def test_a_prompt_built_from_a_simulated_sentence_keeps_the_original_topic():
    """root topic -> a simulated question -> that question as the next prompt's topic -> the root topic again."""
    question = words_for("sim-0a1b-depth_requested-question", "solid-state batteries")
    assert question.endswith("?") and "solid-state batteries" in question
    assert topic_of(f"Research topic: {question}") == "solid-state batteries"


def test_structured_and_plain_replies_are_readable_and_on_topic():
    provider = SimulatedProvider(latency=0.0, list_items=2)
    response_format = {"type": "json_schema", "json_schema": {"name": "f", "schema": Finding.model_json_schema()}}
    request = ChatRequest("sim/default", [{"role": "user", "content": "Research topic: tidal power"}],
                          response_format=response_format)
    finding = Finding.model_validate_json(asyncio.run(provider.complete(request)).content)
    texts = [finding.description, finding.question, *finding.sources]
    assert all("tidal power" in text.lower() and "sim-" not in text for text in texts)
    assert finding.question.endswith("?") and len(set(finding.sources)) == 2
    asked = [{"role": "user", "content": "topic: tidal power"}]
    plain = asyncio.run(provider.complete(ChatRequest("sim/default", asked)))
    assert "simulated reply" in plain.content and "tidal power" in plain.content
    loose = ChatRequest("sim/default", [{"role": "user", "content": "topic: tidal power"}],
                        response_format={"type": "json_object"})
    assert json.loads(asyncio.run(provider.complete(loose)).content)["topic"] == "tidal power"


def test_a_labelled_subject_with_an_id_or_a_note_is_found_and_a_json_key_is_not():
    """An engine's prompt names its subject as "Finding F1: ..." or "Question Q2 (area): ...", and
    may carry a JSON schema whose keys ("$defs") and values (false) are not a subject."""
    schema_tail = '\n{"$defs": {"x": {"type": "object"}}, "strict": false}'
    assert topic_of("Finding F1: retries cause duplicate tool calls" + schema_tail) \
        == "retries cause duplicate tool calls"
    assert topic_of("Question Q2 (lease expiry (area)): How do leases lapse" + schema_tail) == "How do leases lapse"
    assert topic_of("Summarise." + schema_tail) != "$defs"
