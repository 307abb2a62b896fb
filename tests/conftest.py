"""Shared pytest setup for every test tree.
tests/ has no __init__.py: discovery is rootdir-based (see pyproject.toml).

The runtime is durable by default and keeps its run log and branches in ``OPGRAPH_DB``,
and its run-log key in ``OPGRAPH_HOME``; a test session gets a database and a home of its
own (removed when the session ends), so no test reads or writes the user's ``~/.opgraph``.
"""

import atexit
import os
import shutil
import tempfile

if "OPGRAPH_DB" not in os.environ or "OPGRAPH_HOME" not in os.environ:
    _folder = tempfile.mkdtemp(prefix="opgraph-tests-")
    os.environ.setdefault("OPGRAPH_DB", os.path.join(_folder, "opgraph.db"))
    os.environ.setdefault("OPGRAPH_HOME", os.path.join(_folder, "home"))
    atexit.register(shutil.rmtree, _folder, True)


def pytest_configure(config):
    """Nothing else to configure."""


# -- a real PostgreSQL server, for the store's tests on both backends ----------------------
import pytest  # noqa: E402 - after the environment above is set


@pytest.fixture(scope="session")
def postgres_server():
    """A PostgreSQL server of this test session (Debian's binaries, a temp dir, a free port),
    started on first use and stopped at the session's end. Without the binaries the tests that
    need it are skipped (failed under CI), naming the command that installs them."""
    from components import require
    from postgres_server import PostgresServer

    require("postgresql")
    server = PostgresServer.start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_target(request, tmp_path):
    """Where a test's store lives, once per backend: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "opgraph.db"
    return request.getfixturevalue("postgres_server").database()
