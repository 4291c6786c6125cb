"""Node agent: keep the scopes in step with the annotated Pods on this node.

Each round lists the node's Pods (kubelet ``/pods``, or the API server with
``fieldSelector=spec.nodeName=NODE``), picks the running ones with ``agentzip.io/enable:
"true"`` (and valid annotations), maps each Pod UID + QoS class to its cgroup
(``podcgroup``) and adds the leaf cgroup name as a scope through ``agentzip_blk.scopes``.
Scopes it added for Pods that are gone, finished or no longer annotated are removed (and the
settings the tuner wrote to them restored, as ``scope remove`` does). It only ever touches
scopes it added itself (recorded in ``RUN_DIR/k8s-scopes.json``); scopes an operator wrote by
hand are left alone. The tuner picks the scope changes up on its next pass.

Per-Pod compression level: **approximated, not honored per Pod.** The device is one store
per node, compressing with the node's ``compression.level``; the kernel writes swap clusters
without saying which cgroup a page belongs to, so the store cannot pick a level per Pod at
write time, and the level cannot change while swap is attached (the server never restarts
then). What the agent does: every round it reports, per Pod, the requested level and the
node's level, and ``status()['levels']`` counts Pods by requested level; a Pod asking for a
level other than the node's gets a log line "level N requested, node compresses at M". An
operator who wants a Pod compressed harder runs it on nodes whose config sets that level
(e.g. a node label + nodeSelector per level). Enable/disable *is* honored per Pod.

The HTTP source is injectable (``fetch``: url -> parsed JSON) so tests serve recorded
PodList JSON from a local server.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from . import annotations as ann
from .podcgroup import pod_cgroup, qos_class, scope_glob

log = logging.getLogger(__name__)

STATE_FILE = "k8s-scopes.json"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

Fetch = Callable[[str], dict]


def http_fetch(token: str | None = None, cafile: str | None = None, insecure: bool = False,
               timeout: float = 10.0) -> Fetch:
    """GET url -> JSON, with a bearer token and the cluster CA (or no verification, which the
    kubelet's self-signed serving cert often needs)."""
    ctx = None
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif cafile:
        ctx = ssl.create_default_context(cafile=cafile)

    def fetch(url: str) -> dict:
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return json.load(r)
    return fetch


def kubelet_url(base: str = "https://127.0.0.1:10250") -> str:
    return base.rstrip("/") + "/pods"


def apiserver_url(base: str, node: str) -> str:
    q = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
    return f"{base.rstrip('/')}/api/v1/pods?{q}"


@dataclass
class PodScope:
    namespace: str
    name: str
    uid: str
    qos: str
    cgroup: str
    glob: str
    level: int | None


@dataclass
class RoundResult:
    wanted: list[PodScope] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)  # namespace/name -> problem
    levels: dict[str, int] = field(default_factory=dict)  # requested level -> Pods
    node_level: int | None = None

    def to_dict(self) -> dict:
        return {"pods": [vars(p) for p in self.wanted], "added": self.added,
                "removed": self.removed, "invalid": self.invalid, "levels": self.levels,
                "node_level": self.node_level}


def wanted_pods(pod_list: dict, driver: str, node: str | None = None
                ) -> tuple[list[PodScope], dict[str, str]]:
    """The Pods of a PodList that should be in scope, and the ones with bad annotations."""
    if pod_list.get("kind") not in ("PodList", None) or not isinstance(pod_list.get("items"), list):
        raise ValueError(f"expected a PodList, got kind {pod_list.get('kind')!r}")
    out, invalid = [], {}
    for pod in pod_list["items"]:
        md = pod.get("metadata") or {}
        key = f"{md.get('namespace', '')}/{md.get('name', '')}"
        if node and (pod.get("spec") or {}).get("nodeName") not in (None, node):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue  # its cgroup is gone or going
        try:
            settings = ann.parse(md.get("annotations"))
        except ann.AnnotationError as e:  # admitted before the webhook, or webhook bypassed
            invalid[key] = str(e)
            continue
        if settings is None or not settings.enabled or not md.get("uid"):
            continue
        qos = qos_class(pod)
        out.append(PodScope(md.get("namespace", ""), md.get("name", ""), md["uid"], qos,
                            pod_cgroup(md["uid"], qos, driver), scope_glob(md["uid"], qos, driver),
                            settings.level))
    return out, invalid


class NodeAgent:
    def __init__(self, fetch: Fetch, url: str, driver: str, config_path: str | None,
                 run_dir: str, node: str | None = None, release: bool = True) -> None:
        if driver not in ("systemd", "cgroupfs"):
            raise ValueError(f"cgroup driver {driver!r} (expected systemd or cgroupfs)")
        self.fetch, self.url, self.driver = fetch, url, driver
        self.config_path, self.run_dir, self.node = config_path, run_dir, node
        self.release = release  # restore tuner settings of cgroups that left the scopes

    # -- the globs we own ----------------------------------------------------------------
    def _state_path(self) -> str:
        return os.path.join(self.run_dir, STATE_FILE)

    def owned(self) -> list[str]:
        try:
            with open(self._state_path()) as f:
                return list(json.load(f).get("globs", []))
        except FileNotFoundError:
            return []

    def _save(self, globs: list[str]) -> None:
        os.makedirs(self.run_dir, exist_ok=True)
        tmp = self._state_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"globs": sorted(globs)}, f)
        os.replace(tmp, self._state_path())

    # -- one round -----------------------------------------------------------------------
    def run_once(self) -> RoundResult:
        from ...cgroups import ledger, scopes
        from ...config import load_config

        pods, invalid = wanted_pods(self.fetch(self.url), self.driver, self.node)
        res = RoundResult(wanted=pods, invalid=invalid)
        try:
            res.node_level = load_config(self.config_path).compression.level
        except FileNotFoundError:
            res.node_level = None
        for p in pods:
            if p.level is not None:
                res.levels[str(p.level)] = res.levels.get(str(p.level), 0) + 1
                if res.node_level is not None and p.level != res.node_level:
                    log.info("%s/%s: level %d requested, node compresses at %d (one level "
                             "per node)", p.namespace, p.name, p.level, res.node_level)
        for key, problem in invalid.items():
            log.warning("%s: annotations ignored: %s", key, problem)

        existing = {s.cgroup: s for s in scopes.list_scopes(self.config_path)}
        owned = set(self.owned())
        want = {p.glob for p in pods}
        for glob in sorted(want):
            if glob in existing:
                if glob in owned and not existing[glob].enabled:
                    scopes.enable(self.config_path, glob)
                continue
            scopes.add(self.config_path, glob)
            owned.add(glob)
            res.added.append(glob)
        for glob in sorted(owned - want):
            if glob in existing:
                scopes.remove(self.config_path, glob)
            owned.discard(glob)
            res.removed.append(glob)
        self._save(sorted(owned))
        if res.removed and self.release:
            try:
                ledger.release_unscoped(self.run_dir, scopes.list_scopes(self.config_path))
            except Exception as e:  # restoring is best effort; the next round retries
                log.warning("restoring settings of removed Pods: %s", e)
        return res

    def run(self, interval: float, rounds: int | None = None) -> None:
        n = 0
        while rounds is None or n < rounds:
            try:
                r = self.run_once()
                if r.added or r.removed:
                    log.info("scopes: +%s -%s", r.added, r.removed)
            except Exception as e:  # the API may be briefly unreachable: keep going
                log.warning("round failed: %s: %s", type(e).__name__, e)
            n += 1
            if rounds is None or n < rounds:
                time.sleep(interval)
