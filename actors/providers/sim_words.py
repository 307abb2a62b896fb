"""What the simulated models say: short, readable text about the request's topic.

Owns the words of ``sim/`` replies: the topic read off the last user message, a plain
reply about it, and a sentence for each free-text field of a structured reply, chosen by
the field's name. Deterministic (every choice follows from a digest of the hint), so a
seeded run reads the same twice. No I/O, no model: it only has to read like an answer,
so that a demo, an engine's tree or a dataset job on ``sim/`` shows structure a person
can follow instead of placeholder ids.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["plain_reply", "topic_of", "words_for"]

# A labelled subject ("Topic: X", "Finding F1: X", "Question Q2 (area): X"), else a quoted phrase
# that is not a JSON key ("$defs":).
_LABELS = ("research topic|topic|report on|question|task|ticket|seed finding|finding|conclusion|hypothesis|"
           "experiment|subject|text|item")
_SUBJECT = re.compile(
    rf"(?:{_LABELS})(?:\s+[A-Z]{{1,3}}\d+)?(?:\s*\((?:[^()\n]|\([^()\n]*\)){{0,80}}\))?"
    r"\"?\s*[:=]\s*\"?([^\"\n{}\[\]]{3,160})", re.IGNORECASE)
_QUOTED = re.compile(r"\"([^\"\n$][^\"\n]{2,119})\"(?!\s*:)")
_LITERALS = frozenset(("true", "false", "null", "none"))  # a JSON value, not a subject
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9'+-]*")
_FILLER = frozenset("a an the of to in on for and or with by about this that these those is are be please your "
                    "reply answer write give list one line short".split())

# Sentences per kind of field; {topic} is the request's subject.
_STATEMENTS = (
    "{topic} shows a trade-off between cost and durability {setting}",
    "results on {topic} {setting} are promising but come from small studies",
    "{topic} depends more on manufacturing quality than on design {setting}",
    "sources disagree on how {topic} behaves {setting}",
    "{topic} improves steadily {setting}, though the gains are uneven",
    "the main limit of {topic} {setting} is its behaviour under stress",
    "{topic} works well in the lab and less well {setting}",
    "the evidence on {topic} {setting} points to one dominant failure mode",
)
_QUESTIONS = (
    "What limits {topic} {setting}?",
    "How does {topic} behave {setting}?",
    "Which conditions make {topic} fail {setting}?",
    "What would change the conclusion about {topic} {setting}?",
    "How reliable are the measurements of {topic} {setting}?",
)
# Where a statement or question applies: varies the text, so two fields rarely read alike.
_SETTINGS = (
    "at larger scale", "in cold climates", "under heavy load", "over ten years of use", "in mass production",
    "for small teams", "under current regulation", "compared with the incumbent", "in the first year",
    "when costs must fall by half", "in field conditions", "with cheaper materials",
)
_SOURCES = (
    "review article on {topic}",
    "benchmark report on {topic}",
    "field data on {topic}",
    "vendor documentation for {topic}",
    "conference paper on {topic}",
)
_REASONS = (
    "the measurements and the claims agree for {topic}",
    "two sources report different figures for {topic}",
    "the sample behind the claim about {topic} is small",
    "the effect on {topic} holds only under lab conditions",
)
_ACTIONS = (
    "compare two variants of {topic} under the same load",
    "measure {topic} before and after the change",
    "repeat the test of {topic} at a larger scale",
    "collect a week of field data on {topic}",
)
_REPLIES = (
    "{topic} comes down to a few concrete points: what is affected, why, and the next step to take.",
    "On {topic}: the likely cause is clear, the impact is limited, and the fix is a short, safe change.",
    "For {topic}, start with the simplest explanation, check it against the facts given, then act.",
    "{topic}: the request is understood; the answer covers the cause, the effect and what to do next.",
)
# A field's name (its words) -> the sentences it takes.
_FIELD_KINDS = (
    (("question", "unknown", "ask"), _QUESTIONS),
    (("source", "evidence", "reference", "citation", "dataset"), _SOURCES),
    (("rationale", "reason", "nature", "basis", "caveat", "limitation", "why", "note"), _REASONS),
    (("procedure", "method", "step", "action", "approach", "strategy", "plan", "effect", "application",
      "instruction", "fix"), _ACTIONS),
)


_OWN_SENTENCES = tuple(
    re.compile("^" + re.escape(t).replace(re.escape("{topic}"), "(.+?)")
               .replace(re.escape("{setting}"), "(?:" + "|".join(map(re.escape, _SETTINGS)) + ")") + "$", re.IGNORECASE)
    for t in (*_STATEMENTS, *_QUESTIONS, *_SOURCES, *_REASONS, *_ACTIONS))


# Whether any of them matches, in one pass: most phrases are no sentence of ours (a row's prompt, say).
_ANY_OWN_SENTENCE = re.compile("|".join(f"(?:{pattern.pattern})" for pattern in _OWN_SENTENCES), re.IGNORECASE)


def _original(phrase: str) -> str:
    """``phrase`` with any sentence of ours around it taken off (at most a few layers)."""
    if _ANY_OWN_SENTENCE.match(phrase) is None:
        return phrase
    for _ in range(4):
        for pattern in _OWN_SENTENCES:
            match = pattern.match(phrase)
            if match:
                phrase = match.group(1)
                break
        else:
            return phrase
    return phrase


def _pick(options: tuple[str, ...], key: str) -> str:
    digest = int(hashlib.sha256(key.encode()).hexdigest()[:12], 16)
    return options[digest % len(options)].replace("{setting}", _SETTINGS[(digest >> 20) % len(_SETTINGS)])


def topic_of(text: str) -> str:
    """The subject a prompt names (a labelled or quoted phrase), else its first content words."""
    for pattern in (_SUBJECT, _QUOTED):
        match = pattern.search(text)
        if match and any(w.lower() not in _LITERALS for w in _WORD.findall(match.group(1))):
            return _trimmed(match.group(1))
    words = [w for w in _WORD.findall(text) if w.lower() not in _FILLER]
    return _trimmed(" ".join(words[:6])) or "the request"


def _trimmed(phrase: str) -> str:
    phrase = _original(" ".join(phrase.split()).strip(" .,:;-"))
    return phrase if len(phrase) <= 80 else phrase[:80].rsplit(" ", 1)[0]


def plain_reply(topic: str, key: str) -> str:
    """A plain chat reply about ``topic``."""
    return _pick(_REPLIES, key).format(topic=topic)


def words_for(hint: str, topic: str) -> str:
    """A sentence for the free-text field a hint names (``sim-<digest>-<model>-<field>[-<index>]``)."""
    parts = [part for part in hint.split("-") if part and not part.isdigit()]
    field = parts[-1].lower() if len(parts) > 1 else ""
    if field in ("path", "file", "filename"):
        return "notes/" + "-".join(w.lower() for w in _WORD.findall(topic)[:4]) + ".md"
    if field in ("name", "title", "label", "area", "aspect", "dimension", "role"):
        return f"{topic} ({field})"
    for words, options in _FIELD_KINDS:
        if any(word in field for word in words):
            return _pick(options, hint).format(topic=topic)
    sentence = _pick(_STATEMENTS, hint).format(topic=topic)
    return sentence[0].upper() + sentence[1:]
