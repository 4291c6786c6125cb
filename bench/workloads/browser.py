#!/usr/bin/env python3
"""Workload C: headless Chromium rendering local pages, driven over the DevTools protocol.

What a browsing agent's sandbox holds: a Chromium (Debian's ``chromium``, headless, no
network) with several tabs open on pages that mix long text, a large table, an SVG chart and
a few PNG images, each page also holding its data as a JS model. The pages are generated
from the seed into a temp directory and opened as file:// URLs. For each tab the workload
takes a screenshot (PNG) and a checksum of the DOM and of the JS model; those are the data
it verifies later.

This script is the driver *and* the root of the process tree: Chromium and every process it
forks are its descendants, so they live in whatever cgroup this script was started in and a
driver can squeeze the whole tree. Chromium dies with this script (PR_SET_PDEATHSIG).

Speaks the READY / CHECK / TOUCH / VERIFY protocol of ``protocol.py``, over the whole tree:

- READY's size is the PSS of the tree (shared pages split, so the sum is honest);
- CHECK / TOUCH first read every swappable page of every process of the tree (pagewalk via
  /proc/PID/mem, root or ancestor), then re-take every screenshot and recompute every DOM
  checksum, and compare them with the ones taken at build time.

DevTools runs over ``--remote-debugging-pipe`` (fds 3 and 4, NUL-separated JSON): no port.

    python bench/workloads/browser.py --mb 300 --seed 1
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import fcntl
import hashlib
import html
import json
import math
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import pagewalk
import protocol  # a sibling module: bench/workloads is on sys.path when run as a script

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                  "--hide-scrollbars", "--remote-debugging-pipe"]
VIEWPORT = {"width": 1280, "height": 2000, "deviceScaleFactor": 1, "mobile": False}
BASE_MB = 440  # PSS of a headless Chromium tree with one small tab: browser, GPU, utility, zygotes, renderer
ROWS = 800  # table rows (and JS model records) per page
MB_PER_PAGE = 105  # PSS one more tab adds (its renderer: DOM, layout, images, JS model)


class DevToolsError(RuntimeError):
    pass


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


# ---------------------------------------------------------------------------------------
# pages


WORDS = ("model agent memory swap page table render layout value result request response "
         "token report chart series total average error latency throughput cluster region "
         "sandbox session browser screenshot element style script image column row index "
         "the a of to and in is for on with by from this that as at be are was it or an").split()


def png(width: int, height: int, r: random.Random) -> bytes:
    """A deterministic RGB PNG: gradients, blocks and a little noise (compresses like a photo-ish chart)."""
    fx, fy, phase = r.randint(1, 7), r.randint(1, 7), r.randint(0, 255)
    blocks = [(r.randint(0, width), r.randint(0, height), r.randint(10, 80), r.randint(10, 80),
               bytes(r.randint(0, 255) for _ in range(3))) for _ in range(12)]
    noise = r.randbytes(width * 3 + 7)
    rows = []
    for y in range(height):
        row = bytearray(b"\0")  # filter: none
        for x in range(width):
            row += bytes(((x * fx + phase) & 255, (y * fy + phase) & 255, ((x + y) * 3 + noise[x * 3 + y % 7]) & 255))
        for bx, by, bw, bh, rgb in blocks:
            if by <= y < by + bh:
                lo, hi = max(bx, 0), min(bx + bw, width)
                row[1 + lo * 3:1 + hi * 3] = rgb * (hi - lo)
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"".join(rows), 6)) + chunk(b"IEND", b""))


def _text(r: random.Random, n: int) -> str:
    return " ".join(r.choice(WORDS) for _ in range(n)).capitalize() + "."


def page_html(r: random.Random, i: int, rows: int, images: list[str]) -> str:
    """One report page: text, a table of *rows* rows, an SVG chart, images, a JS data model."""
    paras = "".join(f"<p>{html.escape(_text(r, r.randint(40, 160)))}</p>" for _ in range(r.randint(25, 50)))
    records = [{"id": f"r{i}-{k}", "host": f"node-{r.randint(1, 400):03d}.{r.choice(['eu', 'us', 'ap'])}",
                "status": r.choice(["ok", "degraded", "failed", "ok", "ok"]),
                "latency_ms": round(r.lognormvariate(3, 0.8), 2), "requests": r.randint(0, 10**6),
                "note": _text(r, r.randint(3, 14)), "tags": [r.choice(WORDS) for _ in range(r.randint(1, 5))]}
               for k in range(rows)]
    table = "".join(f"<tr><td>{x['id']}</td><td>{x['host']}</td><td class=s-{x['status']}>{x['status']}</td>"
                    f"<td>{x['latency_ms']}</td><td>{x['requests']:,}</td><td>{html.escape(x['note'])}</td>"
                    f"<td>{' '.join(x['tags'])}</td></tr>" for x in records)
    pts = " ".join(f"{k * 2},{300 - int(150 + 120 * math.sin(k / (7 + i)) * r.random())}"
                   for k in range(600))
    bars = "".join(f'<rect x="{k * 20}" y="{300 - h}" width="16" height="{h}" fill="hsl({(k * 37 + i * 11) % 360},60%,55%)"/>'
                   for k, h in enumerate(r.randint(10, 280) for _ in range(60)))
    dots = "".join(f'<circle cx="{r.randint(0, 1200)}" cy="{r.randint(0, 300)}" r="{r.randint(2, 9)}" '
                   f'fill-opacity="0.6" fill="hsl({r.randint(0, 359)},70%,45%)"/>' for _ in range(300))
    labels = "".join(f'<text x="{k * 100}" y="315" font-size="11">{r.choice(WORDS)}</text>' for k in range(12))
    imgs = "".join(f'<figure><img src="{name}" width="480" height="320"><figcaption>{html.escape(_text(r, 8))}'
                   f"</figcaption></figure>" for name in images)
    data = json.dumps(records, separators=(",", ":")).replace("</", "<\\/")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>Report {i}</title><style>
body{{font-family:DejaVu Sans,sans-serif;margin:24px;color:#222}} table{{border-collapse:collapse;font-size:12px}}
td{{border:1px solid #ccc;padding:2px 6px}} .s-failed{{background:#fdd}} .s-degraded{{background:#ffd}}
figure{{display:inline-block;margin:8px}} svg{{border:1px solid #999}}
</style></head><body><h1>Report {i}: {html.escape(_text(r, 5))}</h1>
<svg width="1200" height="320" viewBox="0 0 1200 320"><g>{bars}</g><polyline fill="none" stroke="#036"
stroke-width="1.5" points="{pts}"/><g>{dots}</g><g>{labels}</g></svg>
<div>{imgs}</div><article>{paras}</article><table><thead><tr><th>id</th><th>host</th><th>status</th>
<th>latency ms</th><th>requests</th><th>note</th><th>tags</th></tr></thead><tbody>{table}</tbody></table>
<script type="application/json" id="data">{data}</script>
<script>
const model = JSON.parse(document.getElementById("data").textContent);
const byHost = new Map();
for (const x of model) {{ if (!byHost.has(x.host)) byHost.set(x.host, []); byHost.get(x.host).push(x); }}
const summary = [...byHost].map(([h, xs]) => ({{host: h, n: xs.length,
  mean: xs.reduce((a, x) => a + x.latency_ms, 0) / xs.length, words: xs.map(x => x.note).join(" ")}}));
window.__model = {{model, summary, byHostKeys: [...byHost.keys()]}};
</script></body></html>"""


