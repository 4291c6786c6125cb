#!/usr/bin/env python3
"""Training-only Python heap (never used for held-out pages): a mix of what agents keep,
written independently of the benchmark workloads: stdlib sources parsed to ASTs and
compiled to code objects, HTTP-API-like JSON payloads and their dicts, log lines and
regex text processing, and (when pandas is importable) an event-log DataFrame.
Prints READY, then waits for EOF on stdin.
"""
import argparse
import ast
import json
import os
import random
import re
import sys
import sysconfig

WORDS = ("request response handler session token user account project issue status build "
         "deploy queue worker retry timeout latency cache index search result document page "
         "model prompt completion message role content assistant system tool function args").split()


def api_payload(r, i):
    return {
        "id": f"evt_{r.getrandbits(48):012x}", "object": "event", "created": 1700000000 + i * 7,
        "type": r.choice(["message.created", "run.step", "tool.output", "file.uploaded"]),
        "data": {"role": r.choice(["user", "assistant", "tool"]),
                 "content": [{"type": "text", "text": " ".join(r.choices(WORDS, k=r.randint(5, 60)))}],
                 "metadata": {w: r.randint(0, 999) for w in r.sample(WORDS, 4)},
                 "usage": {"prompt_tokens": r.randint(10, 9000), "completion_tokens": r.randint(1, 900)}},
        "links": [f"https://api.example.net/v1/{r.choice(WORDS)}/{r.getrandbits(32):x}" for _ in range(r.randint(0, 3))],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=60)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    r = random.Random(a.seed)
    keep = []
    budget = a.mb * 2**20
    # 1) ASTs and code objects of stdlib modules (what code-reading agents hold)
    lib = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(lib) if f.endswith(".py"))
    r.shuffle(files)
    used = 0
    for f in files[: 40]:
        try:
            src = open(os.path.join(lib, f), encoding="utf-8").read()
            keep.append((src, ast.parse(src), compile(src, f, "exec")))
            used += len(src) * 12
        except Exception:
            pass
        if used > budget * 0.35:
            break
    # 2) JSON payloads, raw and parsed
    i = 0
    while used < budget * 0.7:
        p = api_payload(r, i)
        s = json.dumps(p)
        keep.append((s, json.loads(s)))
        used += len(s) * 4
        i += 1
    # 3) log lines and regex extraction
    pat = re.compile(r"(\w+)=(\S+)")
    while used < budget * 0.85:
        line = " ".join(f"{w}={r.randint(0, 10**6)}" for w in r.sample(WORDS, 6)) + " level=info"
        keep.append((line, dict(pat.findall(line))))
        used += len(line) * 6
    # 4) an event log frame when pandas exists
    try:
        import numpy as np
        import pandas as pd
        n = int(budget * 0.15 / 120)
        rng = np.random.default_rng(a.seed)
        keep.append(pd.DataFrame({"svc": rng.choice(WORDS, n), "ms": rng.exponential(30, n),
                                  "code": rng.choice([200, 201, 404, 500], n),
                                  "path": [f"/v1/{w}" for w in rng.choice(WORDS, n)]}))
    except ImportError:
        pass
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    sys.stdin.read()
    print(len(keep), file=sys.stderr)


main()
