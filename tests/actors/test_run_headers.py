"""What a durable run's header keeps, and what stays out of every file: keys, passwords, readable modes.

No Ray: headers are encoded and read back as the executor does, providers built and called
through an injected transport (httpx.MockTransport).

    a header            built-in operations by name, HTTP providers described (no key, no password),
                        the rest pickled and signed; read back with keys from the environment
    a secret            a header that would hold one of the environment's is refused, naming where from
    messages            a base URL's password never shows in an error or a repr
    the run-log key     made once, 0600, in a 0700 home; a reader never makes one
    database files      created 0600 with their WAL, an older readable one narrowed
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat

import httpx
import pytest

from opgraph.actors import RunOptions, RunResources
from opgraph.actors.builtin_operations import builtin_operations
from opgraph.actors.models import ChatRequest, ProviderConfigError, ProviderHTTPError, ProviderUnavailable
from opgraph.actors.persistence import Database
from opgraph.actors.persistence.headers import OWN_FIELDS, PLAIN_FIELDS, PYTHON_FIELDS, encode_header, read_header
from opgraph.actors.protocol import RegisteredOperation
from opgraph.actors.providers import (
    AnthropicProvider,
    OpenAICompatibleProvider,
    ScriptedProvider,
    UnavailableProvider,
    provider_from_description,
)
from opgraph.actors.secrets import RUNLOG_KEY_FILE, runlog_key, runlog_key_reader
from opgraph.kernel import CodecError, OperationGraphBuilder, RetryPolicy, RunLogIntegrityError

KEY, ANTHROPIC_KEY, PASSWORD = "sk-SENTINEL-header-1234", "sk-ant-SENTINEL-5678", "SENTINELPW-header"
URL = f"http://operator:{PASSWORD}@127.0.0.1:9/v1"


async def own_operation(branch, **parameters):
    return "mine"


def graph():
    builder = OperationGraphBuilder("headers")
    builder.add_operation("chat", depends_on=[], instruction="hello", model="openai/x")
    return builder.get_graph()


def options(**providers) -> RunOptions:
    operations = {**builtin_operations(), "mine": RegisteredOperation(own_operation)}
    return RunOptions(durable=True, reducers={"total": lambda old, new: old + new}, context={"topic": ("a", 1)},
                      retry_policies={"mine": RetryPolicy.of(3, ["WorkerDied", "Timeout"])},
                      resources=RunResources(operations, providers, {"default_model": "openai/x"}))


def test_every_run_option_has_exactly_one_place_in_a_header():
    places = [*PLAIN_FIELDS, *PYTHON_FIELDS, *OWN_FIELDS]
    assert sorted(places) == sorted(field.name for field in dataclasses.fields(RunOptions))


def test_a_header_names_built_ins_describes_http_providers_and_reads_back_with_the_environments_keys(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    providers = {"openai": OpenAICompatibleProvider(base_url=URL, api_key=KEY, timeout=42.0),
                 "anthropic": AnthropicProvider(api_key=ANTHROPIC_KEY),
                 "scripted": ScriptedProvider(["hello"])}
    header = encode_header(graph(), options(**providers), 7.0)

    for secret in (KEY, ANTHROPIC_KEY, PASSWORD):
        assert secret.encode() not in header
    assert b"react_stream_rounds" not in header  # a built-in travels by name, not pickled by reference
    logged = read_header(header)
    assert logged.started == 7.0 and list(logged.graph.nodes.values())[0].parameters["instruction"] == "hello"
    assert "ReActStream" in logged.fields["operations"]["builtin"]
    described = logged.fields["providers"]["described"]
    assert described["openai"]["base_url"] == "http://operator:***@127.0.0.1:9/v1"
    assert described["openai"]["settings"]["timeout"] == 42.0 and "api_key" not in described["openai"]["settings"]

    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    monkeypatch.setenv("OPENAI_BASE_URL", URL)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-from-the-environment")
    rebuilt = logged.run_options()
    openai = rebuilt.resources.providers["openai"]
    assert openai._http.headers["Authorization"] == "Bearer sk-from-the-environment" and openai.base_url == URL
    assert openai._http.timeout == 42.0
    assert rebuilt.resources.providers["anthropic"]._http.headers["x-api-key"] == "sk-ant-from-the-environment"
    assert isinstance(rebuilt.resources.providers["scripted"], ScriptedProvider)
    assert rebuilt.resources.operations["chat"] is builtin_operations()["chat"]
    assert rebuilt.resources.operations["mine"].fn.__name__ == "own_operation"
    assert rebuilt.reducers["total"](1, 2) == 3 and rebuilt.context == {"topic": ("a", 1)}
    assert rebuilt.retry_policies == {"mine": RetryPolicy.of(3, ["WorkerDied", "Timeout"])}
    assert rebuilt.resources.settings == {"default_model": "openai/x"} and rebuilt.durable

    stand_in = OpenAICompatibleProvider(base_url="http://127.0.0.1:9/v1", api_key="sk-of-the-resumer")
    assert logged.run_options({"openai": stand_in}).resources.providers["openai"] is stand_in


def test_a_url_whose_password_was_cut_needs_the_same_url_in_the_environment():
    description = OpenAICompatibleProvider(base_url=URL, api_key=KEY).description()
    elsewhere = provider_from_description(description, {"OPENAI_BASE_URL": "http://operator:x@other:9/v1"})
    assert isinstance(elsewhere, UnavailableProvider) and "set OPENAI_BASE_URL" in elsewhere.reason
    with pytest.raises(ProviderConfigError, match="not available"):
        asyncio.run(elsewhere.complete(ChatRequest(model="openai/x", messages=[])))
    rebuilt = provider_from_description(description, {"OPENAI_BASE_URL": URL, "OPENAI_API_KEY": "k"})
    assert rebuilt.base_url == URL
    plain = OpenAICompatibleProvider(base_url="http://127.0.0.1:9/v1", api_key=KEY).description()
    assert provider_from_description(plain, {}).base_url == "http://127.0.0.1:9/v1"


class KeyHolder:
    """A provider of one's own that keeps its key: what the header must refuse to store."""

    name = "holder"

    def __init__(self, key: str) -> None:
        self.key = key

    async def complete(self, request):
        raise NotImplementedError


