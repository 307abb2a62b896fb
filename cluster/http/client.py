"""A Python client of `opgraph serve`: the HTTP API's calls, with the server's token sent on each.

Owns ``ServerClient`` (workflows, runs, starting, cancelling; the token from ``client_token``,
so a client on the server's machine needs no setting) and ``ServerRequestError``, what an
error answer becomes (its status and the API's problem list). It decides nothing about a run:
the server does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from opgraph.kernel import OpGraphError

from .auth import client_token

__all__ = ["DEFAULT_URL", "ServerClient", "ServerRequestError"]

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerRequestError(OpGraphError):
    """The server answered with an error: ``status`` is the HTTP status, ``errors`` the problem list, ``body``
    the whole error body (``retry_after`` the seconds a 429 asked to wait)."""

    def __init__(self, message: str, *, status: int, errors: list[dict[str, Any]] | None = None,
                 body: Mapping[str, Any] | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.errors, self.body = status, list(errors or []), dict(body or {})
        self.retry_after = retry_after


class ServerClient:
    """Calls to the `opgraph serve` at ``url``, each with ``Authorization: Bearer TOKEN``.

    ``token`` defaults to ``client_token()``: ``OPGRAPH_TOKEN``, the file ``OPGRAPH_TOKEN_FILE``
    names, or the token a server on this machine generated in the opgraph home. Use it as a
    context manager, or ``close()`` it.
    """

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        token = client_token(token)
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self._http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, json: Any = None, params: Mapping[str, Any] | None = None) -> Any:
        reply = self._http.request(method, path, json=json, params=params)
        if reply.is_success:
            return reply.json() if reply.content else None
        try:
            body = reply.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        retry_after = reply.headers.get("retry-after")
        raise ServerRequestError(f"{method} {path}: {reply.status_code} {body.get('error') or reply.reason_phrase}",
                                 status=reply.status_code, errors=body.get("errors"), body=body,
                                 retry_after=float(retry_after) if retry_after else None)

    # -- workflows -------------------------------------------------------------------------
    def workflows(self) -> list[dict[str, Any]]:
        return self._call("GET", "/api/workflows")["workflows"]

    def workflow(self, name: str, version: int | None = None) -> dict[str, Any]:
        return self._call("GET", f"/api/workflows/{name}", params={} if version is None else {"version": version})

    def create_workflow(self, name: str, spec: Mapping[str, Any] | None,
                        description: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/api/workflows", json={"name": name, "spec": spec, "description": description})

    # -- runs --------------------------------------------------------------------------------
    def start_workflow(self, name: str, inputs: Mapping[str, Any] | None = None, *, version: int | None = None,
                       model: str | None = None) -> dict[str, Any]:
        """Admit a run of workflow ``name`` (202): its id, status and links."""
        body = {key: value for key, value in (("inputs", dict(inputs or {})), ("version", version),
                                                ("model", model)) if value is not None}
        return self._call("POST", f"/api/workflows/{name}/runs", json=body)

    def runs(self, *, workflow: str | None = None, status: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        params = {key: value for key, value in (("workflow", workflow), ("status", status), ("limit", limit))
                  if value is not None}
        return self._call("GET", "/api/runs", params=params)["runs"]

    def run(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/runs/{run_id}")

    def signals(self, run_id: str, after: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/api/runs/{run_id}/signals", params={"after": after})

    def results(self, run_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/runs/{run_id}/results")

    def cancel(self, run_id: str) -> dict[str, Any]:
        return self._call("POST", f"/api/runs/{run_id}/cancel")
