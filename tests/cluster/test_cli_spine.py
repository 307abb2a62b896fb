"""The CLI's spine: one exit-code table in `opgraph --help`, shared options that read the same everywhere.

Walks the whole parser tree of `opgraph` and of the job entrypoint (no command runs): every
``--store``, ``--json``, ``--namespace`` is the one declared in ``command_line``, and every
subcommand's help ends with exit codes drawn from ``ExitCode``.
"""

from __future__ import annotations

import argparse
import re

import pytest

from opgraph.cluster.cli import main
from opgraph.cluster.cli.commands import _build_parser
from opgraph.cluster.command_line import (
    CLUSTER_ADDRESS,
    JSON,
    NAMESPACE,
    RAY_ADDRESS,
    STORE,
    TOKEN,
    ExitCode,
    add_options,
    exit_codes_epilog,
)
from opgraph.cluster.jobs import build_parser as build_job_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "opgraph") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _parsers(child, f"{path} {name}")
    return found


ALL_PARSERS = _parsers(_build_parser()) + _parsers(build_job_parser(), "opgraph.cluster.job")


def test_opgraph_help_shows_the_one_exit_code_table(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    table = text[text.index("exit status (every command"):]
    for code in ExitCode:
        assert re.search(rf"^\s+{code.value}\s+{code.name}\s", table, re.MULTILINE), code
    assert " ".join(ExitCode.RUNTIME.meaning.split()) in " ".join(table.split())


@pytest.mark.parametrize("option", [STORE, JSON, NAMESPACE], ids=lambda option: option.flags[0])
def test_a_shared_option_reads_the_same_in_every_command(option):
    seen = [(path, action) for path, parser in ALL_PARSERS for action in parser._actions
            if option.flags[0] in action.option_strings]
    assert len(seen) >= 3, f"{option.flags[0]} is shared by fewer commands than expected: {[p for p, _ in seen]}"
    for path, action in seen:
        assert action.help == option.help, path
        assert action.default == option.settings.get("default", False), path


def test_every_ray_address_is_one_of_the_two_declared_meanings():
    meanings = {RAY_ADDRESS.help, CLUSTER_ADDRESS.help}
    addresses = [(path, action.help) for path, parser in ALL_PARSERS for action in parser._actions
                 if "--address" in action.option_strings and not path.startswith("opgraph job submit")]
    assert addresses and all(help_text in meanings for _, help_text in addresses), addresses


def test_each_subcommand_names_its_exit_codes_from_the_table():
    listed = 0
    for path, parser in ALL_PARSERS:
        if not parser.epilog or "Exit status:" not in parser.epilog:
            continue
        listed += 1
        named = [code for code in ExitCode if f"{code.value} {code.meaning}" in parser.epilog]
        assert len(named) >= 1 and parser.epilog.startswith(exit_codes_epilog(*named)), path
    assert listed >= 15


def test_the_token_option_reads_opgraph_token(monkeypatch):
    monkeypatch.setenv("OPGRAPH_TOKEN", "from-the-environment")
    parser = argparse.ArgumentParser()
    add_options(parser, TOKEN)
    assert parser.parse_args([]).token == "from-the-environment"
    assert parser.parse_args(["--token", "given"]).token == "given"
    monkeypatch.delenv("OPGRAPH_TOKEN")
    parser = argparse.ArgumentParser()
    add_options(parser, TOKEN)
    assert parser.parse_args([]).token is None
