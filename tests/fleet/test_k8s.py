"""Kubernetes: annotations, Pod -> cgroup mapping, the webhook over real HTTPS on loopback, and
the node agent against a real local HTTP server serving Pod lists.

``tests/data/admission_pod_create.json`` and ``tests/data/kubelet_pods.json`` follow the real
schemas (AdmissionReview admission.k8s.io/v1 as the API server sends it for ``kubectl run``,
and a v1 PodList as the kubelet's /pods returns it, status and qosClass filled in). They were
written for these tests after those schemas, not captured from a live cluster.
"""

from __future__ import annotations

import base64
import copy
import http.server
import json
import shutil
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agentzip_blk.cgroups import scopes
from agentzip_blk.fleet.k8s import annotations as ann
from agentzip_blk.fleet.k8s import nodeagent, podcgroup, webhook

DATA = Path(__file__).resolve().parents[1] / "data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


# --- annotations --------------------------------------------------------------------------

def test_annotations_valid_and_absent():
    assert ann.parse(None) is None
    assert ann.parse({"app": "x"}) is None
    s = ann.parse({ann.ENABLE: "true", ann.LEVEL: "3"})
    assert (s.enabled, s.level, s.warnings) == (True, 3, [])
    s = ann.parse({ann.ENABLE: "false", ann.LEVEL: "19"})
    assert not s.enabled and s.level == 19 and s.warnings
    assert ann.parse({ann.ENABLE: "true"}).level is None


@pytest.mark.parametrize("annotations, needle", [
    ({ann.ENABLE: "yes"}, "must be \"true\" or \"false\""),
    ({ann.ENABLE: "True"}, "must be \"true\" or \"false\""),
    ({ann.ENABLE: "true", ann.LEVEL: "0"}, "1..19"),
    ({ann.ENABLE: "true", ann.LEVEL: "20"}, "1..19"),
    ({ann.ENABLE: "true", ann.LEVEL: "-1"}, "integer"),
    ({ann.ENABLE: "true", ann.LEVEL: "3.5"}, "integer"),
    ({ann.LEVEL: "3"}, "needs"),
    ({ann.ENABLE: "true", "agentzip.io/compresion-level": "3"}, "unknown annotation"),
])
def test_annotations_invalid(annotations, needle):
    with pytest.raises(ann.AnnotationError) as e:
        ann.parse(annotations)
    assert needle in str(e.value)


# --- Pod -> cgroup ---------------------------------------------------------------------------

UID = "7a3c2f10-1b2d-4c5e-8f90-a1b2c3d4e5f6"
U = UID.replace("-", "_")


@pytest.mark.parametrize("qos, driver, path", [
    ("Guaranteed", "cgroupfs", f"/kubepods/pod{UID}"),
    ("Burstable", "cgroupfs", f"/kubepods/burstable/pod{UID}"),
    ("BestEffort", "cgroupfs", f"/kubepods/besteffort/pod{UID}"),
    ("Guaranteed", "systemd", f"/kubepods.slice/kubepods-pod{U}.slice"),
    ("Burstable", "systemd", f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U}.slice"),
    ("BestEffort", "systemd", f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U}.slice"),
])
def test_pod_cgroup(qos, driver, path):
    assert podcgroup.pod_cgroup(UID, qos, driver) == path
    glob = podcgroup.scope_glob(UID, qos, driver)
    # the leaf glob selects the Pod's cgroup (not its containers, not other Pods), also when
    # kubepods sits below another cgroup (kind, k3s)
    tree = ["/kubepods.slice", path, path + "/cri-containerd-abc.scope", "/other" + path,
            podcgroup.pod_cgroup("00000000-0000-4000-8000-000000000000", qos, driver)]
    assert scopes.scoped_cgroups(tree, [scopes.Scope(glob, True)]) == [path, "/other" + path]


def test_qos_class_from_status_and_fallback():
    pods = load("kubelet_pods.json")["items"]
    assert [podcgroup.qos_class(p) for p in pods[:3]] == ["Burstable", "Guaranteed", "BestEffort"]
    for p in pods[:3]:  # the kubelet's rule gives the same answer without status.qosClass
        q = copy.deepcopy(p)
        del q["status"]["qosClass"]
        assert podcgroup.qos_class(q) == p["status"]["qosClass"]


# --- webhook over HTTPS -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "tls.crt", d / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=agentzip-webhook.agentzip.svc", "-keyout", str(key),
                    "-out", str(cert), "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:agentzip-webhook.agentzip.svc"],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture
def webhook_url(tls_files):
    cert, key = tls_files
    server = webhook.make_server(("127.0.0.1", 0), str(cert), str(key))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", ssl.create_default_context(cafile=str(cert))
    finally:
        server.shutdown()
        server.server_close()


