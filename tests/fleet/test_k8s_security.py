"""Kubernetes least privilege and robustness (issue 16 item 7, issue 17 item 3):

- the webhook, run as the installed CLI in its own process, serves a rotated certificate
  without a restart (and keeps the old one while the new pair does not load yet);
- malformed AdmissionReviews and PodList items are answered / skipped one by one; bad Pod
  UIDs never become cgroup paths;
- the node agent, run as the CLI, lists its node's Pods from a local fake of the Kubernetes
  API over HTTPS (the API is not the data path) with a field selector, verifies the
  server's certificate, and never sends its token to a peer it did not verify.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agentzip_blk.fleet.k8s import annotations as ann
from agentzip_blk.fleet.k8s import nodeagent, podcgroup, webhook
from fleet.test_k8s import PodListServer

pytestmark = pytest.mark.slow  # the inner loop leaves it out (docs/CONTRIBUTING.md)

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests/data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def cli_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentzip_blk.cli", *argv], env=cli_env(),
                          capture_output=True, text=True, timeout=60, **kw)


def make_cert(d: Path, cn: str) -> tuple[Path, Path]:
    if not shutil.which("openssl"):
        pytest.skip("openssl not installed (apt-get install openssl)")
    d.mkdir(parents=True, exist_ok=True)
    cert, key = d / "tls.crt", d / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={cn}", "-keyout", str(key), "-out", str(cert),
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def der_of(pem: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.read_text())


# --- webhook certificate rotation -----------------------------------------------------------

def kubelet_secret_dir(root: Path, gen: Path) -> Path:
    """Lay out a Secret volume the way the kubelet does: tls.crt -> ..data/tls.crt,
    ..data -> ..<generation>; a rotation swaps ..data atomically."""
    root.mkdir(exist_ok=True)
    link = root / "..data"
    tmp = root / "..data_tmp"
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(gen.name, tmp)
    os.replace(tmp, link)
    for name in ("tls.crt", "tls.key"):
        if not (root / name).is_symlink():
            os.symlink(f"..data/{name}", root / name)
    return root


def peer_cert(port: int) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # we read the certificate, we do not trust it
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with ctx.wrap_socket(s) as t:
            return t.getpeercert(binary_form=True)


def healthz(port: int, cafile: Path) -> bytes:
    ctx = ssl.create_default_context(cafile=str(cafile))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        with ctx.wrap_socket(s, server_hostname="127.0.0.1") as t:
            t.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            out = b""
            while chunk := t.recv(4096):
                out += chunk
    return out


@pytest.fixture
def webhook_proc(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    g1 = secret / "..2026_01"
    make_cert(g1, "first")
    kubelet_secret_dir(secret, g1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentzip_blk.cli", "webhook", "--listen", "127.0.0.1:0",
         "--tls-cert", str(secret / "tls.crt"), "--tls-key", str(secret / "tls.key")],
        env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "webhook on https://127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        yield proc, port, secret
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_webhook_picks_up_a_rotated_certificate_without_restart(webhook_proc):
    proc, port, secret = webhook_proc
    first = der_of(secret / "..2026_01/tls.crt")
    assert peer_cert(port) == first
    assert healthz(port, secret / "tls.crt").endswith(b"ok")

    # cert-manager renews; the kubelet swaps ..data to the new generation
    g2 = secret / "..2026_02"
    make_cert(g2, "second")
    second = der_of(g2 / "tls.crt")
    assert second != first
    kubelet_secret_dir(secret, g2)
    assert peer_cert(port) == second
    assert healthz(port, g2 / "tls.crt").endswith(b"ok")  # a client trusting only the new one
    assert proc.poll() is None  # same process all along


def test_webhook_keeps_the_old_certificate_while_the_new_pair_is_torn(webhook_proc):
    proc, port, secret = webhook_proc
    first = der_of(secret / "..2026_01/tls.crt")
    # a half-done update: the new certificate with the old key does not load
    g2 = secret / "..2026_02"
    make_cert(g2, "second")
    torn = secret / "..2026_torn"
    torn.mkdir()
    shutil.copy(g2 / "tls.crt", torn / "tls.crt")
    shutil.copy(secret / "..2026_01/tls.key", torn / "tls.key")
    kubelet_secret_dir(secret, torn)
    assert peer_cert(port) == first  # still serving, with the pair that works
    kubelet_secret_dir(secret, g2)
    assert peer_cert(port) == der_of(g2 / "tls.crt")
    assert proc.poll() is None


# --- parsers -----------------------------------------------------------------------------------

@pytest.fixture
def webhook_server(tmp_path):
    cert, key = make_cert(tmp_path / "tls", "wh")
    server = webhook.make_server(("127.0.0.1", 0), str(cert), str(key))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], cert
    finally:
        server.shutdown()
        server.server_close()


def post(port: int, cafile: Path, body: bytes) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"https://127.0.0.1:{port}/mutate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    ctx = ssl.create_default_context(cafile=str(cafile))
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def review_with(mutate) -> bytes:
    r = load("admission_pod_create.json")
    mutate(r["request"])
    return json.dumps(r).encode()


@pytest.mark.parametrize("mutate, expect_code, expect_allowed", [
    (lambda q: q["object"].__setitem__("metadata", "a string"), 200, True),   # no annotations
    (lambda q: q["object"]["metadata"].__setitem__("annotations", ["agentzip.io/enable"]),
     200, False),
    (lambda q: q["object"]["metadata"].__setitem__("annotations", {ann.ENABLE: True}), 200, False),
    (lambda q: q["object"]["metadata"].__setitem__("annotations", {ann.ENABLE: "true",
                                                                   ann.LEVEL: 3}), 200, False),
    (lambda q: q.__setitem__("kind", "Pod"), 200, True),           # kind not a map
    (lambda q: q.__setitem__("object", ["not", "a", "pod"]), 200, True),
])
def test_webhook_malformed_reviews_are_answered_one_by_one(webhook_server, mutate, expect_code,
                                                          expect_allowed):
    port, cert = webhook_server
    code, out = post(port, cert, review_with(mutate))
    assert code in (expect_code, 400)
    if code == 200:
        assert out["response"]["allowed"] is expect_allowed
        if not expect_allowed:
            assert out["response"]["status"]["code"] == 400
    # the server is still there, and a good review still works
    code, out = post(port, cert, json.dumps(load("admission_pod_create.json")).encode())
    assert code == 200 and out["response"]["allowed"] and out["response"]["patch"]


def test_webhook_unforeseen_exception_is_one_400(webhook_server, monkeypatch):
    """Anything review() raises becomes a 400 for that request alone (not a dropped
    connection, which the API server would count as the webhook being down)."""
    port, cert = webhook_server

    def boom(body):
        raise KeyError("surprise")
    monkeypatch.setattr(webhook, "review", boom)
    code, out = post(port, cert, b"{}")
    assert code == 400 and "malformed" in out["error"]
    monkeypatch.undo()
    assert post(port, cert, json.dumps(load("admission_pod_create.json")).encode())[0] == 200


GOOD = "7a3c2f10-1b2d-4c5e-8f90-a1b2c3d4e5f6"


@pytest.mark.parametrize("uid", ["../../../sys/fs/cgroup", "7A3C2F10-1B2D-4C5E-8F90-A1B2C3D4E5F6",
                                 "abc", "a" * 65, "7a3c*", "7a3c2f10/x", "", None, 42,
                                 "7a3c2f10-1b2d-4c5e-8f90-a1b2c3d4e5f6\n", "7a3c 2f10"])
def test_bad_uids_rejected(uid):
    assert not podcgroup.valid_uid(uid)
    with pytest.raises(ValueError):
        podcgroup.pod_cgroup(uid, "Burstable", "systemd")


def test_good_uids_accepted():
    assert podcgroup.valid_uid(GOOD)
    assert podcgroup.valid_uid("0123456789abcdef0123456789abcdef")  # a static Pod's hash


def test_node_agent_skips_malformed_items_and_processes_the_rest():
    pods = load("kubelet_pods.json")
    clean, _ = nodeagent.wanted_pods(pods, "systemd", "worker-1")
    good = {p.name for p in clean}
    assert len(good) == 3
    enabled = {ann.ENABLE: "true"}
    bad_items = [
        "a string",
        42,
        {"metadata": ["not", "a", "map"]},
        {"metadata": {"name": "traversal", "namespace": "x", "uid": "../../../etc",
                      "annotations": enabled}, "status": {"qosClass": "Burstable"}},
        {"metadata": {"name": "upper", "namespace": "x", "uid": GOOD.upper(),
                      "annotations": enabled}, "status": {"qosClass": "Burstable"}},
        {"metadata": {"name": "glob", "namespace": "x", "uid": "7a3c2f10-*",
                      "annotations": enabled}, "status": {"qosClass": "Burstable"}},
        {"metadata": {"name": "no-uid", "namespace": "x", "annotations": enabled}},
        {"metadata": {"name": "qos", "namespace": "x", "uid": GOOD, "annotations": enabled},
         "status": {"qosClass": 5}, "spec": {"containers": "nope"}},
        {"metadata": {"name": "ann-list", "namespace": "x", "uid": GOOD,
                      "annotations": ["agentzip.io/enable"]}},
    ]
    mixed = copy.deepcopy(pods)
    mixed["items"] = bad_items[:4] + mixed["items"] + bad_items[4:]
    skipped: dict[str, str] = {}
    wanted, invalid = nodeagent.wanted_pods(mixed, "systemd", "worker-1", skipped)
    assert {p.name for p in wanted} == good
    for p in wanted:
        assert podcgroup.valid_uid(p.uid)
    assert set(skipped) == {"items[0]", "items[1]", "items[2]", "x/traversal", "x/upper",
                            "x/glob", "x/no-uid", "x/qos"}
    assert "x/ann-list" in invalid and "sandboxes/agent-bad-level" in invalid
    with pytest.raises(ValueError, match="PodList"):
        nodeagent.wanted_pods(["not", "a", "list"], "systemd")


# --- node agent against a fake API server over HTTPS --------------------------------------------

@pytest.fixture
def fake_api(tmp_path):
    cert, key = make_cert(tmp_path / "api", "kube-apiserver")
    pods = load("kubelet_pods.json")
    pods["items"][0]["spec"]["nodeName"] = "worker-2"
    api = PodListServer(tls=(cert, key))
    api.pod_list = pods
    yield api, cert
    api.close()


def agent_argv(tmp_path: Path, *extra: str) -> list[str]:
    cfg = tmp_path / "config.yaml"
    if not cfg.exists():
        cfg.write_text("compression:\n  level: 3\nscopes: []\n")
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    kc = tmp_path / "kubelet.yaml"
    if not kc.exists():
        kc.write_text("failSwapOn: false\nmemorySwap: {swapBehavior: LimitedSwap}\n")
    return ["--config", str(cfg), "--run-dir", str(tmp_path / "run"), "node-agent",
            "--token-file", str(token), "--kubelet-config", str(kc),
            "--state-dir", str(tmp_path / "state"), "--no-release", *extra]


def test_node_agent_cli_lists_its_node_with_a_field_selector(tmp_path, fake_api):
    api, cert = fake_api
    r = cli(*agent_argv(tmp_path, "--source", "api", "--url", api.base, "--node", "worker-1",
                        "--ca-file", str(cert), "--once", "--json"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert api.requests == [("/api/v1/pods?fieldSelector=spec.nodeName%3Dworker-1",
                             "Bearer s3cret-token")]
    assert sorted(p["name"] for p in out["pods"]) == ["agent-besteffort", "agent-guaranteed"]
    assert out["kubelet"]["status"] == "pass" and out["kubelet"]["pods_swap"] is True
    assert json.loads((tmp_path / "state" / nodeagent.STATE_FILE).read_text())["globs"] == \
        sorted(out["added"])
    assert not (tmp_path / "run" / nodeagent.STATE_FILE).exists()
    # LimitedSwap swaps Burstable Pods only: the agent says so for the others
    assert "LimitedSwap gives it no swap" in r.stderr


def test_node_agent_never_sends_its_token_unverified(tmp_path, fake_api):
    api, _ = fake_api
    other_ca, _ = make_cert(tmp_path / "other", "someone-else")
    # the API's certificate is not signed by the CA given: TLS fails before any request
    r = cli(*agent_argv(tmp_path, "--source", "api", "--url", api.base, "--node", "worker-1",
                        "--ca-file", str(other_ca), "--once"))
    assert r.returncode != 0 and api.requests == []
    assert "CERTIFICATE_VERIFY_FAILED" in r.stderr
    # --insecure is refused with one line, and the kubelet source needs its CA
    for argv in (["--source", "api", "--url", api.base, "--node", "w", "--insecure", "--once"],
                 ["--source", "kubelet", "--url", api.base, "--once"]):
        r = cli(*agent_argv(tmp_path, *argv))
        assert r.returncode == 2 and r.stderr.startswith("agentzip-blk: error: node-agent"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert api.requests == []
    with pytest.raises(nodeagent.InsecureToken):
        nodeagent.http_fetch("token", insecure=True)


def test_node_agent_kubelet_source_verifies_the_kubelet_ca(tmp_path, fake_api):
    api, cert = fake_api  # standing in for the kubelet's /pods, with its serving CA given
    kubelet_like = api.base
    r = cli(*agent_argv(tmp_path, "--source", "kubelet", "--url", kubelet_like, "--node",
                        "worker-1", "--ca-file", str(cert), "--once", "--json"))
    assert r.returncode == 0, r.stderr
    assert api.requests == [("/pods", "Bearer s3cret-token")]


def test_node_agent_reports_kubelet_noswap(tmp_path, fake_api, caplog):
    api, cert = fake_api
    (tmp_path / "kubelet.yaml").write_text("failSwapOn: false\n")  # default NoSwap
    agent = nodeagent.NodeAgent(
        nodeagent.http_fetch(cafile=str(cert)), nodeagent.apiserver_url(api.base, "worker-1"),
        "systemd", str(tmp_path / "c.yaml"), str(tmp_path / "run"), "worker-1", release=False,
        kubelet_config=str(tmp_path / "kubelet.yaml"))
    (tmp_path / "c.yaml").write_text("scopes: []\n")
    with caplog.at_level("INFO"):
        res = agent.run_once()
        agent.run_once()
    assert res.kubelet["status"] == "warn" and res.kubelet["pods_swap"] is False
    assert "Pods will not swap" in res.kubelet["detail"]
    assert sum("kubelet swap" in m for m in caplog.messages) == 1  # said once, not per round


def test_node_agent_heartbeat_feeds_the_probes(tmp_path, fake_api):
    """The DaemonSet's probes: the node agent (its own process, looping) writes its heartbeat
    after each round; the probe (python -m agentzip_blk.host.heartbeat, as the kubelet runs it)
    passes liveness and readiness; with the API gone it stays live but not ready."""
    import subprocess
    import sys
    import time
    api, cert = fake_api
    beat = tmp_path / "node-agent.beat"
    argv = agent_argv(tmp_path, "--source", "api", "--url", api.base, "--node", "worker-1",
                      "--ca-file", str(cert), "--interval", "0.2", "--heartbeat", str(beat))
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "agentzip-blk"),
                             *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def probe(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "agentzip_blk.host.heartbeat", str(beat),
                               "--max-age", "30", *extra], capture_output=True, text=True,
                              timeout=30)
    try:
        r = probe()
        assert r.returncode == 1 and "no heartbeat yet" in r.stderr
        deadline = time.monotonic() + 30
        while not beat.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        assert probe().returncode == 0 and probe("--ready").returncode == 0
        api.close()  # the API server goes away
        deadline = time.monotonic() + 30
        while probe("--ready").returncode == 0:
            assert time.monotonic() < deadline, "readiness never failed"
            time.sleep(0.1)
        r = probe("--ready")
        assert "not ready: round failed" in r.stderr and len(r.stderr.splitlines()) == 1
        assert probe().returncode == 0  # alive all the same: no restart for an API outage
    finally:
        proc.terminate()
        proc.wait(10)
    r = subprocess.run([sys.executable, "-m", "agentzip_blk.host.heartbeat", str(beat),
                        "--max-age", "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "stuck" in r.stderr
