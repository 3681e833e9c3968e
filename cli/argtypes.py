"""argparse types shared by several commands: each turns one word into a checked value, or an
ArgumentTypeError that argparse reports as bad usage (exit 2)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

RANKS_ALL = "all"


def positive_number(text: str) -> float:
    """A finite number > 0: a threshold in percent (nan, inf, 0 or a negative one would disable the gate), or a
    link's peak bandwidth."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def existing_input(text: str) -> str:
    """An input path of a read command: a missing one is bad usage (exit 2), found before any work."""
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or directory")
    return text


def int_set(text: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def int_list(text: str) -> list[int]:
    return sorted(int_set(text))


def rank_choice(text: str) -> frozenset[int] | str:
    return RANKS_ALL if text.strip() == RANKS_ALL else int_set(text)


def time_range(text: str) -> tuple[float, float]:
    start, sep, end = text.partition(":")
    try:
        window = float(start), float(end)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END in seconds, got {text!r}") from None
    if not all(math.isfinite(v) for v in window) or window[0] >= window[1]:
        raise argparse.ArgumentTypeError(f"expected finite START < END in seconds, got {text!r}")
    return window