def post(url_ctx, body: bytes | dict, path: str = "/mutate") -> tuple[int, dict]:
    url, ctx = url_ctx
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def apply_patch(obj: dict, patch: list[dict]) -> dict:
    """The subset of RFC 6902 the webhook emits (add/replace of an object member)."""
    obj = copy.deepcopy(obj)
    for op in patch:
        assert op["op"] in ("add", "replace")
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target = obj
        for p in parts[:-1]:
            target = target[p]
        if op["op"] == "replace":
            assert parts[-1] in target
        target[parts[-1]] = op["value"]
    return obj


def review_of(annotations: dict | None, operation: str = "CREATE") -> dict:
    r = load("admission_pod_create.json")
    r["request"]["operation"] = operation
    if annotations is None:
        r["request"]["object"]["metadata"].pop("annotations")
    else:
        r["request"]["object"]["metadata"]["annotations"] = annotations
    return r


def test_webhook_valid_records_on_pod(webhook_url):
    req = load("admission_pod_create.json")
    code, out = post(webhook_url, req)
    assert code == 200
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    resp = out["response"]
    assert resp["uid"] == req["request"]["uid"] and resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch"
    pod = apply_patch(req["request"]["object"], json.loads(base64.b64decode(resp["patch"])))
    a = pod["metadata"]["annotations"]
    assert json.loads(a["agentzip.io/admission"]) == {"enabled": True, "compression_level": 3}
    assert a["agentzip.io/enable"] == "true"  # the request itself is kept


def test_webhook_disabled_pod_warns(webhook_url):
    code, out = post(webhook_url, review_of({ann.ENABLE: "false", ann.LEVEL: "5"}))
    resp = out["response"]
    assert code == 200 and resp["allowed"] and "no effect" in resp["warnings"][0]
    pod = apply_patch(review_of({})["request"]["object"], json.loads(base64.b64decode(resp["patch"])))
    assert json.loads(pod["metadata"]["annotations"][ann.RECORD])["enabled"] is False


@pytest.mark.parametrize("annotations, needle", [
    ({ann.ENABLE: "yes"}, "agentzip.io/enable"),
    ({ann.ENABLE: "true", ann.LEVEL: "42"}, "agentzip.io/compression-level"),
    ({ann.LEVEL: "3"}, "needs"),
])
def test_webhook_invalid_denied(webhook_url, annotations, needle):
    req = review_of(annotations)
    code, out = post(webhook_url, req)
    resp = out["response"]
    assert code == 200 and resp["uid"] == req["request"]["uid"]
    assert resp["allowed"] is False and resp["status"]["code"] == 400
    assert needle in resp["status"]["message"] and "patch" not in resp


@pytest.mark.parametrize("annotations", [None, {}, {"team": "search"}])
def test_webhook_unannotated_untouched(webhook_url, annotations):
    code, out = post(webhook_url, review_of(annotations))
    assert code == 200 and out["response"]["allowed"] is True
    assert "patch" not in out["response"] and "patchType" not in out["response"]


def test_webhook_other_operations_and_bad_bodies(webhook_url):
    req = review_of({ann.ENABLE: "bogus"}, "DELETE")
    req["request"]["oldObject"], req["request"]["object"] = req["request"]["object"], None
    code, out = post(webhook_url, req)
    assert code == 200 and out["response"]["allowed"] is True
    assert post(webhook_url, b"{not json")[0] == 400
    assert post(webhook_url, {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                              "request": {"uid": "x"}})[0] == 400
    assert post(webhook_url, load("admission_pod_create.json"), path="/other")[0] == 404
    url, ctx = webhook_url
    with urllib.request.urlopen(url + "/healthz", context=ctx, timeout=10) as r:
        assert r.read() == b"ok"


def test_webhook_is_tls_only(webhook_url):
    url, _ = webhook_url
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(url.replace("https", "http") + "/healthz", timeout=5).read()
    with pytest.raises(urllib.error.URLError):  # an untrusted cert is refused by a client
        urllib.request.urlopen(url + "/healthz", context=ssl.create_default_context(), timeout=5)


# --- node agent --------------------------------------------------------------------------------

class PodListServer:
    """A real HTTP server serving whatever PodList is set, recording each request's path and
    Authorization header; over HTTPS with ``tls=(cert, key)``."""

    def __init__(self, tls: tuple[Path, Path] | None = None):
        self.pod_list: dict = {}
        self.requests: list[tuple[str, str | None]] = []
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.requests.append((self.path, self.headers.get("Authorization")))
                body = json.dumps(outer.pod_list).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"

    @property
    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pod_server():
    s = PodListServer()
    yield s
    s.close()


def scope_map(config) -> dict[str, bool]:
    return {s.cgroup: s.enabled for s in scopes.list_scopes(str(config))}


