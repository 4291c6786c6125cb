#!/usr/bin/env python3
"""Workload A: a Python data-analysis session in pandas/numpy, deterministic from a seed.

What an agent's notebook kernel keeps alive after a few cells of "clean this export and
summarize it": a raw orders export with mixed dtypes (ints, floats with gaps, timestamps,
messy strings, free text, booleans), a customers table, the cleaned frame (normalized
strings, parsed amounts, imputed gaps, categoricals), the join of both, per-customer and
per-day aggregates, a pivot table, a rolling-window feature frame and a text-feature frame.
Every intermediate frame stays referenced, as it does in a notebook namespace. The row count
is calibrated so that the process's RSS lands near ``--mb``.

Speaks the READY / CHECK / TOUCH / VERIFY protocol of ``protocol.py``; the checksum covers
every value of every frame (``pandas.util.hash_pandas_object``) plus columns and dtypes.

    python bench/workloads/pandas_analysis.py --mb 300 --seed 1
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time

import numpy as np
import pandas as pd
import protocol  # a sibling module: bench/workloads is on sys.path when run as a script
from pagewalk import rss_bytes

# resident bytes per raw order row once every frame below exists; calibrated on pandas 3.x
# (CPython 3.11) so that READY's RSS lands near --mb
BYTES_PER_ROW = 1420
BASE_MB = 75  # interpreter + numpy + pandas, before any data

REGIONS = ["north", "south", "east", "west", "central"]
CHANNELS = ["web", "mobile app", "partner api", "phone", "store"]
STATUSES = ["Delivered", " delivered", "DELIVERED ", "shipped", "Shipped", "cancelled",
            "Cancelled ", "returned", "pending", " Pending"]
PRODUCTS = ["widget", "gadget", "sprocket", "adapter", "cable", "charger", "sensor", "module",
            "bracket", "housing", "lens", "filter", "pump", "valve", "switch"]
WORDS = ("the customer asked about delivery time and wanted a refund because the item "
         "arrived late damaged missing parts wrong colour size works fine great quality "
         "will order again support was helpful slow response tracking number invoice "
         "discount code expired package box label address changed call back please").split()


def _pick(rng: np.random.Generator, choices: list[str], n: int, p=None) -> np.ndarray:
    return np.asarray(choices, dtype=object)[rng.choice(len(choices), size=n, p=p)]


def _comments(rng: np.random.Generator, n: int) -> list:
    """Free-text comments, a third of them missing (None), lengths 3-24 words."""
    words = np.asarray(WORDS, dtype=object)
    lengths = rng.integers(3, 25, size=n)
    picks = rng.integers(0, len(words), size=int(lengths.sum()))
    out, at = [], 0
    missing = rng.random(n) < 0.33
    for i, k in enumerate(lengths.tolist()):
        out.append(None if missing[i] else " ".join(words[picks[at:at + k]]))
        at += k
    return out


def raw_orders(rng: np.random.Generator, n: int, customers: int) -> pd.DataFrame:
    """The export as it arrives: strings where numbers should be, gaps, inconsistent case."""
    amount = rng.gamma(2.0, 45.0, n).round(2)
    amount_text = [f"${a:,.2f}" if k < 0.7 else (f"{a:.2f} USD" if k < 0.9 else "")
                   for a, k in zip(amount.tolist(), rng.random(n).tolist())]
    qty = rng.integers(1, 12, n).astype(float)
    qty[rng.random(n) < 0.04] = np.nan
    start = np.datetime64("2024-01-01T00:00:00")
    return pd.DataFrame({
        "order_id": np.arange(1_000_000, 1_000_000 + n, dtype=np.int64),
        "customer_id": rng.integers(0, customers, n, dtype=np.int64),
        "created": start + rng.integers(0, 365 * 86400, n).astype("timedelta64[s]"),
        "region": _pick(rng, REGIONS, n),
        "channel": _pick(rng, CHANNELS, n, p=[0.45, 0.3, 0.1, 0.05, 0.1]),
        "product": _pick(rng, PRODUCTS, n),
        "sku": [f"SKU-{x:05d}-{y}" for x, y in zip(rng.integers(0, 40000, n).tolist(),
                                                    _pick(rng, list("ABCDEFGH"), n).tolist())],
        "status": _pick(rng, STATUSES, n),
        "amount": amount_text,
        "qty": qty,
        "discount": np.where(rng.random(n) < 0.2, rng.uniform(0.05, 0.3, n).round(3), np.nan),
        "gift": rng.random(n) < 0.07,
        "comment": _comments(rng, n),
    })


def customers_table(rng: np.random.Generator, n: int) -> pd.DataFrame:
    first = ["ana", "ben", "chen", "dara", "eli", "fatima", "goran", "hana", "ivan", "jun"]
    last = ["smith", "garcia", "kowalski", "nguyen", "okafor", "rossi", "schmidt", "tanaka"]
    return pd.DataFrame({
        "customer_id": np.arange(n, dtype=np.int64),
        "name": [f"{a.title()} {b.title()}" for a, b in zip(_pick(rng, first, n), _pick(rng, last, n))],
        "email": [f"user{i}@example.{d}" for i, d in zip(range(n), _pick(rng, ["com", "org", "net"], n))],
        "signup": np.datetime64("2019-01-01") + rng.integers(0, 5 * 365, n).astype("timedelta64[D]"),
        "tier": pd.Categorical(_pick(rng, ["free", "plus", "pro", "enterprise"], n, p=[0.6, 0.25, 0.12, 0.03])),
        "lifetime_value": rng.lognormal(5, 1.2, n).round(2),
    })


def clean(raw: pd.DataFrame) -> pd.DataFrame:
    df = raw.copy()
    df["status"] = df["status"].str.strip().str.lower().astype("category")
    df["region"] = df["region"].astype("category")
    df["channel"] = df["channel"].astype("category")
    amt = df["amount"].str.replace(r"[$,]|\sUSD", "", regex=True)
    df["amount"] = pd.to_numeric(amt.where(amt != ""), errors="coerce")
    # impute: a missing amount gets its product's median, a missing qty becomes 1
    df["amount"] = df["amount"].fillna(df.groupby("product")["amount"].transform("median"))
    df["qty"] = df["qty"].fillna(1).astype(np.int32)
    df["discount"] = df["discount"].fillna(0.0)
    df["revenue"] = (df["amount"] * df["qty"] * (1 - df["discount"])).round(2)
    df["comment"] = df["comment"].fillna("")
    df["month"] = df["created"].dt.to_period("M").astype(str)
    return df[df["status"] != "cancelled"].reset_index(drop=True)


def analyse(rng: np.random.Generator, rows: int) -> dict[str, pd.DataFrame]:
    customers = max(1000, rows // 12)
    frames: dict[str, pd.DataFrame] = {}
    frames["raw"] = raw_orders(rng, rows, customers)
    frames["customers"] = customers_table(rng, customers)
    frames["clean"] = clean(frames["raw"])
    frames["joined"] = frames["clean"].merge(frames["customers"], on="customer_id", how="left")
    j = frames["joined"]
    frames["per_customer"] = j.groupby("customer_id").agg(
        orders=("order_id", "count"), revenue=("revenue", "sum"), mean_amount=("amount", "mean"),
        first=("created", "min"), last=("created", "max"), name=("name", "first"),
        channels=("channel", lambda s: ",".join(sorted(map(str, s.unique()))))).reset_index()
    frames["daily"] = (j.set_index("created").groupby("region", observed=True)["revenue"]
                       .resample("D").agg(["sum", "count", "mean"]).reset_index())
    frames["pivot"] = j.pivot_table(index="month", columns=["region", "channel"], values="revenue",
                                    aggfunc=["sum", "mean"], observed=True)
    r = j.sort_values(["customer_id", "created"])[["customer_id", "created", "revenue", "qty"]]
    roll = r.groupby("customer_id")["revenue"].rolling(5, min_periods=1)
    frames["rolling"] = r.assign(rev_mean5=roll.mean().to_numpy(), rev_max5=roll.max().to_numpy(),
                                 cum_qty=r.groupby("customer_id")["qty"].cumsum())
    words = j["comment"].str.split()
    frames["text"] = pd.DataFrame({
        "order_id": j["order_id"], "n_words": words.str.len(),
        "first_word": words.str[0], "mentions_refund": j["comment"].str.contains("refund"),
        "upper": j["comment"].str.upper(),
    })
    return frames


def checksum(frames: dict[str, pd.DataFrame]) -> str:
    """Hash every value of every frame, in a fixed order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(frames):
        df = frames[name]
        h.update(name.encode())
        h.update(repr([(str(c), str(t)) for c, t in df.dtypes.items()]).encode())
        flat = df.reset_index() if not isinstance(df.index, pd.RangeIndex) else df
        if isinstance(flat.columns, pd.MultiIndex):
            flat = flat.set_axis(["|".join(map(str, c)) for c in flat.columns], axis=1)
        h.update(pd.util.hash_pandas_object(flat, index=True).to_numpy().tobytes())
    return h.hexdigest()