def test_a_header_that_would_hold_a_secret_of_the_environment_is_refused_naming_where_it_came_from(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_API_KEY", "sk-SENTINEL-held-by-my-provider")
    with pytest.raises(CodecError, match="MY_SERVICE_API_KEY") as caught:
        encode_header(graph(), options(holder=KeyHolder(os.environ["MY_SERVICE_API_KEY"])), 1.0, run_id="r1")
    assert "sk-SENTINEL" not in str(caught.value) and caught.value.run_id == "r1"
    monkeypatch.setenv("OPENAI_BASE_URL", URL)
    with pytest.raises(CodecError, match="the password in OPENAI_BASE_URL"):
        encode_header(graph(), options(holder=KeyHolder(URL)), 1.0)


def test_error_messages_and_reprs_show_a_base_url_without_its_password():
    def answer(request: httpx.Request) -> httpx.Response:
        if "refused" in request.url.path:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(401, json={"error": "no"})

    request = ChatRequest(model="openai/x", messages=[{"role": "user", "content": "hi"}])
    for base, error in ((URL, ProviderHTTPError), (URL + "/refused", ProviderUnavailable)):
        provider = OpenAICompatibleProvider(base_url=base, api_key=KEY, max_retries=0,
                                            transport=httpx.MockTransport(answer))
        with pytest.raises(error) as caught:
            asyncio.run(provider.complete(request))
        assert PASSWORD not in str(caught.value) and "operator:***@" in str(caught.value)
        assert PASSWORD not in repr(provider)


def test_the_run_log_key_is_made_once_0600_in_a_0700_home_and_a_reader_never_makes_one(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("OPGRAPH_HOME", str(home))
    monkeypatch.delenv("OPGRAPH_RUNLOG_KEY", raising=False)
    with pytest.raises(RunLogIntegrityError, match="no run-log key here"):
        runlog_key_reader()
    assert not home.exists()
    key = runlog_key()
    assert len(key) == 64 and runlog_key() == key == runlog_key_reader()
    assert stat.S_IMODE((home / RUNLOG_KEY_FILE).stat().st_mode) == 0o600
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    monkeypatch.setenv("OPGRAPH_RUNLOG_KEY", "too short")
    with pytest.raises(RunLogIntegrityError, match="at least 32"):
        runlog_key()
    monkeypatch.setenv("OPGRAPH_RUNLOG_KEY", "a cluster's shared key, long enough: 0123456789")
    assert runlog_key() == b"a cluster's shared key, long enough: 0123456789"


def test_a_database_is_created_0600_with_its_wal_and_an_older_readable_one_is_narrowed(tmp_path):
    fresh = Database(tmp_path / "new" / "opgraph.db")
    fresh.transaction([("INSERT INTO runtime_runs (run_id, executor, status, started) VALUES ('r', 'e', 'live', 1)",
                        ())])
    for name in ("opgraph.db", "opgraph.db-wal", "opgraph.db-shm"):
        assert stat.S_IMODE((tmp_path / "new" / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700
    fresh.close()
    older = tmp_path / "older.db"
    Database(older).close()
    os.chmod(older, 0o644)
    Database(older).close()
    assert stat.S_IMODE(older.stat().st_mode) == 0o600
