"""How the server's flags write their values: token counts and sizes as vLLM writes them, and numbers in
a range; a value out of form or range is refused by argparse, naming the value and the limit."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from fractions import Fraction

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)", re.I)
_COUNT = re.compile(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)")


def parse_size(text: str) -> int:
    """Bytes from `268435456`, `256MiB`, `1.5GiB` or `512M` (powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 256MiB")
    return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))


def parse_count(text: str) -> int:
    """A token count as vLLM writes it: `4096`, `64k` (x1000), `64K` (x1024), `1m`, `1M`, ... `1t`, `1T`;
    a fraction only where it makes a whole count with a decimal unit (`1.5k`), as vLLM reads them."""
    m = _COUNT.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count such as 4096 or 64k")
    number, unit = Fraction(m[1]), m[2]
    if unit.isupper() and number.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary unit ({unit}) takes a whole number")
    count = number * ((1000 if unit.islower() else 1024) ** ("kmgt".index(unit.lower()) + 1) if unit else 1)
    if count.denominator != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(count)


def parse_count_or_auto(text: str) -> int | None:
    """A token count, or None for vLLM's `auto` (also written -1): the engine settles it at start-up."""
    return None if text.strip() in ("auto", "-1") else parse_count(text)


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """A flag's type: an integer from ``low`` (to ``high``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            limit = f"in [{low}, {high}]" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} must be {limit}")
        return value

    return parse


def seconds(text: str) -> float:
    """A flag's type: a finite, non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{value} seconds must be finite and at least 0")
    return value


port = int_in(0, 65535)  # 0: any free port, as the operating system picks
