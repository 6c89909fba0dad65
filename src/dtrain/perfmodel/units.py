"""Parse and print the quantities a cluster description is written in.

Rates are link rates in bits per second as ``tc`` spells them ("100mbit",
"25gbit", "1.5Gbit/s") or plain numbers of bits per second; sizes are bytes
("16MiB", "80GB", "4096"); times are seconds ("5us", "1.2ms", "0.3s", "2e-6").
Everything is returned in SI base units: bytes per second, bytes, seconds.
"""

from __future__ import annotations

import re

from dtrain.errors import ConfigError

__all__ = ["parse_rate", "parse_bytes", "parse_time", "format_rate", "format_bytes", "format_time"]

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BIN = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b)?(?:/s|ps)?\s*$", re.I)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?)?(b)?\s*$", re.I)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|ms|s)?\s*$", re.I)
_TIME_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def parse_rate(value: str | float | int) -> float:
    """A link rate in bits/s ("100mbit", "25gbit", "1e9") -> bytes per second.

    Raises:
        ConfigError: on an unreadable or non-positive rate.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        bits = float(value)
    else:
        m = _RATE.match(str(value))
        if not m or m.group(3) == "B":  # a capital B would mean bytes: ambiguous, refuse
            raise ConfigError(
                f"cannot read the rate {value!r}; write it in bits per second like tc: "
                "'100mbit', '1gbit', '25gbit' (or a number of bits/s)"
            )
        bits = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    if not bits > 0:
        raise ConfigError(f"a rate must be positive, got {value!r}")
    return bits / 8.0


def parse_bytes(value: str | float | int) -> float:
    """A size ("16MiB", "80GB", "4096") -> bytes (binary prefixes with 'i', SI without)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ConfigError(f"cannot read the size {value!r}; write it like '16MiB', '80GB' or a number of bytes")
        p = (m.group(2) or "").lower()
        n = float(m.group(1)) * (_BIN[p] if p.endswith("i") else _PREFIX[p])
    if n < 0:
        raise ConfigError(f"a size must be >= 0, got {value!r}")
    return n


def parse_time(value: str | float | int) -> float:
    """A duration ("5us", "1.2ms", "0.3s", "2e-6") -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        t = float(value)
    else:
        m = _TIME.match(str(value))
        if not m:
            raise ConfigError(f"cannot read the time {value!r}; write it like '5us', '1.2ms' or a number of seconds")
        t = float(m.group(1)) * _TIME_UNIT[m.group(2).lower() if m.group(2) else None]
    if t < 0:
        raise ConfigError(f"a time must be >= 0, got {value!r}")
    return t


def format_rate(bytes_per_s: float) -> str:
    """Bytes per second -> a tc-style bit rate string ("100mbit")."""
    bits = bytes_per_s * 8.0
    for unit, f in (("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= f:
            return f"{bits / f:.4g}{unit}"
    return f"{bits:.4g}bit"


def format_bytes(n: float) -> str:
    for unit, f in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= f:
            return f"{n / f:.3g} {unit}"
    return f"{n:.0f} B"


def format_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
