"""`python -m opgraph.cluster.cli ...`: the same as the `opgraph` command."""

from .commands import main

__all__: list[str] = []

if __name__ == "__main__":  # imported (a test walking every module) it runs nothing
    raise SystemExit(main())
