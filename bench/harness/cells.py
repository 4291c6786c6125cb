"""Table cells of the BENCHMARKS.md sections: a figure, or "-" when it was not measured, and
the arithmetic that tolerates missing figures (None, or a field an older JSON lacks)."""

from __future__ import annotations

import statistics

MiB = 1 << 20


def mib(n) -> str:
    """Bytes as MiB with one decimal."""
    return "-" if n is None else f"{n / MiB:.1f}"


def x(v, suffix: str = "x") -> str:
    """A factor: 2.31x."""
    return "-" if v is None else f"{v:.2f}{suffix}"


def f(v, fmt: str = "{:.1f}") -> str:
    """Any figure, formatted with *fmt*."""
    return "-" if v is None else fmt.format(v)


def pct(v) -> str:
    """A fraction as a whole percentage."""
    return "-" if v is None else f"{v * 100:.0f}%"


def median(vals):
    """The median of the numbers among *vals* (None when there are none)."""
    vals = [v for v in vals if isinstance(v, (int, float))]
    return statistics.median(vals) if vals else None


def rel(a, b):
    """a / b, or None when either is missing or b is 0."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