CHUNK_ROWS = 1024  # rows per item of the agent loop (protocol ROUND)


def chunk_items(frames: dict[str, pd.DataFrame]) -> list[tuple[str, int, int]]:
    """(frame, first row, end row) of every chunk of every frame, oldest rows first, so that
    the last items are the most recent rows of every frame (the orders arrive in order)."""
    items = []
    for name in sorted(frames):
        n = len(frames[name])
        items += [(a // CHUNK_ROWS, name, a, min(n, a + CHUNK_ROWS)) for a in range(0, n, CHUNK_ROWS)]
    items.sort()
    return [(name, a, b) for _, name, a, b in items]


def chunk_digest(frames: dict[str, pd.DataFrame], item: tuple[str, int, int]) -> str:
    name, a, b = item
    part = frames[name].iloc[a:b]
    if isinstance(part.columns, pd.MultiIndex):
        part = part.set_axis(["|".join(map(str, c)) for c in part.columns], axis=1)
    h = hashlib.blake2b(digest_size=16)
    h.update(pd.util.hash_pandas_object(part, index=True).to_numpy().tobytes())
    return h.hexdigest()


class AgentLoop:
    """Protocol ROUND on the frames: verify a skewed choice of row chunks, then a transient
    analysis of them (a copy of ~transient_mib MiB, a group-by over it), freed at the end."""

    def __init__(self, frames: dict[str, pd.DataFrame]):
        self.frames = frames
        self.items = chunk_items(frames)
        self.digests = [chunk_digest(frames, it) for it in self.items]

    def act(self, rng, frac: float, transient_mib: float) -> tuple:
        picks = protocol.skewed_picks(rng, len(self.items), round(frac * len(self.items)))
        nbytes = 0
        for i in picks:
            got = chunk_digest(self.frames, self.items[i])
            if got != self.digests[i]:
                return f"{self.items[i][0]}[{self.items[i][1]}:{self.items[i][2]}]", got, self.digests[i]
            name, a, b = self.items[i]
            nbytes += int(self.frames[name].iloc[a:b].memory_usage(index=True, deep=True).sum())
        joined = self.frames["joined"]
        rows = [(a, b) for name, a, b in (self.items[i] for i in picks) if name == "joined"] or [(0, CHUNK_ROWS)]
        per_row = max(1, int(joined.memory_usage(index=True, deep=True).sum()) // max(1, len(joined)))
        want = max(1, int(transient_mib * 1024 * 1024 / per_row))
        parts, got_rows = [], 0
        while got_rows < want:  # the tool's working copy: the picked rows, as often as needed
            for a, b in rows:
                parts.append(joined.iloc[a:b])
                got_rows += b - a
                if got_rows >= want:
                    break
        work = pd.concat(parts, ignore_index=True)
        summary = work.groupby(["region", "channel"], observed=True)["revenue"].agg(["sum", "mean", "count"])
        if int(summary["count"].sum()) != len(work):
            return "groupby", str(int(summary["count"].sum())), str(len(work))
        del work, parts, summary
        return None, len(picks), nbytes


def rows_for(mb: float) -> int:
    return max(2000, int((mb - BASE_MB) * (1 << 20) / BYTES_PER_ROW))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="target RSS in MiB (default 300)")
    ap.add_argument("--seed", type=int, default=1, help="content seed (default 1)")
    ap.add_argument("--agent-loop", action="store_true",
                    help="take a digest per row chunk at build time and answer ROUND (protocol.py)")
    ap.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    rows = rows_for(a.mb)
    frames = analyse(np.random.default_rng(a.seed), rows)
    gc.collect()
    want = checksum(frames)
    loop = AgentLoop(frames) if a.agent_loop else None
    gc.collect()
    gc.freeze()

    def corrupt() -> None:
        frames["clean"].loc[len(frames["clean"]) // 2, "revenue"] += 0.01

    print(f"pandas_analysis: {rows} raw rows, frames "
          + ", ".join(f"{k} {v.shape[0]}x{v.shape[1]}" for k, v in frames.items())
          + f"; rss {rss_bytes() >> 20} MiB, built in {time.monotonic() - t0:.1f}s, checksum {want}",
          file=sys.stderr, flush=True)
    return protocol.serve("pandas_analysis", want, lambda: checksum(frames),
                          corrupt=corrupt if a.corrupt_for_test else None,
                          act=loop.act if loop else None)


if __name__ == "__main__":
    sys.exit(main())
