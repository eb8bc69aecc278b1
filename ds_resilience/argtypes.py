"""``argparse`` value types shared by the command line and the Megatron argument hooks: a bad value
is an ``argparse`` error at parse time, naming what is allowed. Pure Python."""

from __future__ import annotations

import argparse
from typing import Callable

from .costs import parse_size

__all__ = ["int_at_least", "memory_cap", "positive_int"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer type that refuses values below ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = int_at_least(1)


def memory_cap(flag: str = "--memory-cap") -> Callable[[str], float | str]:
    """A memory cap: a plain number (the cost model's unit) or a size with a unit, kept as written
    (bytes; e.g. ``24GiB``), checked now."""

    def parse(text: str) -> float | str:
        try:
            value, in_bytes = parse_size(text, what=flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text if in_bytes else value

    parse.__name__ = "memory cap"
    return parse
