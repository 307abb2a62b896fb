"""The `opgraph` command line: one sub-module per command group, dispatched by commands.py.

Importing it stays cheap: each command loads Ray, FastAPI or a lane only when it runs, so
`opgraph --version` and usage errors never start anything.
"""

from .commands import main

__all__ = ["main"]
