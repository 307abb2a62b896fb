"""A `ray start` head killed without `ray stop` leaves its address recorded for ``ray.init()``.

    RAY_TMPDIR/ray/ray_current_cluster -> 127.0.0.1:PORT, nothing listening
      connect() -> says so in one line, and starts an embedded Ray (address "local")
    the same record, a listener there -> connect() lets Ray join it (address None)

No Ray is started: ``ray.init`` is replaced by a recorder of what it was asked.
"""

from __future__ import annotations

import logging
import socket

import pytest

from opgraph.actors.driver import runtime


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """A Ray temp folder of this test's, and a function that records an address in it."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    for variable in ("RAY_ADDRESS", "OPGRAPH_RAY_ADDRESS"):
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "ray").mkdir()

    def record(address: str) -> None:
        (tmp_path / "ray" / "ray_current_cluster").write_text(address)

    return record


@pytest.fixture
def asked(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(runtime, "_JOINED_WITH_ADDRESS", runtime._JOINED_WITH_ADDRESS)  # restored after
    monkeypatch.setattr(runtime.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(runtime.ray, "init", lambda address=None, **options: calls.append(address))
    return calls


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_recorded_cluster_nothing_answers_at_is_passed_over_for_an_embedded_ray(recorded, asked, caplog):
    address = f"127.0.0.1:{closed_port()}"
    recorded(address)
    assert runtime.dead_recorded_cluster() == address
    with caplog.at_level(logging.WARNING, logger=runtime.__name__):
        runtime.connect()
    assert asked == ["local"]
    assert f"recorded at {address} does not answer" in caplog.text and "embedded local Ray" in caplog.text


def test_a_recorded_cluster_that_answers_is_joined_and_no_record_is_no_question(recorded, asked, caplog):
    assert runtime.dead_recorded_cluster() is None  # nothing recorded
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        recorded(f"127.0.0.1:{listener.getsockname()[1]}")
        assert runtime.dead_recorded_cluster() is None
        runtime.connect()
    assert asked == [None] and "does not answer" not in caplog.text