def write_pages(directory: str, seed: int, pages: int, rows: int) -> list[str]:
    r = random.Random(seed)
    urls = []
    for i in range(pages):
        images = []
        for k in range(3):
            name = f"img-{i}-{k}.png"
            with open(os.path.join(directory, name), "wb") as f:
                f.write(png(240, 160, r))
            images.append(name)
        path = os.path.join(directory, f"page-{i}.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(page_html(r, i, rows, images))
        urls.append("file://" + path)
    return urls


# the DOM + JS model checksum, computed inside the page (cyrb53 over the serialized state)
DOM_CHECKSUM_JS = """(() => {
  const s = document.documentElement.outerHTML + "\\u0001" + document.body.innerText + "\\u0001" +
            JSON.stringify(window.__model);
  let h1 = 0xdeadbeef, h2 = 0x41c6ce57;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    h1 = Math.imul(h1 ^ c, 2654435761); h2 = Math.imul(h2 ^ c, 1597334677);
  }
  h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507) ^ Math.imul(h2 ^ (h2 >>> 13), 3266489909);
  h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507) ^ Math.imul(h1 ^ (h1 >>> 13), 3266489909);
  return s.length + ":" + (h2 >>> 0).toString(16).padStart(8, "0") + (h1 >>> 0).toString(16).padStart(8, "0");
})()"""


# ---------------------------------------------------------------------------------------
# the browser


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script dies; DevTools pipe on fds 3/4."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Chromium:
    """A headless Chromium on a DevTools pipe; one attached session per tab."""

    def __init__(self, user_data_dir: str, log_path: str, binary: str | None = None):
        binary = binary or find_chromium()
        if not binary:
            raise DevToolsError("chromium not found: apt-get install chromium")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # fds 3 and 4 of the child are the DevTools pipe; F_DUPFD moves our ends above 10 first
        # so that the dup2 onto 3 and 4 cannot clobber one with the other
        high_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD_CLOEXEC, 10)
        high_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_child_r)
        os.close(from_child_w)

        def child_setup():
            _die_with_parent()
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                [binary, *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, pass_fds=(3, 4),
                preexec_fn=child_setup)
        finally:
            os.close(high_r)
            os.close(high_w)
        self._buf = b""
        self._id = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 120.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_child, data):]
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                    raise DevToolsError(f"{method}: no answer within {timeout:.0f}s")
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise DevToolsError(f"{method}: chromium closed the DevTools pipe "
                                        f"(exit status {self.proc.poll()})")
                self._buf += chunk
            raw, _, self._buf = self._buf.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") != self._id:
                continue  # an event, or a late answer: nothing here waits for those
            if "error" in reply:
                raise DevToolsError(f"{method}: {reply['error'].get('message')}")
            return reply.get("result", {})

    def evaluate(self, session: str, expression: str, timeout: float = 120.0):
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True}, session, timeout)
        if "exceptionDetails" in res:
            raise DevToolsError(f"page script failed: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def open_tab(self, url: str) -> str:
        """A new tab on *url*, loaded (images included); returns its session id."""
        target = self.call("Target.createTarget", {"url": "about:blank", "newWindow": True})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", VIEWPORT, session)
        self.call("Page.navigate", {"url": url}, session)
        deadline = time.monotonic() + 120
        while self.evaluate(session, "document.readyState === 'complete' && !!window.__model") is not True:
            if time.monotonic() > deadline:
                raise DevToolsError(f"{url}: not loaded within 120s")
            time.sleep(0.05)
        return session

    def screenshot(self, session: str) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session)["data"])

    def tree(self) -> list[int]:
        return [self.pid, *pagewalk.descendants(self.pid)] if self.proc.poll() is None else []

    def close(self) -> None:
        if self.proc.poll() is None:
            leftovers = pagewalk.descendants(self.pid)
            try:
                self.call("Browser.close", timeout=10)
                self.proc.wait(timeout=10)
            except (DevToolsError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()  # our child
                self.proc.wait()
            for pid in leftovers:  # our descendants, by pid, if any outlived the browser
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()


# ---------------------------------------------------------------------------------------
# the workload


class Session:
    """The tabs, and what they must still show when asked again."""

    def __init__(self, browser: Chromium, urls: list[str]):
        self.browser = browser
        self.tabs = [browser.open_tab(u) for u in urls]
        self.broken = False

    def state(self) -> list[tuple[str, str]]:
        """(DOM + model checksum, screenshot sha256) of every tab, re-computed now."""
        out = []
        for s in self.tabs:
            self.browser.call("Page.bringToFront", session=s)  # only a visible tab paints a frame
            dom = self.browser.evaluate(s, DOM_CHECKSUM_JS)
            shot = hashlib.sha256(self.browser.screenshot(s)).hexdigest()
            out.append((dom, shot))
        return out

    def checksum(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for dom, shot in self.state():
            h.update(f"{dom} {shot}\n".encode())
        return h.hexdigest()

    def corrupt(self) -> None:
        """Change one cell of one tab's table (for the test of VERIFY FAIL)."""
        self.browser.evaluate(self.tabs[len(self.tabs) // 2],
                              "document.querySelector('tbody td').textContent += '!'")


def plan(mb: float) -> tuple[int, int]:
    """(pages, table rows per page) for a tree of about *mb* MiB; small trees get small pages."""
    pages = max(1, 1 + round((mb - BASE_MB) / MB_PER_PAGE))
    rows = ROWS if mb >= BASE_MB + MB_PER_PAGE else ROWS // 10
    return pages, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="target size of the process tree in MiB (default 300)")
    ap.add_argument("--seed", type=int, default=1, help="content seed (default 1)")
    ap.add_argument("--chromium", help="browser binary (default: chromium on PATH)")
    ap.add_argument("--corrupt-for-test", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="agentzip-browser-")
    browser = None
    # SIGTERM / SIGHUP: leave through the finally below (browser closed, temp dir removed)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(143))
    try:
        pages, rows = plan(a.mb)
        site = os.path.join(work, "site")
        os.mkdir(site)
        urls = write_pages(site, a.seed, pages, rows)
        browser = Chromium(os.path.join(work, "profile"), os.path.join(work, "chromium.log"), a.chromium)
        version = browser.call("Browser.getVersion")["product"]
        session = Session(browser, urls)
        want = session.checksum()

        def tree() -> list:
            return ["self", *browser.tree()]

        def size() -> int:
            return sum(pagewalk.pss_bytes(p) for p in tree())

        print(f"browser: {version}, {pages} tabs x {rows} table rows, tree of {len(tree())} processes, "
              f"pss {size() >> 20} MiB, built in {time.monotonic() - t0:.1f}s, checksum {want}",
              file=sys.stderr, flush=True)
        return protocol.serve("browser", want, session.checksum, size=size, pids=tree,
                              corrupt=session.corrupt if a.corrupt_for_test else None)
    except DevToolsError as e:
        print(f"browser: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        if browser is not None:
            browser.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
