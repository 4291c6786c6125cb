"""Human-friendly sizes and durations: parsing for the config file and CLI, formatting for status.

Size suffixes follow util-linux (``zramctl --size``, ``swapon``, ``losetup``: its
``strtosize``): ``K``, ``M``, ``G``, ... alone and ``KiB``, ``MiB``, ``GiB``, ... are powers of
1024; ``KB``, ``MB``, ``GB``, ... are powers of 1000. So "8G" == "8GiB" == 8 * 2**30 but
"8GB" == 8 * 10**9, as ``zramctl --size 8GB`` takes it. The letter and the "b" may be in
either case ("8gib", "8kb"). Before this, "KB"/"MB"/"GB" meant 1024 too; every other
spelling kept its meaning. Sizes print binary ("1.5G" = 1.5 GiB), like ``free -h``.
"""

from __future__ import annotations

import math
import operator
import re
from fractions import Fraction

# suffix (lower case) -> bytes. "" and "b" are plain bytes.
_SIZE_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtpe", start=1):
    _SIZE_UNITS.update(dict.fromkeys((_letter, _letter + "ib"), 1024**_power))
    _SIZE_UNITS[_letter + "b"] = 1000**_power  # util-linux: "KB" is 1000, "K" and "KiB" 1024

# suffix (lower case) -> seconds; Fractions keep "500ms" exact until the final float().
_DURATION_UNITS: dict[str, Fraction] = {
    "": Fraction(1),
    "us": Fraction(1, 1_000_000),
    "ms": Fraction(1, 1000),
    "s": Fraction(1),
    "m": Fraction(60),
    "min": Fraction(60),
    "h": Fraction(3600),
    "d": Fraction(86400),
}

# ASCII digits only (re.ASCII): \d would also accept e.g. Arabic-Indic digits.
_QUANTITY = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)

_SIZE_HINT = ("expected bytes or a number with a unit: K, M, G, T, P or KiB, MiB, ... (powers of "
              "1024), KB, MB, GB, ... (powers of 1000), e.g. '8G', '512MiB', '1.5G'")
_DURATION_HINT = "expected seconds or a number with a unit ms, s, m, h, e.g. '30s', '500ms', '2m'"


def _parse_quantity(value: object, units: dict[str, Fraction | int], what: str, hint: str) -> Fraction:
    """Parse a non-negative number (int, float or "<number><unit>" string) into base units."""
    # bool is an int subclass; `defrag: true` landing in a size field must not read as 1 byte.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"invalid {what} {value!r} ({hint})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"invalid {what} {value!r}: must be a finite number")
    if isinstance(value, (int, float)):
        amount = Fraction(value)
    else:
        match = _QUANTITY.fullmatch(value)
        if match is None:
            if value.strip().startswith("-"):
                raise ValueError(f"invalid {what} {value!r}: must not be negative")
            raise ValueError(f"invalid {what} {value!r} ({hint})")
        number, unit = match.groups()
        if unit.lower() not in units:
            raise ValueError(f"invalid {what} {value!r}: unknown unit {unit!r} ({hint})")
        amount = Fraction(number) * units[unit.lower()]
    if amount < 0:
        raise ValueError(f"invalid {what} {value!r}: must not be negative")
    return amount


def parse_size(value: int | float | str) -> int:
    """Return a size in bytes.

    Accepts a non-negative int (bytes), an integral float (YAML may produce ``4096.0``), or a
    string: a number (optionally with a fraction) and an optional case-insensitive unit,
    B, K/KiB/KB, M/MiB/MB, G/GiB/GB, T/TiB/TB, P/PiB/PB, E/EiB/EB. As in util-linux (see the
    module docstring): "8G" == "8GiB" == 8 * 2**30, "8GB" == 8 * 10**9. A fractional number
    of bytes is rounded down ("0.1K" == 102). Raises ValueError for negatives, NaN/inf, empty strings,
    unknown units, bools and other types.
    """
    amount = _parse_quantity(value, _SIZE_UNITS, "size", _SIZE_HINT)
    if isinstance(value, float) and amount.denominator != 1:
        raise ValueError(f"invalid size {value!r}: a plain number of bytes must be whole")
    return math.floor(amount)


def decimal_hint(value: object) -> str:
    """For an error about a size written with a decimal unit ("1MB"): the reminder that it
    means powers of 1000 now, and the binary spelling; "" for any other value."""
    if not isinstance(value, str):
        return ""
    match = _QUANTITY.fullmatch(value)
    if match is None or not re.fullmatch(r"[kmgtpe]b", match.group(2), re.IGNORECASE):
        return ""
    binary = f"{match.group(1)}{match.group(2)[0].upper()}"
    return (f" ({value.strip()!r} is {parse_size(value)} bytes: KB, MB, GB... are powers of "
            f"1000, as in util-linux; {binary!r} is {parse_size(binary)})")


def parse_duration(value: int | float | str) -> float:
    """Return a duration in seconds.

    Accepts a non-negative number (seconds) or a string like "30s", "500ms", "2m", "1h", "1.5s",
    "100" (plain = seconds); units us, ms, s, m/min, h, d, case-insensitive. Raises ValueError for
    negatives, NaN/inf, empty strings, unknown units, bools and other types.
    """
    return float(_parse_quantity(value, _DURATION_UNITS, "duration", _DURATION_HINT))


def format_bytes(n: int) -> str:
    """Format a byte count the way ``free -h`` / ``zramctl`` do: "0B", "512B", "4K", "1.5M", "10G".

    Binary units; one decimal below 10 (dropped when it is ".0"), none from 10 up.
    """
    if isinstance(n, bool):
        raise ValueError(f"invalid byte count {n!r}")
    n = operator.index(n)  # also accepts numpy integers from stats arrays
    if n < 0:
        raise ValueError(f"invalid byte count {n}: must not be negative")
    letters = "BKMGTPE"
    power = 0
    while power < len(letters) - 1 and n >= 1024 ** (power + 1):
        power += 1
    if power == 0:
        return f"{n}B"
    while True:
        scaled = n / 1024**power
        text = f"{scaled:.1f}" if scaled < 9.95 else f"{scaled:.0f}"
        # 1023.7K would print as "1024K"; free shows "1.0M" for that, so move up a unit.
        if float(text) >= 1024 and power < len(letters) - 1:
            power += 1
            continue
        return text.removesuffix(".0") + letters[power]
