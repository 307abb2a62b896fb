"""A real PostgreSQL server for the tests: Debian's ``postgresql`` binaries, started and stopped here.

``PostgresServer.start()`` makes a cluster with ``initdb`` in a temp dir and runs it with
``pg_ctl`` on a free 127.0.0.1 port (and a unix socket in the same dir). PostgreSQL
refuses to run as root, so under root (CI) the server runs as the ``postgres`` user, through
``runuser``. ``database()`` hands each test a fresh, empty schema of one test database, as
a URL whose ``search_path`` names it (a schema takes milliseconds; ``CREATE DATABASE``
took 0.2 to 2.5 s here); ``stop()`` stops the server (``pg_ctl stop -m immediate``) and
removes the folder.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field

from components import COMPONENTS

from opgraph.cluster.processes import accepts_connections, free_port, run_command, wait_until

__all__ = ["PostgresServer", "postgres_binaries"]

START_DEADLINE = 30.0


def postgres_binaries() -> str | None:
    """The folder holding initdb, pg_ctl and postgres (the ``postgresql`` component), or None."""
    return COMPONENTS["postgresql"].locate()


@dataclass
class PostgresServer:
    folder: str
    port: int
    binaries: str
    user: str | None  # the unprivileged user the server runs as, when we are root
    names: set[str] = field(default_factory=set)

    @property
    def data(self) -> str:
        return os.path.join(self.folder, "data")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @classmethod
    def start(cls, *, durable: bool = False) -> PostgresServer:
        """``durable=False`` (the tests) turns fsync off; ``True`` keeps PostgreSQL's defaults (benchmarks)."""
        binaries = postgres_binaries()
        if binaries is None:
            raise RuntimeError("PostgreSQL's server binaries are missing: "
                               f"{COMPONENTS['postgresql'].fetch_command}")
        user = "postgres" if os.geteuid() == 0 else None
        folder = tempfile.mkdtemp(prefix="opgraph-pg-", dir="/tmp")
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(folder, entry.pw_uid, entry.pw_gid)
        server = cls(folder, free_port(), binaries, user)
        try:
            server._run("initdb", "-D", server.data, "-U", "postgres", "--auth=trust", "--no-sync",
                        "-E", "UTF8", "--locale=C")
            # Durability is the server's business, not these tests': fsync off makes it quick.
            options = (f"-c listen_addresses=127.0.0.1 -c port={server.port} -c unix_socket_directories={folder} "
                       "-c max_connections=200")
            if not durable:
                options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            server._run("pg_ctl", "-D", server.data, "-l", os.path.join(folder, "server.log"), "-o", options,
                        "-w", "-t", str(int(START_DEADLINE)), "start")
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, program: str, *arguments: str) -> None:
        command = [os.path.join(self.binaries, program), *arguments]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        finished = run_command(command, timeout=120, cwd=self.folder)
        if finished.returncode != 0:
            raise RuntimeError(f"{program} failed ({finished.returncode}): {finished.stdout}\n{finished.stderr}")

    def database(self) -> str:
        """The URL of a new, empty schema in the test database: opgraph sees an empty database."""
        import psycopg

        if not self.names:
            with psycopg.connect(self.url(), autocommit=True) as connection:
                connection.execute("CREATE DATABASE opgraph_tests")
        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url("opgraph_tests"), autocommit=True) as connection:
            connection.execute(f"CREATE SCHEMA {name}")
        self.names.add(name)
        return self.url("opgraph_tests") + f"?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            try:
                self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
            except RuntimeError:
                pass  # the folder goes below anyway; a server that did not stop is reported by its port
        with contextlib.suppress(TimeoutError):  # still listening after 10 s: reported by its port
            wait_until(lambda: not accepts_connections(self.port, timeout=0.5), timeout=10,
                       what="PostgreSQL's port closing", interval=0.1)
        shutil.rmtree(self.folder, ignore_errors=True)
