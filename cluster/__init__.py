"""The user-facing surfaces: CLI, jobs, metrics, the run store and benchmarks.
The outermost layer; nothing in kernel/, actors/ or engines/ imports it."""

__all__: list[str] = []
