"""A real Prometheus scrapes a short job, and every panel of the shipped dashboard has data.

    prometheus (Debian's package, unpacked, no service) --scrape every 2 s--> job --metrics-port
    job: python -m opgraph.cluster.job fanout on the local head, in a namespace of its own

After the job ends (its endpoint lingers for one more scrape), every expression of
``cluster/metrics/dashboards/opgraph.json`` is queried over the job's window, as Grafana would
with ``$__rate_interval``; each must return data, and the throughput and latency
panels must show the run: nodes settled per second above 0, p50 near the nodes' 0.4 s.
The Prometheus binary is the ``prometheus`` component (tests/support/components.py): Debian's
package unpacked into the test cache by ``python tests/support/components.py fetch prometheus``
(``.ci/run`` runs it), or ``OPGRAPH_PROMETHEUS``; a machine without it skips this test.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from components import require

from opgraph.cluster.processes import free_port, http_body, run_command, start_server, wait_until

DASHBOARD = importlib.resources.files("opgraph.cluster.metrics").joinpath("dashboards/opgraph.json")
SCRAPE_INTERVAL = 2  # seconds; the exporter answers within its own 2 s deadline
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL}s"  # Grafana's $__rate_interval: four scrape intervals
READY_DEADLINE = 60.0
JOB_TIMEOUT = 240.0
NODES, LATENCY, CAPACITY = 3000, 0.4, 300  # about 4 s of run: two scrapes at least


@pytest.fixture(scope="module")
def prometheus_binary() -> Path:
    binary = Path(require("prometheus"))
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True)
    assert "prometheus, version" in version.stdout + version.stderr
    return binary


@pytest.fixture
def prometheus(prometheus_binary, tmp_path):
    """Prometheus on a free loopback port, scraping a metrics port chosen here."""
    metrics_port, port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""
global:
  scrape_interval: {SCRAPE_INTERVAL}s
scrape_configs:
  - job_name: opgraph
    scrape_timeout: {SCRAPE_INTERVAL}s
    static_configs:
      - targets: ["127.0.0.1:{metrics_port}"]
""")
    url = f"http://127.0.0.1:{port}"
    with start_server([str(prometheus_binary), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                       f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                      ready=lambda: http_body(f"{url}/-/ready"), timeout=READY_DEADLINE, what="prometheus",
                      log_path=tmp_path / "prometheus.log"):
        # Ready is not scraping: Prometheus applies its targets a few seconds later. Wait until
        # it has tried the (not yet open) port once, so a short job is scraped from its start.
        wait_until(lambda: [target for target in httpx.get(f"{url}/api/v1/targets", timeout=2).json()["data"][
            "activeTargets"] if target["health"] != "unknown"], timeout=READY_DEADLINE, what="prometheus scraping")
        yield url, metrics_port


def _dashboard_expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def _query_range(url: str, expression: str, start: float, end: float) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/query_range", timeout=30, params={
        "query": expression.replace("$__rate_interval", RATE_INTERVAL), "start": start, "end": end, "step": 1})
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", (expression, body)
    return body["data"]["result"]


def _values(series: list[dict]) -> list[float]:
    return [float(value) for one in series for _, value in one["values"] if math.isfinite(float(value))]


def test_every_dashboard_expression_has_data_for_a_short_job(prometheus, ray_head, capsys):
    url, metrics_port = prometheus
    namespace = f"prometheus-{uuid.uuid4().hex[:8]}"  # fresh actors: the counters start at 0
    started = time.time()
    job = run_command(
        [sys.executable, "-m", "opgraph.cluster.job", "fanout", "--nodes", str(NODES), "--latency", str(LATENCY),
         "--max-concurrent", str(CAPACITY), "--metrics-port", str(metrics_port), "--metrics-linger", "30",
         "--address", ray_head.address, "--namespace", namespace, "--no-detached"],
        env=ray_head.env(), timeout=JOB_TIMEOUT)
    ended = time.time()
    assert job.returncode == 0, job.stdout + job.stderr
    assert "metrics: scraped once more after the run; closing" in job.stdout, job.stdout

    report, empty = [], []
    for title, expression in _dashboard_expressions():
        values = _values(_query_range(url, expression, started, ended + SCRAPE_INTERVAL))
        report.append(f"{title:<32} {len(values):>4} samples  max {max(values, default=float('nan')):>10.3f}  "
                      f"{expression}")
        if not values:
            empty.append(title)
    with capsys.disabled():  # the figures for the closing note
        print("\n" + "\n".join(report))
    assert not empty, f"panels without data: {empty}"

    settled = _values(_query_range(url, 'sum(rate(opgraph_nodes_settled_total{status="completed"}'
                                         f"[{RATE_INTERVAL}]))", started, ended + SCRAPE_INTERVAL))
    assert max(settled) > 0, "no throughput was seen"
    p50 = _values(_query_range(url, "histogram_quantile(0.5, sum by (le) (rate(opgraph_node_latency_seconds_bucket"
                                    f'{{status="completed"}}[{RATE_INTERVAL}])))', started, ended + SCRAPE_INTERVAL))
    assert p50 and all(LATENCY <= value <= 2 * LATENCY for value in p50), p50  # the nodes' latency, loaded
    # The endpoint lingered for a scrape after the run: the last one saw every node.
    final = _values(_query_range(url, 'opgraph_nodes_settled_total{status="completed"}', started,
                                 ended + SCRAPE_INTERVAL))
    assert max(final) == NODES
