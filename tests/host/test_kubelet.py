"""The kubelet swap check (host.kubelet, doctor's "kubelet swap" line) on temp config files,
and the same check through the CLI in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentzip_blk.host import doctor, kubelet

REPO = Path(__file__).resolve().parents[2]


def check_of(tmp_path, text: str | None) -> doctor.Check:
    path = tmp_path / "config.yaml"
    if text is not None:
        path.write_text(text)
    f = doctor.Facts(kernel="6.12.0", kubelet=kubelet.read_kubelet_swap(str(path)))
    (c,) = [c for c in doctor.diagnose(f) if c.name == "kubelet swap"]
    return c


KC = "apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\n"


@pytest.mark.parametrize("text, status, detail, fix", [
    (None, "pass", "not a Kubernetes node", ""),
    (KC + "failSwapOn: true\n", "fail", "refuses to start", "failSwapOn: false"),
    (KC, "fail", "default true", "failSwapOn: false"),
    (KC + "failSwapOn: false\nmemorySwap:\n  swapBehavior: NoSwap\n", "warn",
     "Pods will not swap", "LimitedSwap"),
    (KC + "failSwapOn: false\n", "warn", "default NoSwap", "LimitedSwap"),
    (KC + "failSwapOn: false\nmemorySwap:\n  swapBehavior: LimitedSwap\n", "pass",
     "Burstable Pods may swap", ""),
    (KC + "failSwapOn: false\nmemorySwap:\n  swapBehavior: UnlimitedSwap\n", "warn",
     "removed in kubelet 1.30", "LimitedSwap"),
    (KC + "failSwapOn: 'no'\n", "warn", "must be true or false", "kubelet config"),
    ("{not: yaml: at all", "warn", "not YAML", "kubelet config"),
    ("- a\n- list\n", "warn", "not a map", "kubelet config"),
])
def test_kubelet_swap_check(tmp_path, text, status, detail, fix):
    c = check_of(tmp_path, text)
    assert c.status == status and detail in c.detail, c
    assert (fix in c.fix) if fix else c.fix == ""


def test_pods_swap_only_with_limited_swap(tmp_path):
    p = tmp_path / "k.yaml"
    p.write_text("failSwapOn: false\nmemorySwap: {swapBehavior: LimitedSwap}\n")
    assert kubelet.read_kubelet_swap(str(p)).pods_swap
    p.write_text("failSwapOn: false\nmemorySwap: {swapBehavior: NoSwap}\n")
    assert not kubelet.read_kubelet_swap(str(p)).pods_swap
    assert not kubelet.read_kubelet_swap(str(tmp_path / "absent")).pods_swap


def run_doctor(tmp_path, kubelet_config: Path) -> dict:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("compression:\n  level: 3\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-m", "agentzip_blk.cli", "--config", str(cfg),
                        "--run-dir", str(tmp_path / "run"), "doctor", "--json",
                        "--kubelet-config", str(kubelet_config)],
                       env=env, capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout)
    assert r.returncode == (1 if out["status"] == "fail" else 0)
    (c,) = [c for c in out["checks"] if c["name"] == "kubelet swap"]
    return {"rc": r.returncode, "status": out["status"], **c}


@pytest.mark.slow
def test_doctor_cli_kubelet_check(tmp_path):
    kc = tmp_path / "kubelet.yaml"
    kc.write_text(KC + "failSwapOn: true\n")
    c = run_doctor(tmp_path, kc)
    assert c["status"] == "fail" and "failSwapOn: false" in c["fix"] and c["rc"] == 1
    kc.write_text(KC + "failSwapOn: false\nmemorySwap: {swapBehavior: LimitedSwap}\n")
    assert run_doctor(tmp_path, kc)["status"] == "pass"
    c = run_doctor(tmp_path, tmp_path / "no-such-file.yaml")
    assert c["status"] == "pass" and "not a Kubernetes node" in c["detail"]


# --- the kubelet's flags: --config, --config-dir drop-ins, --fail-swap-on -----------------------

@pytest.mark.parametrize("argv, config, config_dir, fso", [
    (["kubelet", "--config=/etc/k/c.yaml", "--fail-swap-on=false"], "/etc/k/c.yaml", None, False),
    (["/usr/bin/kubelet", "--config", "/c.json", "--config-dir", "/d"], "/c.json", "/d", None),
    (["kubelet", "--fail-swap-on"], None, None, True),
    (["kubelet", "--fail-swap-on=true", "--v=2"], None, None, True),
])
def test_parse_flags(argv, config, config_dir, fso):
    f = kubelet.parse_flags(argv)
    assert (f.config, f.config_dir, f.fail_swap_on) == (config, config_dir, fso)


def test_drop_ins_merge_over_the_file_and_the_flag_wins(tmp_path):
    """The kubelet's order: the file, then config-dir's *.conf in name order, then flags."""
    main = tmp_path / "kubelet-config.json"  # EKS keeps JSON elsewhere than kubeadm
    main.write_text(json.dumps({"kind": "KubeletConfiguration", "failSwapOn": True}))
    d = tmp_path / "conf.d"
    d.mkdir()
    (d / "10-swap.conf").write_text(KC + "failSwapOn: false\nmemorySwap: {swapBehavior: NoSwap}\n")
    (d / "20-limited.conf").write_text(KC + "memorySwap: {swapBehavior: LimitedSwap}\n")
    (d / "30-ignored.yaml").write_text(KC + "failSwapOn: true\n")  # not *.conf: not read
    flags = kubelet.parse_flags(["kubelet", f"--config={main}", "--config-dir", str(d)])
    k = kubelet.read_kubelet_swap(None, flags)
    assert k.path == str(main) and k.fail_swap_on is False and k.swap_behavior == "LimitedSwap"
    assert k.sources == {"failSwapOn": str(d / "10-swap.conf"),
                         "memorySwap.swapBehavior": str(d / "20-limited.conf")}
    assert kubelet.verdict(k)[0] == "pass"
    flags = kubelet.parse_flags(flags.argv + ["--fail-swap-on=true"])
    status, detail, fix = kubelet.verdict(kubelet.read_kubelet_swap(None, flags))
    assert status == "fail" and "--fail-swap-on (a kubelet flag)" in detail
    assert "drop --fail-swap-on" in fix


def test_a_kubelet_without_a_config_file_is_still_a_node(tmp_path):
    """k3s-like: flags only. --fail-swap-on=false alone: swap allowed, Pods get none."""
    flags = kubelet.parse_flags(["kubelet", "--fail-swap-on=false"])
    k = kubelet.read_kubelet_swap(str(tmp_path / "absent.yaml"), flags)
    assert k.present and kubelet.verdict(k)[0] == "warn"  # NoSwap by default


def test_an_empty_file_is_not_taken_for_the_kubelet_config(tmp_path):
    """The DaemonSet's FileOrCreate volume leaves an empty file where the distribution keeps
    its config elsewhere: a warning that says so, not "failSwapOn not set"."""
    p = tmp_path / "config.yaml"
    p.write_text("")
    status, detail, fix = kubelet.verdict(kubelet.read_kubelet_swap(str(p)))
    assert status == "warn" and "is empty" in detail and "--config" in fix


def test_kubelet_command_line_from_a_proc_tree(tmp_path):
    for pid, comm, argv in ((10, "bash", ["bash"]), (42, "kubelet", ["/usr/bin/kubelet",
                                                                     "--config=/x.yaml"])):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    f = kubelet.kubelet_command_line(str(tmp_path))
    assert f.pid == 42 and f.config == "/x.yaml"
    assert kubelet.kubelet_command_line(str(tmp_path / "none")) is None


def test_doctor_reads_a_running_kubelets_flags(tmp_path):
    """A real process called kubelet (a copy of python, sleeping, with the kubelet's flags):
    `agentzip-blk doctor` (its own process) follows its --config, --config-dir and
    --fail-swap-on, with no --kubelet-config given."""
    import shutil
    import time
    fake = tmp_path / "kubelet"
    shutil.copy(sys.executable if not os.path.islink(sys.executable)
                else os.path.realpath(sys.executable), fake)
    conf = tmp_path / "elsewhere.yaml"
    conf.write_text(KC + "failSwapOn: false\n")
    d = tmp_path / "kubelet.conf.d"
    d.mkdir()
    (d / "50-swap.conf").write_text(KC + "memorySwap: {swapBehavior: LimitedSwap}\n")
    proc = subprocess.Popen([str(fake), "-c", "import time; time.sleep(120)", f"--config={conf}",
                             "--config-dir", str(d)])
    try:
        deadline = time.monotonic() + 10
        while kubelet.kubelet_command_line() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        cfg = tmp_path / "c.yaml"
        cfg.write_text("compression:\n  level: 3\n")
        az = os.path.join(os.path.dirname(sys.executable), "agentzip-blk")
        r = subprocess.run([az, "--config", str(cfg), "--run-dir", str(tmp_path / "run"),
                            "doctor", "--json"], capture_output=True, text=True, timeout=120)
        (c,) = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "kubelet swap"]
        assert c["status"] == "pass" and "LimitedSwap" in c["detail"], c
    finally:
        proc.kill()
        proc.wait()
