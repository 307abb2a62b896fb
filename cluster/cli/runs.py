"""`opgraph runs list|prune`, `opgraph store vacuum`, and `opgraph serve`'s retention options.

Owns the command lines of retention: which runs the store keeps (lane runs, engine runs,
runs only the run log knows) and whether each can still be resumed; deleting old ones by
a policy (``--older-than``, ``--status``, ``--keep-last``), dry or not; giving a SQLite file's
space back; and the schedule `opgraph serve` prunes on. The selection and the deleting are
the run store's (``opgraph.cluster.store.retention``); this module parses and prints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ..command_line import JSON, STORE, ExitCode, add_options, duration_seconds, nonnegative_int, positive_int
from ..store import (
    RETENTION_STATUSES,
    PruneReport,
    RetentionPolicy,
    StoreDatabase,
    holds_run_log,
    prune_runs,
    store_exists,
    store_location,
    stored_runs,
    vacuum_store,
)
from .spine import command_group, refused, subcommand
from .store_migration import add_migrate_parser

__all__ = ["add_retention_options", "add_runs_parser", "add_store_parser", "retention_schedule"]

T = TypeVar("T")
_RESUMABLE_HELP = ("also delete runs that can still be resumed: orphaned (`opgraph run resume`), replayable "
                   "(`opgraph o flow --resume`), or not ended (a run still going loses its record)")


_CODES = (ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE)


def _on_store(prefix: str, store: str | None, work: Callable[[StoreDatabase], T]) -> T | ExitCode:
    """``work(store)`` on the store at ``--store``; else the exit code, said on stderr, when there is no
    store there (none is made) or it cannot be used."""
    from opgraph.kernel import OpGraphError

    path = store_location(store)
    if not store_exists(path):
        print(f"{prefix}: there is no run store at {path}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        with StoreDatabase(path) as opened:
            return work(opened)
    except OpGraphError as exc:
        return refused(prefix, exc)


def _replaying_lanes() -> frozenset[str]:
    from ..lanes import replaying_lanes  # lazy: loading the lanes loads the engines

    return replaying_lanes()


def _megabytes(count: int | None) -> str:
    return "?" if count is None else f"{count / 1e6:.2f} MB"


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp).isoformat(sep=" ", timespec="seconds")


# -- opgraph runs list ------------------------------------------------------------------------
def runs_list(arguments: argparse.Namespace) -> int:
    runs = _on_store("opgraph runs list", arguments.store, lambda store: stored_runs(
        store, replaying_lanes=_replaying_lanes(), run_log_here=holds_run_log(store.path)))
    if isinstance(runs, ExitCode):
        return runs
    now = datetime.datetime.now().timestamp()
    shown = [run for run in runs if (not arguments.status or run.status in arguments.status)
             and (arguments.older_than is None or now - run.at >= arguments.older_than)][:arguments.limit]
    if arguments.json:
        print(json.dumps({"runs": [run.to_dict() for run in shown], "total": len(runs)}, indent=2))
        return ExitCode.OK
    rows = [("RUN", "KIND", "LANE/ENGINE", "STATUS", "CREATED", "ENDED", "RESUMABLE")]
    rows += [(run.run_id, run.kind, run.label, run.status, _when(run.created_at), _when(run.ended_at),
              (run.resumable or "").split(":")[0] or "-") for run in shown]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    print(f"{len(shown)} of {len(runs)} stored runs shown")
    return ExitCode.OK


# -- opgraph runs prune -----------------------------------------------------------------------
def runs_prune(arguments: argparse.Namespace) -> int:
    policy = RetentionPolicy(older_than=arguments.older_than, keep_last=arguments.keep_last,
                             statuses=frozenset(arguments.status) if arguments.status else None,
                             include_resumable=arguments.include_resumable)
    if not policy.selective:
        print("opgraph runs prune: say which runs go: --older-than, --keep-last and/or --status "
              "(every ended run: --older-than 0s)", file=sys.stderr)
        return ExitCode.USAGE

    def prune(store: StoreDatabase) -> tuple[PruneReport, dict[str, Any] | None]:
        report = prune_runs(store, policy, dry_run=arguments.dry_run, replaying_lanes=_replaying_lanes(),
                            run_log_here=holds_run_log(store.path), batch_size=arguments.batch_size)
        return report, _vacuum(store) if arguments.vacuum and not arguments.dry_run else None

    done = _on_store("opgraph runs prune", arguments.store, prune)
    if isinstance(done, ExitCode):
        return done
    report, vacuumed = done
    _print_prune(report, arguments.json, vacuumed)
    return ExitCode.FAILED if arguments.vacuum and not arguments.dry_run and vacuumed is None else ExitCode.OK


def _vacuum(store: StoreDatabase) -> dict[str, Any] | None:
    """``vacuum_store``; None, said on stderr, when another process holds the database."""
    from ..store import WorkflowStoreError

    try:
        return vacuum_store(store)
    except WorkflowStoreError as exc:
        print(f"opgraph store vacuum: {exc}. VACUUM rebuilds the whole file and needs the database to itself: "
              "stop `opgraph serve` and any running runs, then try again", file=sys.stderr)
        return None


def _print_prune(report: PruneReport, as_json: bool, vacuumed: dict[str, Any] | None) -> None:
    if as_json:
        print(json.dumps({**report.to_dict(), "vacuum": vacuumed}, indent=2))
        return
    verb = "would delete" if report.dry_run else "deleted"
    print(f"{verb} {report.runs} of {report.matched} matching runs; kept {report.kept_recent} recent, "
          f"{report.kept_young} younger than --older-than, {report.kept_resumable} resumable"
          + (f", {report.changed} that changed meanwhile" if report.changed else "")
          + (" (stopped early)" if report.stopped else ""))
    width = max(len(table) for table in report.rows)
    print(f"  {'table'.ljust(width)}  rows")
    for table, count in report.rows.items():
        print(f"  {table.ljust(width)}  {count:>{len('rows')}}")
    print(f"  {'total'.ljust(width)}  {report.rows_total:>{len('rows')}}")
    before, after = report.before, report.after
    if report.dry_run:
        print(f"store: {_megabytes(before.bytes if before else None)}; nothing was deleted (dry run)")
    elif before is not None and after is not None:
        print(f"store: {_megabytes(before.bytes)} -> {_megabytes(after.bytes)} "
              f"({_megabytes(report.reclaimed_bytes)} given back)"
              + (f"; {_megabytes(after.free_bytes)} free inside the file" if after.free_bytes else ""))
        if after.incremental is False and after.free_bytes:
            print("  this file was made without incremental vacuum: its free pages are reused by new runs; "
                  "`opgraph store vacuum` (needs the database to itself) returns them and turns it on")
        if report.dialect == "postgresql":
            print("  PostgreSQL's autovacuum makes the deleted rows' space reusable; the tables do not shrink")
    if report.space_error:
        print(f"  giving space back failed (the rows are deleted; tried again next time): {report.space_error}")
    for run in report.resumable[:5]:
        print(f"  kept {run['run_id']} ({run['status']}): {run['resumable']}")
    if vacuumed is not None:
        _print_vacuum(vacuumed)


# -- opgraph store vacuum ---------------------------------------------------------------------
def store_vacuum(arguments: argparse.Namespace) -> int:
    vacuumed = _on_store("opgraph store vacuum", arguments.store, _vacuum)
    if isinstance(vacuumed, ExitCode):
        return vacuumed
    if vacuumed is None:
        return ExitCode.FAILED
    if arguments.json:
        print(json.dumps(vacuumed, indent=2))
    else:
        _print_vacuum(vacuumed)
    return ExitCode.OK


def _print_vacuum(vacuumed: dict[str, Any]) -> None:
    before, after = vacuumed["before"]["bytes"], vacuumed["after"]["bytes"]
    print(f"vacuum: {_megabytes(before)} -> {_megabytes(after)} ({_megabytes(vacuumed['reclaimed_bytes'])} given "
          "back)" + ("; incremental vacuum is on from now" if vacuumed["converted_to_incremental"] else ""))


# -- the parsers ------------------------------------------------------------------------------
def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--status", action="append", choices=RETENTION_STATUSES, default=None,
                        help="only runs with this status (repeat for several; default: any)")
    parser.add_argument("--older-than", type=duration_seconds, default=None, metavar="DURATION",
                        help="only runs that ended (or, not ended, began) at least this long ago: 30d, 12h, 90m")


def _action(actions: Any, name: str, help_text: str, description: str, handler: Callable[[argparse.Namespace], int],
            add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """One action of `opgraph runs` or `opgraph store`: its own arguments, then --store and --json."""
    parser = subcommand(actions, name, help_text, codes=_CODES, description=description)
    if add_arguments is not None:
        add_arguments(parser)
    add_options(parser, STORE, JSON)
    parser.set_defaults(handler=handler)


def _add_list_arguments(listing: argparse.ArgumentParser) -> None:
    _add_selection(listing)
    listing.add_argument("--limit", type=positive_int, default=50, metavar="N", help="show at most N runs (50)")


def _add_prune_arguments(prune: argparse.ArgumentParser) -> None:
    _add_selection(prune)
    prune.add_argument("--keep-last", type=nonnegative_int, default=None, metavar="N",
                       help="keep the N most recent runs of the selected statuses, whatever their age")
    prune.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
    prune.add_argument("--include-resumable", action="store_true", help=_RESUMABLE_HELP)
    prune.add_argument("--vacuum", action="store_true",
                       help="then rebuild a SQLite file with VACUUM (as `opgraph store vacuum`; it needs the "
                            "database to itself)")
    prune.add_argument("--batch-size", type=positive_int, default=100, metavar="N",
                       help="runs deleted per transaction, at most (100; fewer while batches are slow)")


def add_runs_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "runs", "the runs the store keeps: list them, prune old ones")
    _action(actions, "list", "list the runs the store keeps, newest first, and which can still be resumed",
            "Every run the database keeps: lane runs (the run store's records), engine runs, and "
            "runs only the runtime's run log knows (a Python Session.flow), with whether each can "
            "still be resumed, which `opgraph runs prune` never deletes unless told.",
            runs_list, _add_list_arguments)
    _action(actions, "prune", "delete old runs with their signals, run log and branches, in short batches",
            "Delete the runs a policy selects: of the runs with --status (any by default), the "
            "--keep-last most recent stay, and of the others those --older-than go. A run goes with "
            "its record, signals, node results, recorded branches, engine events, run log and the "
            "branches that were its alone (a branch another run still records stays), a batch of "
            "runs a short transaction, so a live server is never held up. A run that can still be "
            "resumed stays unless --include-resumable. SQLite then gives the freed pages back "
            "(incremental vacuum); PostgreSQL's autovacuum reclaims them.",
            runs_prune, _add_prune_arguments)


def add_store_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "store", "the run store's database")
    _action(actions, "vacuum", "rebuild a SQLite store with VACUUM, giving free space back (needs it to itself)",
            "SQLite: VACUUM rebuilds the file without its free pages and turns incremental vacuum on "
            "(a file made before opgraph did so can be converted no other way), so later prunes give "
            "their space back as they go. It needs the database to itself: stop `opgraph serve` and "
            "running runs first. PostgreSQL: a plain VACUUM (ANALYZE) of the store's tables.",
            store_vacuum)
    add_migrate_parser(actions)


# -- opgraph serve --retention-... ------------------------------------------------------------
def add_retention_options(parser: argparse.ArgumentParser) -> None:
    """`opgraph serve`'s automatic retention; off unless --retention-keep-last or --retention-older-than."""
    # argparse parses a string default with the option's type: the environment is checked as the flag is.
    parser.add_argument("--retention-keep-last", type=nonnegative_int, metavar="N",
                        default=os.environ.get("OPGRAPH_RETENTION_KEEP_LAST") or None,
                        help="prune on a schedule, keeping the N most recent runs (default: "
                             "OPGRAPH_RETENTION_KEEP_LAST; no automatic pruning unless this or the next is set)")
    parser.add_argument("--retention-older-than", type=duration_seconds, metavar="DURATION",
                        default=os.environ.get("OPGRAPH_RETENTION_OLDER_THAN") or None,
                        help="prune on a schedule the runs that ended this long ago, e.g. 30d "
                             "(default: OPGRAPH_RETENTION_OLDER_THAN)")
    parser.add_argument("--retention-interval", type=duration_seconds, metavar="DURATION",
                        default=os.environ.get("OPGRAPH_RETENTION_INTERVAL") or "1h",
                        help="how often the server prunes, from its start (default: OPGRAPH_RETENTION_INTERVAL, "
                             "else 1h). Resumable runs are never pruned automatically")


def retention_schedule(arguments: argparse.Namespace) -> Any:
    """The ``RetentionSchedule`` the serve options ask for, or None (automatic pruning off)."""
    if arguments.retention_keep_last is None and arguments.retention_older_than is None:
        return None
    from ..http.retention import RetentionSchedule

    return RetentionSchedule(RetentionPolicy(older_than=arguments.retention_older_than,
                                             keep_last=arguments.retention_keep_last),
                             interval=arguments.retention_interval)
