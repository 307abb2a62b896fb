"""Prometheus metrics of a running runtime (`opgraph metrics serve`) and the Grafana dashboard.

The exporter turns the actors' and engines' ``statistics()`` snapshots into metric families;
``dashboards/`` holds the dashboard and a Prometheus configuration that scrapes it.
"""

from .engines import engine_metric_families
from .exporter import (
    DEFAULT_LINGER,
    DEFAULT_PORT,
    KNOWN_PROVIDERS,
    LATENCY_STATUSES,
    SETTLED_STATUSES,
    MetricsServer,
    RuntimeCollector,
    find_runtime,
    serve,
    serve_metrics,
)

__all__ = [
    "DEFAULT_LINGER",
    "DEFAULT_PORT",
    "KNOWN_PROVIDERS",
    "LATENCY_STATUSES",
    "SETTLED_STATUSES",
    "MetricsServer",
    "RuntimeCollector",
    "engine_metric_families",
    "find_runtime",
    "serve",
    "serve_metrics",
]
