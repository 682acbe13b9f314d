"""Payload sizes and link rates as the user writes them on the `dilocox linkcheck` command line."""

from __future__ import annotations

import re

from dilocox.net.link import parse_bandwidth

# The prefix is case-free ("kB" = "KB"), the unit must be "B": "Mb" would be megabits, which no payload is.
_SIZE = re.compile(r"^(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?:(?P<prefix>(?i:[kmg]i?))?B)?$")
_SIZE_FACTOR = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
_SIZE_EXAMPLES = "'256KB,1MB,4MB,16MB' (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024, a bare number is bytes)"


def parse_sizes(text: str) -> list[int]:
    """Parse `--sizes` ("256KB,1MB,4MB,16MB") into payload bytes per rank.

    Sizes are decimal like the rates in `dilocox.net.link` ("1MB" = 1,000,000 bytes), so "16MB at 100Mbps" is
    exactly 1.28 s. Each must be a positive multiple of 4 bytes because it is also an fp32 all-reduce payload.
    """
    sizes: list[int] = []
    for item in text.split(","):
        item = item.strip()
        match = _SIZE.match(item)
        if match is None:
            bits = " (a lowercase b is bits; payload sizes are bytes: write B)" if item.endswith("b") else ""
            raise ValueError(f"--sizes: {item!r} is not a size{bits}; use e.g. {_SIZE_EXAMPLES}")
        value = float(match["num"]) * _SIZE_FACTOR[(match["prefix"] or "").lower()]
        nbytes = round(value)
        if abs(value - nbytes) > 1e-6 * max(1.0, value):
            raise ValueError(f"--sizes: {item!r} is {value} bytes, not a whole number of bytes")
        if nbytes <= 0 or nbytes % 4:
            raise ValueError(
                f"--sizes: {item!r} = {nbytes} bytes must be a positive multiple of 4 (it is also an fp32 "
                f"all-reduce payload); use e.g. {_SIZE_EXAMPLES}"
            )
        sizes.append(nbytes)
    return sizes


def format_size(nbytes: int) -> str:
    """A payload size as the user would have typed it: "256 KB", "1 MiB", else "1,234 B"."""
    for unit, factor in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes:,} B"


def parse_bandwidths(text: str) -> list[tuple[str, float]]:
    """Parse `--bandwidth` ("100Mbps" or "100Mbps,1Gbps") into (label, bytes/s); "unlimited" makes no sense here."""
    links: list[tuple[str, float]] = []
    for item in text.split(","):
        label = item.strip()
        bytes_per_s = parse_bandwidth(label)
        if bytes_per_s is None:
            raise ValueError(
                f"--bandwidth {label!r}: a shaped link needs a finite rate, e.g. '100Mbps' or '1Gbps' "
                "(the unshaped veth is always measured as the baseline)"
            )
        links.append((label, bytes_per_s))
    return links
