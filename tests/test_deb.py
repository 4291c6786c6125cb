"""The Debian package (tools/build-deb.sh): it builds, lintian finds no error in it, it holds
what a host needs without the checkout, it installs into and is removed from a dpkg root
(dpkg --root, maintainer scripts run chrootless), apt can satisfy its Depends here, and the
packaged CLI and plugin run on Debian's python3 with Debian's python3-* packages.

One build per module (~15 s) and one lintian run (~20 s): the whole module stays under a
minute. No chroot: debootstrap needs minutes and a mirror; dpkg --root exercises the
package's own install and removal, and the host's Debian python runs the installed files.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from agentzip_blk.fleet import systemd as units_install

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"  # the launcher's #! and nbdkit's libpython
LIB = "usr/lib/agentzip-blk"
UNITS = sorted(str(p.relative_to(units_install.SOURCE)) for p in units_install.unit_files())

pytestmark = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("dpkg-deb", "dpkg", "cc", "lintian")),
    reason="needs dpkg-deb, dpkg, cc and lintian (./setup.sh test installs them)")
pytestmark = [pytestmark, pytest.mark.slow]  # the inner loop leaves it out


def run(cmd, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 120)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


@pytest.fixture(scope="module")
def deb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = run([str(ROOT / "tools/build-deb.sh"), str(out)], env=dict(os.environ, PYTHON=sys.executable),
            timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    path = Path(r.stdout.strip().splitlines()[-1])
    assert path.parent == out and path.is_file()
    return path


@pytest.fixture(scope="module")
def slow_checks(deb):
    """lintian (~20 s) and apt's resolver (~10 s) run in the background while the other tests
    run; the tests at the end of this module collect them."""
    procs = {"lintian": subprocess.Popen(["lintian", "--tag-display-limit", "0", str(deb)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    if os.geteuid() == 0:  # apt-get -s on a local .deb wants root
        procs["apt"] = subprocess.Popen(["apt-get", "install", "-s", "-q", str(deb)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def collect(procs, name: str, timeout: float = 240) -> tuple[int, str]:
    out, err = procs[name].communicate(timeout=timeout)
    return procs[name].returncode, out + err


@pytest.fixture(scope="module")
def installed(deb, tmp_path_factory) -> Path:
    """The package installed into an empty dpkg root (its Depends are the host's business:
    test_apt_can_satisfy_the_depends)."""
    root = tmp_path_factory.mktemp("root")
    for d in ("info", "updates", "triggers"):
        (root / "var/lib/dpkg" / d).mkdir(parents=True)
    (root / "var/lib/dpkg/status").touch()
    r = dpkg(root, "-i", str(deb))
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def dpkg(root: Path, *args: str) -> subprocess.CompletedProcess:
    return run(["dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends",
                "--force-not-root", "--log=/dev/null", *args])


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "AGENTZIP_", "VIRTUAL_ENV"))}
    env["PATH"] = "/usr/sbin:/usr/bin:/sbin:/bin"  # no venv python3 on PATH
    return env


def packaged_cli(root: Path, *args: str, **kw):
    """The installed /usr/bin/agentzip-blk (its #! is Debian's python3), outside the venv."""
    return run([SYSTEM_PYTHON, str(root / "usr/bin/agentzip-blk"), *args], env=clean_env(), **kw)


def test_the_version_and_architecture_are_in_the_name(deb, slow_checks):
    import tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    # arch-dependent, not _all: it carries the compiled mlock shim and zstandard (build-deb.sh)
    assert deb.name == f"agentzip-blk_{version}_{arch}.deb"
    fields = run(["dpkg-deb", "-f", str(deb)]).stdout
    assert f"Architecture: {arch}" in fields and f"Version: {version}" in fields
    depends = re.search(r"^Depends: (.*)$", fields, re.M).group(1)
    names = {d.strip().split()[0] for d in depends.split(",")}
    assert {"nbdkit", "nbdkit-plugin-python", "fuse3", "util-linux", "python3"} <= names
    assert {"python3-numpy", "python3-yaml", "python3-lz4", "python3-xxhash", "python3-cryptography"} <= names
    assert {"liblz4-1", "libzstd1", "libssl3"} <= names  # the native request path links them
    assert "python3-zstandard" not in names  # bookworm's 0.20 cannot read the store's frames


def test_the_file_list_holds_what_a_host_needs(deb):
    listing = run(["dpkg-deb", "-c", str(deb)]).stdout
    files = {line.split()[-1].removeprefix("./") for line in listing.splitlines()
             if not line.startswith("d")}
    manifest = json.loads((ROOT / "agentzip_blk/codec/dicts/manifest.json").read_text())
    dicts = {f"{LIB}/agentzip_blk/codec/dicts/{e['file'] or e['name'] + '.dict'}"
             for e in manifest["dictionaries"]}
    need = {
        "usr/bin/agentzip-blk",
        f"{LIB}/agentzip_blk/datapath/nbdkit_plugin.py",  # the plugin nbdkit loads
        f"{LIB}/agentzip_blk/cli/__init__.py",
        f"{LIB}/libagentzip-mlock.so",  # prebuilt: `up` compiles nothing
        "etc/agentzip/config.yaml",
        "usr/share/man/man1/agentzip-blk.1.gz",
        "usr/share/man/man5/agentzip-blk.yaml.5.gz",  # the config file's page
        "usr/share/bash-completion/completions/agentzip-blk",
        "usr/share/zsh/vendor-completions/_agentzip-blk",
        "usr/share/fish/vendor_completions.d/agentzip-blk.fish",
        "usr/share/doc/agentzip-blk/copyright",
        "usr/share/doc/agentzip-blk/changelog.gz",
        "usr/share/doc/agentzip-blk/README.md",  # the units' Documentation=file:
        "usr/share/agentzip-blk/grafana-dashboard.json",  # for the monitoring side to import
        "usr/share/agentzip-blk/prometheus-alerts.yaml",
        "usr/share/doc/agentzip-blk/examples/agentzip-blk-metrics-nonroot.conf",
        *dicts,
        *(f"usr/lib/systemd/system/{u}" for u in UNITS),
    }
    assert not need - files, sorted(need - files)
    assert any(f.startswith(f"{LIB}/zstandard/backend_c.") for f in files)
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    # the one shared object inside the package: the native request path, built for python3.11
    assert [f for f in files if f.startswith(f"{LIB}/agentzip_blk/") and f.endswith(".so")] == [
        f"{LIB}/agentzip_blk/datapath/nativeloop{sysconfig.get_config_var('EXT_SUFFIX')}"]
    ctrl = Path(run(["mktemp", "-d"]).stdout.strip())
    try:
        assert run(["dpkg-deb", "-e", str(deb), str(ctrl)]).returncode == 0
        assert (ctrl / "conffiles").read_text().split() == ["/etc/agentzip/config.yaml"]
    finally:
        shutil.rmtree(ctrl)


def test_install_and_remove_in_a_dpkg_root(deb, tmp_path):
    """Install, conffile registered, postinst byte-compiled; remove leaves only the conffile
    (and no __pycache__); purge leaves nothing of ours."""
    root = tmp_path / "root"
    for d in ("info", "updates", "triggers"):
        (root / "var/lib/dpkg" / d).mkdir(parents=True)
    (root / "var/lib/dpkg/status").touch()
    r = dpkg(root, "-i", str(deb))
    assert r.returncode == 0, r.stdout + r.stderr
    st = run(["dpkg-query", f"--admindir={root}/var/lib/dpkg", "-s", "agentzip-blk"]).stdout
    assert "Status: install ok installed" in st
    assert re.search(r"^Conffiles:\n /etc/agentzip/config\.yaml [0-9a-f]{32}", st, re.M), st
    assert list((root / LIB / "agentzip_blk/cli").glob("__pycache__/*.pyc"))  # postinst
    r = dpkg(root, "-r", "agentzip-blk")
    assert r.returncode == 0, r.stdout + r.stderr
    left = [p for p in root.rglob("*") if p.is_file() and "var/lib/dpkg" not in str(p)]
    assert left == [root / "etc/agentzip/config.yaml"], left  # prerm removed the bytecode
    r = dpkg(root, "-P", "agentzip-blk")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (root / "etc/agentzip").exists() and not (root / LIB).exists()


def test_the_packaged_cli_runs_on_debian_python(installed, tmp_path):
    r = packaged_cli(installed, "--help")
    assert r.returncode == 0 and "install-units" in r.stdout, r.stderr
    # its own files, Debian's dependencies, the vendored zstandard ahead of Debian's, and the
    # shipped config.yaml valid and meaning the defaults
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import agentzip_blk, zstandard, numpy; "
             "import lz4, xxhash, yaml, tqdm, cryptography, prometheus_client, sortedcontainers; "
             "from agentzip_blk.config.load import load_config; "
             "ok = load_config(sys.argv[2]) == load_config('/dev/null'); "
             "print(agentzip_blk.__file__, agentzip_blk.__version__, zstandard.__file__, "
             "zstandard.__version__, numpy.__file__, ok)")
    r = run([SYSTEM_PYTHON, "-I", "-c", probe, str(installed / LIB),
             str(installed / "etc/agentzip/config.yaml")])
    assert r.returncode == 0, r.stderr
    pkg, version, zstd, zstd_version, np, defaults = r.stdout.split()
    import agentzip_blk
    assert version == agentzip_blk.__version__
    assert pkg.startswith(str(installed / LIB)) and zstd.startswith(str(installed / LIB))
    assert tuple(int(x) for x in zstd_version.split(".")[:2]) >= (0, 24)
    assert np.startswith("/usr/lib/python3/dist-packages/")
    assert defaults == "True"
    # the packaged units, installed by the packaged program, name it
    r = packaged_cli(installed, "install-units", "--prefix", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    svc = (tmp_path / "p/etc/systemd/system/agentzip-blk.service").read_text()
    assert f"ExecStart={installed}/usr/bin/agentzip-blk up" in svc


def test_the_packaged_mlock_shim_works(installed):
    """Preloaded into a process (as `up` does into nbdfuse), the prebuilt shim refuses SIGTERM;
    `up` would take it from here: chain.MLOCK_SHIMS names /usr/lib/agentzip-blk's."""
    from agentzip_blk.host import chain
    assert f"/{LIB}/libagentzip-mlock.so" in chain.MLOCK_SHIMS
    lib = installed / LIB / "libagentzip-mlock.so"
    proc = subprocess.Popen(["sleep", "30"], env=dict(os.environ, LD_PRELOAD=str(lib)),
                            stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None, "SIGTERM ended a process preloaded with the packaged shim"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    assert "nbdfuse refused a signal" in err


def test_the_packaged_units_name_the_packaged_program(installed):
    for u in UNITS:
        text = (installed / "usr/lib/systemd/system" / u).read_text()
        src = (units_install.SOURCE / u).read_text()
        assert text == src.replace(units_install.PLACEHOLDER_BIN, "/usr/bin/agentzip-blk"), u


@pytest.mark.nbdkit
def test_the_packaged_plugin_serves_bytes_back(installed, tmp_path):
    """nbdkit runs the installed plugin (Debian's libpython, python3-numpy, the vendored
    zstandard): pages written come back byte for byte."""
    nbd = pytest.importorskip("nbd")
    if run(["nbdkit", "python", "--version"]).returncode != 0:
        pytest.skip("nbdkit-plugin-python missing")
    sock, control = tmp_path / "nbd.sock", tmp_path / "control.sock"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"pool:\n  swap_out_path: {tmp_path / 'disk-tier'}\n")
    proc = subprocess.Popen([SYSTEM_PYTHON, str(installed / "usr/bin/agentzip-blk"),
                             "--config", str(cfg), "--run-dir", str(tmp_path), "serve",
                             "--socket", str(sock), "--control", str(control), "--size", "64M"],
                            env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (sock.exists() and control.exists()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the packaged serve did not come up"
            time.sleep(0.05)
        # incompressible, compressible (zstd with a dictionary), zero and duplicate pages
        text = b"".join(b'{"role": "tool", "content": "page %05d"}\n' % i for i in range(1600))
        pages = os.urandom(4096 * 8) + text[:4096 * 16] + bytes(4096 * 4) + text[:4096 * 4]
        h = nbd.NBD()
        h.connect_unix(str(sock))
        try:
            h.pwrite(pages, 1 << 20)
            assert h.pread(len(pages), 1 << 20) == pages
        finally:
            h.shutdown()
        r = packaged_cli(installed, "--run-dir", str(tmp_path), "stats", "--json",
                         "--control", str(control))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)
        # the server is nbdkit running the installed plugin on the installed package
        nbdkit_pid = int((tmp_path / "serve.pid").read_text())
        argv = Path(f"/proc/{nbdkit_pid}/cmdline").read_bytes().split(b"\0")
        assert str(installed / LIB / "agentzip_blk/datapath/nbdkit_plugin.py").encode() in argv
        environ = Path(f"/proc/{nbdkit_pid}/environ").read_bytes().split(b"\0")
        pythonpath = next(e for e in environ if e.startswith(b"PYTHONPATH=")).decode()
        assert pythonpath.split("=", 1)[1].split(":")[0] == str(installed / LIB)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_man_page_renders_and_names_every_subcommand(installed):
    from agentzip_blk.cli import COMMANDS, build_parser
    page = installed / "usr/share/man/man1/agentzip-blk.1.gz"
    groff = shutil.which("groff")
    if groff:
        r = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z"], input=gzip.decompress(page.read_bytes()),
                           capture_output=True, timeout=60)
        assert r.returncode == 0 and not r.stderr, r.stderr  # -ww -z: every warning, no output
    r = run(["man", "-l", "-Tutf8", str(page)], env=dict(os.environ, MANWIDTH="100"))
    assert r.returncode == 0, r.stderr
    text = re.sub(r".\x08", "", r.stdout)
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    names = list(sub.choices)
    assert len(names) == len(COMMANDS)
    for name in names:
        assert f"agentzip-blk {name}" in text, name
    assert "EXIT STATUS" in text and "/etc/agentzip/config.yaml" in text


def test_the_bash_completion_loads_and_completes_subcommands(installed):
    comp = installed / "usr/share/bash-completion/completions/agentzip-blk"
    r = run(["bash", "-c", f'source "{comp}" && complete -p agentzip-blk'])
    assert r.returncode == 0, r.stderr
    fn = re.search(r"-F (\S+) agentzip-blk", r.stdout).group(1)
    # what bash offers after `agentzip-blk st<TAB>`
    script = (f'source "{comp}"; COMP_WORDS=(agentzip-blk st); COMP_CWORD=1; '
              f'COMP_LINE="agentzip-blk st"; COMP_POINT=${{#COMP_LINE}}; {fn} agentzip-blk st agentzip-blk; '
              'printf "%s\\n" "${COMPREPLY[@]}"')
    r = run(["bash", "-c", script])
    assert set(r.stdout.split()) >= {"status", "stats"}, r.stdout + r.stderr


def test_the_config_man_page_documents_every_key_with_its_default(installed):
    from agentzip_blk.config import reference
    page = installed / "usr/share/man/man5/agentzip-blk.yaml.5.gz"
    src = gzip.decompress(page.read_bytes())
    if shutil.which("groff"):
        r = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z"], input=src,
                           capture_output=True, timeout=60)
        assert r.returncode == 0 and not r.stderr, r.stderr
    r = run(["man", "-l", "-Tutf8", str(page)], env=dict(os.environ, MANWIDTH="200"))
    assert r.returncode == 0, r.stderr
    text = re.sub(r".\x08", "", r.stdout)
    assert "AGENTZIP-BLK.YAML(5)" in text
    for k in reference.KEYS:
        if k.name == "scopes":
            continue
        section, key = k.name.split(".")
        default = reference.value_text(k.name, reference.default_of(k.name))
        assert re.search(rf"^\s+{key} \(default {re.escape(default)}\)$", text, re.M), k.name
        assert section.upper() in text
    # agentzip-blk(1) points at it
    one = gzip.decompress((installed / "usr/share/man/man1/agentzip-blk.1.gz").read_bytes())
    assert b"agentzip\\-blk.yaml" in one or b"agentzip-blk.yaml" in one


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish missing (apt-get install fish)")
def test_the_fish_completion_completes_subcommands_and_options(installed):
    comp = installed / "usr/share/fish/vendor_completions.d/agentzip-blk.fish"
    r = run(["fish", "--no-config", "-c", f"source {comp}; complete -C 'agentzip-blk st'; "
             "echo ---; complete -C 'agentzip-blk status --'; echo ---; "
             "complete -C 'agentzip-blk config '"])
    assert r.returncode == 0, r.stderr
    first, options, config = r.stdout.split("---\n")
    assert {line.split("\t")[0] for line in first.splitlines()} == {"status", "stats"}
    assert {"--json", "--noheadings", "--run-dir"} <= {line.split("\t")[0] for line in
                                                       options.splitlines()}
    assert [line.split("\t")[0] for line in config.splitlines()] == ["show"]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh missing (apt-get install zsh)")
