"""A test whose outside program is missing skips and names the command that fetches it; under CI it fails.

    pytest (subprocess) -> a test calling require("postgresql"|"prometheus"|"bare-python")
        with the lookups pointed at nothing (OPGRAPH_POSTGRES_BIN, OPGRAPH_PROMETHEUS, OPGRAPH_TEST_CACHE)
    without CI: skipped, the message holds `python tests/support/components.py fetch NAME`
    with OPGRAPH_REQUIRE_ALL=1 (or CI=1, which .ci/run's CI sets): failed, so CI can skip nothing

No Ray, no download: the child session only looks for the components.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from components import missing_fails

from opgraph.cluster.processes import run_command

REPOSITORY = Path(__file__).resolve().parents[2]
NAMES = ("postgresql", "prometheus", "chromium", "bare-python")
NEEDS_THEM = """
import pytest
from components import require

@pytest.mark.parametrize("name", {names!r})
def test_needs(name):
    require(name)
"""


def child_session(tmp_path: Path, **switches: str) -> tuple[int, str]:
    """pytest on a file of tests that each need one component, on a machine that has none of them."""
    test_file = tmp_path / "test_needs_components.py"
    test_file.write_text(NEEDS_THEM.format(names=NAMES))
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    environment = {name: value for name, value in os.environ.items() if name not in ("CI", "OPGRAPH_REQUIRE_ALL")}
    environment.update(OPGRAPH_POSTGRES_BIN=str(empty), OPGRAPH_PROMETHEUS=str(empty / "prometheus"),
                       OPGRAPH_CHROMIUM=str(empty / "chromium"), OPGRAPH_TEST_CACHE=str(empty), **switches)
    done = run_command([sys.executable, "-m", "pytest", "-rsf", "-p", "no:cacheprovider", "-c",
                        str(REPOSITORY / "pyproject.toml"), "--rootdir", str(REPOSITORY), str(test_file)],
                       env=environment, timeout=120, cwd=tmp_path)
    return done.returncode, done.stdout + done.stderr


def test_a_missing_component_skips_with_the_command_that_fetches_it(tmp_path):
    status, output = child_session(tmp_path)
    assert status == 0 and f"{len(NAMES)} skipped" in output, output
    for name in NAMES:
        assert f"fetch it with `python tests/support/components.py fetch {name}`" in output, output


def test_under_ci_a_missing_component_fails_the_test(tmp_path):
    status, output = child_session(tmp_path, OPGRAPH_REQUIRE_ALL="1")
    assert status == 1 and f"{len(NAMES)} failed" in output and "skipped" not in output, output
    assert "a missing component fails the test" in output, output


@pytest.mark.parametrize(("environment", "fails"), [
    ({}, False), ({"CI": "1"}, True), ({"CI": "true"}, True), ({"OPGRAPH_REQUIRE_ALL": "1"}, True),
    ({"CI": "0"}, False), ({"OPGRAPH_REQUIRE_ALL": "false"}, False)])
def test_ci_or_opgraph_require_all_is_what_makes_a_missing_component_a_failure(monkeypatch, environment, fails):
    for name in ("CI", "OPGRAPH_REQUIRE_ALL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert missing_fails() is fails
