#!/usr/bin/env python3
"""A deterministic, agent-like Python heap: multi-round tool-calling transcripts.

Builds, from a seed, what a Python agent process keeps while it works: the raw JSON of
every model response and tool result (nested dicts, escaped strings, code snippets,
numbers, JSON inside JSON strings), the parsed dicts of the same, the conversation
history, a string pool of interned names/paths/URLs, token-id arrays and a small
embedding per session. It grows until an estimate of its live heap reaches ``--mb``.

Speaks the READY / CHECK / TOUCH / VERIFY protocol of ``protocol.py`` (so a driver can
squeeze it while it is idle).

EOF on stdin exits with status 2. Diagnostics go to stderr. Same --seed and --mb give the
same data (run it with PYTHONHASHSEED=0 to make dict hash fields identical as well).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import time
from array import array

import protocol  # a sibling module: the script's own directory is on sys.path
from pagewalk import rss_bytes

# ---------------------------------------------------------------------------------------
# vocabulary

_ENGLISH = """
the a to of and in is it you that for on with as this be are was have not or at by from
we can will if an but all so one which their there what about when up out do more time
has would into them some could other then than its only also new just like use should
how any these first because our two may well after way most make file function error
value data test result output input check run update need see found following first
example code change line return call number list string type object module import class
method request response status server client config path name key field table query
user agent tool model step task plan next done first issue fix build install package
version command shell directory repository branch commit review parse format json yaml
missing failed success warning info debug trace stack frame memory cache page size
""".split()

_CODE_WORDS = """
def return import from class self if elif else for while try except finally with as
yield async await lambda None True False print len range dict list str int float bool
isinstance raise assert pass break continue global nonlocal super property staticmethod
""".split()

_SYLL = ["ka", "lo", "mer", "tion", "da", "ta", "proc", "ess", "ing", "ver", "al", "con",
         "fig", "ser", "vice", "han", "dle", "re", "quest", "pay", "load", "sche", "ma",
         "in", "dex", "cli", "ent", "row", "col", "umn", "vec", "tor", "grad", "ient",
         "batch", "norm", "token", "iz", "er", "pipe", "line", "fet", "ch", "pars"]

_TOOLS = ["read_file", "run_shell", "search_web", "http_get", "python_exec", "write_file",
          "list_dir", "grep"]

_SYSTEM_PROMPT_PARTS = [
    "You are an autonomous software engineering agent working inside a sandbox.",
    "You can call tools to read and write files, run shell commands, search the web and",
    "execute Python. Think step by step. Prefer small, verifiable changes. When a command",
    "fails, read the error carefully and try a different approach. Never fabricate tool",
    "output. Report progress in short messages and finish with a summary of what changed.",
    "Available tools: " + ", ".join(_TOOLS) + ".",
    "Rules: 1) keep the repository buildable; 2) run the tests after each change;",
    "3) do not access the network except through search_web and http_get;",
    "4) respect the user's coding style; 5) explain non-obvious decisions.",
]


class Gen:
    """Seeded generators of agent-ish content."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        r = self.rng
        invented = sorted({"".join(r.choice(_SYLL) for _ in range(r.randint(2, 4)))
                           for _ in range(2500)})
        vocab = _ENGLISH + _CODE_WORDS + invented
        r.shuffle(vocab)
        self.vocab = vocab
        self.token_id = {w: i + 100 for i, w in enumerate(vocab)}
        # Zipf-ish weights: a few words very common, a long tail
        acc, cw = 0.0, []
        for i in range(len(vocab)):
            acc += 1.0 / (i + 1) ** 1.07
            cw.append(acc)
        self.cw = cw
        self.idents = sorted({self._ident() for _ in range(1500)})
        self.dirs = ["src", "tests", "lib", "app", "docs", "scripts", "pkg", "internal", "api",
                     "models", "utils", "services", "core", "cli", "data"]
        self.exts = [".py", ".py", ".py", ".ts", ".js", ".json", ".yaml", ".md", ".toml"]
        self.system_prompt = " ".join(_SYSTEM_PROMPT_PARTS) * 3
        self.ts = 1_717_000_000

    def words(self, n: int) -> list[str]:
        return self.rng.choices(self.vocab, cum_weights=self.cw, k=n)

    def text(self, n: int) -> str:
        ws = self.words(n)
        r = self.rng
        out, i = [], 0
        while i < n:
            k = r.randint(6, 18)
            s = " ".join(ws[i:i + k])
            out.append(s[:1].upper() + s[1:] + r.choice([".", ".", ".", "?", ":", "!"]))
            i += k
        return " ".join(out)

    def _ident(self) -> str:
        r = self.rng
        parts = r.choices(_ENGLISH + _CODE_WORDS[:10], k=r.randint(1, 3))
        return "_".join(p for p in parts if p.isidentifier()) or "x"

    def ident(self) -> str:
        return self.rng.choice(self.idents)

    def hexid(self, n: int = 24) -> str:
        return "%0*x" % (n, self.rng.getrandbits(4 * n))

    def path(self) -> str:
        r = self.rng
        depth = r.randint(1, 3)
        return "/".join(r.choice(self.dirs) for _ in range(depth)) + "/" + self.ident() + r.choice(self.exts)

    def url(self) -> str:
        r = self.rng
        host = r.choice(["docs.python.org", "github.com", "stackoverflow.com", "pypi.org",
                         "developer.mozilla.org", "arxiv.org", "news.ycombinator.com",
                         "en.wikipedia.org", "readthedocs.io", "blog.example.com"])
        return f"https://{host}/" + "/".join(self.words(r.randint(1, 4))) + \
            (f"?id={r.randint(1, 10**6)}" if r.random() < 0.3 else "")

    def number(self):
        r = self.rng
        k = r.random()
        if k < 0.35:
            return r.randint(0, 1000)
        if k < 0.55:
            return r.randint(0, 10**9)
        if k < 0.85:
            return round(r.uniform(-1000, 1000), r.randint(1, 6))
        return r.random()

    # -- tool results ---------------------------------------------------------------

    def code(self, lines: int) -> str:
        r = self.rng
        out = []
        indent = 0
        cls = False
        while len(out) < lines:
            k = r.random()
            pad = "    " * indent
            if indent == 0 or k < 0.08:
                if r.random() < 0.3:
                    out.append(f"class {self.ident().title().replace('_', '')}:")
                    cls, indent = True, 1
                    out.append('    """' + self.text(r.randint(5, 15)) + '"""')
                    continue
                if r.random() < 0.2:
                    out.append(f"import {self.ident()}")
                    out.append(f"from {self.ident()}.{self.ident()} import {self.ident()}, {self.ident()}")
                    continue
                indent = 1 if cls and indent >= 1 else 0
                pad = "    " * indent
                args = ", ".join(self.ident() for _ in range(r.randint(0, 4)))
                out.append(f"{pad}def {self.ident()}({'self, ' if cls else ''}{args}):")
                indent += 1
                continue
            if k < 0.25:
                out.append(f"{pad}{self.ident()} = {self.ident()}({self.ident()}, {self.number()!r})")
            elif k < 0.35:
                out.append(f"{pad}if {self.ident()} {r.choice(['==', '!=', '<', '>=', 'is', 'in'])} {self.ident()}:")
                indent = min(indent + 1, 5)
            elif k < 0.42:
                out.append(f"{pad}for {self.ident()} in {self.ident()}.{self.ident()}():")
                indent = min(indent + 1, 5)
            elif k < 0.5:
                out.append(f"{pad}# " + self.text(r.randint(4, 14)))
            elif k < 0.58:
                out.append(f"{pad}return {self.ident()}")
                indent = max(indent - 1, 1 if cls else 0)
            elif k < 0.66:
                out.append(f'{pad}logger.info("{self.text(r.randint(3, 9))} %s", {self.ident()})')
            elif k < 0.72:
                out.append(f'{pad}raise ValueError(f"{self.text(r.randint(3, 8))}: {{{self.ident()}!r}}")')
            elif k < 0.8:
                out.append(f"{pad}{self.ident()}[{self.number()!r}] = {{\"{self.ident()}\": {self.number()!r}, "
                           f"\"{self.ident()}\": \"{self.ident()}\"}}")
            else:
                out.append(f"{pad}{self.ident()}.{self.ident()}({', '.join(self.ident() for _ in range(r.randint(0, 3)))})")
        return "\n".join(out) + "\n"

    def shell_output(self) -> str:
        r = self.rng
        kind = r.random()
        lines = []
        if kind < 0.35:  # pytest
            n = r.randint(5, 60)
            for i in range(n):
                st = "PASSED" if r.random() < 0.85 else r.choice(["FAILED", "SKIPPED", "ERROR"])
                lines.append(f"{self.path()}::test_{self.ident()} {st} [{100 * (i + 1) // n:3d}%]")
            lines.append(f"==== {r.randint(1, n)} passed, {r.randint(0, 5)} failed in {r.uniform(0.1, 90):.2f}s ====")
        elif kind < 0.6:  # ls -la
            for _ in range(r.randint(5, 40)):
                lines.append(f"-rw-r--r-- 1 agent agent {r.randint(0, 10**6):8d} "
                             f"{r.choice(['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun'])} {r.randint(1, 28):2d} "
                             f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d} {self.path()}")
        elif kind < 0.8:  # traceback
            lines.append("Traceback (most recent call last):")
            for _ in range(r.randint(2, 12)):
                lines.append(f'  File "/workspace/{self.path()}", line {r.randint(1, 900)}, in {self.ident()}')
                lines.append(f"    {self.ident()} = {self.ident()}.{self.ident()}({self.ident()})")
            lines.append(f"{r.choice(['KeyError', 'TypeError', 'ValueError', 'AttributeError'])}: "
                         f"'{self.ident()}' {self.text(r.randint(3, 10))}")
        else:  # pip / build log
            for _ in range(r.randint(5, 30)):
                lines.append(f"Collecting {self.ident().replace('_', '-')}=={r.randint(0, 9)}.{r.randint(0, 30)}.{r.randint(0, 20)}")
                if r.random() < 0.5:
                    lines.append(f"  Downloading {self.url()} ({r.uniform(0.01, 30):.1f} MB)")
            lines.append("Successfully installed " + " ".join(
                f"{self.ident().replace('_', '-')}-{r.randint(0, 9)}.{r.randint(0, 30)}" for _ in range(r.randint(1, 8))))
        return "\n".join(lines) + "\n"

    def api_doc(self, depth: int = 0) -> dict:
        r = self.rng
        d = {}
        for _ in range(r.randint(2, 7)):
            k = self.ident()
            x = r.random()
            if x < 0.3:
                d[k] = self.number()
            elif x < 0.55:
                d[k] = self.text(r.randint(1, 12)) if r.random() < 0.6 else self.ident()
            elif x < 0.65:
                d[k] = r.choice([True, False, None])
            elif x < 0.8 and depth < 3:
                d[k] = self.api_doc(depth + 1)
            elif depth < 3:
                d[k] = [self.api_doc(depth + 2) if r.random() < 0.4 else self.number()
                        for _ in range(r.randint(1, 6))]
            else:
                d[k] = self.hexid(r.choice([8, 16, 32]))
        return d

    def table(self) -> str:
        r = self.rng
        cols = [self.ident() for _ in range(r.randint(3, 8))]
        rows = ["      " + "  ".join(f"{c:>12}" for c in cols)]
        for i in range(r.randint(5, 40)):
            rows.append(f"{i:5d} " + "  ".join(f"{self.number()!s:>12}" for _ in cols))
        return "\n".join(rows) + "\n"

    def tool_call(self) -> tuple[str, dict, str]:
        """(tool name, arguments, result text)"""
        r = self.rng
        name = r.choices(_TOOLS, weights=[30, 25, 10, 10, 10, 8, 4, 3])[0]
        if name == "read_file":
            args = {"path": self.path()}
            if r.random() < 0.2:
                args["start_line"] = r.randint(1, 400)
            result = self.code(r.randint(15, 160))
        elif name == "run_shell":
            args = {"command": r.choice(["pytest -x -q", "ls -la", "python -m pip install -e .",
                                         "python main.py", "git status", "make test"])
                    + " " + self.path(), "timeout": r.choice([30, 60, 120, 300])}
            result = self.shell_output()
        elif name == "search_web":
            args = {"query": self.text(r.randint(3, 9)), "num_results": 5}
            result = json.dumps({"results": [{"title": self.text(r.randint(4, 10)), "url": self.url(),
                                              "snippet": self.text(r.randint(20, 60)),
                                              "score": round(r.random(), 4)}
                                             for _ in range(5)]}, indent=r.choice([None, 2]))
        elif name == "http_get":
            args = {"url": self.url(), "headers": {"Accept": "application/json",
                                                   "Authorization": "Bearer " + self.hexid(32)}}
            result = json.dumps({"status": 200, "request_id": self.hexid(16), "data": self.api_doc()},
                                indent=r.choice([None, 2, 4]))
        elif name == "python_exec":
            args = {"code": self.code(r.randint(3, 25))}
            result = self.table()
        elif name == "write_file":
            args = {"path": self.path(), "content": self.code(r.randint(10, 120))}
            result = json.dumps({"ok": True, "bytes_written": len(args["content"])})
        elif name == "list_dir":
            args = {"path": r.choice(self.dirs), "recursive": r.random() < 0.3}
            result = "\n".join(self.path() for _ in range(r.randint(5, 50)))
        else:
            args = {"pattern": self.ident(), "path": r.choice(self.dirs)}
            result = "\n".join(f"{self.path()}:{r.randint(1, 900)}: {self.code(1).strip()}"
                               for _ in range(r.randint(1, 30)))
        return name, args, result

    def round(self, session: int, idx: int, model: str) -> dict:
        """One model turn plus the tool results it asked for, as an API would return it."""
        r = self.rng
        self.ts += r.randint(1, 40)
        calls, results = [], []
        for _ in range(r.choices([0, 1, 2, 3], weights=[10, 60, 22, 8])[0]):
            name, args, result = self.tool_call()
            cid = "call_" + self.hexid(24)
            calls.append({"id": cid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args)}})
            results.append({"role": "tool", "tool_call_id": cid, "name": name, "content": result})
        content = self.text(r.randint(15, 220)) if (not calls or r.random() < 0.5) else None
        pt = r.randint(500, 120_000)
        ct = r.randint(10, 2_000)
        return {
            "session": session, "round": idx,
            "response": {
                "id": "chatcmpl-" + self.hexid(29), "object": "chat.completion", "created": self.ts,
                "model": model,
                "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop",
                             "message": {"role": "assistant", "content": content,
                                         **({"tool_calls": calls} if calls else {})}}],
                "usage": {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct},
            },
            "tool_results": results,
            "latency_ms": round(r.uniform(150, 20_000), 1),
        }


