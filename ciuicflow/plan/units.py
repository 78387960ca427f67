"""Parameter counts, bandwidths and times from the command line's strings; and back, for tables."""
from __future__ import annotations

import re

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}


def parse_count(value) -> float:
    """Parameters: 7e9, "7B", "67b", "25M", "350k"."""
    if isinstance(value, (int, float)):
        count = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a parameter count from {value!r}: use e.g. 7B, 67B, 25M, 7e9")
        count = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    if not count >= 1:
        raise ValueError(f"parameter count must be at least 1, got {value!r}")
    return count


def parse_bandwidth(value) -> float:
    """Bytes/s from "600GB/s", "200Gbit/s", "200Gbit", "100gbps", "1.5e9" (a plain number is bytes/s).

    Units with "bit"/"bps" or a lower-case "b" (Gb, Mb) are bits; "B"/"byte" are bytes."""
    if isinstance(value, (int, float)):
        rate = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)"
                             r"(bits?|bps|b|B|bytes?|Bps)?(/s|ps)?\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a bandwidth from {value!r}: use e.g. 600GB/s, 200Gbit/s, 1gbit")
        number, prefix, binary, unit, _ = match.groups()
        scale = (1024 ** " kmgtp".index(prefix.lower())) if binary else _SI[prefix.lower()]
        bits = unit is not None and (unit.startswith("bit") or unit in ("bps", "b"))
        rate = float(number) * scale / (8 if bits else 1)
    if not rate > 0:
        raise ValueError(f"bandwidth must be positive, got {value!r}")
    return rate


def parse_seconds(value) -> float:
    """Seconds from "5us", "5µs", "1.5ms", "2ns", "0.3s", "3e-6" (a plain number is seconds)."""
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*", str(value))
        if match is None:
            raise ValueError(f"cannot parse a time from {value!r}: use e.g. 5us, 1.5ms, 0.3s")
        seconds = float(match.group(1)) * {None: 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6,
                                             "ns": 1e-9}[match.group(2)]
    if seconds < 0:
        raise ValueError(f"time must not be negative, got {value!r}")
    return seconds


def format_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"

