"""Kubernetes least privilege (issue 27, item 5): the node agent is not root and shares no
host pid namespace; the tuner, which needs both, is alone in a Pod of its own; no container
holds an API token it does not use; docs/KUBERNETES.md lists each container's privileges as
the manifests give them. And the node agent, run as its own non-root process against a fake
API server, writes a drop-in that root's loader takes for its scopes only."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from fleet.test_k8s import PodListServer, load

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"
AGENT_UID = 65532


def _workloads() -> dict[str, dict]:
    docs = []
    for f in sorted(K8S.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("DaemonSet", "Deployment")}


def _service_accounts() -> dict[str, dict]:
    docs = []
    for f in sorted(K8S.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}


def _uid(pod: dict, c: dict) -> int:
    return c.get("securityContext", {}).get(
        "runAsUser", pod.get("securityContext", {}).get("runAsUser", 0))


def _has_token(pod: dict, c: dict) -> bool:
    """The container sees a service-account token: automounted, or mounted by hand."""
    sa = _service_accounts().get(pod.get("serviceAccountName", "default"), {})
    auto = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
    by_hand = {v["name"] for v in pod.get("volumes", [])
               if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    return bool(auto) or any(m["name"] in by_hand for m in c.get("volumeMounts", []))


def test_only_the_tuner_shares_the_hosts_pid_namespace_and_it_is_alone():
    shared = {name: [c["name"] for c in w["spec"]["template"]["spec"]["containers"]]
              for name, w in _workloads().items()
              if w["spec"]["template"]["spec"].get("hostPID")}
    assert shared == {"agentzip-tuner": ["tuner"]}


def test_the_node_agent_is_not_root_and_only_it_holds_the_api_token():
    pod = _workloads()["agentzip-node"]["spec"]["template"]["spec"]
    cs = {c["name"]: c for c in pod["containers"]}
    agent = cs["node-agent"]
    assert agent["securityContext"]["runAsNonRoot"] is True
    assert _uid(pod, agent) == AGENT_UID
    holders = sorted(c["name"] for w in _workloads().values()
                     for c in w["spec"]["template"]["spec"]["containers"]
                     if _has_token(w["spec"]["template"]["spec"], c))
    assert holders == ["node-agent"]
    # its two writable host directories must be made for it: never created root's by the kubelet
    types = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v}
    assert types["/etc/agentzip/config.d"] == "Directory"
    assert types["/var/lib/agentzip/node-agent"] == "Directory"


def _privileges_table() -> dict[str, dict[str, str]]:
    text = (REPO / "docs/KUBERNETES.md").read_text()
    section = text.split("## Privileges", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = [h.strip() for h in next(line for line in section.splitlines()
                                      if line.startswith("| container")).strip("|").split("|")]
    table = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(header, cells))
    return table


def test_kubernetes_md_lists_each_containers_privileges():
    table = _privileges_table()
    seen = set()
    for name, w in _workloads().items():
        pod = w["spec"]["template"]["spec"]
        for c in pod["containers"]:
            row = table.get(c["name"])
            assert row is not None, f"docs/KUBERNETES.md, Privileges: no row for {c['name']}"
            seen.add(c["name"])
            assert f"`{name}`" in row["workload"], (c["name"], row)
            assert row["uid"] == str(_uid(pod, c)), (c["name"], row)
            assert row["hostPID"] == ("yes" if pod.get("hostPID") else "no"), (c["name"], row)
            assert (row["API token"] != "none") == _has_token(pod, c), (c["name"], row)
            hp = {v["name"]: v["hostPath"]["path"] for v in pod.get("volumes", []) if "hostPath" in v}
            for m in c.get("volumeMounts", []):
                if m["name"] in hp:
                    assert f"`{hp[m['name']]}`" in row["host paths (rw / ro)"] or \
                        m["name"] == "kubelet-config", (c["name"], hp[m["name"]], row)
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
    assert seen == set(table), f"rows without a container: {set(table) - seen}"


@pytest.fixture
def agent_dir():
    """A directory the agent's uid can traverse (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="azagent-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="root and setpriv: the agent runs as another uid")
def test_the_non_root_node_agent_writes_scopes_only(agent_dir):
    """The agent, uid 65532, its own process of the CLI: it can write its drop-in into a
    config.d the host gave it, root's loader takes its scopes; a drop-in it wrote with any
    other key is refused by root's `config show` in one line."""
    tmp_path = agent_dir
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    config = etc / "config.yaml"
    config.write_text("scopes: []\npool: {swap_out_path: /var/lib/agentzip/swapfile}\n")
    for d in (etc / "config.d", tmp_path / "state", tmp_path / "run"):
        d.mkdir(mode=0o755)
        os.chown(d, AGENT_UID, AGENT_UID)
    pods = PodListServer()
    pods.pod_list = load("kubelet_pods.json")
    try:
        agent = subprocess.run(
            ["setpriv", "--reuid", str(AGENT_UID), "--regid", str(AGENT_UID), "--clear-groups",
             os.path.join(os.path.dirname(sys.executable), "agentzip-blk"),
             "--config", str(config), "--run-dir", str(tmp_path / "run"), "node-agent",
             "--source", "api", "--url", pods.base, "--node", "worker-1", "--no-release",
             "--state-dir", str(tmp_path / "state"), "--kubelet-config", str(tmp_path / "none"),
             "--once", "--json"],
            capture_output=True, text=True, timeout=120, cwd="/",
            env={**os.environ, "PYTHONPATH": str(REPO), "HOME": "/"})
    finally:
        pods.close()
    assert agent.returncode == 0, agent.stdout + agent.stderr
    assert json.loads(agent.stdout)["added"], agent.stdout
    dropin = etc / "config.d" / "90-scopes.yaml"
    assert dropin.stat().st_uid == AGENT_UID
    az = [sys.executable, "-m", "agentzip_blk.cli", "config", "show", "--config", str(config),
          "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shown = subprocess.run(az, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    shown = json.loads(shown.stdout)
    assert shown["sources"]["scopes"] == str(dropin)
    assert any(s["cgroup"].startswith("kubepods") or "pod" in s["cgroup"]
               for s in shown["config"]["scopes"]), shown["config"]["scopes"]
    # a compromised agent adds a key of root's: root's tools refuse the config in one line
    data = yaml.safe_load(dropin.read_text())
    data["pool"] = {"swap_out_path": "/etc/shadow"}
    subprocess.run(["setpriv", "--reuid", str(AGENT_UID), "--regid", str(AGENT_UID),
                    "--clear-groups", "/usr/bin/python3", "-c",
                    "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", str(dropin),
                    yaml.safe_dump(data)], check=True, cwd="/")
    refused = subprocess.run(az, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert re.search(r"90-scopes.yaml: pool: this drop-in is owned by uid 65532.*scopes and "
                     r"nothing else", refused.stderr), refused.stderr
