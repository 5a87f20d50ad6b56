"""argparse `type=` functions that check ranges, so a bad flag value is one usage line
(argparse prints "argument --x: invalid value: ...") and never a traceback later."""

from __future__ import annotations

import argparse
import re

# vLLM's human-readable integers: lowercase = powers of 1000, uppercase = powers of 1024
# ("4k" = 4000, "4K" = 4096); a decimal part only with lowercase ("25.6k" = 25600).
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}
_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([kmgKMG]?)")


def human_int(text: str) -> int:
    match = _HUMAN.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (e.g. 2048, 4k = 4000, "
                                         f"4K = 4096)")
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a decimal needs a lowercase suffix "
                                             f"(k = 1000); K = 1024 takes whole numbers only")
        value = int(number) * _BINARY[suffix]
    else:
        scaled = float(number) * _DECIMAL.get(suffix, 1)
        if scaled != int(scaled) or ("." in number and not suffix):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
        value = int(scaled)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def human_bytes(text: str) -> int:
    """A byte count, written as human_int's numbers ("8G" = 8 GiB, "8g" = 8e9)."""
    try:
        return human_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes (e.g. 8589934592, "
                                         f"8G = 8 GiB, 8g = 8e9)") from None


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}; got {value}")
        return value
    parse.__name__ = f"integer >= {lo}"     # argparse names the type in some messages
    return parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]; got {value}")
    return value
