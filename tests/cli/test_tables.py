"""The zramctl-like tables of `status`, `stats` and `dict list`: -o picks the columns in order,
--output-all gives all of them, --raw splits on whitespace into the chosen columns, -n drops
the header, -b gives integers, an unknown column is one error line and exit 2. `stats` runs
against a real nbdkit server holding pages written over NBD; everything in separate processes."""

from __future__ import annotations

import json

import pytest

from agentzip_blk.cli.dicts import DICTS
from agentzip_blk.cli.stats import STATS
from agentzip_blk.cli.status import STATUS
from agentzip_blk.cli.table import BYTES, INT, Column, Table, key
from agentzip_blk.codec.dictionaries.files import load_manifest
from nbdkit_server import nbdkit_available, start_server

from .clirun import one_error_line, run

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

PAGE = 4096


def _raw(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines()]


# --- the helper --------------------------------------------------------------------------------

T = Table([Column("NAME", "n", key("name")), Column("SIZE", "s", key("size"), BYTES),
           Column("N", "count", key("n"), INT), Column("NOTE", "x", key("note"), default=False)])
ROWS = [{"name": "a", "size": 1536, "n": 7, "note": "two words"},
        {"name": "longer", "size": 10 << 30, "n": None, "note": ""}]


def test_render_aligns_numbers_right_text_left():
    assert T.render(ROWS, T.defaults()).splitlines() == [
        "NAME   SIZE N",
        "a      1.5K 7",
        "longer  10G -"]


def test_render_raw_escapes_and_keeps_one_field_per_column():
    out = T.render(ROWS, T.select("NAME,NOTE,SIZE"), raw=True, exact_bytes=True)
    assert out.splitlines() == ["NAME NOTE SIZE", "a two\\x20words 1536", "longer - 10737418240"]
    assert T.render(ROWS, T.select("n"), headings=False).splitlines() == ["7", "-"]


def test_select():
    assert [c.name for c in T.select(None)] == ["NAME", "SIZE", "N"]
    assert [c.name for c in T.select("+note")] == ["NAME", "SIZE", "N", "NOTE"]
    assert [c.name for c in T.select("size,name")] == ["SIZE", "NAME"]
    assert [c.name for c in T.select("n", output_all=True)] == ["NAME", "SIZE", "N", "NOTE"]
    with pytest.raises(Exception, match="unknown column 'BOGUS'"):
        T.select("NAME,BOGUS")


# --- dict list -----------------------------------------------------------------------------------

def test_dict_list_columns():
    infos = load_manifest()
    res = run("dict", "list", "-o", "NAME,SIZE", "--raw", "-b")
    assert res.returncode == 0, res.stderr
    rows = _raw(res.stdout)
    assert rows[0] == ["NAME", "SIZE"]
    assert rows[1:] == [[i.name, str(i.size)] for i in infos]  # -b: exact bytes

    res = run("dict", "list", "-o", "SIZE,NAME", "--raw", "-n")
    assert _raw(res.stdout) == [[("32K" if 32000 < i.size <= 32768 else "?"), i.name]
                                for i in infos]

    res = run("dict", "list", "--output-all", "--raw")
    rows = _raw(res.stdout)
    assert rows[0] == DICTS.names() and all(len(r) == len(DICTS.names()) for r in rows)

    res = run("dict", "list")  # the default: the runtime is no longer cut at 28 characters
    longest = max((i.version for i in infos), key=len)
    assert longest in res.stdout
    assert res.stdout.splitlines()[0].split() == ["NAME", "SIZE", "RUNTIME", "GAIN"]


def test_dict_list_json_is_unchanged():
    res = run("dict", "list", "--json", "-o", "NAME")
    assert json.loads(res.stdout) == [vars(i) for i in load_manifest()]


@pytest.mark.parametrize("argv, good", [(["dict", "list"], "NAME"), (["status"], "NAME"),
                                        (["stats"], "ORIG"), (["config", "show"], "KEY")])
def test_unknown_column_is_exit_2(tmp_path, argv, good):
    res = run("--run-dir", tmp_path, *argv, "-o", f"{good},NOPE")
    assert res.returncode == 2 and res.stdout == ""
    assert "unknown column 'NOPE'" in one_error_line(res.stderr)


# --- status ----------------------------------------------------------------------------------

