"""Human units for display: bytes and seconds inside, KiB..GiB, ms and G(FLOP) on screen.

Pipeline position: shared by every stage that writes text for people (the
planner's reasons, the CLI tables, the TensorBoard summaries). House style:
values are bytes and seconds everywhere else; only these functions convert.
"""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Binary units: 1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_count(n: float) -> str:
    """SI units for parameter and FLOP counts: 7.76e9 -> '7.76 G'."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)}"


def fmt_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"
