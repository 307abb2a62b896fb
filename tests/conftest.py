"""Shared pytest setup for every test tree.
tests/ has no __init__.py: discovery is rootdir-based (see pyproject.toml).

The runtime is durable by default and keeps its run log and branches in ``OPGRAPH_DB``;
a test session gets a database of its own (removed when the session ends), so no test
reads or writes the user's ``~/.opgraph``.
"""

import atexit
import os
import shutil
import tempfile

if "OPGRAPH_DB" not in os.environ:
    _folder = tempfile.mkdtemp(prefix="opgraph-tests-")
    os.environ["OPGRAPH_DB"] = os.path.join(_folder, "opgraph.db")
    atexit.register(shutil.rmtree, _folder, True)


def pytest_configure(config):
    """Nothing else to configure."""
