"""Node agent: keep the scopes in step with the annotated Pods on this node.

Each round lists the node's Pods (the API server with ``fieldSelector=spec.nodeName=NODE``:
the least-privilege source, a plain ``pods list``; or the kubelet's ``/pods``, which RBAC
authorizes as ``nodes/proxy`` and which this project's manifests no longer grant), picks the running ones with ``agentzip.io/enable:
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

Robustness: one malformed Pod (a non-map field, a Pod UID that is not 8..64 of ``[0-9a-f-]``)
is skipped with a log line and counted in ``RoundResult.skipped``; the rest of the round goes
on. TLS: the peer is always verified (the cluster CA, or the kubelet's serving CA given as a
file); ``http_fetch`` refuses to send a bearer token over an unverified connection.

Kubelet swap settings: every round reads the kubelet's config file (``host.kubelet``) and
reports ``failSwapOn`` / ``memorySwap.swapBehavior`` in ``RoundResult.kubelet``, with a log
line whenever the verdict changes: with ``NoSwap`` the Pods it scopes get no swap (the kubelet
sets their containers' ``memory.swap.max`` to 0), whatever the tuner does.

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

from ...host.heartbeat import write as write_heartbeat
from ...host.kubelet import (
    DEFAULT_KUBELET_CONFIG,
    kubelet_command_line,
    read_kubelet_swap,
    verdict,
)
from . import annotations as ann
from .podcgroup import pod_cgroup, qos_class, scope_glob, valid_uid

log = logging.getLogger(__name__)

STATE_FILE = "k8s-scopes.json"
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
CA_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"

Fetch = Callable[[str], dict]


class InsecureToken(ValueError):
    """A bearer token would go to a peer whose certificate is not checked."""


def http_fetch(token: str | None = None, cafile: str | None = None, insecure: bool = False,
               timeout: float = 10.0) -> Fetch:
    """GET url -> JSON, with a bearer token, verifying the server against *cafile* (or the
    system's CAs). ``insecure`` (no verification) is for tests against a local server and
    never goes with a token: whoever answers would get the service account's credentials."""
    if insecure and token:
        raise InsecureToken("refusing to send a bearer token without TLS verification: give "
                            "the server's CA file instead")
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
    skipped: dict[str, str] = field(default_factory=dict)  # malformed items -> why
    levels: dict[str, int] = field(default_factory=dict)  # requested level -> Pods
    node_level: int | None = None
    kubelet: dict | None = None  # {"status", "detail", "fix", "pods_swap"}

    def to_dict(self) -> dict:
        return {"pods": [vars(p) for p in self.wanted], "added": self.added,
                "removed": self.removed, "invalid": self.invalid, "skipped": self.skipped,
                "levels": self.levels, "node_level": self.node_level, "kubelet": self.kubelet}


def _pod_scope(pod: dict, driver: str, node: str | None) -> PodScope | None:
    """One PodList item -> its scope, or None when it should not be in scope. Raises
    AnnotationError for bad annotations and anything else for a malformed item."""
    md = pod.get("metadata") or {}
    if node and (pod.get("spec") or {}).get("nodeName") not in (None, node):
        return None
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None  # its cgroup is gone or going
    settings = ann.parse(md.get("annotations"))
    if settings is None or not settings.enabled:
        return None
    uid = md.get("uid")
    if not valid_uid(uid):  # it becomes a cgroup path and a glob: nothing but [0-9a-f-]
        raise ValueError(f"Pod UID {str(uid)[:80]!r} is not 8..64 of [0-9a-f-]")
    qos = qos_class(pod)
    ns, name = md.get("namespace", ""), md.get("name", "")
    if not isinstance(ns, str) or not isinstance(name, str):
        raise ValueError("metadata.namespace/name are not strings")
    return PodScope(ns, name, uid, qos, pod_cgroup(uid, qos, driver),
                    scope_glob(uid, qos, driver), settings.level)


def _item_key(pod: object, index: int) -> str:
    md = pod.get("metadata") if isinstance(pod, dict) else None
    if isinstance(md, dict) and isinstance(md.get("name"), str):
        return f"{md.get('namespace', '')}/{md['name']}"
    return f"items[{index}]"


def wanted_pods(pod_list: dict, driver: str, node: str | None = None,
                skipped: dict[str, str] | None = None
                ) -> tuple[list[PodScope], dict[str, str]]:
    """The Pods of a PodList that should be in scope, and the ones with bad annotations.
    Malformed items go to *skipped* (key -> why) with a log line; the others are processed."""
    if not isinstance(pod_list, dict) or pod_list.get("kind") not in ("PodList", None) \
            or not isinstance(pod_list.get("items"), list):
        kind = pod_list.get("kind") if isinstance(pod_list, dict) else type(pod_list).__name__
        raise ValueError(f"expected a PodList, got kind {kind!r}")
    out, invalid = [], {}
    skipped = {} if skipped is None else skipped
    for i, pod in enumerate(pod_list["items"]):
        key = _item_key(pod, i)
        try:
            if not isinstance(pod, dict):
                raise ValueError(f"item is a {type(pod).__name__}, not an object")
            p = _pod_scope(pod, driver, node)
        except ann.AnnotationError as e:  # admitted before the webhook, or webhook bypassed
            invalid[key] = str(e)
            continue
        except Exception as e:  # one bad item must not stop the round for every other Pod
            skipped[key] = f"{type(e).__name__}: {e}"
            log.warning("%s: skipped malformed Pod: %s", key, skipped[key])
            continue
        if p is not None:
            out.append(p)
    return out, invalid


class NodeAgent:
    def __init__(self, fetch: Fetch, url: str, driver: str, config_path: str | None,
                 run_dir: str, node: str | None = None, release: bool = True,
                 state_dir: str | None = None,
                 kubelet_config: str | None = DEFAULT_KUBELET_CONFIG) -> None:
        if driver not in ("systemd", "cgroupfs"):
            raise ValueError(f"cgroup driver {driver!r} (expected systemd or cgroupfs)")
        self.fetch, self.url, self.driver = fetch, url, driver
        self.config_path, self.run_dir, self.node = config_path, run_dir, node
        # restore tuner settings of cgroups that left the scopes (needs the run dir's ledger
        # and cgroupfs; the tuner does the same every step, so a DaemonSet turns it off)
        self.release = release
        self.state_dir = state_dir or run_dir  # where the owned-globs file lives
        self.kubelet_config = kubelet_config  # None: do not look
        self._kubelet_said: tuple | None = None
        self._qos_said: set[str] = set()  # Pod UIDs already told they get no swap

    # -- the globs we own ----------------------------------------------------------------
    def _state_path(self) -> str:
        return os.path.join(self.state_dir, STATE_FILE)

    def owned(self) -> list[str]:
        try:
            with open(self._state_path()) as f:
                globs = json.load(f).get("globs", [])
        except FileNotFoundError:
            return []
        except (ValueError, AttributeError) as e:  # a torn or hand-edited file: start afresh
            log.warning("%s unreadable (%s): scopes added before are no longer tracked",
                        self._state_path(), e)
            return []
        return [g for g in globs if isinstance(g, str)]

    def _save(self, globs: list[str]) -> None:
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        tmp = self._state_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"globs": sorted(globs)}, f)
        os.replace(tmp, self._state_path())

    # -- one round -----------------------------------------------------------------------
    def run_once(self) -> RoundResult:
        from ...cgroups import ledger, scopes
        from ...config import load_config

        res = RoundResult()
        res.wanted, res.invalid = wanted_pods(self.fetch(self.url), self.driver, self.node,
                                              res.skipped)
        pods = res.wanted
        self._check_kubelet(res)
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
        for key, problem in res.invalid.items():
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

    def _check_kubelet(self, res: RoundResult) -> None:
        """The kubelet's swap settings into the result; a log line when the verdict changes."""
        if self.kubelet_config is None:
            return
        # the kubelet's flags where its process is visible (hostPID): its --config-dir
        # drop-ins and --fail-swap-on count too; the mounted file otherwise
        k = read_kubelet_swap(self.kubelet_config, kubelet_command_line())
        status, detail, fix = verdict(k)
        res.kubelet = {"status": status, "detail": detail, "fix": fix, "pods_swap": k.pods_swap}
        if (status, detail) != self._kubelet_said:
            self._kubelet_said = (status, detail)
            (log.info if status == "pass" else log.warning)(
                "kubelet swap: %s%s", detail, f" (fix: {fix})" if fix else "")
        if k.pods_swap:
            for p in res.wanted:
                if p.qos != "Burstable" and p.uid not in self._qos_said:
                    self._qos_said.add(p.uid)
                    log.info("%s/%s is %s: LimitedSwap gives it no swap (Burstable Pods only)",
                             p.namespace, p.name, p.qos)

    def run(self, interval: float, rounds: int | None = None,
            heartbeat: str | None = None) -> None:
        """A round every *interval* s; after each, *heartbeat* (host.heartbeat) says it lives
        and whether the round listed the Pods (ready) or failed (not ready, and why)."""
        n = 0
        while rounds is None or n < rounds:
            try:
                r = self.run_once()
                if r.added or r.removed:
                    log.info("scopes: +%s -%s", r.added, r.removed)
                ready, detail = True, f"{len(r.wanted)} Pods in scope"
            except Exception as e:  # the API may be briefly unreachable: keep going
                log.warning("round failed: %s: %s", type(e).__name__, e)
                ready, detail = False, f"round failed: {type(e).__name__}: {e}"
            if heartbeat:
                try:
                    write_heartbeat(heartbeat, ready, detail)
                except OSError as e:  # a probe then fails: say why here too
                    log.warning("heartbeat %s: %s", heartbeat, e.strerror or e)
            n += 1
            if rounds is None or n < rounds:
                time.sleep(interval)
