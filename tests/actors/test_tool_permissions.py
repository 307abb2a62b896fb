"""Tool permissions enforced where tools run: operate, ReAct and act refuse a forbidden call, typed.

No Ray: each verb runs against an in-memory branch and a scripted provider that asks for a
tool the caller may not use. The refusal is an observation in the conversation
(``"error_type": "ToolPermissionError"``), and the tool function is never invoked.
"""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from fake_chat import FakeBranch, FakeProvider, reply, tool_answers

from opgraph.actors.models import ChatRequest, ChatResponse, ToolCall
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


def asks_for(*calls: ToolCall) -> FakeProvider:
    """A provider that asks for ``calls`` first, then answers "done" once a tool has answered."""

    def step(request: ChatRequest) -> ChatResponse:
        answered = any(message.get("role") == "tool" for message in request.messages)
        return reply("done") if answered else reply(None, *calls)

    return FakeProvider(step)


def branch_of(provider: FakeProvider) -> FakeBranch:
    return FakeBranch(provider, default_model="script/m")


@pytest.fixture(autouse=True)
def _fresh_record():
    INVOKED.clear()
    yield
    INVOKED.clear()


def test_operate_refuses_a_forbidden_tool_the_model_asks_for_and_never_runs_it():
    script = asks_for(ToolCall("c1", "delete_everything", {"reason": "why not"}), ToolCall("c2", "read_note", {}))
    branch = branch_of(script)
    text = asyncio.run(operate(branch, "Tidy up.", tools=[read_note, delete_everything],
                               permissions=["read_note"]))
    assert text == "done"
    assert INVOKED == ["read_note"]
    answers = tool_answers(branch.history)
    assert answers["read_note"] == "hello"
    assert answers["delete_everything"]["error_type"] == "ToolPermissionError"
    assert "may not call the tool 'delete_everything'" in answers["delete_everything"]["error"]
    # Only what it may call is offered; asking for the rest anyway is what gets refused.
    assert [item["function"]["name"] for item in script.requests[0].tools] == ["read_note"]


def test_react_and_act_refuse_the_same_way():
    script = asks_for(ToolCall("c1", "delete_everything", {}))
    branch = branch_of(script)
    result = asyncio.run(ReAct(branch, "Go.", tools=[read_note, delete_everything],
                               permissions={"deny": ["delete_everything"]}))
    [action] = result["rounds"][0]["actions"]
    assert action["error_type"] == "ToolPermissionError" and "output" not in action
    entries = asyncio.run(act(branch_of(asks_for()), tools=[read_note, delete_everything],
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

    script = asks_for(ToolCall("c1", "read_path", {"path": "../../etc/passwd"}))
    branch = branch_of(script)
    asyncio.run(operate(branch, "Read.", tools=[reader], permissions=secure))
    assert INVOKED == [] and tool_answers(branch.history)["read_path"]["error_type"] == "ToolPermissionError"


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
    branch = branch_of(asks_for())
    assert asyncio.run(chat(branch, "Hi.", permissions=["read_note"])) == ""
    assert branch.history[0] == {"role": "user", "content": "Hi."}
    assert "permissions" not in str(branch.provider.requests[0].messages)
