"""Quantities with units, as recipes write them ("64GiB", "48 GB/s", "480 TFLOP/s", "10us").

Every field that holds bytes, bytes per second, FLOP/s or seconds accepts either a plain number
(in bytes, bytes/s, FLOP/s, seconds) or a string with a unit. Parsing is strict: an unknown unit
or a negative value is an error, never a guess.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator

_PREFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"


def _number(value: object, what: str) -> float | None:
    if isinstance(value, bool):
        raise ValueError(f"expected {what}, got a boolean")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"expected a non-negative {what}, got {value}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected {what} as a number or a string with a unit, got {type(value).__name__}")
    return None


def _scaled(text: str, pattern: str, scale: dict[str, float], what: str, example: str) -> float:
    m = re.fullmatch(_NUMBER + pattern + r"\s*", text)
    if m is None or m.group(2) not in scale:
        raise ValueError(f"cannot read {text!r} as {what} (example: {example!r})")
    return float(m.group(1)) * scale[m.group(2)]


def parse_bytes(value: object) -> int:
    """'64GiB' -> 68719476736; '1.5 MB' -> 1500000; 4096 -> 4096."""
    n = _number(value, "a size in bytes")
    if n is None:
        scale = {p + "B": v for p, v in {**_PREFIX, **_BINARY}.items()}
        n = _scaled(value, r"([kKMGTPE]?i?B)", scale, "a size", "64GiB")
    if n != int(n):
        raise ValueError(f"a size in bytes must be a whole number, got {value!r}")
    return int(n)


def parse_bandwidth(value: object) -> float:
    """'48 GB/s' -> 4.8e10 bytes per second."""
    n = _number(value, "a bandwidth in bytes/s")
    if n is None:
        scale = {p + "B/s": v for p, v in {**_PREFIX, **_BINARY}.items()}
        scale |= {p + "b/s": v / 8 for p, v in _PREFIX.items()}  # network links are quoted in bits
        n = _scaled(value, r"([kKMGTPE]?i?[Bb]/s)", scale, "a bandwidth", "48 GB/s")
    return n


def parse_flops(value: object) -> float:
    """'480 TFLOP/s' -> 4.8e14 FLOP per second."""
    n = _number(value, "a FLOP/s rate")
    if n is None:
        scale = {p + "FLOP/s": v for p, v in _PREFIX.items()}
        n = _scaled(value, r"([kKMGTPE]?FLOP/s)", scale, "a FLOP/s rate", "480 TFLOP/s")
    return n


def parse_seconds(value: object) -> float:
    """'10us' -> 1e-05 seconds."""
    n = _number(value, "a duration in seconds")
    if n is None:
        n = _scaled(value, r"(s|ms|us|ns)", _TIME, "a duration", "10us")
    return n


Bytes = Annotated[int, BeforeValidator(parse_bytes)]
Bandwidth = Annotated[float, BeforeValidator(parse_bandwidth)]
Flops = Annotated[float, BeforeValidator(parse_flops)]
Seconds = Annotated[float, BeforeValidator(parse_seconds)]


def fmt_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s: float) -> str:
    """Human-readable duration: 0.0123 -> '12.30 ms'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.2f} {unit}"
    return f"{s / 1e-9:.0f} ns"
