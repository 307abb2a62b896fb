"""`python -m opgraph.cluster.job MODE ...`: the documented name of the job entrypoint (cluster/jobs/).

Kept as the command `ray job submit` runs and `opgraph job submit` builds; the entrypoint
itself lives in the jobs package.
"""

from opgraph.cluster.jobs import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