@pytest.mark.parametrize("driver", ["systemd", "cgroupfs"])
def test_node_agent_rounds(tmp_path, pod_server, driver):
    config = tmp_path / "config.yaml"
    config.write_text("compression:\n  level: 3\nscopes:\n  - cgroup: agent-sandbox-*.slice\n"
                      "    enabled: true\n")
    run_dir = tmp_path / "run"
    pods = load("kubelet_pods.json")
    pod_server.pod_list = pods
    agent = nodeagent.NodeAgent(nodeagent.http_fetch(), nodeagent.kubelet_url(pod_server.base),
                                driver, str(config), str(run_dir), node="worker-1")
    res = agent.run_once()
    assert pod_server.paths == ["/pods"]
    by_name = {p.name: p for p in res.wanted}
    assert sorted(by_name) == ["agent-besteffort", "agent-burstable", "agent-guaranteed"]
    for p in res.wanted:
        assert p.cgroup == podcgroup.pod_cgroup(p.uid, p.qos, driver)
        assert scopes.match(p.glob, p.cgroup)
    assert list(res.invalid) == ["sandboxes/agent-bad-level"]
    assert res.levels == {"3": 1, "9": 1} and res.node_level == 3
    have = scope_map(config)
    assert have == {"agent-sandbox-*.slice": True, **{p.glob: True for p in res.wanted}}
    assert sorted(res.added) == sorted(p.glob for p in res.wanted)

    # same list again: nothing changes
    res2 = agent.run_once()
    assert res2.added == [] and res2.removed == [] and scope_map(config) == have

    # the guaranteed Pod goes away, the burstable one drops its annotation, and an operator
    # disables the best-effort one by hand: the agent removes the first two only, and
    # leaves the hand-written scope alone
    gone = by_name["agent-guaranteed"].glob
    unannotated = by_name["agent-burstable"].glob
    pods2 = copy.deepcopy(pods)
    pods2["items"] = [p for p in pods2["items"] if p["metadata"]["name"] != "agent-guaranteed"]
    for p in pods2["items"]:
        if p["metadata"]["name"] == "agent-burstable":
            p["metadata"]["annotations"] = {}
    pod_server.pod_list = pods2
    scopes.add(str(config), "/by/hand.slice")
    res3 = agent.run_once()
    assert sorted(res3.removed) == sorted([gone, unannotated]) and res3.added == []
    have3 = scope_map(config)
    assert gone not in have3 and unannotated not in have3
    assert have3["/by/hand.slice"] is True and have3[by_name["agent-besteffort"].glob] is True
    assert json.loads((run_dir / nodeagent.STATE_FILE).read_text())["globs"] == [
        by_name["agent-besteffort"].glob]


def test_node_agent_api_server_url_and_node_filter(tmp_path, pod_server):
    pods = load("kubelet_pods.json")
    pods["items"][0]["spec"]["nodeName"] = "worker-2"  # not ours: the API may list it if asked
    pod_server.pod_list = pods
    config = tmp_path / "config.yaml"
    config.write_text("scopes: []\n")
    url = nodeagent.apiserver_url(pod_server.base, "worker-1")
    agent = nodeagent.NodeAgent(nodeagent.http_fetch(), url, "systemd", str(config),
                                str(tmp_path / "run"), node="worker-1")
    res = agent.run_once()
    assert pod_server.paths == ["/api/v1/pods?fieldSelector=spec.nodeName%3Dworker-1"]
    assert sorted(p.name for p in res.wanted) == ["agent-besteffort", "agent-guaranteed"]


# --- manifests -------------------------------------------------------------------------------

def test_manifests_consistent():
    import yaml

    from agentzip_blk import cli
    docs = []
    for f in sorted((Path(__file__).resolve().parents[2] / "deploy/k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Service",
            "MutatingWebhookConfiguration", "Deployment"} <= kinds
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    parser = cli.build_parser()
    for kind in ("DaemonSet", "Deployment"):
        for d in (x for x in docs if x["kind"] == kind):
            tpl = d["spec"]["template"]
            labels = tpl["metadata"]["labels"]
            assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
            sa = tpl["spec"]["serviceAccountName"]
            assert ("ServiceAccount", sa) in by
            for c in tpl["spec"]["containers"]:
                parser.parse_args(c["args"])  # every container runs a real subcommand
    for svc in (x for x in docs if x["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= x["spec"]["template"]["metadata"]["labels"].items()
                   for x in docs if x["kind"] in ("DaemonSet", "Deployment"))
    (wh,) = by[("MutatingWebhookConfiguration", "agentzip")]["webhooks"]
    assert wh["admissionReviewVersions"] == ["v1"] and wh["sideEffects"] == "None"
    cc = wh["clientConfig"]["service"]
    assert cc["path"] == "/mutate" and ("Service", cc["name"]) in by
    assert wh["rules"][0]["resources"] == ["pods"] and wh["rules"][0]["operations"] == ["CREATE"]
    rules = by[("ClusterRole", "agentzip-node-agent")]["rules"]
    assert any("pods" in r["resources"] and "list" in r["verbs"] for r in rules)
