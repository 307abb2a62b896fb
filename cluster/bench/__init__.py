"""Benchmarks and the chaos script: each module is a script that prints medians and ratios.

``python -m opgraph.cluster.bench`` (``opgraph bench``) runs the standard shapes; the other
scripts run as ``python -m opgraph.cluster.bench.<name>``. Nothing is imported here, so the
kernel benchmark never loads Ray.
"""

__all__: list[str] = []
