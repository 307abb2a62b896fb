"""Engine figures: the review engine on sim/ (4 dimensions, 20 issues) and driver CPU per agent turn.

Owns one benchmark script: it runs ``ReviewEngine`` repeatedly on the embedded runtime
with the built-in simulated provider giving 5 issues per dimension, and prints medians
of wall time, agents made, turns, and the driver process's CPU seconds per agent turn
(all threads of this process, Ray's included), with the ratio of the turns' summed
worker-side time to the wall time (how much the concurrent dimensions and verifiers
overlap). Run: ``python -m opgraph.cluster.bench.engines [--repeat 5] [--latency 0.05]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

__all__ = ["main", "measure"]

CODE = '''def load(path):
    data = open(path).read()
    return eval(data)


def total(rows):
    result = 0
    for row in rows:
        result = result + row["amount"]
    return result
'''


async def _one(session: Any, engine: Any) -> dict[str, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = await engine.run(CODE, session=session)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    run = result.run
    turns = run.events.notifications("turn_completed")
    from opgraph.engines import IssueFound

    return {
        "wall_s": wall,
        "agents": run.agents_made,
        "issues": len(run.by_type(IssueFound)),
        "verifiers": len(run.verifiers),
        "turns": len(turns),
        "turn_seconds": sum(record.data["elapsed"] for record in turns),
        "driver_cpu_s": cpu,
        "degraded": float(result.degraded),
    }


def measure(repeat: int = 5, latency: float = 0.05, items: int = 5, warmup: int = 1) -> dict[str, Any]:
    """Medians over ``repeat`` review runs (after ``warmup`` unmeasured ones)."""
    from opgraph.actors import Session
    from opgraph.actors.providers import SimulatedProvider
    from opgraph.engines import ReviewEngine

    engine = ReviewEngine()
    with Session() as session:  # every run's agent branches are dropped when the block ends
        session.register_provider("sim", SimulatedProvider(latency=latency, list_items=items, seed=7))
        for _ in range(warmup):
            asyncio.run(_one(session, engine))
        samples = [asyncio.run(_one(session, engine)) for _ in range(repeat)]

    def median(key: str) -> float:
        return statistics.median(sample[key] for sample in samples)

    return {
        "repeat": repeat, "sim_latency_s": latency, "dimensions": 4, "issues": median("issues"),
        "agents_made": median("agents"), "verifiers": median("verifiers"), "turns": median("turns"),
        "wall_s": round(median("wall_s"), 3),
        "driver_cpu_s": round(median("driver_cpu_s"), 3),
        "driver_cpu_s_per_turn": round(statistics.median(s["driver_cpu_s"] / s["turns"] for s in samples), 4),
        "overlap_ratio": round(statistics.median(s["turn_seconds"] / s["wall_s"] for s in samples), 2),
        "degraded_runs": int(sum(sample["degraded"] for sample in samples)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.engines", description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--latency", type=float, default=0.05, help="sim/ latency per model call (0.05 s)")
    parser.add_argument("--items", type=int, default=5, help="issues per dimension (5: 20 issues)")
    arguments = parser.parse_args(argv)
    figures = measure(arguments.repeat, arguments.latency, arguments.items, arguments.warmup)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