def test_the_zsh_completion_registers_with_compinit(installed):
    comp_dir = installed / "usr/share/zsh/vendor-completions"
    assert run(["zsh", "-n", str(comp_dir / "_agentzip-blk")]).returncode == 0
    r = run(["zsh", "-f", "-c", f"fpath=({comp_dir} $fpath); autoload -U compinit; "
             "compinit -u -D; print -r -- ${_comps[agentzip-blk]}"])
    assert r.stdout.strip() == "_agentzip-blk", r.stdout + r.stderr
    text = (comp_dir / "_agentzip-blk").read_text()
    assert "status:" in text and "install-units:" in text


def test_lintian_reports_no_errors(slow_checks):
    rc, out = collect(slow_checks, "lintian")
    errors = [line for line in out.splitlines() if line.startswith("E:")]
    assert not errors, out
    assert "agentzip-blk" in out or rc == 0, out  # it ran on the package (or found nothing)


def test_apt_can_satisfy_the_depends(slow_checks):
    """apt's resolver on this host's sources: the Depends exist in Debian at those versions."""
    if "apt" not in slow_checks:
        pytest.skip("apt-get -s on a local .deb wants root")
    rc, out = collect(slow_checks, "apt")
    assert rc == 0, out
    assert re.search(r"^Inst agentzip-blk ", out, re.M), out


