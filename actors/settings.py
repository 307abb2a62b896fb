"""Process settings of the actor runtime: names, sizes, intervals and the environment they come from.

Owns the defaults every actor module reads (so none of them imports another for a
constant) and the naming of actors. A detached runtime is shared by name by every
process of its namespace; an owned one carries its creator's id in every name, so no
other process can find and come to depend on actors that die with their owner.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CANCEL_GRACE_SECONDS",
    "DEFAULT_NAMESPACE",
    "EXECUTOR_CONCURRENCY",
    "EXECUTOR_PREFIX",
    "PROBE_INTERVAL_SECONDS",
    "PROBE_TIMEOUT_SECONDS",
    "WORKER_CONCURRENCY",
    "ActorNames",
    "names_in",
    "newest_generation",
    "opgraph_home",
    "cancel_grace_seconds",
    "default_max_concurrency",
    "direct_calls",
    "durable_by_default",
    "executor_pool_size",
    "tune_garbage_collector",
]

DEFAULT_NAMESPACE = "opgraph"
EXECUTOR_PREFIX = "opgraph-executor-"
WORKER_CONCURRENCY = 100_000
EXECUTOR_CONCURRENCY = 100_000
# How often the executor asks every worker and store whether it is alive, and how long
# an answer may take: an idle actor's death is noticed within about a second.
PROBE_INTERVAL_SECONDS = 1.0
PROBE_TIMEOUT_SECONDS = 10.0
CANCEL_GRACE_SECONDS = 5.0
# How long an ended run waits in its executor's memory for a driver to take its result and
# forget it. A driver that died (or a run recovered by a replacement executor for a driver
# that is gone) never will; after this the run is let go, and a durable run's result is
# still read from the run log.
UNCLAIMED_RUN_SECONDS = 300.0


def tune_garbage_collector() -> None:
    """Collect the youngest generation every 50,000 allocations instead of 700.

    A run allocates several small objects per settlement; with the default threshold
    the collector repeatedly scans a heap holding the whole graph. Measured with
    ``python -m opgraph.cluster.bench.kernel``: about a third of scheduler time.
    """
    _, second, third = gc.get_threshold()
    gc.set_threshold(50_000, second, third)


def opgraph_home(environ: Mapping[str, str] | None = None) -> Path:
    """The folder opgraph keeps its files in on this machine: ``$OPGRAPH_HOME``, else ``~/.opgraph``
    (the default database, the server's generated token, the user's playbooks); ``environ`` is
    the environment to read (default: this process's)."""
    configured = (os.environ if environ is None else environ).get("OPGRAPH_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".opgraph"


def direct_calls() -> bool:
    """Whether executors send calls to workers, and workers their branch calls to stores, on direct
    sockets (actors/workers/channel.py): on unless ``OPGRAPH_DIRECT_CALLS=0``, which sends them
    through Ray's actor calls."""
    return switched_on("OPGRAPH_DIRECT_CALLS")


def durable_by_default() -> bool:
    """Whether a Session logs its runs when it is not told: on unless ``OPGRAPH_DURABLE=0``."""
    return switched_on("OPGRAPH_DURABLE")


def switched_on(variable: str) -> bool:
    """An on/off setting that is on unless set to 0, false, no or off (any case)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def cancel_grace_seconds() -> float:
    """How long cancelled operations get to stop before they are reported cancelled anyway."""
    return _positive_float("OPGRAPH_CANCEL_GRACE", CANCEL_GRACE_SECONDS)


def default_max_concurrency() -> int:
    """``max_concurrent=None``: the ``OPGRAPH_MAX_CONCURRENCY`` bound, default 10,000."""
    text = os.environ.get("OPGRAPH_MAX_CONCURRENCY", "10000")
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        from opgraph.kernel import OperationError  # local: settings load before anything else

        raise OperationError(f"OPGRAPH_MAX_CONCURRENCY must be a whole number of at least 1, got {text!r}")
    return value


def executor_pool_size(requested: int | None = None) -> int:
    """How many executors a runtime starts: ``requested``, else ``OPGRAPH_EXECUTORS``, else one
    per alive Ray node (so 1 on a single machine, where a second executor only shares its cores).

    A run is owned by one executor, so a pool lets runs schedule in parallel on as many
    processes; one run never spans two executors.
    """
    from opgraph.kernel import OperationError  # local: settings load before anything else

    if requested is None:
        text = os.environ.get("OPGRAPH_EXECUTORS", "").strip()
        if not text:
            import ray  # local: settings are read before Ray is needed anywhere

            return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))
        try:
            requested = int(text)
        except ValueError:
            raise OperationError(f"OPGRAPH_EXECUTORS must be a whole number of at least 1, got {text!r}") from None
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise OperationError(f"the executor pool size must be a whole number of at least 1, got {requested!r}")
    return requested


def _positive_float(variable: str, default: float) -> float:
    text = os.environ.get(variable)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        from opgraph.kernel import OperationError  # local: settings load before anything else

        raise OperationError(f"{variable} must be a number of seconds above 0, got {text!r}")
    return value


@dataclass(frozen=True)
class ActorNames:
    """The names of one runtime's actors.

    ``suffix`` is empty for the detached runtime every process of the namespace shares
    (``opgraph-executor-0``, ``opgraph-worker-1``...). An owned runtime's names end in
    its creator's id. A replacement takes the next generation (``opgraph-worker-1.g2``):
    a dead actor's name is not always free yet, and a name must never find the dead one.
    The executors of a pool are members 0, 1, ...: member 0 is ``executor``, member 2 is
    ``opgraph-executor-0-m2`` (and ``opgraph-executor-0-m2.g1`` once replaced).
    """

    suffix: str = ""

    @property
    def executor(self) -> str:
        return f"{EXECUTOR_PREFIX}{self.suffix or '0'}"

    def executor_member(self, member: int = 0) -> str:
        """Pool member ``member``'s name before any replacement: whose runs the run log names."""
        return self.executor if member == 0 else f"{self.executor}-m{member}"

    def executor_of(self, generation: int, member: int = 0) -> str:
        base = self.executor_member(member)
        return base if generation == 0 else f"{base}.g{generation}"

    def worker(self, index: int, generation: int = 0) -> str:
        return self._member("worker", index, generation)

    def store(self, index: int, generation: int = 0) -> str:
        return self._member("branches", index, generation)

    def owner(self, namespace: str | None) -> str:
        """Whose rows a durable store of this runtime writes: its namespace and creator
        (``detached`` for the runtime the namespace shares). Replacements keep it."""
        return f"{namespace or ''}/{self.suffix or 'detached'}"

    def _member(self, kind: str, index: int, generation: int) -> str:
        name = f"opgraph-{kind}-{index}"
        if self.suffix:
            name += f"-{self.suffix}"
        return name if generation == 0 else f"{name}.g{generation}"


def newest_generation(names: set[str] | list[str], base: str) -> tuple[str, int] | None:
    """The newest generation of ``base`` among ``names`` (``base`` is 0, ``base.gN`` is N)."""
    best = None
    for name in names:
        if name == base:
            generation = 0
        elif name.startswith(base + ".g") and name[len(base) + 2:].isdigit():
            generation = int(name[len(base) + 2:])
        else:
            continue
        if best is None or generation > best[1]:
            best = (name, generation)
    return best


def names_in(namespace: str | None) -> set[str]:
    """The named actors of ``namespace`` (an actor's own namespace can differ from its job's)."""
    import ray  # local: settings are read before Ray is needed anywhere

    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if namespace is None or entry["namespace"] == namespace}
