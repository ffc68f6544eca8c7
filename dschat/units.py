"""Sizes and counts as people read them: the one byte formatter and the one count formatter of dschat's messages
(the planner's tables, the doctor's findings, a full disk's line)."""

from __future__ import annotations

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``4.0 KiB``, ``12.5 MiB``, ``2.00 GiB``, ``1.50 TiB`` (two decimals from a
    GiB up, where a plan's figures are compared; one below)."""
    size = abs(n)
    if size >= TiB:
        return f"{n / TiB:.2f} TiB"
    if size >= GiB:
        return f"{n / GiB:.2f} GiB"
    if size >= MiB:
        return f"{n / MiB:.1f} MiB"
    if size >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    """A count with a decimal suffix: ``950``, ``12.3K``, ``4.24M``, ``1.10B`` (parameters, rows, tokens)."""
    size = abs(n)
    if size >= 1e9:
        return f"{n / 1e9:.2f}B"
    if size >= 1e6:
        return f"{n / 1e6:.2f}M"
    if size >= 1e3:
        return f"{n / 1e3:.1f}K"
    return f"{n:.0f}"
