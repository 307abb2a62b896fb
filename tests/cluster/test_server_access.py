"""Issue #32 against the app over real HTTP: each attack from outside, and what `opgraph serve` answers now.

    uvicorn (a thread, 127.0.0.1, any port) <- create_app(token) <- httpx / raw sockets playing the attacker

The token (findings 1: 401 on every route, the OpenAPI document, the docs and a stream added
later; the sign-in URL), DNS rebinding and cross-site forgery (finding 2: 421, 403, 415, in that
order after the token), paths (finding 6: no base_dir in a run request, a refused cwd that says
nothing of the disk, a playbook 404 without the server's folders), bounds (finding 7: versions
per workflow, the run cap's 429, the read deadlines) and names (finding 8). No Ray: the app's
runtime factory is never reached. The same attacks against a real `opgraph serve` process are
in test_serve_hardening.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from typing import Any

import httpx
import pytest
from api_server import serve
from fastapi.responses import StreamingResponse

from opgraph.cluster.http import (
    AccessPolicy,
    BindRefusedError,
    RunCapacityError,
    RunTasks,
    ServerClient,
    ServerRequestError,
    ServerTokenError,
    check_bind,
    client_token,
    create_app,
    deadline_protocol,
    server_token,
)
from opgraph.cluster.lanes import open_store

TOKEN = "test-token-" + "x" * 32
ATTACKER = "https://attacker.example"


class NoRuntime:
    """The app's runtime factory: nothing here may need one."""

    def __call__(self) -> Any:
        raise AssertionError("a request reached the runtime")


