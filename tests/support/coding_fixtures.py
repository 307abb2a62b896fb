"""Helpers for the coding engine's tests: a throw-away repository, a scripted coder, snapshots.

``make_project`` writes a tiny Python project whose one test fails (``add`` subtracts)
beside a sibling folder the run must never touch; ``CodingScript`` is a scripted model
that answers each coding agent (planner, implementer, verifier) with typed emissions,
deciding from the request (so any worker answers the same); ``PLAN`` and ``VERIFIED`` are
the planner's and the verifier's clean replies; ``coding_case`` builds an engine, its
inputs and the project in one call.
This module travels to the Ray workers by value (it registers itself), so its scripts work there.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine_scripts import agent_of, last_user
from ray import cloudpickle

__all__ = [
    "BROKEN",
    "FIXED",
    "PLAN",
    "PYTEST",
    "VERIFIED",
    "CodingScript",
    "change",
    "coding_case",
    "edit",
    "make_project",
    "snapshot",
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

BROKEN = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TEST = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# A real pytest, quick to start: no third-party plugins, no cache folder.
PYTEST = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {sys.executable} -m pytest -q -p no:cacheprovider"

_ROUND = re.compile(r"after round (\d+)")


def make_project(root: Path) -> tuple[Path, Path]:
    """``root/project`` (calc.py with a bug, its failing test) and ``root/outside`` (a sibling with a file)."""
    project = root / "project"
    project.mkdir(parents=True)
    (project / "calc.py").write_text(BROKEN)
    (project / "test_calc.py").write_text(TEST)
    outside = root / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("untouched\n")
    return project, outside


def snapshot(folder: Path) -> dict[str, tuple[str, str]]:
    """Every entry under ``folder`` (links not followed): kind and content or link target."""
    found: dict[str, tuple[str, str]] = {}
    for current, folders, files in os.walk(folder):
        for name in folders + files:
            path = Path(current) / name
            relative = str(path.relative_to(folder))
            if path.is_symlink():
                found[relative] = ("link", os.readlink(path))
            elif path.is_dir():
                found[relative] = ("dir", "")
            else:
                found[relative] = ("file", path.read_bytes().decode("utf-8", "replace"))
    return found


def edit(path: str, content: str = "", *, delete: bool = False) -> dict[str, Any]:
    return {"path": path, "content": content, "delete": delete}


def change(*edits: dict[str, Any], summary: str = "a change") -> str:
    """A change_proposed emission bundle, as the implementer's reply text."""
    return json.dumps({"change_proposed": [{"plan": "P1", "summary": summary,
                                            "files_touched": [item["path"] for item in edits],
                                            "edits": list(edits)}]})


PLAN = json.dumps({"work_planned": [{"approach": "make add add", "files_to_touch": ["calc.py"],
                                     "test_strategy": "run the tests", "acceptance_criteria": ["add(2, 3) == 5"]}]})
VERIFIED = json.dumps({"verify_result": [{"change": "C2", "tests": "T2", "meets_acceptance": True, "unmet": []}]})


class CodingScript:
    """A scripted coder: the planner plans, the implementer answers ``changes[n]`` in round n
    (0 implementing, then each fix round; the last repeats), the verifier verifies.

    ``changes`` items are reply texts (``change(...)``) or callables of the request. A
    reply in ``replies`` for an agent name overrides the defaults.
    """

    def __init__(self, changes: list[str | Callable[[Any], Any]], *, plan: str = PLAN, verify: str = VERIFIED,
                 replies: dict[str, Any] | None = None) -> None:
        self.changes = list(changes)
        self.plan = plan
        self.verify = verify
        self.replies = dict(replies or {})

    def __call__(self, request: Any) -> Any:
        agent = agent_of(request)
        if agent in self.replies:
            reply = self.replies[agent]
            return reply(request) if callable(reply) else reply
        if agent == "planner":
            return self.plan
        if agent == "verifier":
            return self.verify
        if agent == "implementer":
            found = _ROUND.search(last_user(request))
            round_ = int(found.group(1)) + 1 if found else 0  # a fix prompt names the round it follows
            reply = self.changes[min(round_, len(self.changes) - 1)]
            return reply(request) if callable(reply) else reply
        return "ok"


def coding_case(register_model: Callable[..., str], root: Path, *, changes: list[Any] | None = None,
                replies: dict[str, Any] | None = None, test_cmd: str = PYTEST,
                **settings: Any) -> tuple[Any, tuple, dict[str, Any]]:
    """``(engine, args, kwargs)`` so that ``engine.run(*args, **kwargs)``
    runs a complete coding chain on a fresh tiny project under ``root``.

    ``register_model`` is the engine tests' ``model`` fixture (it registers a scripted
    provider and returns its model id). By default the script fixes the bug in round 0,
    so the run makes three agents (planner, implementer; the verifier is exempt) and one
    test run, and returns a ``CodeResultRecorded`` with verdict ``passed``. ``changes``
    replaces the implementer's replies per round (say ``["prose only"]`` for a missed
    emission), ``replies`` any agent's (``{"planner": ...}``), ``test_cmd`` the gate
    (say ``"sleep 30"`` to have something to cancel or time out); ``settings`` override
    the engine's (max_agents, deadline_s, max_tokens, max_fix_rounds, test_timeout_s...).
    """
    from opgraph.engines import CodingEngine

    project, _ = make_project(root)
    script = CodingScript(changes or [change(edit("calc.py", FIXED), summary="add adds")], replies=replies)
    options = {"model": register_model(script), "test_timeout_s": 60.0, "turn_timeout_s": 60.0, "kill_grace_s": 0.5,
               "max_fix_rounds": 1, **settings}
    return CodingEngine(**options), ("make add() add its arguments",), {"workspace": str(project),
                                                                        "test_cmd": test_cmd}
