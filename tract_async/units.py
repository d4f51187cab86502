"""Byte sizes as people type and read them: ``parse_size('64M')``, ``fmt_bytes(3 << 29)``.

Its own module (and dependency-free) so that every command-line front end (``tract``, ``tract
demo``, the serving processes) can use it without importing another front end.
"""
from __future__ import annotations

import argparse

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

SIZE_HELP = "bytes, or a number with K, M, G or T (powers of 1024; e.g. 4096, 64M, 1.5G)"
"""What a ``--size``-like option accepts, for its help text."""


def parse_size(text: str) -> int:
    """'64M', '1G', '4096', '1.5G', '64MiB' -> bytes (units are powers of 1024).

    Raises argparse.ArgumentTypeError (the type argparse turns into a usage error)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[:-1] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 4096, 64M, 1G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    """Bytes for a human: '512 B', '8.0 MiB', '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
