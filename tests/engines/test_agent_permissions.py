"""An engine agent's permissions are enforced by the runtime, on the worker, whatever the model asks.

A scripted model asks for a tool its agent may not call: the call is refused with a typed
observation in the agent's own conversation (the BranchStore's record of it), and the
tool function never runs (it would leave a file behind). For operate and ReAct turns,
through any engine (here a test engine), and a turn's own permissions only narrow.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_scripts import ScriptEngine
from fake_chat import tool_answers

from opgraph.actors.verbs import Tool
from opgraph.engines import EngineInputError

pytestmark = pytest.mark.ray


def note_tools(folder: str) -> tuple[Tool, Tool]:
    def read_note() -> str:
        """Read the note."""
        return "hello"

    def write_note(text: str) -> str:
        """Write the note (leaves a file behind: the proof it ran)."""
        Path(folder, "written.txt").write_text(text)
        return "written"

    return Tool.from_function(read_note), Tool.from_function(write_note)


def asks_for_both(request) -> dict:
    """First ask for both tools; once answered, say which tools were offered."""
    if any(message.get("role") == "tool" for message in request.messages):
        offered = sorted(item["function"]["name"] for item in request.tools or [])
        return {"content": "offered: " + ",".join(offered)}
    return {"tool_calls": [{"id": "c1", "name": "write_note", "arguments": {"text": "pwned"}},
                           {"id": "c2", "name": "read_note", "arguments": {}}]}


@pytest.mark.parametrize("operation", ["operate", "ReAct"])
def test_a_forbidden_tool_is_refused_in_the_conversation_and_never_runs(session, model, tmp_path, operation):
    tools = note_tools(str(tmp_path))
    scripted = model(asks_for_both)

    async def body(run):
        agent = await run.make_agent("clerk", name="clerk", model=scripted, tools=tools, permissions=["read_note"])
        result = await run.turn(agent, "Do the notes.", operation=operation)
        return result.response, await session.messages(agent.id)

    response, messages = asyncio.run(ScriptEngine(body).run(session=session))
    answers = tool_answers(messages)
    assert answers["read_note"] == "hello"
    assert answers["write_note"]["error_type"] == "ToolPermissionError"
    assert "may not call the tool 'write_note'" in answers["write_note"]["error"]
    assert not (tmp_path / "written.txt").exists()
    final = response if isinstance(response, str) else response["answer"]
    assert final == "offered: read_note"  # the forbidden tool was not even offered


def test_a_turns_own_permissions_only_narrow_the_agents(session, model, tmp_path):
    tools = note_tools(str(tmp_path))
    scripted = model(asks_for_both)

    async def body(run):
        agent = await run.make_agent("clerk", name="clerk", model=scripted, tools=tools, permissions=["read_note"])
        await run.turn(agent, "Do the notes.", permissions=["write_note"])
        return await session.messages(agent.id)

    answers = tool_answers(asyncio.run(ScriptEngine(body).run(session=session)))
    assert answers["write_note"]["error_type"] == answers["read_note"]["error_type"] == "ToolPermissionError"
    assert not (tmp_path / "written.txt").exists()


def test_bad_permissions_are_refused_before_the_agent_exists(session):
    async def body(run):
        await run.make_agent("clerk", permissions={"alow": ["read_note"]})

    with pytest.raises(EngineInputError, match="unknown permission keys"):
        asyncio.run(ScriptEngine(body).run(session=session))
