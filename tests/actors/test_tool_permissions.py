"""Tool permissions enforced where tools run: operate, ReAct and act refuse a forbidden call, typed.

No Ray: each verb runs against an in-memory branch and a scripted provider that asks for a
tool the caller may not use. The refusal is an observation in the conversation
(``"error_type": "ToolPermissionError"``), and the tool function is never invoked.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

import pytest

from opgraph.actors.models import ChatRequest, ChatResponse, ToolCall, Usage
from opgraph.actors.verbs import (
    ReAct,
    Tool,
    ToolPermissionError,
    ToolPermissions,
    act,
    chat,
    operate,
    tool,
)

INVOKED: list[str] = []


def read_note() -> str:
    """Read the note."""
    INVOKED.append("read_note")
    return "hello"


def delete_everything(reason: str = "") -> str:
    """A tool no careful caller allows."""
    INVOKED.append("delete_everything")
    return "deleted"


def read_path(path: str) -> str:
    """Read a file by path."""
    INVOKED.append(f"read_path:{path}")
    return "contents"


class Script:
    """Asks for ``calls`` first, then answers "done"; records every request."""

    name = "script"

    def __init__(self, *calls: ToolCall) -> None:
        self.calls = list(calls)
        self.requests: list[ChatRequest] = []

    async def complete(self, request: ChatRequest) -> ChatResponse:
        self.requests.append(request)
        answered = any(message.get("role") == "tool" for message in request.messages)
        calls = [] if answered else self.calls
        return ChatResponse(content="done" if answered else None, tool_calls=calls, usage=Usage(5, 5),
                            model=request.model, provider="script",
                            finish_reason="tool_calls" if calls else "stop")


class Branch:
    def __init__(self, provider: Any) -> None:
        self.id, self.run_id, self.node_id = "branch-1", "run-1", "node-1"
        self.default_model = "script/m"
        self.provider = provider
        self.history: list[Any] = []

    async def messages(self) -> list[Any]:
        return list(self.history)

    async def append(self, *messages: Any) -> int:
        self.history.extend(messages)
        return len(self.history)

    def emit(self, request: Any) -> None:
        raise AssertionError("nothing here emits")

    def provider_for(self, model: str) -> Any:
        return self.provider


@pytest.fixture(autouse=True)
def _fresh_record():
    INVOKED.clear()
    yield
    INVOKED.clear()


def _tool_answers(history: list[Any]) -> dict[str, dict[str, Any]]:
    calls = {item["id"]: item["function"]["name"] for message in history if message.get("tool_calls")
             for item in message["tool_calls"]}
    answers = {}
    for message in history:
        if message.get("role") == "tool":
            content = message["content"]
            answers[calls[message["tool_call_id"]]] = json.loads(content) if content.startswith("{") else content
    return answers


def test_operate_refuses_a_forbidden_tool_the_model_asks_for_and_never_runs_it():
    script = Script(ToolCall("c1", "delete_everything", {"reason": "why not"}), ToolCall("c2", "read_note", {}))
    branch = Branch(script)
    text = asyncio.run(operate(branch, "Tidy up.", tools=[read_note, delete_everything],
                               permissions=["read_note"]))
    assert text == "done"
    assert INVOKED == ["read_note"]
    answers = _tool_answers(branch.history)
    assert answers["read_note"] == "hello"
    assert answers["delete_everything"]["error_type"] == "ToolPermissionError"
    assert "may not call the tool 'delete_everything'" in answers["delete_everything"]["error"]
    # Only what it may call is offered; asking for the rest anyway is what gets refused.
    assert [item["function"]["name"] for item in script.requests[0].tools] == ["read_note"]


def test_react_and_act_refuse_the_same_way():
    script = Script(ToolCall("c1", "delete_everything", {}))
    branch = Branch(script)
    result = asyncio.run(ReAct(branch, "Go.", tools=[read_note, delete_everything],
                               permissions={"deny": ["delete_everything"]}))
    [action] = result["rounds"][0]["actions"]
    assert action["error_type"] == "ToolPermissionError" and "output" not in action
    entries = asyncio.run(act(Branch(Script()), tools=[read_note, delete_everything],
                              actions=[{"function": "delete_everything", "arguments": {}},
                                       {"function": "read_note", "arguments": {}}],
                              permissions=ToolPermissions(allow=frozenset({"read_note"}))))
    assert [entry.get("error_type") for entry in entries] == ["ToolPermissionError", None]
    assert INVOKED == ["read_note"]


def test_path_arguments_are_confined_to_the_working_directory(tmp_path):
    (tmp_path / "inside.txt").write_text("x")
    (tmp_path / "link_out").symlink_to("/etc")
    reader = Tool.from_function(read_path, paths=("path",))
    secure = ToolPermissions(cwd=str(tmp_path))
    for path in ("../elsewhere", "/etc/passwd", "link_out/passwd"):
        refused = secure.refusal("read_path", reader.path_arguments, {"path": path})
        assert isinstance(refused, ToolPermissionError) and refused.tool == "read_path"
    assert secure.refusal("read_path", reader.path_arguments, json.dumps({"path": "inside.txt"})) is None
    assert secure.refusal("read_path", reader.path_arguments, {"path": "."}) is None  # the folder itself
    assert secure.refusal("read_path", reader.path_arguments, {"path": str(tmp_path / "inside.txt")}) is None
    assert ToolPermissions(cwd=str(tmp_path), secure=False).refusal("read_path", ("path",), {"path": "/etc"}) is None
    # A secure caller with no working directory may not run a tool that takes paths at all.
    no_cwd = ToolPermissions(allow=frozenset({"read_path"}))
    assert "no working directory" in no_cwd.refusal("read_path", ("path",), {"path": "inside.txt"}).message

    script = Script(ToolCall("c1", "read_path", {"path": "../../etc/passwd"}))
    branch = Branch(script)
    asyncio.run(operate(branch, "Read.", tools=[reader], permissions=secure))
    assert INVOKED == [] and _tool_answers(branch.history)["read_path"]["error_type"] == "ToolPermissionError"


def test_permissions_forms_narrowing_and_pickling():
    assert ToolPermissions.of(None) is None
    assert ToolPermissions.of(["a", "b"]).allow == {"a", "b"}
    mapped = ToolPermissions.of({"allow": ["a", "b"], "deny": ["b"], "cwd": "/w"})
    assert (mapped.permits("a"), mapped.permits("b"), mapped.cwd) == (True, False, "/w")
    assert ToolPermissions.of([]).permits("anything") is False  # an empty allow-list allows nothing
    narrowed = mapped.narrow(ToolPermissions.of(["b", "c"]))
    assert narrowed.allow == {"b"} and not narrowed.permits("b")  # narrowing never widens
    with pytest.raises(ToolPermissionError):
        ToolPermissions.of({"alow": ["a"]})
    copy = pickle.loads(pickle.dumps(tool(read_path, paths=("path",))))
    assert copy.path_arguments == ("path",) and copy.name == "read_path"
    assert pickle.loads(pickle.dumps(mapped)) == mapped


def test_verbs_without_tools_accept_permissions_and_have_nothing_to_enforce():
    """An engine attaches its agent's permissions to every turn: a chat turn takes them quietly."""
    branch = Branch(Script())
    assert asyncio.run(chat(branch, "Hi.", permissions=["read_note"])) == ""
    assert branch.history[0] == {"role": "user", "content": "Hi."}
    assert "permissions" not in str(branch.provider.requests[0].messages)