CHROOT = os.environ.get("AGENTZIP_TEST_CHROOT")  # a Debian 12 tree: debootstrap bookworm DIR


@pytest.mark.skipif(not CHROOT or os.geteuid() != 0,
                    reason="set AGENTZIP_TEST_CHROOT to a debootstrapped bookworm tree (as root); "
                           "CI has none: debootstrap and the install take ~5 min")
def test_apt_install_and_purge_in_a_bookworm_chroot(deb):
    """The real path on a pristine Debian 12: apt resolves and installs the Depends, the
    packaged CLI runs, purge leaves nothing. (Run once by hand for the packaging work:
    debootstrap --variant=minbase bookworm DIR; ~1m40 for the install of its 70 packages.)"""
    root = Path(CHROOT)
    (root / "tmp" / deb.name).write_bytes(deb.read_bytes())
    mounted = []
    try:
        for src, dst, opts in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--bind"])):
            if run(["mountpoint", "-q", str(root / dst)]).returncode != 0:
                assert run(["mount", *opts, src, str(root / dst)]).returncode == 0
                mounted.append(root / dst)

        def sh(script: str, timeout: float = 900) -> subprocess.CompletedProcess:
            return run(["chroot", str(root), "sh", "-ec", script], timeout=timeout,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive"})

        r = sh(f"apt-get update -qq; apt-get install -y -q --no-install-recommends /tmp/{deb.name}")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr
        r = sh("agentzip-blk --version; dpkg -s agentzip-blk | grep '^Status'; "
               "agentzip-blk install-units --prefix /tmp/u >/dev/null; "
               "grep '^ExecStart=' /tmp/u/etc/systemd/system/agentzip-blk.service; "
               # `up` takes the packaged shim: no compiler in this tree
               "! command -v cc; mkdir -p /tmp/run; python3 -c 'import sys; sys.path.insert(0, "
               "\"/usr/lib/agentzip-blk\"); from agentzip_blk.host import chain; "
               "print(\"shim\", chain.mlock_shim(\"/tmp/run\"))'")
        assert r.returncode == 0, r.stderr
        assert "install ok installed" in r.stdout and "ExecStart=/usr/bin/agentzip-blk up" in r.stdout
        assert f"shim /{LIB}/libagentzip-mlock.so" in r.stdout
        r = sh("apt-get purge -y -q agentzip-blk >/dev/null; "
               "test ! -e /usr/lib/agentzip-blk && test ! -e /etc/agentzip && test ! -e /usr/bin/agentzip-blk")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        for m in reversed(mounted):
            run(["umount", str(m)])
        (root / "tmp" / deb.name).unlink(missing_ok=True)


TRIXIE = os.environ.get("AGENTZIP_TEST_TRIXIE_CHROOT")  # debootstrap trixie DIR (Debian 13)


@pytest.mark.skipif(not TRIXIE or os.geteuid() != 0,
                    reason="set AGENTZIP_TEST_TRIXIE_CHROOT to a debootstrapped trixie tree (as "
                           "root): debootstrap --variant=minbase --include=python3 trixie DIR "
                           "(~2 min), then libpython3.13-dev in it for the native path")
def test_the_debian_13_package_installs_serves_and_purges_in_a_trixie_chroot(tmp_path):
    """`DEB_SUITE=trixie tools/build-deb.sh` on this Debian 12 host: apt in a Debian 13 root
    resolves its Depends (python3 3.13, numpy 2), the packaged serve runs nbdkit with trixie's
    libpython3.13 and the vendored zstandard's cp313 backend, pages come back byte for byte,
    purge leaves nothing. (Run by hand for issue 29: python3 3.13.5, nbdkit 1.42.3, numpy
    2.2.4; `up` with the FUSE door and the native path, `status` OK, `down` also ran there.)"""
    nbd = pytest.importorskip("nbd")
    root = Path(TRIXIE)
    inc = root / "usr/include/python3.13"
    env = dict(os.environ, PYTHON=sys.executable, DEB_SUITE="trixie")
    if (inc / "Python.h").exists():
        env["PYTHON_INCLUDE"] = f"-I{inc} -idirafter {root / 'usr/include'}"
    r = run([str(ROOT / "tools/build-deb.sh"), str(tmp_path)], env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    deb = Path(r.stdout.strip().splitlines()[-1])
    assert deb.name.endswith("+deb13_amd64.deb") or "+deb13_" in deb.name
    fields = run(["dpkg-deb", "-f", str(deb), "Depends"]).stdout
    assert "python3 (>= 3.13), python3 (<< 3.14)" in fields
    (root / "tmp" / deb.name).write_bytes(deb.read_bytes())
    srv = root / "tmp/agentzip-deb13"
    shutil.rmtree(srv, ignore_errors=True)
    srv.mkdir()
    (srv / "config.yaml").write_text("pool:\n  swap_out_path: /tmp/agentzip-deb13/tier\n")
    mounted, proc = [], None
    try:
        for src, dst, opts in (("proc", "proc", ["-t", "proc"]), ("/dev", "dev", ["--bind"])):
            if run(["mountpoint", "-q", str(root / dst)]).returncode != 0:
                assert run(["mount", *opts, src, str(root / dst)]).returncode == 0
                mounted.append(root / dst)

        def sh(script: str, timeout: float = 900) -> subprocess.CompletedProcess:
            return run(["chroot", str(root), "sh", "-ec", script], timeout=timeout,
                       env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                            "DEBIAN_FRONTEND": "noninteractive"})

        r = sh(f"apt-get install -y -q --no-install-recommends /tmp/{deb.name} >/dev/null; "
               "agentzip-blk --version; python3 -c 'import sys; print(sys.version_info[:2])'")
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr
        assert "(3, 13)" in r.stdout
        proc = subprocess.Popen(["chroot", str(root), "/usr/bin/agentzip-blk", "--config",
                                 "/tmp/agentzip-deb13/config.yaml", "--run-dir",
                                 "/tmp/agentzip-deb13", "serve", "--size", "64M"],
                                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not ((srv / "nbd.sock").exists() and (srv / "control.sock").exists()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the packaged serve did not come up"
            time.sleep(0.1)
        text = b"".join(b'{"role": "tool", "content": "page %05d"}\n' % i for i in range(1600))
        pages = os.urandom(4096 * 8) + text[:4096 * 16] + bytes(4096 * 4)
        h = nbd.NBD()
        h.connect_unix(str(srv / "nbd.sock"))
        try:
            h.pwrite(pages, 1 << 20)
            assert h.pread(len(pages), 1 << 20) == pages
        finally:
            h.shutdown()
        r = sh("agentzip-blk --run-dir /tmp/agentzip-deb13 stats --json --control "
               "/tmp/agentzip-deb13/control.sock")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["codec_pages"].get("zstd", 0) > 0  # frames, cp313 backend
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        r = sh("apt-get purge -y -q agentzip-blk >/dev/null; test ! -e /usr/lib/agentzip-blk && "
               "test ! -e /etc/agentzip && test ! -e /usr/bin/agentzip-blk")
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for m in reversed(mounted):
            run(["umount", str(m)])
        shutil.rmtree(srv, ignore_errors=True)
        (root / "tmp" / deb.name).unlink(missing_ok=True)
