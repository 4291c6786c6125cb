"""Attach/detach chain (agentzip_blk.host) and the CLI around it.

Swap tests attach a real chain: nbdkit -> nbdfuse -> loop (direct I/O) -> swap. They
run inside this test process (a supervisor may kill detached helpers when a command
returns) and every one of them tears down in a fixture finalizer that runs even when
the test fails: swapoff, losetup -d, fusermount3 -u, stop nbdkit -- in that order.

The server plugin is a fixture parameter: nbdkit's built-in ``memory`` plugin (the chain
is plugin-agnostic) and the project's nbdkit/agentzip_plugin.py once it exists. Set
AGENTZIP_TEST_PLUGINS=memory (or =agentzip) to run only one of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from agentzip_blk import cli, errors, procfs
from agentzip_blk.host import attach, facts, health, procs, runstate
from agentzip_blk.host.chain import required_tools, resolve_frontend, teardown
from agentzip_blk.host.servercmd import default_plugin_path, nbdkit_command, plugin_env
from agentzip_blk.procfs import loop_backing

SIZE = 64 << 20
FUSE_TOOLS = ["nbdkit", "nbdfuse", "fusermount3", "losetup", "mkswap", "swapon", "swapoff"]


# --- helpers ---------------------------------------------------------------------------

def _swap_skip_reason() -> str | None:
    if not facts.is_root():
        return "needs root (swap, loop devices, FUSE)"
    missing = facts.missing_tools(FUSE_TOOLS)
    if missing:
        return f"missing tools: {', '.join(missing)}"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control"
    if facts.zswap_enabled():
        return "zswap is enabled (up refuses it)"
    return None


requires_swap = pytest.mark.skipif(_swap_skip_reason() is not None,
                                   reason=_swap_skip_reason() or "")


def _mounts_under(prefix: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            mp = procfs.unescape(line.split()[4])
            if mp == prefix or mp.startswith(prefix + "/"):
                out.append(mp)
    return out


def _loops_under(prefix: str) -> list[str]:
    out = []
    for name in os.listdir("/sys/block"):
        if not name.startswith("loop"):
            continue
        try:
            with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8",
                      errors="surrogateescape") as f:
                backing = f.read().strip()
        except OSError:
            continue
        if backing.startswith(prefix + "/"):
            out.append(f"/dev/{name}")
    return out


def _procs_mentioning(prefix: str) -> list[int]:
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        pid = int(entry)
        if any(prefix in a for a in procfs.process_cmdline(pid)) and procs.pid_alive(pid):
            out.append(pid)
    return out


def leftovers(run_dir: str) -> dict:
    """Everything the chain of ``run_dir`` may have left behind (empty lists when clean)."""
    loops = _loops_under(run_dir)
    return {
        "swaps": [a.filename for a in procfs.swaps()
                  if a.filename in loops or a.filename.startswith(run_dir)],
        "loops": loops,
        "mounts": _mounts_under(run_dir),
        "procs": _procs_mentioning(run_dir),
    }


def assert_clean(run_dir: str) -> None:
    left = leftovers(run_dir)
    assert left["swaps"] == [], f"swap areas left: {left}"
    assert left["loops"] == [], f"loop devices left: {left}"
    assert left["mounts"] == [], f"fuse mounts left: {left}"
    assert left["procs"] == [], f"processes left: {left}"


def emergency_teardown(run_dir: str) -> None:
    """Last resort after a failed test: undo anything under run_dir, in the safe order."""
    try:
        if runstate.RunState.load(run_dir) is not None:
            attach.down(run_dir, force=True, timeout=20)
    except Exception as e:  # fall through to the manual sweep
        print(f"emergency_teardown: down failed: {e}", file=sys.stderr)
    left = leftovers(run_dir)
    for loop in left["loops"]:
        if procfs.swap_area(loop) is not None:
            subprocess.run(["swapoff", loop], check=False)
    for loop in _loops_under(run_dir):
        subprocess.run(["losetup", "-d", loop], check=False)
    for mp in _mounts_under(run_dir):
        subprocess.run(["fusermount3", "-u", mp], check=False)
        if mp in _mounts_under(run_dir):
            subprocess.run(["fusermount3", "-u", "-z", mp], check=False)
    time.sleep(0.2)
    if any(procfs.swap_area(l) for l in _loops_under(run_dir)):
        return  # never stop a server that still backs swap
    for pid in _procs_mentioning(run_dir):
        argv = procfs.process_cmdline(pid)
        if argv and os.path.basename(argv[0]) in ("nbdkit", "nbdfuse"):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while _procs_mentioning(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)


def _plugin_params():
    """(plugin, front end) pairs: nbdkit's memory plugin behind nbdfuse, and ours behind
    each front end that a host without kernel nbd has (its own FUSE file, nbdfuse)."""
    wanted = os.environ.get("AGENTZIP_TEST_PLUGINS", "memory,agentzip").split(",")
    params = []
    if "memory" in wanted:
        params.append(pytest.param(("memory", "nbdfuse"), id="memory"))
    if "agentzip" in wanted:
        path = default_plugin_path()
        for frontend, pid in (("fuse", "agentzip-fuse"), ("nbdfuse", "agentzip-nbdfuse")):
            params.append(pytest.param(
                (path, frontend), id=pid,
                marks=pytest.mark.skipif(not os.path.isfile(path),
                                         reason=f"{path} not written yet")))
    return params


@pytest.fixture(params=_plugin_params())
def plugin_frontend(request) -> tuple[str, str]:
    return request.param


@pytest.fixture
def plugin(plugin_frontend) -> str:
    """The nbdkit plugin behind the device: 'memory' or the path of agentzip_plugin.py."""
    return plugin_frontend[0]


@pytest.fixture
def frontend(plugin_frontend) -> str:
    """device.frontend of the chain: "fuse" (served by nbdkit itself) or "nbdfuse"."""
    return plugin_frontend[1]


@pytest.fixture
def run_dir():
    """A short private run directory; the finalizer undoes anything attached from it."""
    d = tempfile.mkdtemp(prefix="azt-", dir="/tmp")
    try:
        yield d
    finally:
        if facts.is_root():
            emergency_teardown(d)
        shutil.rmtree(d, ignore_errors=True)


def _config(run_dir):
    from agentzip_blk.config import Config
    cfg = Config()
    # Never share the default disk tier file with another server; the run dir is removed
    # after each test, so the file goes with it.
    cfg.pool.swap_out_path = os.path.join(run_dir, "disk-tier")
    return cfg


@pytest.fixture
def chain(run_dir, plugin, frontend):
    """An attached device (64 MiB, priority 123); teardown guaranteed by ``run_dir``."""
    state = attach.up(_config(run_dir), None, run_dir, priority=123, size=SIZE, plugin=plugin,
                      frontend=None if facts.nbd_kernel_available() else frontend)
    yield state
    if runstate.RunState.load(run_dir) is not None:
        attach.down(run_dir, force=True)


# --- unit tests (no root needed) ---------------------------------------------------------

def test_swaps_parses_proc_swaps(tmp_path):
    p = tmp_path / "swaps"
    p.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                 "/dev/loop3                              partition\t65532\t\t1024\t\t7\n"
                 "/swap\\040file                           file\t\t1024\t\t0\t\t-2\n")
    areas = procfs.swaps(str(p))
    assert [(a.filename, a.type, a.size, a.used, a.priority) for a in areas] == [
        ("/dev/loop3", "partition", 65532 * 1024, 1024 * 1024, 7),
        ("/swap file", "file", 1024 * 1024, 0, -2)]


def test_meminfo_in_bytes(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemTotal:       24683520 kB\nMemAvailable:    1000 kB\nHugePages_Total:       0\n")
    mi = procfs.meminfo(str(p))
    assert mi == {"MemTotal": 24683520 * 1024, "MemAvailable": 1000 * 1024,
                  "HugePages_Total": 0}


def test_require_tools_message_says_what_to_install():
    with pytest.raises(facts.SetupError) as ei:
        facts.require_tools(["nbdkit", "/nonexistent/nbdfuse"])
    msg = str(ei.value)
    assert "\n" not in msg and "nbdfuse not found" in msg
    assert "apt-get install" in msg and "libnbd-bin" in msg and "fuse3" in msg


def test_process_facts():
    assert procfs.process_rss(os.getpid()) > 0
    assert procs.pid_alive(os.getpid())
    assert not procs.pid_alive(0)
    assert procfs.process_cmdline(os.getpid())


def test_swapoff_fits():
    gib = 1 << 30
    ok, avail, needed = attach.swapoff_fits(0, {"MemAvailable": 0, "MemTotal": gib})
    assert ok  # nothing swapped: nothing to bring back
    ok, _, needed = attach.swapoff_fits(500 << 20, {"MemAvailable": 600 << 20, "MemTotal": gib})
    assert not ok and needed == (500 << 20) + attach.SWAPOFF_MARGIN_MIN
    ok, _, _ = attach.swapoff_fits(500 << 20, {"MemAvailable": 2 * gib, "MemTotal": 4 * gib})
    assert ok


def test_nbdkit_command_matches_interfaces():
    cmd = nbdkit_command("/x/nbdkit/agentzip_plugin.py", "/run/a/nbd.sock", "/run/a/control.sock",
                         "/run/a/nbdkit.pid", config_path="/etc/agentzip/config.yaml",
                         size=1 << 30)
    assert cmd == ["nbdkit", "-f", "-U", "/run/a/nbd.sock", "-P", "/run/a/nbdkit.pid",
                   "--filter=ip", "python", "/x/nbdkit/agentzip_plugin.py",
                   f"allow=uid:{os.geteuid()}", "deny=all",
                   "config=/etc/agentzip/config.yaml", f"size={1 << 30}",
                   "control=/run/a/control.sock"]
    assert "-f" not in nbdkit_command("/p.py", "/s", None, "/pid", foreground=False)
    env = plugin_env()
    parts = env["PYTHONPATH"].split(os.pathsep)
    import agentzip_blk
    assert os.path.dirname(os.path.dirname(os.path.abspath(agentzip_blk.__file__))) == parts[0]
    assert any(p.startswith(os.path.realpath(sys.prefix)) and "site-packages" in p
               for p in parts) or sys.prefix == sys.base_prefix


def test_runstate_roundtrip(tmp_path):
    st = runstate.RunState(run_dir=str(tmp_path), plugin="memory",
                         nbd_socket=str(tmp_path / "nbd.sock"), size=SIZE, nbdkit_pid=42)
    st.save()
    again = runstate.RunState.load(str(tmp_path))
    assert again == st
    assert json.loads((tmp_path / "state.json").read_text())["nbdkit_pid"] == 42


# --- CLI error lines (no root needed: root is simulated) -------------------------------------

def _one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("agentzip-blk: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", [["up"], ["down"]])
def test_cli_non_root(monkeypatch, capsys, tmp_path, command):
    monkeypatch.setattr(facts, "is_root", lambda: False)
    rc = cli.main(["--run-dir", str(tmp_path), *command])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "root" in line and "sudo" in line


@pytest.mark.parametrize("text,key", [
    ("device:\n  swap_priority: 99999\n", "device.swap_priority"),
    ("pool:\n  max_sizee: 1G\n", "pool.max_sizee"),
])
def test_cli_bad_config(monkeypatch, capsys, tmp_path, text, key):
    monkeypatch.setattr(facts, "is_root", lambda: True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    rc = cli.main(["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "up",
                   "--plugin", "memory"])
    assert rc == 2
    assert key in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "state.json").exists()


def test_cli_missing_config_file(capsys, tmp_path):
    rc = cli.main(["--config", str(tmp_path / "nope.yaml"), "serve"])
    assert rc == 2
    assert "nope.yaml" in _one_error_line(capsys.readouterr().err)


def test_cli_missing_tool(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(facts, "is_root", lambda: True)
    monkeypatch.setattr(facts, "nbd_kernel_available", lambda: False)
    real_which = facts.which
    monkeypatch.setattr(facts, "which",
                        lambda n: None if os.path.basename(n) == "nbdfuse" else real_which(n))
    rc = cli.main(["--run-dir", str(tmp_path), "up", "--plugin", "memory", "--size", "64M"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "nbdfuse not found: apt-get install libnbd-bin fuse3" in line


@pytest.mark.skipif(facts.missing_tools(FUSE_TOOLS), reason="tools missing")
def test_cli_refuses_zswap(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(facts, "is_root", lambda: True)
    monkeypatch.setattr(facts, "zswap_enabled", lambda *a: True)
    rc = cli.main(["--run-dir", str(tmp_path), "up", "--plugin", "memory", "--size", "64M"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "zswap" in line and "echo N > /sys/module/zswap/parameters/enabled" in line
    assert "--allow-zswap" in line


def test_cli_status_not_attached(capsys, tmp_path):
    assert cli.main(["--run-dir", str(tmp_path), "status"]) == 3
    assert "not attached" in capsys.readouterr().out
    assert cli.main(["--run-dir", str(tmp_path), "status", "--json"]) == 3
    st = json.loads(capsys.readouterr().out)
    assert st["attached"] is False and st["swap"] is None and "zswap_enabled" in st


def test_cli_stats_without_server(capsys, tmp_path):
    assert cli.main(["--run-dir", str(tmp_path), "stats"]) == 1
    assert "no server" in _one_error_line(capsys.readouterr().err)


@pytest.fixture
def fake_control(monkeypatch):
    """Replace agentzip_blk.datapath.control.request."""
    reply = {"ok": True, "orig_mem": 100 << 20, "stored_mem": 25 << 20, "ratio": 4.0,
             "pages": 25600, "same_pages": 100, "raw_pages": 3, "compressed_pages": 25497,
             "shared_pages": 7, "codec_pages": {"zstd": 25497}, "max_size": 8 << 30,
             "pool_bytes": 24 << 20, "meta_bytes": 1 << 20, "enospc": 0}
    calls = []

    def request(path, cmd, **args):
        calls.append((path, cmd, args))
        return dict(reply)

    from agentzip_blk.datapath import control
    monkeypatch.setattr(control, "request", request)
    return reply, calls


def test_cli_stats_json_is_the_control_reply(fake_control, capsys, tmp_path):
    reply, calls = fake_control
    sock = str(tmp_path / "control.sock")
    assert cli.main(["stats", "--json", "--control", sock]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    expected = dict(reply)
    del expected["ok"]
    assert json.loads(out) == expected
    assert calls == [(sock, "stats", {})]


def test_cli_stats_human(fake_control, capsys, tmp_path):
    assert cli.main(["stats", "--control", str(tmp_path / "c.sock")]) == 0
    head, row = capsys.readouterr().out.splitlines()
    assert head.split()[:7] == ["ORIG", "STORED", "RATIO", "PAGES", "SAME", "RAW", "SHARED"]
    assert row.split()[:4] == ["100M", "25M", "4.00", "25600"]
    assert "zstd:25497" in row


# --- real swap ---------------------------------------------------------------------------------

def _dio(loop: str) -> str:
    with open(f"/sys/block/{os.path.basename(loop)}/loop/dio") as f:
        return f.read().strip()


@requires_swap
def test_attach_status_detach(chain, run_dir, plugin, frontend, capsys):
    st = chain
    assert st.mode == "fuse" or st.mode == "nbd"
    area = procfs.swap_area(st.device)
    assert area is not None, open("/proc/swaps").read()
    assert area.priority == 123
    assert area.size > SIZE - (1 << 20)
    if st.mode == "fuse":
        assert st.loop_device.startswith("/dev/loop")
        assert _dio(st.loop_device) == "1"
        assert _mounts_under(run_dir) == [os.path.join(run_dir, "mnt")]
        assert st.frontend == frontend
        assert loop_backing(st.loop_device) == st.fuse_file
    if st.mode == "fuse" and frontend == "nbdfuse":
        assert procs.pid_alive(st.nbdfuse_pid)
        if facts.which("cc") or facts.which("gcc"):  # the mlockall preload shim
            assert st.nbdfuse_locked
            assert procfs.process_locked(st.nbdfuse_pid) > 0
    if st.mode == "fuse" and frontend == "fuse":
        # no helper process: the loop device backs onto the file nbdkit itself serves; the
        # holder of its descriptors (host.holder) keeps them across a crash
        assert st.nbdfuse_pid is None and st.fuse_file == os.path.join(run_dir, "mnt", "device")
        assert sorted(_procs_mentioning(run_dir)) == sorted([st.nbdkit_pid, st.holder_pid])
    assert procs.pid_alive(st.nbdkit_pid)
    with open(f"/proc/{st.nbdkit_pid}/oom_score_adj") as f:
        # best effort: needs CAP_SYS_RESOURCE, which some containers lack
        assert (f.read().strip() == "-1000") == st.oom_protected
    with open(f"/proc/{st.nbdkit_pid}/status") as f:
        vmlck = [l for l in f if l.startswith("VmLck:")][0]
    assert int(vmlck.split()[1]) > 0, "the server should have locked its memory (plugin mlockall or --swap)"

    s = health.status(run_dir)
    assert s["attached"] is True
    assert s["swap"]["filename"] == st.device and s["swap"]["priority"] == 123
    assert s["server"]["alive"] and s["server"]["rss"] > 0
    if st.mode == "fuse":
        assert s["loop"]["dio"] is True and s["mount"]["mounted"]
        assert s["loop"]["rotational"] is False  # device.rotational defaults to off
        assert (s["nbdfuse"] is None) == (frontend == "fuse")
    with open(os.path.join(run_dir, "state.json")) as f:
        assert json.load(f)["device"] == st.device

    if plugin.endswith(".py"):  # the real plugin also serves the control socket
        from agentzip_blk.datapath import control
        stats = control.request(st.control_socket, "stats")
        assert stats["size"] == SIZE
        assert cli.main(["--run-dir", run_dir, "stats", "--json"]) == 0
        js = json.loads(capsys.readouterr().out)
        assert "ok" not in js and {"orig_mem", "stored_mem", "ratio"} <= set(js)
        assert cli.main(["--run-dir", run_dir, "stats"]) == 0
        assert capsys.readouterr().out.split()[:3] == ["ORIG", "STORED", "RATIO"]
        if st.frontend == "fuse":  # the swap requests (mkswap's writes) came through FUSE
            door = stats["server"]["fuse"]
            assert door["alive"] and door["writes"] > 0 and door["errors"] == 0

    nbdkit_pid, nbdfuse_pid, holder_pid = st.nbdkit_pid, st.nbdfuse_pid, st.holder_pid
    res = attach.down(run_dir)
    assert res["device"] == st.device
    assert procfs.swap_area(st.device) is None
    assert not procs.pid_alive(nbdkit_pid)
    assert not nbdfuse_pid or not procs.pid_alive(nbdfuse_pid)
    assert not holder_pid or not procs.pid_alive(holder_pid)
    assert not os.path.exists(os.path.join(run_dir, "state.json"))
    assert_clean(run_dir)


@requires_swap
def test_up_refuses_double_up(chain, run_dir, plugin, capsys):
    with pytest.raises(attach.AlreadyAttached, match="agentzip-blk down"):
        attach.up(_config(run_dir), None, run_dir, priority=5, size=SIZE, plugin=plugin)
    # the CLI says the same in one line, exit 2
    rc = cli.main(["--run-dir", run_dir, "up", "--plugin", "memory", "--size", "64M"])
    assert rc == 2
    assert "already attached" in _one_error_line(capsys.readouterr().err)
    # still attached and unharmed
    assert procfs.swap_area(chain.device).priority == 123
    assert runstate.RunState.load(run_dir).nbdkit_pid == chain.nbdkit_pid
    attach.down(run_dir)
    assert_clean(run_dir)


@requires_swap
def test_stale_state_is_cleaned(run_dir):
    # a state file whose processes are long gone (pid 1 is not our nbdkit)
    stale = runstate.RunState(run_dir=run_dir, plugin="memory",
                            nbd_socket=os.path.join(run_dir, "nbd.sock"), size=SIZE,
                            nbdkit_pid=1, device="/dev/loop999999")  # no such loop device
    stale.save()
    st = attach.up(_config(run_dir), None, run_dir, priority=7, size=SIZE, plugin="memory")
    try:
        assert st.nbdkit_pid != 1 and procfs.swap_area(st.device).priority == 7
    finally:
        attach.down(run_dir)
    assert_clean(run_dir)
    assert procs.pid_alive(1)


@requires_swap
def test_rotational_on_request(run_dir):
    """device.rotational flags the loop device before swapon (cluster swap readahead)."""
    cfg = _config(run_dir)
    cfg.device.rotational = True
    with attach.attached(cfg, run_dir, priority=8, size=SIZE, plugin="memory") as st:
        if st.mode == "fuse":
            s = health.status(run_dir)
            assert s["loop"]["rotational"] is True
            assert not [w for w in s["warnings"] if "rotational" in w]
            with open(f"/sys/block/{os.path.basename(st.loop_device)}/queue/rotational") as f:
                assert f.read().strip() == "1"
    assert_clean(run_dir)


def fail_after(monkeypatch, failing: str) -> None:
    """Make the attach fail right after step ``failing`` (chain.step_done ends each step)."""
    from agentzip_blk.host import chain

    def step_done(step: str) -> None:
        if step == failing:
            raise errors.DeviceError(f"injected failure after {step}")

    monkeypatch.setattr(chain, "step_done", step_done)


@requires_swap
@pytest.mark.parametrize("step", ["nbdkit", "nbdfuse", "losetup", "mkswap", "swapon"])
def test_rollback_after_each_step(run_dir, step, monkeypatch):
    fail_after(monkeypatch, step)
    with pytest.raises(errors.DeviceError, match=f"injected failure after {step}"):
        attach.up(_config(run_dir), None, run_dir, priority=9, size=SIZE, plugin="memory")
    assert_clean(run_dir)
    assert not os.path.exists(os.path.join(run_dir, "state.json"))


@requires_swap
@pytest.mark.skipif(not os.path.isfile(default_plugin_path()), reason="plugin missing")
@pytest.mark.parametrize("step", ["nbdkit", "fuse", "losetup", "mkswap", "swapon"])
def test_rollback_after_each_step_in_process_fuse(run_dir, step, monkeypatch):
    """The in-process front end: a failure after nbdkit mounted its FUSE file unmounts it
    (the server then stops with nothing left behind)."""
    fail_after(monkeypatch, step)
    with pytest.raises(errors.DeviceError, match=f"injected failure after {step}"):
        attach.up(_config(run_dir), None, run_dir, priority=9, size=SIZE, frontend="fuse",
                  kernel_nbd=False)
    assert_clean(run_dir)
    assert not os.path.exists(os.path.join(run_dir, "state.json"))


def test_frontend_resolution():
    from agentzip_blk.config import Config
    plugin = default_plugin_path()
    cfg = Config()
    assert resolve_frontend(cfg, None, kernel_nbd=True, plugin=plugin) == "nbd"
    assert resolve_frontend(cfg, None, kernel_nbd=False, plugin=plugin) == "fuse"
    # nbdkit's own plugins cannot serve FUSE: auto falls back to nbdfuse, fuse is an error
    assert resolve_frontend(cfg, None, kernel_nbd=False, plugin="memory") == "nbdfuse"
    with pytest.raises(errors.SetupError, match="agentzip plugin"):
        resolve_frontend(cfg, "fuse", kernel_nbd=False, plugin="memory")
    cfg.device.frontend = "nbdfuse"
    assert resolve_frontend(cfg, None, kernel_nbd=True, plugin=plugin) == "nbdfuse"
    cfg.device.frontend = "nbd"
    with pytest.raises(errors.SetupError, match="no nbd driver"):
        resolve_frontend(cfg, None, kernel_nbd=False, plugin=plugin)
    assert required_tools(False, frontend="fuse") == [
        "nbdkit", "mkswap", "swapon", "swapoff", "fusermount3", "losetup"]


@requires_swap
def test_rollback_when_mkswap_fails(run_dir):
    with pytest.raises(errors.DeviceError, match="mkswap"):
        attach.up(_config(run_dir), None, run_dir, priority=9, size=SIZE, plugin="memory",
                  tools={"mkswap": "/bin/false"})
    assert_clean(run_dir)
    assert not os.path.exists(os.path.join(run_dir, "state.json"))


@requires_swap
def test_server_start_failure_reports_log(run_dir):
    with pytest.raises(errors.DeviceError) as ei:
        attach.up(_config(run_dir), None, run_dir, priority=9, size=SIZE,
                  plugin="no-such-plugin-azt")
    msg = str(ei.value)
    assert "nbdkit exited" in msg and "no-such-plugin-azt" in msg  # the log tail is included
    assert_clean(run_dir)


@requires_swap
def test_down_refuses_when_memory_would_not_fit(chain, run_dir, monkeypatch):
    real_area = procfs.swap_area

    def swapped_a_lot(dev, *a):
        area = real_area(dev, *a)
        if area is not None:
            area.used = 500 << 20
        return area

    monkeypatch.setattr(procfs, "swap_area", swapped_a_lot)
    monkeypatch.setattr(procfs, "meminfo", lambda *a: {"MemTotal": 1 << 30,
                                                       "MemAvailable": 100 << 20,
                                                       "MemFree": 100 << 20})
    with pytest.raises(attach.SwapoffRefused, match="--force"):
        attach.down(run_dir)
    assert real_area(chain.device) is not None, "refused down must leave swap on"
    assert procs.pid_alive(chain.nbdkit_pid)
    # the CLI: one line, runtime failure
    rc = cli.main(["--run-dir", run_dir, "down"])
    assert rc == 1
    # --force goes ahead
    assert cli.main(["--run-dir", run_dir, "down", "--force"]) == 0
    monkeypatch.undo()
    assert_clean(run_dir)


@requires_swap
def test_teardown_refuses_to_stop_server_under_swap(chain, run_dir, monkeypatch):
    # swapoff "succeeds" without doing anything: the server must survive
    state = runstate.RunState.load(run_dir)
    state.tools = {"swapoff": "/bin/true"}
    with pytest.raises(errors.DeviceError, match="still in /proc/swaps"):
        teardown(state)
    assert procfs.swap_area(chain.device) is not None
    assert procs.pid_alive(chain.nbdkit_pid)


@requires_swap
def test_attached_context_manager_tears_down_on_error(run_dir):
    with pytest.raises(ZeroDivisionError):
        with attach.attached(_config(run_dir), run_dir, priority=11, size=SIZE, plugin="memory") as st:
            assert procfs.swap_area(st.device).priority == 11
            1 / 0
    assert_clean(run_dir)


@requires_swap
def test_cli_up_status_down(run_dir, capsys):
    assert cli.main(["--run-dir", run_dir, "up", "--plugin", "memory", "--size", "64M",
                     "--priority", "17"]) == 0
    out = capsys.readouterr().out
    assert "swap on" in out and "priority 17" in out
    assert cli.main(["--run-dir", run_dir, "status", "-o", "TYPE,PRIO,DIO,HEALTH", "--raw",
                     "-n"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["agentzip", "17", "on", "OK"]
    assert cli.main(["--run-dir", run_dir, "status", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["attached"] and st["swap"]["priority"] == 17
    assert cli.main(["--run-dir", run_dir, "down"]) == 0
    assert "detached" in capsys.readouterr().out
    assert_clean(run_dir)
    assert cli.main(["--run-dir", run_dir, "down"]) == 0  # nothing to do
    assert "nothing to do" in capsys.readouterr().err


# --- serve ---------------------------------------------------------------------------------------

@pytest.mark.skipif(facts.missing_tools(["nbdkit"]), reason="nbdkit missing")
def test_cli_serve_foreground_and_sigterm(run_dir, plugin):
    nbd = pytest.importorskip("nbd")
    sock = os.path.join(run_dir, "s.sock")
    proc = subprocess.Popen([sys.executable, "-m", "agentzip_blk.cli", "--run-dir", run_dir,
                             "serve", "--socket", sock, "--size", "64M", "--plugin", plugin],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "serve did not create its socket"
            time.sleep(0.05)
        h = nbd.NBD()
        h.connect_unix(sock)
        try:
            assert h.get_size() == SIZE
            h.pwrite(b"\x5a" * 4096, 8192)
            assert h.pread(4096, 8192) == b"\x5a" * 4096
        finally:
            h.shutdown()
        if plugin.endswith(".py"):
            assert cli.main(["--run-dir", run_dir, "stats", "--json"]) == 0
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert leftovers(run_dir)["procs"] == []