# ---------------------------------------------------------------------------------------
# the heap


# live bytes per byte of raw JSON (raw str + parsed objects + history/pool/arrays);
# calibrated on CPython 3.11 so that READY's RSS lands close to --mb
HEAP_PER_RAW_BYTE = 3.15


class Heap:
    def __init__(self, seed: int, mb: float):
        self.gen = Gen(seed)
        self.target = int(mb * 1024 * 1024)
        self.raw: list[str] = []  # raw JSON of every round
        self.sessions: list[dict] = []  # parsed rounds, messages, tokens, embedding
        self.pool: dict[str, str] = {}  # interned names / paths / urls
        self.raw_of: list[tuple[int, int]] = []  # per session: its slice of self.raw
        self.digests: list[str] = []  # per session, with --agent-loop (protocol ROUND)

    def intern(self, s: str) -> str:
        return self.pool.setdefault(s, s)

    def build(self) -> None:
        g = self.gen
        r = g.rng
        est = 0
        sid = 0
        while est < self.target:
            model = self.intern(r.choice(["agent-model-2", "agent-model-2-mini", "coder-large"]))
            task = g.text(r.randint(20, 120))
            sess = {"id": "sess_" + g.hexid(16), "model": model, "task": task,
                    "system": g.system_prompt, "rounds": [], "messages": [],
                    "tokens": array("I"), "embedding": array("f"), "files": {}}
            sess["messages"].append({"role": "system", "content": sess["system"]})
            sess["messages"].append({"role": "user", "content": task})
            for i in range(r.randint(3, 14)):
                raw = json.dumps(g.round(sid, i, model))
                parsed = json.loads(raw)
                self.raw.append(raw)
                sess["rounds"].append(parsed)
                msg = parsed["response"]["choices"][0]["message"]
                sess["messages"].append(msg)
                for call in msg.get("tool_calls", ()):
                    fn = call["function"]
                    fn["name"] = self.intern(fn["name"])
                    args = json.loads(fn["arguments"])
                    call["parsed_arguments"] = args
                    if "path" in args:
                        p = self.intern(args["path"])
                        sess["files"][p] = sess["files"].get(p, 0) + 1
                    if "url" in args:
                        self.intern(args["url"])
                sess["messages"].extend(parsed["tool_results"])
                if msg.get("content"):
                    sess["tokens"].extend(g.token_id[w.strip(".?:!").lower()]
                                          for w in msg["content"].split()
                                          if w.strip(".?:!").lower() in g.token_id)
                est += int(len(raw) * HEAP_PER_RAW_BYTE)
            sess["embedding"].extend(r.gauss(0.0, 0.25) for _ in range(384))
            self.raw_of.append((len(self.raw) - len(sess["rounds"]), len(self.raw)))
            self.sessions.append(sess)
            sid += 1

    def checksum(self) -> str:
        """Read every byte the heap holds (raw text, parsed objects, pool, arrays)."""
        h = hashlib.blake2b(digest_size=16)
        for raw in self.raw:
            h.update(raw.encode())
        dumps = json.JSONEncoder(separators=(",", ":"), default=_arr).encode
        for sess in self.sessions:
            h.update(dumps(sess).encode())
            h.update(sess["tokens"].tobytes())
            h.update(sess["embedding"].tobytes())
        for k in self.pool:
            h.update(k.encode())
        return h.hexdigest()

    def session_text(self, i: int) -> str:
        """Session *i* as the next prompt would carry it: its raw rounds and its objects."""
        a, b = self.raw_of[i]
        sess = self.sessions[i]
        return "".join(self.raw[a:b]) + json.JSONEncoder(separators=(",", ":"), default=_arr).encode(sess) \
            + sess["tokens"].tobytes().hex() + sess["embedding"].tobytes().hex()

    def take_digests(self) -> None:
        self.digests = [hashlib.blake2b(self.session_text(i).encode(), digest_size=16).hexdigest()
                        for i in range(len(self.sessions))]

    def act(self, rng, frac: float, transient_mib: float) -> tuple:
        """One agent round (protocol ROUND): re-read a skewed choice of sessions and verify
        them, then build a prompt of ~transient_mib MiB from them and parse it back (freed)."""
        picks = protocol.skewed_picks(rng, len(self.sessions), round(frac * len(self.sessions)))
        texts, nbytes = [], 0
        for i in picks:
            t = self.session_text(i)
            got = hashlib.blake2b(t.encode(), digest_size=16).hexdigest()
            if got != self.digests[i]:
                return f"session{i}", got, self.digests[i]
            nbytes += len(t)
            texts.append(t)
        want = int(transient_mib * 1024 * 1024)
        parts, size = [], 0
        while size < want:  # the next prompt: the picked context, repeated as it accumulates
            for t in texts:
                parts.append(json.dumps({"role": "user", "content": t[: want - size]}))
                size += len(parts[-1])
                if size >= want:
                    break
        prompt = "[" + ",".join(parts) + "]"
        back = json.loads(prompt)
        if len(back) != len(parts):
            return "prompt", str(len(back)), str(len(parts))
        del parts, prompt, back, texts
        return None, len(picks), nbytes

    def corrupt(self) -> None:
        """Flip one value in the middle of the heap (for the test of VERIFY FAIL)."""
        sess = self.sessions[len(self.sessions) // 2]
        sess["rounds"][0]["response"]["created"] += 1


def _arr(o):
    if isinstance(o, array):
        return len(o)
    raise TypeError(type(o))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="target live heap in MiB (default 300)")
    ap.add_argument("--seed", type=int, default=1, help="content seed (default 1)")
    ap.add_argument("--agent-loop", action="store_true",
                    help="take a digest per session at build time and answer ROUND (protocol.py)")
    ap.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    gc.disable()  # nothing here is cyclic garbage; keep the collector from walking the heap
    t0 = time.monotonic()
    rss0 = rss_bytes()
    heap = Heap(a.seed, a.mb)
    heap.build()
    t_build = time.monotonic() - t0
    want = heap.checksum()
    if a.agent_loop:
        heap.take_digests()
    gc.freeze()
    print(f"agent_json: {len(heap.sessions)} sessions, {len(heap.raw)} rounds, "
          f"{sum(map(len, heap.raw)) >> 20} MiB raw JSON, pool {len(heap.pool)}, "
          f"rss {rss_bytes() >> 20} MiB (+{(rss_bytes() - rss0) >> 20}), built in {t_build:.1f}s, "
          f"checksum {want}", file=sys.stderr, flush=True)
    return protocol.serve("agent_json", want, heap.checksum,
                          corrupt=heap.corrupt if a.corrupt_for_test else None,
                          act=heap.act if a.agent_loop else None)


if __name__ == "__main__":
    sys.exit(main())
