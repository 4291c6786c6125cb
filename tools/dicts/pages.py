"""Seeded local HTML pages for the Chromium corpus (file:// only, no network).

Two styles that share no template, so training and held-out pages come from different
"programs": `heldout` renders the benchmark's kind of page (text, tables, SVG, a few canvas
images); `train` renders other sites (lists, forms, code listings, nested navigation).
"""

from __future__ import annotations

import html
import os
import random

WORDS = ("agent sandbox memory page swap token model prompt result value table column row "
         "report chart figure data source build deploy service request latency error warning "
         "the a of and to in is for on with as by at from this that").split()


def _text(r: random.Random, n: int) -> str:
    return html.escape(" ".join(r.choice(WORDS) for _ in range(n)).capitalize() + ".")


def heldout_page(r: random.Random, i: int) -> str:
    rows = "".join(
        "<tr>" + "".join(f"<td>{r.randint(0, 10**6) if c % 2 else _text(r, 3)}</td>" for c in range(6)) + "</tr>"
        for _ in range(r.randint(50, 200)))
    svg = "".join(f'<circle cx="{r.randint(0, 400)}" cy="{r.randint(0, 300)}" r="{r.randint(2, 30)}" '
                  f'fill="hsl({r.randint(0, 360)},70%,50%)"/>' for _ in range(r.randint(50, 300)))
    paras = "".join(f"<p>{_text(r, r.randint(30, 120))}</p>" for _ in range(r.randint(20, 60)))
    canvas = (f'<canvas id="c" width="600" height="300"></canvas><script>const c=document.getElementById("c")'
              f'.getContext("2d");for(let i=0;i<500;i++){{c.fillStyle=`hsl(${{(i*{r.randint(1, 9)})%360}},60%,50%)`;'
              f'c.fillRect((i*37)%600,(i*53)%300,20,20);}}</script>')
    return (f"<!doctype html><html><head><title>Report {i}</title><style>td{{border:1px solid #ccc}}"
            f"</style></head><body><h1>Report {i}</h1>{paras}<table>{rows}</table>"
            f'<svg width="400" height="300">{svg}</svg>{canvas}</body></html>')


def train_page(r: random.Random, i: int) -> str:
    nav = "".join(f'<li><a href="#s{k}">{_text(r, 2)}</a><ul>' +
                  "".join(f"<li>{_text(r, 4)}</li>" for _ in range(r.randint(2, 8))) + "</ul></li>"
                  for k in range(r.randint(10, 40)))
    form = "".join(f'<label>{_text(r, 2)} <input name="f{k}" value="{_text(r, 2)}"></label><br>'
                   for k in range(r.randint(10, 50)))
    code = html.escape("\n".join(f"def f{k}(x):\n    return x * {r.randint(1, 99)} + {r.random():.4f}"
                                 for k in range(r.randint(50, 300))))
    items = "".join(f'<div class="card"><h3>{_text(r, 3)}</h3><p>{_text(r, r.randint(10, 60))}</p></div>'
                    for _ in range(r.randint(30, 120)))
    script = ("<script>const data=[];for(let i=0;i<20000;i++)data.push({id:i,label:'item '+i,"
              "v:Math.sin(i)});document.title+=' '+data.length;</script>")
    return (f"<!doctype html><html><head><title>Docs {i}</title><style>.card{{margin:4px;padding:4px;"
            f"box-shadow:0 1px 3px #888}}</style></head><body><nav><ul>{nav}</ul></nav><form>{form}</form>"
            f"<pre><code>{code}</code></pre>{items}{script}</body></html>")


def write_pages(directory: str, style: str, seed: int, count: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    r = random.Random(seed)
    make = heldout_page if style == "heldout" else train_page
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"{style}-{seed}-{i}.html")
        with open(path, "w", encoding="utf-8") as f:
            f.write(make(r, i))
        paths.append(path)
    return paths
