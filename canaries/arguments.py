"""The value types of ``rtv``'s flags: argparse turns a bad value into a usage error (exit 2) naming it."""

from __future__ import annotations

import argparse

__all__ = ["fraction", "positive", "seconds"]


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, found {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, found {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, found {value}")
    return value
