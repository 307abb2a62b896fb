"""Reaching Ray from a command: a bounded probe of the address first, and errors that say what was tried.

Owns what a command does before it joins a cluster or starts an embedded Ray: it asks the
address's GCS for its cluster id over gRPC, within a few seconds, and turns the answer
into a typed error (nothing listens, no answer, not a Ray GCS, the token is missing or
wrong); and it turns a failed start into ``RuntimeStartError``. Ray itself retries such
addresses for minutes, or forever, and reports an authentication failure as "cannot
connect". It must not start opgraph actors: the Session does that.

    OpGraphError
    ├── RuntimeStartError          Ray could not be started or joined; no run was created
    └── ClusterUnreachableError    the address answered wrongly or not at all (``tried`` says how)
        └── ClusterAuthenticationError   the cluster wants a token this process did not send
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from opgraph.kernel import OpGraphError

from .command_line import ExitCode

__all__ = [
    "CONNECT_TIMEOUT",
    "EXIT_RUNTIME",
    "ClusterAuthenticationError",
    "ClusterUnreachableError",
    "RuntimeStartError",
    "open_session",
    "probe_cluster",
    "start_runtime",
]

CONNECT_TIMEOUT = 5.0  # seconds the probe waits for the GCS to answer
# The exit status of every command whose runtime could not be started or reached: no
# run exists, so it is neither "the run failed" (1) nor "bad arguments" (2).
EXIT_RUNTIME = ExitCode.RUNTIME

T = TypeVar("T")


class RuntimeStartError(OpGraphError):
    """Ray could not be started (embedded) or joined (an address); nothing ran. ``address``
    is what was asked for (None: the embedded local Ray)."""

    def __init__(self, message: str, *, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class ClusterUnreachableError(RuntimeStartError):
    """The address did not answer as a Ray cluster; ``tried`` says what was tried and what came back."""

    def __init__(self, message: str, *, address: str | None = None, tried: str | None = None) -> None:
        super().__init__(message, address=address)
        self.tried = tried


class ClusterAuthenticationError(ClusterUnreachableError):
    """The cluster uses token authentication and refused this process's token (or its lack of one)."""


@dataclass(frozen=True, slots=True)
class _Target:
    host: str
    port: int


def _target(address: str | None) -> _Target | None:
    """The GCS ``host:port`` to probe, or None when Ray resolves the address itself."""
    if address in (None, "", "local"):
        return None
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or ""
        if not address or address == "auto":
            return None  # Ray reads the cluster `ray start` recorded on this machine
    if address.startswith("ray://"):
        return None  # the Ray Client server speaks its own protocol; ray.init reports it
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnreachableError(f"{address!r} is not a Ray address: use host:port, auto or ray://host:port",
                                      address=address, tried="parsing the address")
    return _Target(host.strip("[]"), int(port))


def _auth_metadata() -> tuple[tuple[str, str], ...]:
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ()
    # Ray's own token loader: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token.
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        _get_authentication_metadata_tuple,
    )

    return tuple(_get_authentication_metadata_tuple())


def probe_cluster(address: str | None, *, timeout: float = CONNECT_TIMEOUT) -> None:
    """Return when ``address``'s GCS answers within ``timeout`` seconds; else raise a typed error.

    Nothing to probe (the embedded Ray, ``auto`` without ``RAY_ADDRESS``, ``ray://``)
    returns at once. A token the cluster refuses is ``ClusterAuthenticationError``, which
    says to export ``RAY_AUTH_MODE=token`` with the cluster's token.
    """
    target = _target(address)
    if target is None:
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    where = f"{target.host}:{target.port}"
    tried = f"asked the Ray GCS at {where} for its cluster id (gRPC, {timeout:g} s)"
    try:
        metadata = _auth_metadata()
    except Exception as exc:  # Ray's token loader: no token where token mode wants one
        raise ClusterAuthenticationError(
            f"RAY_AUTH_MODE=token is set but no token was found ({exc}); set RAY_AUTH_TOKEN to the cluster's "
            "token, or put it in ~/.ray/auth_token (on the head: `ray get-auth-token`)",
            address=address, tried="reading this process's Ray token") from exc
    channel = grpc.insecure_channel(where)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout, metadata=metadata)
    except grpc.RpcError as exc:
        raise _translate(exc, address or where, tried) from exc
    finally:
        channel.close()


def _translate(exc: Any, address: str, tried: str) -> ClusterUnreachableError:
    import grpc

    code = exc.code()
    answer = f"{tried}: {code.name} ({exc.details()})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
            advice = ("this process sent a token the cluster does not accept: set RAY_AUTH_TOKEN (or "
                      "~/.ray/auth_token) to the cluster's token (on the head: `ray get-auth-token`)")
        else:
            advice = ("the cluster uses token authentication (Ray's default): export RAY_AUTH_MODE=token, "
                      "with the cluster's token in RAY_AUTH_TOKEN or ~/.ray/auth_token")
        return ClusterAuthenticationError(f"authentication failed at the Ray cluster {address}: {advice}; {answer}",
                                          address=address, tried=answer)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        reason = "it did not answer in time (a wrong address, a firewall, or a port that is not Ray's GCS)"
    elif code == grpc.StatusCode.UNAVAILABLE:
        reason = "nothing answered there (is the head running? `ray start --head` prints its address)"
    elif code == grpc.StatusCode.UNIMPLEMENTED:
        reason = "something answered, but it is not a Ray GCS (the dashboard or client port, perhaps)"
    else:
        reason = "it answered, but not as a Ray GCS does"
    return ClusterUnreachableError(f"cannot reach a Ray cluster at {address}: {reason}; {answer}",
                                   address=address, tried=answer)


def start_runtime(start: Callable[[], T], address: str | None, *, timeout: float = CONNECT_TIMEOUT) -> T:
    """Probe ``address``, then call ``start`` (which joins or starts Ray); Ray's failures become
    ``RuntimeStartError`` (``ClusterUnreachableError`` for an address that does not answer)."""
    probe_cluster(address, timeout=timeout)
    try:
        return start()
    except OpGraphError:
        raise
    except Exception as exc:  # Ray's own start errors, translated once here for every command
        where = "the embedded local Ray" if address is None else f"the Ray cluster at {address}"
        raise RuntimeStartError(f"could not start or join {where}: {type(exc).__name__}: {exc}",
                                address=address) from exc


def open_session(address: str | None = None, *, namespace: str = "opgraph", detached: bool | None = False,
                 default_model: str | None = None, timeout: float = CONNECT_TIMEOUT) -> Any:
    """The Session every command uses: ``address`` probed first, Ray's failures typed
    (``start_runtime``), and the model providers this process's environment configures
    registered on it, so ``OPENAI_MAX_CONCURRENCY``, ``OPENAI_TIMEOUT`` and the rest hold
    in the workers wherever they run (``opgraph.actors.providers.ENVIRONMENT_SETTINGS``).
    ``detached=None`` leaves it to the Session: detached when it joins through an address."""
    from opgraph.actors import Session  # local: --help and usage errors must not load Ray
    from opgraph.actors.providers import environment_providers

    session = start_runtime(lambda: Session(address, namespace=namespace, detached=detached,
                                            default_model=default_model), address, timeout=timeout)
    for name, provider in environment_providers().items():
        session.register_provider(name, provider)
    return session
