"""`opgraph bench --shapes http,http-stream` end to end at a CI size, and the pieces it stands on.

Topology: the bench -> its server process (aiohttp on 127.0.0.1, "item N" answered after
a seeded log-normal latency) <- opgraph's fan-out on the shared Ray (workers -> the openai/
provider over aiohttp), bare aiohttp, and LangGraph and lionagi in this process.
200 calls at a median of 20 ms, 50 in flight.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from components import require

from opgraph.cluster.bench.http_server import ideal_makespan, latencies, latency
from opgraph.cluster.bench.shapes import main
from opgraph.cluster.bench.tiktoken_file import O200K_SHA256


def test_latencies_are_seeded_by_index_and_the_ideal_is_the_greedy_makespan():
    assert latency(36, 7) == latency(36, 7) != latency(36, 8)
    assert latencies(36, 3, scale=2.0) == [2.0 * latency(36, index) for index in range(3)]
    # 2 in flight, started in index order: [3, 1, 1, 1] -> 3 | 1, 1, 1 -> 3 s.
    assert ideal_makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert ideal_makespan([1.0, 1.0, 1.0], 2, tail=0.5) == 3.0
    waits = sorted(latencies(36, 10_000))
    assert 0.95 < waits[5_000] < 1.05 and 7.0 < waits[9_900] < 9.0  # median 1 s, p99 about 8 s


def test_the_http_bench_prints_every_client_against_the_ideal(session, tmp_path, capsys, monkeypatch):
    """Non-streaming and streamed: every client completes every call, and the table, the CPU per call
    and the time to first token beyond the server's latency are printed and in the JSON."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", require("o200k-base"))
    path = tmp_path / "figures.json"

    status = main(["--shapes", "http,http-stream", "--http-calls", "200", "--http-scale", "0.02",
                   "--http-concurrency", "50", "--http-clients", "aiohttp,opgraph", "--compare", "lionagi,langgraph",
                   "--json", str(path)])

    output = capsys.readouterr().out
    assert status == 0, output
    assert "ideal makespan" in output and "ratio to ideal" in output and "TTFT added p50 ms" in output
    assert "lionagi counts tokens with tiktoken's files" in output
    document = json.loads((tmp_path / "figures-http.json").read_text())
    assert [bench["stream"] for bench in document["benchmarks"]] == [False, True]
    for bench in document["benchmarks"]:
        assert not bench["failures"]
        assert set(bench["results"]) == {"aiohttp", "opgraph", "lionagi", "langgraph"}
        for name, (run,) in bench["results"].items():
            assert run["calls_answered"] == 200, name
            assert run["ratio"] >= 0.95, name  # nobody beats the makespan of the server's own latencies
            assert run["cpu_ms_per_call"] > 0 and run["ttft_added_p50_ms"] >= -5, name
        # opgraph's CPU is counted over its workers and executor, not the driver alone
        assert any(role.startswith("ray::") for role in bench["results"]["opgraph"][0]["cpu_ms_by_role"])


def test_the_rebuilt_o200k_base_is_the_file_tiktoken_pins():
    folder = require("o200k-base")
    from opgraph.cluster.bench.tiktoken_file import O200K_URL

    data = (__import__("pathlib").Path(folder) / hashlib.sha1(O200K_URL.encode()).hexdigest()).read_bytes()
    assert hashlib.sha256(data).hexdigest() == O200K_SHA256
    assert data.count(b"\n") == 199_998  # ranks 0..199997: o200k_base's mergeable ranks


@pytest.mark.parametrize("argv", [["--http-calls", "0"], ["--http-scale", "0"]])
def test_bad_http_settings_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(["--shapes", "http", *argv])
    assert "--http-calls" in capsys.readouterr().err
