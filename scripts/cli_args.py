"""Argument types the benchmark scripts share: a count below its minimum is refused by argparse
(exit 2, naming the flag) before any run starts -- not found minutes later as an empty median or a
division by zero."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An argparse `type` for an int >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse
