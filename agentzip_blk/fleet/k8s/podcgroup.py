"""Where the kubelet puts a Pod's cgroup: Pod UID + QoS class + cgroup driver -> path.

The kubelet's layout (pkg/kubelet/cm, default ``--cgroup-root=/``):

=========== ====================================================================
driver      Guaranteed / Burstable / BestEffort
=========== ====================================================================
cgroupfs    /kubepods/pod<UID>, /kubepods/burstable/pod<UID>, /kubepods/besteffort/pod<UID>
systemd     /kubepods.slice/kubepods-pod<U>.slice,
            /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<U>.slice,
            /kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<U>.slice
=========== ====================================================================

where <U> is the UID with "-" replaced by "_" (a "-" in a systemd slice name means nesting).
The same relative path holds on cgroup v2 and in v1's memory hierarchy.

The scope added for a Pod is the *leaf* name alone (unique: it carries the UID), which
``scopes.match`` matches at any depth: it works with a non-default ``--cgroup-root``
(e.g. kind or k3s nest kubepods below another cgroup).
"""

from __future__ import annotations

import re

# A Pod UID becomes part of a cgroup path and a scope glob: lowercase hex and "-" only (RFC
# 4122 UIDs from the API server, 32-hex config hashes of static Pods), so that no UID can
# name "..", a "/", a glob character or another Pod's prefix.
UID_RE = re.compile(r"[0-9a-f-]{8,64}")

QOS_CLASSES = ("Guaranteed", "Burstable", "BestEffort")


def qos_class(pod: dict) -> str:
    """status.qosClass when the API server set it (always, for admitted Pods); else the
    kubelet's rule from the containers' requests and limits (cpu and memory)."""
    q = (pod.get("status") or {}).get("qosClass")
    if q in QOS_CLASSES:
        return q
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        for r in ("cpu", "memory"):
            if r in req or r in lim:
                any_set = True
            if r not in lim or (r in req and req[r] != lim[r]):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def valid_uid(uid: object) -> bool:
    return isinstance(uid, str) and UID_RE.fullmatch(uid) is not None


def pod_cgroup(uid: str, qos: str, driver: str) -> str:
    """The Pod's cgroup, relative to the hierarchy root."""
    if qos not in QOS_CLASSES:
        raise ValueError(f"QoS class {qos!r} (expected one of {', '.join(QOS_CLASSES)})")
    if not valid_uid(uid):
        raise ValueError(f"bad Pod UID {uid!r} (expected 8..64 of [0-9a-f-])")
    if driver == "cgroupfs":
        mid = {"Guaranteed": "", "Burstable": "/burstable", "BestEffort": "/besteffort"}[qos]
        return f"/kubepods{mid}/pod{uid}"
    if driver == "systemd":
        u = uid.replace("-", "_")
        if qos == "Guaranteed":
            return f"/kubepods.slice/kubepods-pod{u}.slice"
        q = qos.lower()
        return f"/kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod{u}.slice"
    raise ValueError(f"cgroup driver {driver!r} (expected systemd or cgroupfs)")


def scope_glob(uid: str, qos: str, driver: str) -> str:
    return pod_cgroup(uid, qos, driver).rsplit("/", 1)[1]
