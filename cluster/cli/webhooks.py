"""`opgraph webhook add|list|show|test|deliveries|enable|relay`: signed webhooks of run events, on the store.

Owns the webhook commands' parsers, what each prints, and its refusals (a URL outside the
allow-list or a malformed secret reference is a usage error, nothing stored). A new endpoint
without ``--secret-ref`` gets a generated secret, kept in ``$OPGRAPH_HOME/webhook-secrets``
(``0600``) and printed once, for the receiver. Endpoints, signing and delivering are
cluster/control's; the same operations are under /api/webhooks of `opgraph serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
from typing import Any

from ..command_line import JSON, STORE, ExitCode, add_options, positive_float, positive_int
from .spine import command_group, subcommand

__all__ = ["add_webhook_parser"]

_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE)
_ALLOW_HELP = ("also allow targets in this network: loopback, private, link-local, an address or a CIDR "
               "(repeat it; added to OPGRAPH_WEBHOOK_ALLOWED_NETWORKS)")


def _when(moment: float | None) -> str:
    return "-" if moment is None else datetime.datetime.fromtimestamp(moment).strftime("%Y-%m-%d %H:%M:%S")


def _allow_list(arguments: argparse.Namespace) -> Any:
    from ..control.webhooks import ALLOWED_NETWORKS_ENV, AllowList

    given = [*(os.environ.get(ALLOWED_NETWORKS_ENV, "").split(",")), *(getattr(arguments, "allow_network", None) or [])]
    return AllowList.parse(given)


def _on_webhooks(prefix: str, arguments: argparse.Namespace, action: Any) -> int:
    """Run ``action(webhooks)`` on the store; typed errors become the exit code they mean."""
    from opgraph.kernel import OpGraphError

    from ..control.webhooks import WebhookError, WebhookNameConflictError, WebhookNotFoundError, Webhooks
    from ..store import StoreDatabase, store_location

    try:
        allow = _allow_list(arguments)
    except ValueError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        with StoreDatabase(store_location(arguments.store)) as store:
            return action(Webhooks(store, allow=allow))
    except WebhookError as exc:  # an unknown or taken name is refused; bad input (URL, secret, events) is usage
        print(f"{prefix}: {exc.message}", file=sys.stderr)
        refused = isinstance(exc, WebhookNotFoundError | WebhookNameConflictError)
        return ExitCode.FAILED if refused else ExitCode.USAGE
    except (OpGraphError, ValueError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return ExitCode.USAGE


def _print_endpoint(endpoint: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(endpoint.as_json(), indent=2))
        return
    state = "enabled" if endpoint.enabled else f"DISABLED: {endpoint.disabled_reason}"
    print(f"{endpoint.name}  {endpoint.url}\n  events: {', '.join(endpoint.event_types)}\n"
          f"  secret: {endpoint.secret_ref}\n  {state}")
    if endpoint.counts:
        print("  deliveries: " + ", ".join(f"{count} {status}" for status, count in sorted(endpoint.counts.items())))


def _add(arguments: argparse.Namespace) -> int:
    from ..control.webhooks import generate_secret, store_secret

    def add(webhooks: Any) -> int:
        generated = None
        reference = arguments.secret_ref
        if reference is None:
            reference = arguments.name
        endpoint = webhooks.add(arguments.name, arguments.url, secret_ref=reference, events=arguments.event,
                                description=arguments.description)
        if arguments.secret_ref is None:  # stored after the endpoint: a refused endpoint leaves no secret behind
            generated = generate_secret()
            where = store_secret(arguments.name, generated)
        _print_endpoint(endpoint, arguments.json)
        if generated is not None:
            print(f"signing secret (give it to the receiver; kept in {where}, mode 0600):\n{generated}",
                  file=sys.stderr if arguments.json else sys.stdout)
        return ExitCode.OK

    return _on_webhooks("opgraph webhook add", arguments, add)


def _list(arguments: argparse.Namespace) -> int:
    def listing(webhooks: Any) -> int:
        endpoints = webhooks.list()
        if arguments.json:
            print(json.dumps({"webhooks": [endpoint.as_json() for endpoint in endpoints]}, indent=2))
            return ExitCode.OK
        rows = [("NAME", "URL", "EVENTS", "STATE")]
        rows += [(e.name, e.url, ",".join(e.event_types), "enabled" if e.enabled else "disabled") for e in endpoints]
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        for endpoint in endpoints:
            if not endpoint.enabled:
                print(f"{endpoint.name}: {endpoint.disabled_reason}")
        return ExitCode.OK

    return _on_webhooks("opgraph webhook list", arguments, listing)


def _show(arguments: argparse.Namespace) -> int:
    def show(webhooks: Any) -> int:
        _print_endpoint(webhooks.get(arguments.name), arguments.json)
        return ExitCode.OK

    return _on_webhooks("opgraph webhook show", arguments, show)


def _enable(arguments: argparse.Namespace) -> int:
    def enable(webhooks: Any) -> int:
        _print_endpoint(webhooks.enable(arguments.name), arguments.json)
        return ExitCode.OK

    return _on_webhooks("opgraph webhook enable", arguments, enable)


def _print_deliveries(name: str, deliveries: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"name": name, "deliveries": deliveries}, indent=2))
        return
    for delivery in deliveries:
        retry = f", next attempt {_when(delivery['next_attempt_at'])}" if delivery["status"] == "pending" else ""
        print(f"{delivery['event_id']}  {delivery['event_type']}  {delivery['subject_id']}  {delivery['status']} "
              f"after {delivery['attempts']} attempt(s){retry}")
        for attempt in delivery["attempt_log"]:
            code = attempt["status_code"] if attempt["status_code"] is not None else "-"
            print(f"    #{attempt['attempt']} {_when(attempt['at'])}  {attempt['outcome']:<9} HTTP {code}  "
                  f"{attempt['latency'] * 1000:.0f} ms" + (f"  {attempt['error']}" if attempt["error"] else ""))
    if not deliveries:
        print(f"no deliveries to {name} yet")


def _deliveries(arguments: argparse.Namespace) -> int:
    def deliveries(webhooks: Any) -> int:
        _print_deliveries(arguments.name, webhooks.deliveries(arguments.name, limit=arguments.limit), arguments.json)
        return ExitCode.OK

    return _on_webhooks("opgraph webhook deliveries", arguments, deliveries)


def _relay_settings(arguments: argparse.Namespace, allow: Any) -> Any:
    import dataclasses

    from ..control.relay import RelaySettings

    settings = RelaySettings.from_environment() or RelaySettings()
    changes: dict[str, Any] = {"allow": allow}
    if getattr(arguments, "timeout", None) is not None:
        changes["timeout"] = arguments.timeout
    return dataclasses.replace(settings, **changes)


def _test(arguments: argparse.Namespace) -> int:
    def test(webhooks: Any) -> int:
        event_id = webhooks.test(arguments.name)
        print(f"queued {event_id} (webhook.test) for {arguments.name}")
        if not arguments.send:
            print("the relay of `opgraph serve` (or `opgraph webhook relay`) sends it; "
                  f"`opgraph webhook deliveries {arguments.name}` shows how it went")
            return ExitCode.OK
        from ..control.relay import WebhookRelay

        relay = WebhookRelay(webhooks.db, _relay_settings(arguments, webhooks.allow))
        asyncio.run(relay.run_once())
        (delivery,) = [row for row in webhooks.deliveries(arguments.name, limit=50) if row["event_id"] == event_id]
        _print_deliveries(arguments.name, [delivery], arguments.json)
        return ExitCode.OK if delivery["status"] == "delivered" else ExitCode.FAILED

    return _on_webhooks("opgraph webhook test", arguments, test)


def _relay(arguments: argparse.Namespace) -> int:
    def relay(webhooks: Any) -> int:
        from ..control.relay import WebhookRelay

        settings = _relay_settings(arguments, webhooks.allow)
        delivering = WebhookRelay(webhooks.db, settings)
        if arguments.once:
            done = asyncio.run(delivering.run_once())
            print(json.dumps({"fanned_out": done.fanned_out, "attempted": done.attempted, "outcomes": done.outcomes,
                              "disabled": done.disabled}))
            return ExitCode.OK

        async def forever() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for number in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(number, stop.set)
            print(f"relaying webhooks from {webhooks.db.path} (Ctrl-C to stop)", flush=True)
            await delivering.run(stop, on_error=lambda exc: print(f"opgraph webhook relay: {exc}; trying again",
                                                                  file=sys.stderr))

        asyncio.run(forever())
        print(f"stopped after {delivering.passes} passes: {json.dumps(delivering.totals)}")
        return ExitCode.OK

    return _on_webhooks("opgraph webhook relay", arguments, relay)


def add_webhook_parser(subcommands: Any) -> None:
    actions = command_group(
        subcommands, "webhook", "signed webhooks of run events (Standard Webhooks), delivered from the outbox",
        description="Every run transition writes an event to the store's outbox in the same transaction; the "
                    "relay of `opgraph serve` (or `opgraph webhook relay`) signs each one (webhook-id, "
                    "webhook-timestamp, webhook-signature) and sends it to the endpoints subscribed to it, "
                    "retrying on a schedule (at once, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h). An endpoint "
                    "that keeps failing is disabled, with its reason. Targets must resolve to public addresses "
                    "unless OPGRAPH_WEBHOOK_ALLOWED_NETWORKS (or --allow-network) allows more.")
    add = subcommand(actions, "add", "add an endpoint that receives run events", codes=_CODES,
                     description="Add an endpoint. Its URL must be http(s) and resolve inside the allow-list. "
                                 "The signing secret is never stored in the database: --secret-ref names it; "
                                 "without one, a secret is generated, kept in $OPGRAPH_HOME/webhook-secrets "
                                 "(mode 0600) under the endpoint's name, and printed once.")
    add.add_argument("name", metavar="NAME")
    add.add_argument("url", metavar="URL")
    add.add_argument("--secret-ref", default=None, metavar="REF",
                     help="where the whsec_ secret lives: env:VARIABLE, file:PATH (mode 0600), or a NAME in "
                          "$OPGRAPH_HOME/webhook-secrets (default: generate one under the endpoint's name)")
    add.add_argument("--event", action="append", default=None, metavar="TYPE",
                     help="an event type or pattern to send: run.completed, run.failed, run.*, * (repeat it; "
                          "default run.*)")
    add.add_argument("--description", default=None)
    add.add_argument("--allow-network", action="append", default=None, metavar="NETWORK", help=_ALLOW_HELP)
    add_options(add, STORE, JSON)
    add.set_defaults(handler=_add)

    listing = subcommand(actions, "list", "list the endpoints, and why any is disabled", codes=_CODES)
    add_options(listing, STORE, JSON)
    listing.set_defaults(handler=_list)

    for name, help_text, handler in (("show", "show one endpoint and its deliveries by status", _show),
                                     ("enable", "enable a disabled endpoint again; its pending deliveries go on",
                                      _enable)):
        command = subcommand(actions, name, help_text, codes=_CODES)
        command.add_argument("name", metavar="NAME")
        add_options(command, STORE, JSON)
        command.set_defaults(handler=handler)

    test = subcommand(actions, "test", "queue a signed webhook.test event for one endpoint", codes=_CODES,
                      description="Queue a webhook.test event for this endpoint alone. The running relay sends "
                                  "it; --send sends it now from this process and prints the attempt (exit 1 "
                                  "if it was not delivered).")
    test.add_argument("name", metavar="NAME")
    test.add_argument("--send", action="store_true", help="send it now, from this process, and print how it went")
    test.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                      help="seconds the receiver has to answer (OPGRAPH_WEBHOOK_TIMEOUT, else 10)")
    test.add_argument("--allow-network", action="append", default=None, metavar="NETWORK", help=_ALLOW_HELP)
    add_options(test, STORE, JSON)
    test.set_defaults(handler=_test)

    deliveries = subcommand(actions, "deliveries", "show an endpoint's newest deliveries with every attempt",
                            codes=_CODES)
    deliveries.add_argument("name", metavar="NAME")
    deliveries.add_argument("--limit", type=positive_int, default=20, metavar="N", help="at most N deliveries (20)")
    add_options(deliveries, STORE, JSON)
    deliveries.set_defaults(handler=_deliveries)

    relay = subcommand(actions, "relay", "deliver the outbox until Ctrl-C (what `opgraph serve` also runs)",
                       codes=_CODES,
                       description="Deliver the store's outbox: fan each event out to its endpoints, send what is "
                                   "due, record every attempt. Several relays may share a store. --once makes one "
                                   "pass and prints what it did.")
    relay.add_argument("--once", action="store_true", help="one pass, then exit")
    relay.add_argument("--timeout", type=positive_float, default=None, metavar="SECONDS",
                       help="seconds a receiver has to answer (OPGRAPH_WEBHOOK_TIMEOUT, else 10)")
    relay.add_argument("--allow-network", action="append", default=None, metavar="NETWORK", help=_ALLOW_HELP)
    add_options(relay, STORE)
    relay.set_defaults(handler=_relay)
