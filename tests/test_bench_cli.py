"""The benchmarks' one entry point (`python -m bench NAME`): `--help` lists every bench, each
bench answers `--help`, every bench module is listed, and every bench command line in
BENCHMARKS.md, README.md and docs/ names a bench and passes its argument parser. Fast: nothing
runs past argument parsing, no root needed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.cli import BENCHES  # noqa: E402

DOCS = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_BENCHES = {"__init__", "__main__", "cli", "swap_report"}  # swap_report: swap's report


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_every_bench():
    r = bench("--help")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(BENCHES)
    assert all(line.split(maxsplit=1)[1:] for line in r.stdout.splitlines() if line.startswith("  ")), \
        "a bench without a summary: its module needs a docstring"


def test_no_name_or_an_unknown_one_is_a_usage_error():
    assert bench().returncode == 2
    r = bench("no_such_bench")
    assert r.returncode == 2 and "no bench 'no_such_bench'" in r.stderr


def test_every_bench_module_is_listed():
    modules = {p.stem for p in (ROOT / "bench").glob("*.py")} - NOT_BENCHES
    assert modules == set(BENCHES)


@pytest.mark.parametrize("name", BENCHES)
def test_bench_help(name):
    r = bench(name, "--help")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"usage: python -m bench {name}"), r.stdout[:200]


# --- the command lines of the docs ---------------------------------------------------------

# python -m bench NAME and its arguments, up to the end of the code span or line, a `#`
# comment or a trailing note in parentheses ("   (results/...json; 15 min)")
COMMAND = re.compile(r"python -m bench (\w+)([^`\n#]*?)(?=\s{3}\(|\s*#|\s*$)")


def _code(text: str) -> list[str]:
    """Fenced and indented code lines, and the inline code spans of each paragraph (a span
    may wrap onto the paragraph's next line)."""
    out: list[str] = []
    prose: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    ") and not (prose and prose[-1]):
            out.append(line)
        else:
            prose.append(line)
    for paragraph in "\n".join(prose).split("\n\n"):
        out += [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", paragraph)]
    return out


def doc_commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        for code in _code(doc.read_text(encoding="utf-8")):
            for m in COMMAND.finditer(code):
                found.append((doc.name, m.group(1), shlex.split(m.group(2))))
    return found


# A template, not a command: placeholders the reader fills in
TEMPLATE = re.compile(r"\.\.\.|[<\[]")

# Parse argv with the bench's own parser, then stop: argparse.ArgumentParser.parse_args exits
# 0 once the arguments parsed (2 on an error, as always), so nothing is run.
PARSE_ONLY = """
import argparse, sys
from bench.cli import main
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    print("PARSED")
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_args
sys.exit(main(sys.argv[1:]))
"""


def test_the_docs_have_bench_commands():
    """The extraction finds them (the checks below are not vacuous), and no command line
    runs a benchmark from its old place (tools/bench*.py, tools/load.py)."""
    cmds = doc_commands()
    assert len(cmds) > 40 and {"swap", "density", "demo", "load", "latency"} <= {c[1] for c in cmds}
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        assert not re.search(r"python\s+tools/(bench\w*|load)\.py", text), doc.name


@pytest.mark.parametrize("doc,name,argv", doc_commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_doc_command_parses(doc, name, argv):
    if name.isupper():
        return  # `python -m bench NAME --help`: NAME is a placeholder
    assert name in BENCHES, f"{doc}: `python -m bench {name}`: no such bench"
    if any(TEMPLATE.search(a) for a in argv):
        return  # a template ("--json ...", "--tree <checkout>"): the name is all there is to check
    r = subprocess.run([sys.executable, "-c", PARSE_ONLY, name, *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0 and "PARSED" in r.stdout, \
        f"{doc}: python -m bench {name} {shlex.join(argv)}:\n{r.stdout}{r.stderr}"
