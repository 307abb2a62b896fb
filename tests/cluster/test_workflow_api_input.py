"""What the workflow HTTP API answers to requests built to break it: every answer is ours.

Out-of-range numbers, bodies that are not UTF-8 or nest 10,000 deep or hold a lone
surrogate, bodies over the size limit, conditions that can never compile, a version
without a spec: each gets 404, 413 or 422 with the API's problem list, never a 500 and
never FastAPI's ``{"detail": ...}``. The server runs definitions only (no Ray needed):
its runtime factory is never reached by these requests.
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Any

import httpx
import pytest
from api_server import serve

from opgraph.cluster.http import create_app
from opgraph.cluster.lanes import open_store
from opgraph.cluster.processes import run_command
from opgraph.cluster.store import WorkflowVersionNotFoundError

BODY_LIMIT = 64 * 1024  # this module's server limit, small enough to pass quickly
SQLITE_LIMIT = 2**63 - 1  # the largest integer SQLite stores
JSON_LIMIT = 2**53 - 1  # the largest integer every JSON client holds exactly: the API's bound
CLI_TIMEOUT = 60.0


def _spec(**edge: Any) -> dict[str, Any]:
    """a -> b, with ``edge`` merged into the one edge."""
    return {
        "version": 1,
        "nodes": [{"id": "a", "kind": "chat", "pos": {"x": 0, "y": 0}, "config": {"prompt": "A", "model": "sim/fast"}},
                  {"id": "b", "kind": "chat", "pos": {"x": 1, "y": 0}, "config": {"prompt": "B", "model": "sim/fast"}}],
        "edges": [{"id": "e1", "from": "a", "to": "b", **edge}],
    }


class NoRuntime:
    """The app's runtime factory: these tests must never need one."""

    def __call__(self) -> Any:
        raise AssertionError("a definitions-only request started the runtime")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("api-input") / "opgraph.db") as opened:
        yield opened


@pytest.fixture(scope="module")
def served(store):
    with serve(create_app(store, session_factory=NoRuntime(), max_body_bytes=BODY_LIMIT,
                          start_runtime=False)) as running:
        yield running


@pytest.fixture(scope="module")
def client(served):
    with served.client() as http:
        yield http


def assert_problems(reply: httpx.Response, status: int) -> list[dict[str, Any]]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert "detail" not in body
    assert body["errors"] and all(set(e) == {"error", "node_id", "edge_id"} for e in body["errors"])
    assert body["error"] == body["errors"][0]["error"]
    return body["errors"]


