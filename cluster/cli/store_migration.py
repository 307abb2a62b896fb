"""``opgraph store migrate``: bring a database to this opgraph's schema, signing an older run log on request.

Owns the one command that may read an older opgraph's unsigned run-log rows: only with
``--trust-existing``, the operator's word that nobody else could have written them. It
prints what it signed; a SQLite file is then rewritten (``VACUUM``) so that no page keeps
the bytes the rows held before (an older header held provider keys).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..command_line import STORE, ExitCode, add_options
from .spine import refused, subcommand

__all__ = ["add_migrate_parser"]


def add_migrate_parser(actions: Any) -> None:
    """`opgraph store migrate`, an action of the `store` group (cluster/cli/runs.py)."""
    migrate = subcommand(
        actions, "migrate", "bring the database to this opgraph's schema; --trust-existing signs an older run log",
        codes=(ExitCode.OK, ExitCode.USAGE),
        description="Migrate the run store and the runtime's tables of STORE. A run log written before runtime "
                    "schema 4 kept pickles unsigned, which this opgraph refuses to read: --trust-existing reads "
                    "them once, on your word that nobody but you could have written the database (it never came "
                    "from a backup, a shared server or another machine you do not trust), and writes them again "
                    "signed with this machine's run-log key, run headers without provider keys.")
    migrate.add_argument("--trust-existing", action="store_true",
                         help="sign the rows an older opgraph wrote (read unsigned, once)")
    add_options(migrate, STORE)
    migrate.set_defaults(handler=_migrate)


def _migrate(arguments: argparse.Namespace) -> int:
    from opgraph.actors.persistence import Database
    from opgraph.actors.persistence.backends import describe, is_postgres
    from opgraph.kernel import OpGraphError

    from ..lanes import open_store
    from ..store import store_location

    target = store_location(arguments.store)
    try:
        open_store(target).close()  # the run store's own tables, migrated as any command would
        database = Database(target, trust_existing=arguments.trust_existing)
    except OpGraphError as exc:
        return refused("opgraph store migrate", exc, ExitCode.USAGE)
    try:
        if database.signed and not is_postgres(database.path):
            database.rewrite()  # the old rows' bytes leave the file's free pages too
    finally:
        database.close()
    print(json.dumps({"store": describe(str(target)), "signed": database.signed}, sort_keys=True))
    if not database.signed:
        print("opgraph store migrate: nothing needed signing", file=sys.stderr)
    return ExitCode.OK
