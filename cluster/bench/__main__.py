"""`python -m opgraph.cluster.bench ...`: the same as `opgraph bench ...`."""

from .shapes import main

__all__: list[str] = []

if __name__ == "__main__":  # imported (a test walking every module) it runs nothing
    raise SystemExit(main())
