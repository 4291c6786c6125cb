"""nbdfuse's mlock preload shim (host/chain.py): built ahead of time (setup.sh, the .deb) and
used by `up` from there; compiled by `up` only when none is prebuilt; a clear error when
neither is possible. The shim itself: a process preloaded with it has locked memory and
survives SIGTERM (what nbdfuse needs, checked on `sleep`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from agentzip_blk.errors import SetupError
from agentzip_blk.host import chain, facts

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def locked_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    return 0


def assert_shim_works(lib: str) -> None:
    """Preloaded into sleep: memory locked, SIGTERM refused (with its line on stderr)."""
    proc = subprocess.Popen(["sleep", "30"], env=dict(os.environ, LD_PRELOAD=lib),
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while locked_kib(proc.pid) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if os.geteuid() == 0:  # RLIMIT_MEMLOCK stops others from locking anything much
            assert locked_kib(proc.pid) > 0
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None, "SIGTERM ended a process preloaded with the shim"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "nbdfuse refused a signal" in err


@pytest.mark.slow
@needs_cc
def test_compiled_shim_locks_and_refuses_sigterm(tmp_path):
    lib = chain.compile_mlock_shim(str(tmp_path / "shim.so"))
    assert lib == str(tmp_path / "shim.so") and not (tmp_path / "shim.so.c").exists()
    assert_shim_works(lib)


@needs_cc
def test_build_it_ahead_of_time_in_a_separate_process(tmp_path):
    """What setup.sh and tools/build-deb.sh run."""
    import sys
    out = tmp_path / "lib.so"
    r = subprocess.run([sys.executable, "-m", "agentzip_blk.host.chain", str(out), "-Wall", "-Werror"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out)
    assert_shim_works(str(out))


def test_up_uses_a_prebuilt_shim_and_compiles_none(tmp_path, monkeypatch):
    pre = tmp_path / "prebuilt.so"
    pre.write_bytes(b"\x7fELF")  # found by path; `up` does not look inside
    monkeypatch.setattr(chain, "MLOCK_SHIMS", ("/nonexistent/libagentzip-mlock.so", str(pre)))
    monkeypatch.setattr(facts, "which", lambda name: None)  # no compiler: must not matter
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert chain.mlock_shim(str(run_dir)) == str(pre)
    assert list(run_dir.iterdir()) == []


@needs_cc
def test_a_stale_prebuilt_shim_is_not_used(tmp_path, monkeypatch):
    pre = tmp_path / "prebuilt.so"
    pre.write_bytes(b"\x7fELF")
    old = os.path.getmtime(chain.__file__) - 60  # built before chain.py last changed
    os.utime(pre, (old, old))
    monkeypatch.setattr(chain, "MLOCK_SHIMS", (str(pre),))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lib = chain.mlock_shim(str(run_dir))
    assert lib == str(run_dir / "agentzip-mlock.so")  # compiled afresh into the run dir
    assert_shim_works(lib)


def test_neither_prebuilt_nor_a_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(chain, "MLOCK_SHIMS", (str(tmp_path / "missing.so"),))
    monkeypatch.setattr(facts, "which", lambda name: None)
    with pytest.raises(SetupError) as exc:
        chain.mlock_shim(str(tmp_path))
    msg = str(exc.value)
    assert "mlock shim" in msg and str(tmp_path / "missing.so") in msg and "no C compiler" in msg
    assert "setup.sh" in msg and "\n" not in msg


@pytest.mark.skipif(not os.path.isfile(chain.MLOCK_SHIMS[0]), reason="setup.sh has not built it")
def test_the_checkout_shim_setup_sh_built_works():
    assert_shim_works(chain.MLOCK_SHIMS[0])
