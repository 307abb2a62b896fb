"""The user-facing surfaces: lanes, the run store, the HTTP API, the CLI, jobs, metrics and benchmarks.
The outermost layer; nothing in kernel/, actors/ or engines/ imports it."""

__all__: list[str] = []
