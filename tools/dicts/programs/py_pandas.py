#!/usr/bin/env python3
"""Held-out Python data analysis heap: pandas/numpy cleaning and transforming mixed-dtype
frames, several intermediate frames alive. Prints READY, then waits for EOF on stdin.

    python py_pandas.py --mb 80 --seed 7
"""
import argparse
import sys

import numpy as np
import pandas as pd

CITIES = ["Berlin", "Paris", "Lagos", "Lima", "Osaka", "Austin", "Pune", "Oslo", "Quito", "Perth"]
STATUS = ["ok", "failed", "pending", "retry", "cancelled"]


def frame(rng, n):
    df = pd.DataFrame({
        "order_id": np.arange(n, dtype=np.int64) + rng.integers(1, 10**6),
        "customer": [f"cust-{x:06d}" for x in rng.integers(0, 50000, n)],
        "city": pd.Categorical(rng.choice(CITIES, n)),
        "status": rng.choice(STATUS, n),
        "amount": rng.gamma(2.0, 40.0, n).round(2),
        "qty": rng.integers(1, 20, n).astype(np.int32),
        "ts": pd.Timestamp("2024-01-01") + pd.to_timedelta(rng.integers(0, 86400 * 365, n), unit="s"),
        "note": [("rush delivery" if x < 0.1 else "gift wrap" if x < 0.15 else "") for x in rng.random(n)],
        "score": np.where(rng.random(n) < 0.05, np.nan, rng.normal(0.5, 0.2, n)),
    })
    return df


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=80)
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    keep = []
    total = 0
    while total < a.mb * 2**20:
        df = frame(rng, 40000)
        df = df[df.status != "cancelled"].copy()
        df["revenue"] = df.amount * df.qty
        df["month"] = df.ts.dt.to_period("M").astype(str)
        df["note"] = df.note.str.upper().replace("", None)
        piv = df.pivot_table(index="city", columns="month", values="revenue", aggfunc="sum", observed=False)
        agg = df.groupby(["city", "status"], observed=True).agg(n=("order_id", "size"), rev=("revenue", "sum"),
                                                                 avg=("score", "mean")).reset_index()
        top = df.nlargest(500, "revenue")
        js = agg.to_json(orient="records")
        keep.append((df, piv, agg, top, js, df.describe()))
        total += int(df.memory_usage(deep=True).sum()) + len(js)
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.read()
    print(sum(len(k[0]) for k in keep), file=sys.stderr)


main()
