"""The spending options `opgraph engine run` and `opgraph map` share: a token bound, a dollar bound and the prices.

Owns the three arguments (--max-tokens, --max-cost-usd, --price) and how --price is read
(``model_price``); each command says in its own words what it bounds. It must not know a command.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from .command_line import model_price

__all__ = ["add_budget_options"]


def add_budget_options(parser: argparse.ArgumentParser, *, tokens_type: Callable[[str], int], tokens_help: str,
                       cost_help: str) -> None:
    """--max-tokens (read by ``tokens_type``), --max-cost-usd and --price, in that order, none by default."""
    parser.add_argument("--max-tokens", type=tokens_type, default=None, help=tokens_help)
    parser.add_argument("--max-cost-usd", type=float, default=None, help=cost_help)
    parser.add_argument("--price", action="append", type=model_price, metavar="MODEL=PROMPT,COMPLETION",
                        help="$ per million prompt and completion tokens for a provider/model (repeatable)")
