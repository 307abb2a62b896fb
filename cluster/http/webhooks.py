"""The HTTP API's webhook routes (`opgraph webhook ...` under /api/webhooks) and the server's relay task.

Owns the routes' request and answer shapes, the status each webhook error is answered with
(422 for a URL outside the allow-list or a malformed secret reference, 404 for an unknown
name, 409 for a taken one), and ``RelayTask``, the relay `opgraph serve` runs beside the
API on a connection of its own. Endpoints, signing and sending are cluster/control's; the
access guard in front of every route is guard.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParameter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from opgraph.kernel import OpGraphError

from ..control.relay import RelaySettings, WebhookRelay
from ..control.webhooks import (
    MAX_URL_LENGTH,
    WebhookError,
    WebhookNameConflictError,
    WebhookNotFoundError,
    Webhooks,
)
from ..store import MAX_NAME_LENGTH, NAME_PATTERN, StoreDatabase
from .problems import error_body, errors, links
from .runs import say

__all__ = ["AddWebhookRequest", "RelayTask", "add_webhook_routes"]


class AddWebhookRequest(BaseModel):
    """A webhook endpoint: where run events are sent, and where its signing secret lives (never the secret)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"name": "ops", "url": "https://hooks.example.com/opgraph", "secret_ref": "env:OPS_WEBHOOK_SECRET",
         "events": ["run.completed", "run.failed"]}]})

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    url: str = Field(min_length=1, max_length=MAX_URL_LENGTH, description="http(s) URL, checked against the "
                     "server's allow-list (OPGRAPH_WEBHOOK_ALLOWED_NETWORKS)")
    secret_ref: str = Field(min_length=1, max_length=1005, description="where the whsec_ signing secret lives: "
                            "env:VARIABLE, file:PATH (mode 0600), or a NAME in $OPGRAPH_HOME/webhook-secrets")
    events: list[str] | None = Field(default=None, min_length=1, max_length=50,
                                     description="event types or patterns (run.completed, run.*, *); default run.*")
    description: str | None = Field(default=None, max_length=2000)


_WEBHOOK_NAME = PathParameter(pattern=NAME_PATTERN, min_length=1, max_length=MAX_NAME_LENGTH,
                              description=f"the webhook's name: 1 to {MAX_NAME_LENGTH} of A-Z a-z 0-9 . _ -")
_LINKS = links(201, "The new webhook endpoint", {
    operation: {"name": "$response.body#/name"}
    for operation in ("get_webhook", "test_webhook", "webhook_deliveries", "enable_webhook")})


def _status(exc: WebhookError) -> int:
    if isinstance(exc, WebhookNotFoundError):
        return 404
    if isinstance(exc, WebhookNameConflictError):
        return 409
    return 422


async def _webhook_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, WebhookError)
    return JSONResponse(error_body(exc.message, endpoint=exc.endpoint), status_code=_status(exc))


def add_webhook_routes(app: FastAPI, store: StoreDatabase, webhooks: Webhooks | None = None) -> Webhooks:
    """The /api/webhooks routes over ``store`` (its endpoints checked against ``webhooks.allow``)."""
    webhooks = webhooks or Webhooks(store)
    app.add_exception_handler(WebhookError, _webhook_error)

    @app.post("/api/webhooks", status_code=201, operation_id="create_webhook",
              responses={**errors(409, 413, 422), **_LINKS})
    def create_webhook(body: AddWebhookRequest) -> dict[str, Any]:
        """Add an endpoint. Its URL must resolve inside the allow-list; its secret is named, never sent."""
        return webhooks.add(body.name, body.url, secret_ref=body.secret_ref, events=body.events,
                            description=body.description).as_json()

    @app.get("/api/webhooks", operation_id="list_webhooks", responses=errors())
    def list_webhooks() -> dict[str, Any]:
        return {"webhooks": [endpoint.as_json() for endpoint in webhooks.list()]}

    @app.get("/api/webhooks/{name}", operation_id="get_webhook", responses=errors(404, 422))
    def get_webhook(name: str = _WEBHOOK_NAME) -> dict[str, Any]:
        """The endpoint, its deliveries by status, and why it was disabled (if it was)."""
        return webhooks.get(name).as_json()

    @app.post("/api/webhooks/{name}/test", status_code=202, operation_id="test_webhook",
              responses=errors(404, 422))
    def test_webhook(name: str = _WEBHOOK_NAME) -> dict[str, Any]:
        """Queue a signed ``webhook.test`` event for this endpoint alone; its deliveries show the outcome."""
        event_id = webhooks.test(name)
        return {"name": name, "event_id": event_id, "links": {"deliveries": f"/api/webhooks/{name}/deliveries"}}

    @app.post("/api/webhooks/{name}/enable", operation_id="enable_webhook", responses=errors(404, 422))
    def enable_webhook(name: str = _WEBHOOK_NAME) -> dict[str, Any]:
        """Enable a disabled endpoint again; its pending deliveries go on."""
        return webhooks.enable(name).as_json()

    @app.get("/api/webhooks/{name}/deliveries", operation_id="webhook_deliveries", responses=errors(404, 422))
    def webhook_deliveries(name: str = _WEBHOOK_NAME,
                           limit: int = Query(default=20, ge=1, le=1000)) -> dict[str, Any]:
        """The newest deliveries, each with every attempt: outcome, HTTP status, latency, error."""
        return {"name": name, "deliveries": webhooks.deliveries(name, limit=limit)}

    return webhooks


class RelayTask:
    """The relay `opgraph serve` runs: ``start()`` on the server's loop, ``await stop()`` before it ends.
    It delivers through a connection of its own to the store (the same one only for ``:memory:``)."""

    def __init__(self, store: StoreDatabase, settings: RelaySettings,
                 open_store: Callable[[str], StoreDatabase] = StoreDatabase) -> None:
        self.store, self.settings, self._open = store, settings, open_store
        self.relay: WebhookRelay | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._relay(), name="opgraph-webhook-relay")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    async def _relay(self) -> None:
        own = self.store.path != ":memory:"
        try:
            store = await asyncio.to_thread(self._open, self.store.path) if own else self.store
        except OpGraphError as exc:
            say(f"webhooks: cannot open the store to deliver from it: {exc}; webhooks are not sent")
            return
        self.relay = WebhookRelay(store, self.settings)
        try:
            await self.relay.run(self._stop, on_error=lambda exc: say(f"webhooks: a relay pass failed: {exc}; "
                                                                      "trying again"))
        finally:
            if own:
                await asyncio.to_thread(store.close)
