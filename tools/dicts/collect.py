#!/usr/bin/env python3
"""Collect a corpus of real runtime heap pages for dictionary training and evaluation.

Runs real programs under real runtimes (CPython 3.11 and 3.12, Node.js, headless Chromium),
waits until each has built its heap, and samples the resident anonymous pages of its whole
process tree through /proc/PID/{maps,pagemap,mem} (agentzip_blk.cgroups.procmem, read-only).
Same-filled pages are dropped (the store never compresses them) and exact duplicates within
a run are dropped (dedup takes them).

Training and held-out pages come from different programs *and* different runs (seeds):
every run below is marked `train`, `heldout` or `host`, and no program is used for both
`train` and `heldout`. `host` runs are earlier runs of the held-out programs (another seed),
the pages a host's `dictionary: auto` would have learnt from before the held-out run.

    sudo .venv/bin/python tools/dicts/collect.py --out /var/tmp/agentzip-corpus

Output: OUT/RUNTIME/ROLE-PROGRAM-SEED.pages (concatenated 4 KiB pages) + runs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from agentzip_blk.cgroups import procmem  # noqa: E402
from pages import write_pages  # noqa: E402

from bench.harness.workloads import DIR as WORKLOADS_DIR, module  # noqa: E402

descendants = module("pagewalk").descendants

PROG = os.path.join(HERE, "programs")
VENV_PY = os.path.join(ROOT, ".venv", "bin", "python")
PY312 = os.path.expanduser("~/.pyenv/versions/3.12.1/bin/python3.12")
AGENT_JSON = os.path.join(WORKLOADS_DIR, "agent_json.py")


def runs(mb: float) -> list[dict]:
    m = str(mb)
    out = [
        # CPython 3.11 (the venv's, Debian's /usr/bin/python3 + pandas)
        dict(runtime="python311", role="train", program="py_train_mix", seed=1,
             cmd=[VENV_PY, f"{PROG}/py_train_mix.py", "--mb", m, "--seed", "1"]),
        dict(runtime="python311", role="train", program="py_train_mix", seed=2,
             cmd=[VENV_PY, f"{PROG}/py_train_mix.py", "--mb", m, "--seed", "2"]),
        dict(runtime="python311", role="heldout", program="py_pandas", seed=7, workload="Python data analysis",
             cmd=[VENV_PY, f"{PROG}/py_pandas.py", "--mb", m, "--seed", "7"]),
        dict(runtime="python311", role="heldout", program="agent_json", seed=7, workload="tool calling",
             cmd=[VENV_PY, AGENT_JSON, "--mb", m, "--seed", "7"]),
        # Node.js 20 / V8
        dict(runtime="v8", role="train", program="node_train_mix", seed=1,
             cmd=["node", f"{PROG}/node_train_mix.js", "--mb", m, "--seed", "1"]),
        dict(runtime="v8", role="train", program="node_train_mix", seed=2,
             cmd=["node", f"{PROG}/node_train_mix.js", "--mb", m, "--seed", "2"]),
        dict(runtime="v8", role="heldout", program="node_text", seed=7, workload="Node.js text",
             cmd=["node", f"{PROG}/node_text.js", "--mb", m, "--seed", "7"]),
        # Chromium, headless
        dict(runtime="chromium", role="train", program="chromium_docs", seed=1, pages="train"),
        dict(runtime="chromium", role="train", program="chromium_docs", seed=2, pages="train"),
        dict(runtime="chromium", role="heldout", program="chromium_report", seed=7, pages="heldout",
             workload="headless browser"),
    ]
    # Issue 6's benchmark workloads, when present: more held-out programs of the same kinds.
    workloads = WORKLOADS_DIR
    if os.path.exists(os.path.join(workloads, "pandas_analysis.py")):
        out.append(dict(runtime="python311", role="heldout", program="pandas_analysis", seed=7,
                        workload="Python data analysis",
                        cmd=[VENV_PY, f"{workloads}/pandas_analysis.py", "--mb", m, "--seed", "7"]))
    if os.path.exists(os.path.join(workloads, "node_text.js")):
        out.append(dict(runtime="v8", role="heldout", program="node_text_issue6", seed=7,
                        workload="Node.js text",
                        cmd=["node", f"{workloads}/node_text.js", "--mb", m, "--seed", "7"]))
    # "host" runs: an earlier run (another seed) of each held-out program, as a host that
    # keeps running the same agents would have seen it. Only `dictionary: auto`'s host
    # training uses these (bench_codecs' "zstd 3 + auto"); prebuilt dictionaries never do.
    for r in [x for x in out if x["role"] == "heldout"]:
        h = dict(r, role="host", seed=8)
        h.pop("workload", None)
        if "cmd" in h:
            h["cmd"] = [a if a != "7" else "8" for a in h["cmd"]]
        out.append(h)
    if os.path.exists(PY312):
        out += [
            dict(runtime="python312", role="train", program="py_train_mix", seed=1,
                 cmd=[PY312, f"{PROG}/py_train_mix.py", "--mb", m, "--seed", "1"]),
            dict(runtime="python312", role="train", program="py_train_mix", seed=2,
                 cmd=[PY312, f"{PROG}/py_train_mix.py", "--mb", m, "--seed", "2"]),
            dict(runtime="python312", role="heldout", program="agent_json", seed=7, workload="tool calling",
                 cmd=[PY312, AGENT_JSON, "--mb", m, "--seed", "7"]),
        ]
    return out


def runtime_version(run: dict) -> str:
    if run["runtime"] == "chromium":
        return subprocess.run(["chromium", "--version"], capture_output=True, text=True).stdout.strip()
    exe = run["cmd"][0]
    flag = ["--version"]
    res = subprocess.run([exe, *flag], capture_output=True, text=True)
    return (res.stdout or res.stderr).strip()


def filter_pages(pages: list[bytes]) -> list[bytes]:
    """Drop same-filled pages and exact duplicates (the store never compresses either)."""
    seen, out = set(), []
    for p in pages:
        w = np.frombuffer(p, dtype=np.uint64)
        if (w == w[0]).all() or p in seen:
            continue
        seen.add(p)
        out.append(p)
    return out


def sample_program(cmd: list[str], limit: int, seed: int) -> list[bytes]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"{cmd}: no READY (got {line!r})")
        return procmem.process_pages(descendants(proc.pid), limit=limit, seed=seed)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sample_chromium(style: str, seed: int, limit: int, npages: int = 6) -> list[bytes]:
    tmp = tempfile.mkdtemp(prefix="agentzip-chromium-")
    try:
        paths = write_pages(os.path.join(tmp, "site"), style, seed, npages)
        profile = os.path.join(tmp, "profile")
        argv = ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", f"--user-data-dir={profile}", "--remote-debugging-port=0",
                "--remote-debugging-address=127.0.0.1", "about:blank"]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            port_file = os.path.join(profile, "DevToolsActivePort")
            deadline = time.time() + 30
            while not os.path.exists(port_file) or not open(port_file).read().strip():
                if time.time() > deadline:
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.2)
            port = int(open(port_file).read().split()[0])
            for path in paths:  # one tab per page, over the DevTools HTTP endpoint
                req = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?file://{path}", method="PUT")
                urllib.request.urlopen(req, timeout=10).read()
            time.sleep(6)  # let the renderers lay out, paint and run their scripts
            return procmem.process_pages(descendants(proc.pid), limit=limit, seed=seed)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/var/tmp/agentzip-corpus")
    ap.add_argument("--mb", type=float, default=60, help="heap size each program builds")
    ap.add_argument("--limit", type=int, default=6000, help="pages sampled per run")
    ap.add_argument("--only", help="comma-separated runtimes")
    a = ap.parse_args()
    meta = []
    only = set(a.only.split(",")) if a.only else None
    for run in runs(a.mb):
        if only and run["runtime"] not in only:
            continue
        t0 = time.time()
        if "pages" in run:
            pages = sample_chromium(run["pages"], run["seed"], a.limit)
        else:
            pages = sample_program(run["cmd"], a.limit, run["seed"])
        kept = filter_pages(pages)
        d = os.path.join(a.out, run["runtime"])
        os.makedirs(d, exist_ok=True)
        name = f"{run['role']}-{run['program']}-{run['seed']}.pages"
        with open(os.path.join(d, name), "wb") as f:
            f.write(b"".join(kept))
        info = {k: v for k, v in run.items() if k != "cmd"}
        info.update(file=f"{run['runtime']}/{name}", sampled=len(pages), kept=len(kept),
                    version=runtime_version(run), seconds=round(time.time() - t0, 1))
        meta.append(info)
        print(f"{run['runtime']:10} {run['role']:8} {run['program']:16} seed {run['seed']}: "
              f"{len(pages)} sampled, {len(kept)} kept ({info['version']})", flush=True)
    path = os.path.join(a.out, "runs.json")
    old = json.load(open(path)) if os.path.exists(path) else []
    keep_old = [m for m in old if m["file"] not in {x["file"] for x in meta}]
    with open(path, "w") as f:
        json.dump(keep_old + meta, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
