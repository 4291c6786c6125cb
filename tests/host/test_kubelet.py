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


def test_doctor_cli_kubelet_check(tmp_path):
    kc = tmp_path / "kubelet.yaml"
    kc.write_text(KC + "failSwapOn: true\n")
    c = run_doctor(tmp_path, kc)
    assert c["status"] == "fail" and "failSwapOn: false" in c["fix"] and c["rc"] == 1
    kc.write_text(KC + "failSwapOn: false\nmemorySwap: {swapBehavior: LimitedSwap}\n")
    assert run_doctor(tmp_path, kc)["status"] == "pass"
    c = run_doctor(tmp_path, tmp_path / "no-such-file.yaml")
    assert c["status"] == "pass" and "not a Kubernetes node" in c["detail"]
