"""Argument types of the benchmark scripts: a refused value exits with code 2 and one line that
names the option and what it takes."""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, with a refused value reported in one line (no usage block above it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def positive(text: str) -> int:
    value = whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seed(text: str) -> int:
    value = whole_number(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be a whole number from 0 to 2**63 - 1, got {value}")
    return value


def kernel_size(text: str) -> int:
    value = whole_number(text)
    if value < 128 or value % 128:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 128 (every block format's tile), got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value
