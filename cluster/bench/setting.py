"""A/B of a process setting: `opgraph bench` run with an environment variable at each value, alternating.

Owns alternating the runs and comparing their figures. Settings read at process start
(``OPGRAPH_DIRECT_CALLS``, ``OPGRAPH_DURABLE``, ...) cannot be flipped within one
runtime, so each value gets a fresh `opgraph bench` process (its own embedded Ray). The
processes alternate (A B, B A, A B, ...), so drift hits every value alike; per shape it
prints each value's median over the rounds (of each process's own median) and the ratio
of each value to the first.

    python -m opgraph.cluster.bench.setting OPGRAPH_DIRECT_CALLS=1,0 [--rounds 2] [-- BENCH ARGS ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m opgraph.cluster.bench.setting", description=__doc__.split("\n")[0])
    parser.add_argument("setting", help="NAME=VALUE1,VALUE2[,...]: the environment variable and its values")
    parser.add_argument("--rounds", type=int, default=2, help="`opgraph bench` processes per value (default 2)")
    return parser


def _bench(name: str, value: str, bench_args: list[str], directory: str, index: int) -> dict[str, float | None]:
    path = os.path.join(directory, f"{index}.json")
    environment = {**os.environ, name: value}
    command = [sys.executable, "-m", "opgraph.cluster.bench", *bench_args, "--json", path]
    completed = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if completed.returncode != 0 or not os.path.exists(path):
        print(completed.stdout[-2000:], file=sys.stderr)
        raise SystemExit(f"`opgraph bench` with {name}={value} failed (exit {completed.returncode})")
    with open(path) as handle:
        document = json.load(handle)
    figures = {}
    for shape in document["shapes"]:
        result = shape["results"]["opgraph"]
        figures[shape["label"]] = result["median_seconds"]
        figures.setdefault("__ideal__" + shape["label"], shape["ideal_seconds"] or None)
        figures["__nodes__" + shape["label"]] = shape["nodes"]
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    bench_args = argv[split + 1:]  # for `opgraph bench`, after --
    name, _, listed = args.setting.partition("=")
    values = [value for value in listed.split(",") if value != ""]
    if not name or len(values) < 2:
        raise SystemExit("give a setting and at least two values: NAME=A,B")
    runs: dict[str, list[dict[str, float | None]]] = {value: [] for value in values}
    with tempfile.TemporaryDirectory(prefix="opgraph-ab-") as directory:
        index = 0
        for round_number in range(args.rounds):
            order = values if round_number % 2 == 0 else list(reversed(values))
            for value in order:
                print(f"round {round_number + 1}: {name}={value}", file=sys.stderr, flush=True)
                runs[value].append(_bench(name, value, bench_args, directory, index))
                index += 1
    labels = [label for label in runs[values[0]][0] if not label.startswith("__")]
    print(f"`opgraph bench {' '.join(bench_args)}`, {args.rounds} process(es) per value of {name}, alternating; "
          "seconds: the median over processes of each one's median (x ideal, or nodes/s)")
    print(f"{'shape':42}" + "".join(f"{name + '=' + value:>26}" for value in values)
          + "".join(f"{value + '/' + values[0]:>10}" for value in values[1:]))
    for label in labels:
        medians = []
        for value in values:
            seconds = [figures[label] for figures in runs[value] if figures.get(label) is not None]
            medians.append(statistics.median(seconds) if seconds else None)
        ideal = runs[values[0]][0].get("__ideal__" + label)
        nodes = runs[values[0]][0].get("__nodes__" + label)
        cells = []
        for median in medians:
            if median is None:
                cells.append(f"{'failed':>26}")
            else:
                figure = f"{median / ideal:.2f}x" if ideal else f"{nodes / median:,.0f}/s"
                cells.append(f"{f'{median:.2f} s ({figure})':>26}")
        ratios = [f"{'n/a':>10}" if medians[0] is None or other is None else f"{other / medians[0]:>10.2f}"
                  for other in medians[1:]]
        print(f"{label:42}" + "".join(cells) + "".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