def post_raw(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def test_numbers_past_sqlite_are_422_or_404_never_500(client, store):
    client.post("/api/workflows", json={"name": "numbers", "spec": _spec()}).raise_for_status()
    huge = SQLITE_LIMIT + 1
    assert_problems(client.get("/api/workflows/numbers", params={"version": huge}), 422)
    assert_problems(client.post("/api/workflows/numbers/runs", json={"version": huge}), 422)
    assert_problems(client.get("/api/runs/any/signals", params={"after": huge}), 422)
    assert_problems(client.get("/api/workflows/numbers", params={"version": JSON_LIMIT + 1}), 422)
    # The largest version a request may name is in range, and simply does not exist.
    assert "version" in assert_problems(client.get("/api/workflows/numbers",
                                                   params={"version": JSON_LIMIT}), 404)[0]["error"]
    # Past SQLite's integers the store answers "no such version" rather than overflowing.
    for version in (SQLITE_LIMIT, huge, 2**200):
        with pytest.raises(WorkflowVersionNotFoundError):
            store.resolve("numbers", version)


@pytest.mark.parametrize(("label", "content"), [
    ("lone surrogate in the spec", b'{"name": "s1", "spec": {"version": 1, "note": "\\ud800"}}'),
    ("lone surrogate in the name", b'{"name": "\\udfff", "spec": {"version": 1}}'),
    ("lone surrogate in a key", b'{"name": "s2", "spec": {"version": 1, "\\ud800": 1}}'),
    ("not UTF-8", b'{"name": "\xff\xfe", "spec": {"version": 1}}'),
    ("10,000 levels deep", b'{"name": "deep", "spec": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
    ("101 levels deep", b'{"name": "deep", "spec": ' + b"[" * 100 + b"]" * 100 + b"}"),
    ("not JSON", b'{"name": '),
])
def test_bodies_the_parser_cannot_take_get_the_problem_list(client, label, content):
    assert_problems(post_raw(client, "/api/workflows", content), 422)
    stored = {workflow["name"] for workflow in client.get("/api/workflows").json()["workflows"]}
    assert not stored & {"s1", "s2", "deep"}, label


def test_a_run_request_with_a_lone_surrogate_in_its_inputs_is_422(client):
    client.post("/api/workflows", json={"name": "surrogate-inputs", "spec": _spec()}).raise_for_status()
    reply = post_raw(client, "/api/workflows/surrogate-inputs/runs", b'{"inputs": {"topic": "\\ud83d"}}')
    assert "body.inputs.topic" in assert_problems(reply, 422)[0]["error"]


def _raw_request(port: int, head: bytes, first_chunk: bytes) -> bytes:
    """Send a request head and only the first part of its body; return what the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(head + first_chunk)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < answer.index(b"\r\n\r\n") + 4 + _length(answer):
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


def _length(answer: bytes) -> int:
    for line in answer.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _head(served: Any, *lines: str, token: bool = True) -> bytes:
    """A POST /api/workflows head to ``served``: its Host, the token (unless not ``token``), then ``lines``."""
    fields = [f"host: 127.0.0.1:{served.port}", *([f"authorization: Bearer {served.token}"] if token else []), *lines]
    return ("POST /api/workflows HTTP/1.1\r\n" + "".join(f"{field}\r\n" for field in fields) + "\r\n").encode()


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(served):
    """A 100 MB body is declared and 1 KiB of it sent: the 413 arrives with the rest unsent.
    Without a declared length (chunked), the 413 comes once the limit is passed."""
    declared = _head(served, "content-type: application/json", "content-length: 100000000")
    answer = _raw_request(served.port, declared, b"{" + b" " * 1023)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert "100000000 bytes" in body["error"] and body["errors"][0]["error"] == body["error"]

    chunk = b" " * (BODY_LIMIT // 2)
    chunked = _head(served, "content-type: application/json", "transfer-encoding: chunked")
    encoded = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3))  # 1.5 x the limit, no end
    answer = _raw_request(served.port, chunked, encoded)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert str(BODY_LIMIT) in json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def test_an_oversized_body_without_the_token_is_401_and_is_not_read(served):
    """The token comes first (issue #32): a stranger's 100 MB upload is refused before a byte of it
    is read (401, not 413), and the same upload with the token still gets its 413."""
    declared = ("content-type: application/json", "content-length: 100000000")
    answer = _raw_request(served.port, _head(served, *declared, token=False), b"{" + b" " * 1023)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert b"www-authenticate: bearer" in answer.lower() and b"connection: close" in answer.lower()
    answer = _raw_request(served.port, _head(served, *declared), b"{" + b" " * 1023)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("condition", [
    "(lambda: 1)()",
    "__import__('os').system('true')",
    "result.text == '" + "x" * 3_600 + "'",
])
def test_a_condition_that_can_never_compile_is_refused_when_added(client, tmp_path, condition):
    """a -(condition)-> b, through POST, PUT and `opgraph workflows add`: each refuses it
    with the edge's id, and nothing is stored."""
    never = {"name": "never", "spec": _spec(condition=condition)}
    problems = assert_problems(client.post("/api/workflows", json=never), 422)
    assert problems[0]["edge_id"] == "e1" and "edge expression" in problems[0]["error"]
    assert client.get("/api/workflows/never").status_code == 404

    name = f"put-never-{len(condition)}"
    client.post("/api/workflows", json={"name": name, "spec": _spec()}).raise_for_status()
    problems = assert_problems(client.put(f"/api/workflows/{name}", json={"spec": _spec(condition=condition)}), 422)
    assert problems[0]["edge_id"] == "e1"
    assert client.get(f"/api/workflows/{name}").json()["version"] == 1

    definition = tmp_path / "never.json"
    definition.write_text(json.dumps(_spec(condition=condition)))
    added = run_command([sys.executable, "-m", "opgraph.cluster.cli", "workflows", "add", "never",
                        str(definition), "--store", str(tmp_path / "cli.db")],
                        timeout=CLI_TIMEOUT)
    assert added.returncode == 2, added.stdout + added.stderr
    assert '"edge_id": "e1"' in added.stderr and "Traceback" not in added.stderr


def test_a_version_without_a_spec_is_refused(client):
    client.post("/api/workflows", json={"name": "keeps-spec", "spec": _spec()}).raise_for_status()
    problems = assert_problems(client.put("/api/workflows/keeps-spec", json={"spec": None}), 422)
    assert "needs a spec" in problems[0]["error"]
    latest = client.get("/api/workflows/keeps-spec").json()
    assert latest["version"] == 1 and latest["spec"] == _spec()


def test_starlettes_own_answers_use_the_problem_list_too(client):
    assert_problems(client.get("/api/nowhere"), 404)
    refused = client.delete("/api/runs")
    assert_problems(refused, 405)
    assert "GET" in refused.headers["allow"]
