"""A durable run's header: what a recovery needs of the run's options, as typed fields, and no secret.

Owns the header's format. Plain options are msgpack fields; built-in operations are kept
by name, HTTP providers as a description (kind, name, base URL without its password,
settings without the key), rebuilt from the environment of whoever recovers the run. What
only Python holds (the graph, reducers, node builders, the caller's own operations and
providers) is pickled, so the header is signed (kernel/codec.py). A header that would hold
a secret of this process's environment is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray import cloudpickle

from opgraph.kernel import CodecError, Pickled, RetryPolicy, RunLogIntegrityError, decode_logged, encode_logged

from ..protocol import RunOptions, RunResources
from ..secrets import find_secret, runlog_key, runlog_key_reader, secret_values
from .codec import pickle_value

__all__ = ["HEADER_FORMAT", "LoggedHeader", "decode_header", "encode_header", "read_header"]

HEADER_FORMAT = 1

# RunOptions fields by how a header keeps them (a test checks that every field is in one).
PLAIN_FIELDS = ("max_concurrent", "parallel", "reactive", "max_spawn", "default_branch_id", "clone_source_branch_id",
                "known_branches", "want_signals", "want_events", "stream_buffer", "branch_scope", "scope_parent",
                "isolated", "cancel_grace", "durable", "detached", "keep_open")
PYTHON_FIELDS = ("context", "spawn_type", "node_builder", "reducers", "spawn_branch_setup")  # pickled, signed
OWN_FIELDS = ("resources", "retry_policies")  # each has a form of its own, below


def encode_header(graph: Any, options: RunOptions, started: float, *, run_id: str | None = None) -> bytes:
    """``options`` and ``graph`` as a header. ``graph`` may come already pickled (bytes: ``Session``
    ships a durable run's graph so, and its bytes are recorded as they are)."""
    from ..builtin_operations import is_builtin
    from ..providers import describe_provider  # local: providers load httpx

    resources = options.resources
    builtin = sorted(name for name, operation in resources.operations.items() if is_builtin(name, operation))
    own_operations = {name: operation for name, operation in resources.operations.items() if name not in builtin}
    described, own_providers = {}, {}
    for name, provider in resources.providers.items():
        description = describe_provider(provider)
        if description is None:
            own_providers[name] = provider
        else:
            described[name] = description
    fields = {
        "format": HEADER_FORMAT,
        "started": started,
        "graph": Pickled(graph if isinstance(graph, bytes) else pickle_value(graph)),
        "options": {name: getattr(options, name) for name in PLAIN_FIELDS},
        "python": {name: _pickled(getattr(options, name)) for name in PYTHON_FIELDS},
        "retry_policies": {name: [policy.max_attempts, sorted(policy.on)]
                           for name, policy in options.retry_policies.items()},
        "operations": {"builtin": builtin, "own": _pickled(own_operations or None)},
        "providers": {"described": described, "own": _pickled(own_providers or None)},
        "settings": dict(resources.settings),
        "spawn_type": _pickled(resources.spawn_type),
    }
    header = encode_logged(fields, dumps=pickle_value, key=runlog_key)
    leaked = find_secret(header, secret_values())
    if leaked is not None:
        raise CodecError(f"the run's header would hold {leaked}: a durable run keeps no secret. Read it from the "
                         "environment where it is used (in the operation or the provider's call), or run with "
                         "durable=False", run_id=run_id)
    return header


def _pickled(value: Any) -> Any:
    return None if value is None else Pickled(pickle_value(value))


@dataclass
class LoggedHeader:
    """A header read back: the graph as submitted, when the run started, and its options' fields."""

    graph: Any
    started: float
    fields: dict[str, Any]

    def run_options(self, providers: Mapping[str, Any] | None = None) -> RunOptions:
        """The run's options, to go on with it here. Built-in operations come from this opgraph's
        table; a described provider is ``providers[name]`` when given (the resuming caller's,
        built from its environment), else rebuilt from this process's environment."""
        from ..builtin_operations import builtin_operations

        fields = self.fields
        table = builtin_operations()
        unknown = [name for name in fields["operations"]["builtin"] if name not in table]
        if unknown:
            raise CodecError(f"the run's header names built-in operations this opgraph lacks: {', '.join(unknown)}")
        operations = {name: table[name] for name in fields["operations"]["builtin"]}
        operations.update(fields["operations"]["own"] or {})
        resources = RunResources(operations, _providers(fields["providers"], providers or {}),
                                 dict(fields["settings"]), fields["spawn_type"])
        policies = {name: RetryPolicy(max_attempts, frozenset(on))
                    for name, (max_attempts, on) in fields["retry_policies"].items()}
        return RunOptions(**fields["options"], **fields["python"], resources=resources, retry_policies=policies)


def _providers(kept: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    from ..providers import provider_from_description

    providers = dict(kept["own"] or {})
    for name, description in kept["described"].items():
        providers[name] = given.get(name) or provider_from_description(description)
    return providers


def read_header(header: bytes) -> LoggedHeader:
    """A header ``encode_header`` wrote, its signature checked first (``RunLogIntegrityError``)."""
    fields = decode_logged(header, key=runlog_key_reader, loads=cloudpickle.loads)
    if not isinstance(fields, dict) or fields.get("format") != HEADER_FORMAT:
        raise RunLogIntegrityError("a run's header is not one this opgraph writes (format "
                                   f"{fields.get('format') if isinstance(fields, dict) else '?'!r})")
    graph = fields.pop("graph")
    return LoggedHeader(graph, fields.pop("started"), fields)


def decode_header(header: bytes, providers: Mapping[str, Any] | None = None) -> tuple[Any, RunOptions, float]:
    """(graph, options, started) of a header, to go on with its run (``LoggedHeader.run_options``)."""
    logged = read_header(header)
    return logged.graph, logged.run_options(providers), logged.started

