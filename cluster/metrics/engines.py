"""Prometheus metric families for engines, from ``engine_statistics()``-shaped snapshots.

Owns the translation of engine counters (agents made, budget exhaustions, missing
emissions, judge outcomes, runs) into metric families, for ``cluster/metrics/exporter.py`` to
yield. Snapshots come from this process (``opgraph.engines.engine_statistics()``) or,
for an exporter in another process, from the store (``EngineRunStore.statistics()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["engine_metric_families"]


def engine_metric_families(snapshot: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    """One family per counter, labelled by engine kind; every family is yielded even when empty."""
    scalars = [
        ("opgraph_engine_runs_started_total", "Engine runs started, by engine.", "runs_started"),
        ("opgraph_engine_agents_made_total", "Agents made by engine runs (exempt ones included), by engine.",
         "agents_made"),
        ("opgraph_engine_emissions_missing_total", "Agents whose typed emission never arrived after repair, "
                                                   "by engine.", "emissions_missing"),
    ]
    for name, documentation, key in scalars:
        family = CounterMetricFamily(name, documentation, labels=["engine"])
        for engine, stats in sorted(snapshot.items()):
            family.add_metric([engine], stats.get(key, 0))
        yield family
    labelled = [
        ("opgraph_engine_budget_exhaustions_total", "Engine runs whose hard budget ran out, by engine and bound.",
         "reason", "budget_exhaustions"),
        ("opgraph_engine_judge_outcomes_total", "Judge decisions, by engine and outcome (allow, reject, error "
                                                "= failed open, budget = failed closed, skipped).",
         "outcome", "judge_outcomes"),
        ("opgraph_engine_runs_finished_total", "Engine runs ended, by engine and status.", "status", "runs_finished"),
    ]
    for name, documentation, label, key in labelled:
        family = CounterMetricFamily(name, documentation, labels=["engine", label])
        for engine, stats in sorted(snapshot.items()):
            for value_label, value in sorted((stats.get(key) or {}).items()):
                family.add_metric([engine, value_label], value)
        yield family
