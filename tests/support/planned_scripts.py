"""A scripted planner and task model for the planned-lane tests, usable in any process and its workers.

``PlannedScript(log_path)`` answers the planner's turn with the plan its task names
(``PLANS[key]``, the prompt being the key), a task node by markers in its instruction
(``SPAWN2`` asks for two follow-ups, ``SLOW`` takes ``SLOW_SECONDS``, ``FAILONCE`` fails
while the file ``<log>.fail`` exists), and the synthesiser with a fixed line. Every call
appends one line to ``log_path`` (``planner``, ``task <instruction>``, ``synthesis``), so a
test can count calls made in any process.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from opgraph.actors.models import ProviderUnavailable

__all__ = ["PLANS", "SLOW_SECONDS", "PlannedScript", "calls"]

SLOW_SECONDS = 2.5


def _step(task: str, role: str, *depends: int) -> dict[str, Any]:
    return {"task": task, "assignee": role, "depends_on": [str(d) for d in depends]}


PLANS: dict[str, list[Any]] = {
    # 1 (SPAWN2) -> 2 -> 3 (SLOW) -> 4 (SLOW); the children of 1 run beside 2.
    "crash-plan": [_step("gather SPAWN2", "researcher"), _step("weigh", "analyst", 1),
                   _step("draft SLOW", "writer", 2), _step("review SLOW", "critic", 3)],
    # an unknown role dropped (its dependants renumbered), a role's case ignored, a self, an out-of-range
    # and a non-integer ordinal dropped
    "messy-plan": [_step("one", "RESEARCHER"), _step("two", "wizard", 1), _step("three", "writer", 1, 3, 9, 2),
                   _step("four", "analyst", 3, "x")],
    "cycle-plan": [_step("a", "writer", 2), _step("b", "critic", 1)],
    "empty-plan": [],
    "spawny-plan": [_step("a SPAWN2", "researcher"), _step("b SPAWN2", "critic"), _step("c SPAWN2", "writer")],
    "failing-plan": [_step("fine SPAWN2", "researcher"), _step("broken FAILONCE SPAWN2", "writer"),
                     _step("after", "critic", 2)],
    "big-plan": [_step(f"part {i}", "researcher") for i in range(30)],
}


def calls(log_path: str | Path) -> list[str]:
    path = Path(log_path)
    return path.read_text().splitlines() if path.exists() else []


def _text(request: Any) -> str:
    return "\n".join(str(message.get("content", "")) for message in request.messages)


def _last_user(request: Any) -> str:
    return next((str(m.get("content")) for m in reversed(request.messages) if m.get("role") == "user"), "")


_PREAMBLES = ("Context:", "Shared context:", "Results of earlier steps:")


def _instruction(user: str) -> str:
    """The instruction in a task node's user message: the part after the context preamble, one line."""
    parts = [part for part in user.split("\n\n") if part.strip() and not part.startswith(_PREAMBLES)]
    return parts[0].strip().split("\n", 1)[0] if parts else ""


class PlannedScript:
    def __init__(self, log_path: str | Path) -> None:
        self.log_path = str(log_path)

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as log:
            log.write(line.replace("\n", " ") + "\n")

    async def __call__(self, request: Any) -> Any:
        user = _last_user(request)
        if "Plan the work for this task" in user:
            self._log("planner")
            key = user.split("Task: ", 1)[1].split("\n", 1)[0].strip()
            plan = PLANS.get(key, [])
            if "Your previous plan had no usable assignment" in user and key == "empty-then-one":
                plan = [_step("only", "writer")]
            return json.dumps({"assignments": plan})
        if "You are synthesizer" in _text(request):
            self._log("synthesis")
            return "the final answer"
        instruction = _instruction(user)
        self._log(f"task {instruction}")
        if "FAILONCE" in instruction and os.path.exists(self.log_path + ".fail"):
            return ProviderUnavailable("scripted failure", provider="scripted")
        if "SLOW" in instruction:
            await asyncio.sleep(SLOW_SECONDS)
        spawn = []
        if "SPAWN2" in instruction:
            spawn = [{"instruction": f"child {index} of {instruction.split()[0]}"} for index in (1, 2)]
        return json.dumps({"text": f"done {instruction.split()[0] if instruction else ''}", "spawn": spawn})
