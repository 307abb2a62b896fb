"""`python -m opgraph.cluster.jobs MODE ...`: the job entrypoint (`opgraph.cluster.job` is the same)."""

from .entrypoint import main

__all__: list[str] = []

if __name__ == "__main__":  # imported (a test walking every module) it runs nothing
    raise SystemExit(main())