def _spec(prompt: str = "Draft", **config: Any) -> dict[str, Any]:
    return {"version": 1,
            "nodes": [{"id": "in", "kind": "input", "pos": {"x": 0, "y": 0}},
                      {"id": "draft", "kind": "chat", "pos": {"x": 1, "y": 0},
                       "config": {"prompt": prompt, "model": "sim/fast", **config}}],
            "edges": [{"id": "e1", "from": "in", "to": "draft"}], "inputs": ["topic"], "outputs": ["draft"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with open_store(tmp_path_factory.mktemp("access") / "opgraph.db", max_versions=3) as opened:
        yield opened


@pytest.fixture(scope="module")
def served(store, tmp_path_factory):
    root = tmp_path_factory.mktemp("workflow-root")
    (root / "exists").mkdir()
    app = create_app(store, session_factory=NoRuntime(), start_runtime=False, workflow_root=root,
                     access=AccessPolicy(TOKEN, allowed_hosts=("api.example.com",),
                                         allowed_origins=("https://console.example.com",)))

    # A stream added to the app after create_app, as a console or control plane will add routes:
    # it gets every check by being in the same app, with nothing of its own.
    @app.get("/api/test-stream", include_in_schema=False)
    def stream() -> StreamingResponse:
        async def events() -> Any:
            for number in range(3):
                yield f"event: tick\ndata: {number}\n\n"
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    with serve(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(served):
    with served.client() as http:
        yield http


@pytest.fixture()
def stranger(served):
    """A client without the token."""
    with httpx.Client(base_url=served.url, timeout=30) as http:
        yield http


def assert_refused(reply: httpx.Response, status: int, words: str) -> None:
    assert reply.status_code == status, (reply.status_code, reply.text)
    body = reply.json()
    assert body["error"] == body["errors"][0]["error"] and words in body["error"], body


# -- finding 1: the token ----------------------------------------------------------------------
def _every_path(client: httpx.Client) -> list[tuple[str, str]]:
    """Every operation in the OpenAPI document (its parameters filled in), the docs, and the late stream."""
    document = client.get("/openapi.json").json()
    found = [(method.upper(), path.replace("{name}", "drafts").replace("{run_id}", "no-such-run"))
             for path, methods in document["paths"].items() for method in methods]
    return [*found, ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect"),
            ("GET", "/api/test-stream"), ("GET", "/api/no-such-route")]


def test_every_route_is_401_without_the_token_and_answers_with_it(client, stranger):
    routes = _every_path(client)
    assert len(routes) >= 23
    for method, path in routes:
        for headers in ({}, {"authorization": "Bearer wrong-" + TOKEN}, {"authorization": f"Basic {TOKEN}"},
                        {"authorization": TOKEN}):
            reply = stranger.request(method, path, headers=headers, json={} if method in ("POST", "PUT") else None)
            assert_refused(reply, 401, "this server needs its token")
            assert reply.headers["www-authenticate"].startswith("Bearer")
        reply = client.request(method, path, json={} if method in ("POST", "PUT") else None)
        assert reply.status_code != 401, (method, path, reply.text)


def test_a_stream_added_later_is_guarded_and_streams_with_the_token(client, stranger):
    assert_refused(stranger.get("/api/test-stream"), 401, "needs its token")
    with client.stream("GET", "/api/test-stream") as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        assert [line for line in reply.iter_lines() if line.startswith("data:")] == ["data: 0", "data: 1", "data: 2"]


def test_the_sign_in_url_takes_the_token_in_its_query_and_nothing_else_does(served, stranger):
    signed_in = stranger.get("/", params={"token": TOKEN})
    assert signed_in.status_code == 200 and signed_in.json()["signed_in"] is True
    # The sign-in URL also gives the console's session cookie, which signs that client in from then on.
    cookie = signed_in.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    stranger.cookies.clear()
    assert_refused(stranger.get("/", params={"token": "wrong"}), 401, "needs its token")
    assert_refused(stranger.get("/api/workflows", params={"token": TOKEN}), 401, "needs its token")
    assert_refused(stranger.post("/", params={"token": TOKEN}, json={}), 401, "needs its token")


def test_the_openapi_document_states_the_bearer_scheme_and_the_guards_answers(client):
    document = client.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["bearer"] == {**document["components"]["securitySchemes"]
                                                                   ["bearer"], "type": "http", "scheme": "bearer"}
    assert document["security"] == [{"bearer": []}]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            expected = {"401", "421"} | ({"403", "415"} if method in ("post", "put", "patch", "delete") else set())
            assert expected <= set(operation["responses"]), (method, path)
    assert "429" in document["paths"]["/api/workflows/{name}/runs"]["post"]["responses"]


# -- finding 2: Host and Origin, and the order of the checks -------------------------------------
def test_a_foreign_host_is_421_and_the_servers_own_names_are_served(served, client):
    for host in ("attacker.example", f"attacker.example:{served.port}", "127.0.0.1:1", f"127.0.0.2:{served.port}",
                 f"0.0.0.0:{served.port}", "localhost.attacker.example"):
        assert_refused(client.get("/api/workflows", headers={"host": host}), 421, "does not answer to")
    for host in (f"127.0.0.1:{served.port}", f"localhost:{served.port}", f"LOCALHOST:{served.port}",
                 "api.example.com", "api.example.com:443"):
        assert client.get("/api/workflows", headers={"host": host}).status_code == 200, host


def test_a_cross_site_post_is_403_and_a_same_origin_one_passes(served, client):
    _create(client, "origin-checked")
    for origin in (ATTACKER, "null", f"http://127.0.0.1:{served.port + 1}", f"http://attacker.example:{served.port}",
                   "http://console.example.com"):
        reply = client.post("/api/workflows/origin-checked/runs", json={"version": 99}, headers={"origin": origin})
        assert_refused(reply, 403, "is refused")
    assert_refused(client.delete("/api/workflows/origin-checked", headers={"origin": ATTACKER}), 403, "is refused")
    assert_refused(client.put("/api/workflows/origin-checked", json={"spec": _spec("v2")},
                              headers={"origin": ATTACKER}), 403, "is refused")
    # The server's own pages, an allowed origin, and no Origin at all (curl, the CLI) pass the guard:
    # the route answers (here 422: the version does not exist).
    for headers in ({"origin": f"http://127.0.0.1:{served.port}"}, {"origin": f"http://localhost:{served.port}"},
                    {"origin": "https://console.example.com"}, {}):
        reply = client.post("/api/workflows/origin-checked/runs", json={"version": 99}, headers=headers)
        assert reply.status_code == 422, (headers, reply.text)
    assert client.get("/api/workflows", headers={"origin": ATTACKER}).status_code == 200  # reads: CORS keeps them


def test_a_form_or_text_post_is_415_so_no_page_can_post_without_a_preflight(client):
    _create(client, "typed-bodies")
    for content_type, content in (("text/plain", b""), ("text/plain", b'{"inputs": {}}'),
                                  ("application/x-www-form-urlencoded", b"inputs=1"),
                                  ("multipart/form-data; boundary=x", b"--x--")):
        reply = client.post("/api/workflows/typed-bodies/runs", content=content,
                            headers={"content-type": content_type})
        assert_refused(reply, 415, "must be JSON")
    assert_refused(client.post("/api/runs/no-such-run/cancel", content=b"x"), 415, "no content type")
    # No body and no type (curl -X POST, httpx): the route answers; JSON with a charset too.
    assert client.post("/api/runs/no-such-run/cancel").status_code == 404
    reply = client.post("/api/runs/no-such-run/cancel", content=b"{}",
                        headers={"content-type": "application/json; charset=utf-8"})
    assert reply.status_code == 404


def test_the_checks_run_in_the_order_token_host_origin_content_type(served, stranger):
    auth = {"authorization": f"Bearer {TOKEN}"}
    attack = {"host": "attacker.example", "origin": ATTACKER, "content-type": "text/plain"}
    path = "/api/workflows/anything/runs"
    assert stranger.post(path, content=b"", headers=attack).status_code == 401
    assert stranger.post(path, content=b"", headers={**auth, **attack}).status_code == 421
    own_host = {**attack, "host": f"127.0.0.1:{served.port}"}
    assert stranger.post(path, content=b"", headers={**auth, **own_host}).status_code == 403
    assert stranger.post(path, content=b"", headers={**auth, **own_host, "origin": served.url}).status_code == 415


def test_without_a_token_the_host_and_origin_checks_still_hold(store):
    app = create_app(store, session_factory=NoRuntime(), start_runtime=False, access=AccessPolicy(None))
    with serve(app) as running, running.client() as http:
        assert http.get("/api/workflows").status_code == 200
        assert http.get("/api/workflows", headers={"host": "attacker.example"}).status_code == 421
        assert http.post("/api/runs/x/cancel", json={}, headers={"origin": ATTACKER}).status_code == 403
        assert "security" not in http.get("/openapi.json").json()


def test_an_app_made_without_a_policy_has_a_random_token_and_is_not_open(store):
    first = create_app(store, session_factory=NoRuntime(), start_runtime=False)
    second = create_app(store, session_factory=NoRuntime(), start_runtime=False)
    assert len(first.state.access.token) >= 40 and first.state.access.token != second.state.access.token


# -- finding 6: paths ------------------------------------------------------------------------------
def _create(client: httpx.Client, name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    reply = client.post("/api/workflows", json={"name": name, "spec": spec or _spec()})
    assert reply.status_code == 201, reply.text
    return reply.json()


def test_a_run_request_cannot_choose_a_base_dir(client):
    _create(client, "no-paths")
    reply = client.post("/api/workflows/no-paths/runs", json={"base_dir": "/etc"})
    assert_refused(reply, 422, "base_dir")
    assert client.get("/api/runs", params={"workflow": "no-paths"}).json()["runs"] == []


def test_a_refused_cwd_says_nothing_of_the_servers_disk(client, tmp_path):
    """Inside the server's root or not, existing or not: one answer (the root is the server's, never in it)."""
    answers = set()
    for number, cwd in enumerate(("/etc", "/no/such/folder", "missing", str(tmp_path), "/root")):
        _create(client, f"cwd-{number}", _spec(cwd=cwd))
        reply = client.post(f"/api/workflows/cwd-{number}/runs", json={})
        assert reply.status_code == 422, reply.text
        answers.add(reply.json()["error"].replace(repr(cwd), "CWD"))
    assert answers == {"config.cwd CWD is not an existing directory inside the run's base_dir"}, answers


def test_an_unknown_playbook_is_404_without_the_folders_searched(client):
    reply = client.post("/api/playbooks/no-such-book/runs", json={})
    assert_refused(reply, 404, "no playbook 'no-such-book' on this server")
    assert "/" not in reply.json()["error"].replace("`", "")


# -- finding 7: bounds -----------------------------------------------------------------------------
def test_a_workflow_stops_at_its_version_cap_with_409(client):
    _create(client, "capped")
    for version in (2, 3):
        assert client.put("/api/workflows/capped", json={"spec": _spec(f"v{version}")}).json()["version"] == version
    assert client.put("/api/workflows/capped", json={"spec": _spec("v3")}).status_code == 200  # same spec: no version
    reply = client.put("/api/workflows/capped", json={"spec": _spec("v4")})
    assert_refused(reply, 409, "already has 3 versions")
    assert reply.json()["limit"] == 3 and client.get("/api/workflows/capped").json()["version"] == 3


def test_the_run_cap_admits_max_runs_then_refuses_until_one_settles(store):
    async def scenario() -> None:
        runs = RunTasks(store, max_runs=2)
        release = asyncio.Event()
        with runs.admission() as first:
            runs.start("one", {}, release.wait(), first)
        with runs.admission():  # a second request still preparing holds its place
            with pytest.raises(RunCapacityError) as refused, runs.admission():
                pass
            assert refused.value.retry_after >= 1 and refused.value.limit == 2
        with runs.admission() as again:  # the preparing one failed: its place is free again
            runs.start("two", {}, release.wait(), again)
        with pytest.raises(RunCapacityError), runs.admission():
            pass
        release.set()
        await asyncio.sleep(0.05)  # the two tasks end, and their done-callbacks run
        assert runs.statistics() == {"in_flight": 0, "admitting": 0, "max_runs": 2}
        with runs.admission():
            pass

    asyncio.run(scenario())


def _answer(connection: socket.socket, deadline: float) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and when (seconds since the call)."""
    started, answer = time.monotonic(), b""
    connection.settimeout(deadline)
    while True:
        chunk = connection.recv(4096)
        if not chunk:
            return answer, time.monotonic() - started
        answer += chunk


def test_read_deadlines_close_a_slow_head_and_a_slow_body_but_not_a_slow_route(store):
    app = create_app(store, session_factory=NoRuntime(), start_runtime=False, access=AccessPolicy(TOKEN))

    @app.get("/api/test-slow", include_in_schema=False)
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(1.5)  # longer than both deadlines: the route's own time is not the client's
        return {"slow": True}

    with serve(app, http=deadline_protocol(head_timeout=0.5, body_timeout=1.0)) as running:
        head = f"POST /api/workflows HTTP/1.1\r\nhost: 127.0.0.1:{running.port}\r\nauthorization: Bearer {TOKEN}\r\n"
        with socket.create_connection(("127.0.0.1", running.port)) as silent:  # connects, sends nothing
            answer, after = _answer(silent, 5)
            assert answer.startswith(b"HTTP/1.1 408") and 0.4 < after < 2.5, (answer, after)
        with socket.create_connection(("127.0.0.1", running.port)) as trickle:  # a header byte at a time
            started = time.monotonic()
            with pytest.raises(OSError):
                for byte in head.encode():
                    trickle.sendall(bytes([byte]))
                    time.sleep(0.05)
            assert time.monotonic() - started < 2.5
        with socket.create_connection(("127.0.0.1", running.port)) as slow_body:
            slow_body.sendall((head + "content-type: application/json\r\ncontent-length: 100\r\n\r\n{").encode())
            answer, after = _answer(slow_body, 5)
            assert answer == b"" and 0.8 < after < 3.5, (answer, after)
        with running.client() as http:
            assert http.get("/api/workflows").status_code == 200
            time.sleep(0.7)  # an idle keep-alive connection past the head deadline is still usable
            assert http.get("/api/workflows").status_code == 200
            assert http.get("/api/test-slow").json() == {"slow": True}
            assert http.post("/api/workflows", json={"name": "after-slow", "spec": _spec()}).status_code == 201


# -- finding 8: names ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["a\x01b", "tab\tname", "new\nline", "a/b", "a@b", "triage@2", "with space", "..",
                                  "x" * 121, "caf\u00e9"])
def test_a_name_with_control_characters_a_slash_or_an_at_is_refused(client, name):
    reply = client.post("/api/workflows", json={"name": name, "spec": _spec()})
    assert reply.status_code == 422, reply.text
    assert name.strip() not in {row["name"] for row in client.get("/api/workflows").json()["workflows"]}


@pytest.mark.parametrize("segment", ["a%01b", "a%40b", "a%20b", "x" * 121, "%2E%2E%2E"])
def test_a_name_in_a_path_is_held_to_the_same_rule(client, segment):
    for method, path in (("GET", f"/api/workflows/{segment}"), ("GET", f"/api/workflows/{segment}/versions"),
                         ("POST", f"/api/workflows/{segment}/runs"), ("DELETE", f"/api/workflows/{segment}"),
                         ("POST", f"/api/playbooks/{segment}/runs")):
        reply = client.request(method, path, json={} if method == "POST" else None)
        assert reply.status_code == 422, (method, path, reply.text)


# -- the token's sources and the binds it allows ------------------------------------------------------
def test_a_loopback_server_generates_a_private_token_once_and_clients_read_it(tmp_path, monkeypatch):
    for variable in ("OPGRAPH_TOKEN", "OPGRAPH_TOKEN_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("OPGRAPH_HOME", str(tmp_path / "home"))
    assert client_token() is None
    token = server_token()
    assert token.source == "home" and token.value is None and not token.operator_set
    check_bind("127.0.0.1", token)
    made = token.ensure()
    path = tmp_path / "home" / "server-token"
    assert made.path == path and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(made.value) >= 40 and server_token().ensure().value == made.value  # the same one next time
    assert client_token() == made.value and client_token("given-explicitly") == "given-explicitly"
    monkeypatch.setenv("OPGRAPH_TOKEN", "from-the-environment-1234")
    assert client_token() == "from-the-environment-1234"
    assert server_token().value == "from-the-environment-1234" and server_token().operator_set
    path.chmod(0o644)  # a token others can read is refused, by the server and by a client
    monkeypatch.delenv("OPGRAPH_TOKEN")
    with pytest.raises(ServerTokenError, match="chmod 600"):
        server_token().ensure()
    with pytest.raises(ServerTokenError, match="can be read by other users"):
        client_token()


def test_a_token_file_must_be_private_and_a_token_long(tmp_path, monkeypatch):
    monkeypatch.delenv("OPGRAPH_TOKEN", raising=False)
    file = tmp_path / "token"
    file.write_text("s3cret-operator-token-0123456789\n")
    file.chmod(0o600)
    assert server_token(token_file=file).value == "s3cret-operator-token-0123456789"
    monkeypatch.setenv("OPGRAPH_TOKEN_FILE", str(file))
    assert server_token().source == "file" and client_token() == "s3cret-operator-token-0123456789"
    file.chmod(0o640)
    with pytest.raises(ServerTokenError, match="mode 0640"):
        server_token(token_file=file)
    with pytest.raises(ServerTokenError, match="at least 16"):
        server_token(environ={"OPGRAPH_TOKEN": "short"})
    with pytest.raises(ServerTokenError, match="cannot read"):
        server_token(token_file=tmp_path / "missing")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LocalHost"])
def test_any_loopback_bind_may_start_without_a_token_the_operator_set(host):
    check_bind(host, server_token(environ={}))
    check_bind(host, server_token(no_auth=True))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.5", "example.com", "10.0.0.1"])
def test_a_public_bind_needs_a_token_the_operator_set_and_never_no_auth(host):
    with pytest.raises(BindRefusedError, match="needs a token the operator set"):
        check_bind(host, server_token(environ={}))
    with pytest.raises(BindRefusedError, match="only allowed on a loopback"):
        check_bind(host, server_token(no_auth=True))
    check_bind(host, server_token(environ={"OPGRAPH_TOKEN": "an-operator-token-0123456789"}))


def test_the_server_client_sends_the_token_and_raises_typed_errors(served, monkeypatch):
    monkeypatch.setenv("OPGRAPH_TOKEN", TOKEN)
    with ServerClient(served.url) as api:
        assert api.create_workflow("client-made", _spec())["version"] == 1
        assert "client-made" in {row["name"] for row in api.workflows()}
        with pytest.raises(ServerRequestError) as missing:
            api.run("no-such-run")
        assert missing.value.status == 404 and missing.value.errors
    with ServerClient(served.url, token="wrong-" + TOKEN) as api, pytest.raises(ServerRequestError) as refused:
        api.runs()
    assert refused.value.status == 401 and "needs its token" in str(refused.value)


def test_the_generated_token_file_is_created_with_no_window_for_others(tmp_path):
    """Even with a permissive umask the file is 0600 from its first byte (os.open with the mode)."""
    previous = os.umask(0o000)
    try:
        made = server_token(environ={"OPGRAPH_HOME": str(tmp_path / "home")}).ensure()
    finally:
        os.umask(previous)
    assert stat.S_IMODE(made.path.stat().st_mode) == 0o600
