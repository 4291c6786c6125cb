import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentzip_blk.config.quantities import format_bytes, parse_duration, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    "value, expected",
    [
        (0, 0),
        (100, 100),
        ("100", 100),
        ("0", 0),
        ("512B", 512),
        ("4K", 4 * KiB),
        ("4k", 4 * KiB),
        ("4KB", 4000),  # util-linux: KB, MB, GB are powers of 1000
        ("4kb", 4000),
        ("4KiB", 4 * KiB),
        ("4kib", 4 * KiB),
        ("512MiB", 512 * MiB),
        ("512M", 512 * MiB),
        ("8GB", 8 * 10**9),
        ("8gB", 8 * 10**9),
        ("1MB", 10**6),
        ("8G", 8 * GiB),
        ("8gib", 8 * GiB),
        ("1.5G", 3 * GiB // 2),
        ("1T", TiB),
        ("2TB", 2 * 10**12),
        ("2TiB", 2 * TiB),
        ("1EiB", 1 << 60),
        ("1EB", 10**18),
        ("1P", 1 << 50),
        (" 8 GB ", 8 * 10**9),
        (" 8 G ", 8 * GiB),
        (".5K", 512),
        ("1.", 1),
        ("0.1K", 102),  # fractional bytes round down
        (4096.0, 4096),
    ],
)
def test_parse_size_valid(value, expected):
    result = parse_size(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value",
    [-1, "-1", "-4K", " -1G", -1.5, "", "   ", "abc", "8XB", "GB", "K4", "1.2.3", "4 K B", "1,5G",
     "8iB", "8KiBB", "8Ki", "8KBi",
     "nan", "inf", float("nan"), float("inf"), 1.5, True, False, None, [4096], {"a": 1}, "٣K"],
)
def test_parse_size_invalid(value):
    with pytest.raises(ValueError):
        parse_size(value)


def test_parse_size_error_names_value():
    with pytest.raises(ValueError, match="'8XB'"):
        parse_size("8XB")
    with pytest.raises(ValueError, match="negative"):
        parse_size("-4K")


@given(st.integers(min_value=0, max_value=1 << 62))
def test_parse_size_plain_numbers(n):
    assert parse_size(n) == n
    assert parse_size(str(n)) == n


@given(
    st.integers(min_value=0, max_value=1 << 20),
    st.sampled_from([("k", 1), ("m", 2), ("g", 3), ("t", 4)]),
    st.sampled_from(["", "b", "ib"]),
    st.booleans(),
)
def test_parse_size_units_any_case(n, unit, suffix, upper):
    letter, power = unit
    text = f"{n}{letter}{suffix}"
    factor = 1000**power if suffix == "b" else 1024**power  # util-linux: KB = 1000
    assert parse_size(text.upper() if upper else text) == n * factor


@pytest.mark.parametrize(
    "value, expected",
    [
        ("30s", 30.0),
        ("500ms", 0.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("100", 100.0),
        ("1.5s", 1.5),
        ("250us", 0.00025),
        ("1d", 86400.0),
        (" 2 min ", 120.0),
        ("0", 0.0),
        (5, 5.0),
        (0.25, 0.25),
    ],
)
def test_parse_duration_valid(value, expected):
    result = parse_duration(value)
    assert result == pytest.approx(expected)
    assert type(result) is float


@pytest.mark.parametrize(
    "value", [-1, -0.5, "-1s", "", "abc", "5x", "s", "1.2.3s", "nan", float("nan"), float("inf"), True, None, [1]]
)
def test_parse_duration_invalid(value):
    with pytest.raises(ValueError):
        parse_duration(value)


@given(st.integers(min_value=0, max_value=10**9))
def test_parse_duration_ms(n):
    assert parse_duration(f"{n}ms") == pytest.approx(n / 1000)
    assert parse_duration(n) == n


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, "0B"),
        (1, "1B"),
        (512, "512B"),
        (1023, "1023B"),
        (1024, "1K"),
        (4096, "4K"),
        (1536, "1.5K"),
        (3 * MiB // 2, "1.5M"),
        (int(2.3 * GiB), "2.3G"),
        (10 * GiB, "10G"),
        (int(10.4 * KiB), "10K"),
        (int(9.96 * KiB), "10K"),
        (int(9.94 * KiB), "9.9K"),
        (1023 * KiB + 1000, "1M"),  # 1023.98K rounds up into the next unit, not "1024K"
        (GiB - 1, "1G"),
        (5 * TiB, "5T"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize("n", [-1, True, 1.5, "10"])
def test_format_bytes_invalid(n):
    with pytest.raises((ValueError, TypeError)):
        format_bytes(n)


def test_format_bytes_numpy_int():
    np = pytest.importorskip("numpy")
    assert format_bytes(np.int64(4096)) == "4K"


@given(st.integers(min_value=0, max_value=1 << 62))
def test_format_bytes_round_trips_within_rounding(n):
    text = format_bytes(n)
    # two significant digits below 10 and integers above: at most 5% off, and always parseable
    assert math.isclose(parse_size(text), n, rel_tol=0.05, abs_tol=1)
    number = text[:-1]
    assert not number.endswith(".0")
    assert float(number) < 1024