def test_status_columns(tmp_path):
    res = run("--run-dir", tmp_path, "status", "-o", "NAME,SIZE,USED,PRIO", "--raw", "-b")
    assert res.returncode == 3, res.stderr  # nothing of ours attached from this run dir
    rows = _raw(res.stdout)
    assert rows[0] == ["NAME", "SIZE", "USED", "PRIO"]
    for row in rows[1:]:  # the host's other swap areas, if any
        assert len(row) == 4 and all(c.lstrip("-").isdigit() for c in row[1:])
    assert "device not attached" in res.stderr  # notes go to stderr with --raw

    res = run("--run-dir", tmp_path, "status", "-n", "-o", "TYPE")
    assert not any(line.strip() == "TYPE" for line in res.stdout.splitlines())
    res = run("--run-dir", tmp_path, "status", "--output-all", "--raw")
    assert _raw(res.stdout)[0] == STATUS.names()
    res = run("--run-dir", tmp_path, "status")
    assert res.stdout.splitlines()[0].split() == [c.name for c in STATUS.defaults()]
    assert "device not attached" in res.stdout  # for people, the notes follow the table


def test_status_json_is_unchanged(tmp_path):
    res = run("--run-dir", tmp_path, "status", "--json", "-o", "NAME", "--raw")
    assert res.returncode == 3
    st = json.loads(res.stdout)
    assert st["run_dir"] == str(tmp_path) and "other_swaps" in st and "warnings" in st


# --- stats, against a real server ----------------------------------------------------------------

@pytest.fixture
def server(tmp_path):
    reason = nbdkit_available()
    if reason:
        pytest.skip(reason)
    nbd = pytest.importorskip("nbd")
    srv = start_server(tmp_path)
    try:
        h = nbd.NBD()
        h.connect_unix(srv.nbd_socket)
        try:
            for i in range(8):  # 8 distinct compressible pages
                h.pwrite((b"agentzip page %d " % i) * (PAGE // 16), i * PAGE)
            h.flush()
        finally:
            h.shutdown()
        yield srv
    finally:
        srv.stop()


def test_stats_columns(server):
    sock = server.control_socket
    res = run("stats", "--control", sock, "--json")
    st = json.loads(res.stdout)
    assert st["pages"] == 8 and st["orig_mem"] == 8 * PAGE  # the JSON schema is the reply

    res = run("stats", "--control", sock, "-o", "ORIG,PAGES,STORED,RATIO", "--raw", "-b")
    assert res.returncode == 0, res.stderr
    head, row = _raw(res.stdout)
    assert head == ["ORIG", "PAGES", "STORED", "RATIO"]
    assert row[:3] == [str(st["orig_mem"]), "8", str(st["stored_mem"])]
    assert float(row[3]) == pytest.approx(st["ratio"], abs=0.005)

    res = run("stats", "--control", sock, "-o", "ORIG", "-n")
    assert res.stdout.split() == ["32K"]  # human size without -b

    res = run("stats", "--control", sock, "--output-all", "--raw", "-b")
    head, row = _raw(res.stdout)
    assert head == STATS.names() and len(row) == len(head)
    assert row[head.index("SIZE")] == str(64 << 20)

    res = run("stats", "--control", sock)
    assert res.stdout.splitlines()[0].split() == [c.name for c in STATS.defaults()]


def test_stats_cgroup_table_options():
    import argparse

    from agentzip_blk.cli.stats import CGROUPS, cgroup_table

    row = {"cgroup": "/a.slice", "pids": 2, "orig_mem": 8 << 20, "stored_mem": 2 << 20,
           "ratio": 4.0, "pages": 2048, "zero_pages": 0, "same_pages": 1, "disk_pages": 0,
           "kernel_swap": None, "blob_pages": 2047, "other_swap_pages": 0, "unreadable": 0}
    res = {"cgroups": [row, dict(row, cgroup="/b.slice")], "total": dict(row, cgroup="*"),
           "device": "/dev/loop9", "swap_type": 1,
           "store": {"pages": 4096, "orig_mem": 16 << 20, "compressed_bytes": 4 << 20,
                     "stored_mem": 5 << 20}}
    args = argparse.Namespace(output="CGROUP,ORIG,RATIO,KSWAP", output_all=False, raw=True,
                              noheadings=False, bytes=True)
    assert _raw(cgroup_table(res, args)) == [
        ["CGROUP", "ORIG", "RATIO", "KSWAP"], ["/a.slice", str(8 << 20), "4.00", "-"],
        ["/b.slice", str(8 << 20), "4.00", "-"], ["total", str(8 << 20), "4.00", "-"]]
    args.output, args.raw, args.bytes = None, False, False
    text = cgroup_table(res, args)
    assert text.splitlines()[0].split() == [c.name for c in CGROUPS.defaults()]
    assert "device /dev/loop9" in text  # for people, the notes follow
