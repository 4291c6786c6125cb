"""The kubelet's swap settings, read from its config file (KubeletConfiguration YAML).

Two settings decide whether a swap device and Kubernetes get along (docs/KUBERNETES.md):

- ``failSwapOn`` (default true): the kubelet refuses to start while any swap is on. It must be
  false on a node with our device.
- ``memorySwap.swapBehavior`` (kubelet 1.30+; default ``NoSwap``): ``NoSwap`` gives every
  container ``memory.swap.max = 0``, so Pods stay out of swap (the node's other processes may
  still use it); ``LimitedSwap`` lets Burstable Pods swap up to a share proportional to their
  memory request (Guaranteed and BestEffort Pods still get 0), on cgroup v2 only.

``doctor`` reports them (``host.doctor``) and the node agent logs them every round. Where the
file does not exist this is not a Kubernetes node and there is nothing to check.

The file is not all the kubelet reads: its command line may name another file (``--config``:
EKS, GKE and others keep it elsewhere than kubeadm), a drop-in directory (``--config-dir``,
kubelet 1.28+: its ``*.conf`` files, in name order, merged over the file) and the flag
``--fail-swap-on`` itself, which wins over both (the kubelet's merge order: flags last). Where
the kubelet process is visible (a host's /proc: ``doctor``; a Pod only with hostPID), all of
that is read (``kubelet_command_line``); ``sources`` says what each value came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
_TRUE, _FALSE = ("true", "1", "t", "yes"), ("false", "0", "f", "no")  # Go's ParseBool, roughly
BEHAVIORS = ("NoSwap", "LimitedSwap")
PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class KubeletSwap:
    path: str
    present: bool = False
    fail_swap_on: bool | None = None  # None: not set (the kubelet's default is true)
    swap_behavior: str | None = None  # None: not set (the kubelet's default is NoSwap)
    error: str = ""
    empty: bool = False  # the file exists and is empty (a hostPath FileOrCreate made it)
    # where each setting came from: "failSwapOn" -> "PATH" / "DROPIN" / "--fail-swap-on"
    sources: dict[str, str] = field(default_factory=dict)
    flags: list[str] | None = None  # the kubelet's command line, where it was seen

    @property
    def effective_fail_swap_on(self) -> bool:
        return True if self.fail_swap_on is None else self.fail_swap_on

    @property
    def effective_behavior(self) -> str:
        return self.swap_behavior or "NoSwap"

    @property
    def pods_swap(self) -> bool:
        """Whether the kubelet lets (Burstable) Pods into swap at all."""
        return self.present and not self.error and self.effective_behavior == "LimitedSwap"


@dataclass
class KubeletFlags:
    """What the kubelet's command line says about its config (kubelet_command_line)."""
    pid: int
    config: str | None = None
    config_dir: str | None = None
    fail_swap_on: bool | None = None
    argv: list[str] = field(default_factory=list)


def parse_flags(argv: list[str], pid: int = 0) -> KubeletFlags:
    """--config, --config-dir and --fail-swap-on from a kubelet argv (pflag syntax: --x=v,
    --x v, and a bare --fail-swap-on meaning true)."""
    out = KubeletFlags(pid, argv=list(argv))
    i = 1
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--config", "--config-dir"):
            if not eq and i + 1 < len(argv):
                i += 1
                value = argv[i]
            setattr(out, "config" if name == "--config" else "config_dir", value or None)
        elif name == "--fail-swap-on":
            v = value.lower() if eq else "true"
            out.fail_swap_on = True if v in _TRUE else False if v in _FALSE else None
        i += 1
    return out


def kubelet_command_line(proc: str = "/proc") -> KubeletFlags | None:
    """The first process whose command is kubelet, its flags; None where none is visible (not
    a node, or a Pod without the host's pid namespace)."""
    try:
        pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/comm", encoding="utf-8", errors="replace") as f:
                comm = f.read().strip()
            if comm != "kubelet":
                continue
            with open(f"{proc}/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="surrogateescape") for a in f.read().split(b"\0") if a]
        except OSError:
            continue  # gone, or not ours to read
        if argv:
            return parse_flags(argv, pid)
    return None


def _load(path: str, k: KubeletSwap, label: str) -> dict | None:
    """One KubeletConfiguration document (YAML or JSON) as a map; sets k.error and returns
    None when it is broken. An empty file is {} (and k.empty for the main file)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        k.error = f"cannot read {path}: {e.strerror or e}"
        return None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        k.error = f"{path} is not YAML: {str(e).splitlines()[0]}"
        return None
    if doc is None:
        if label == "config":
            k.empty = True
        return {}
    if not isinstance(doc, dict):
        k.error = f"{path} is not a KubeletConfiguration (not a map)"
        return None
    return doc


def _apply(doc: dict, path: str, k: KubeletSwap) -> bool:
    """Merge one document's swap settings into k (a later one wins key by key)."""
    fso = doc.get("failSwapOn")
    if fso is not None and not isinstance(fso, bool):
        k.error = f"{path}: failSwapOn must be true or false, got {fso!r}"
        return False
    if fso is not None:
        k.fail_swap_on, k.sources["failSwapOn"] = fso, path
    ms = doc.get("memorySwap") or {}
    if not isinstance(ms, dict):
        k.error = f"{path}: memorySwap must be a map, got {ms!r}"
        return False
    sb = ms.get("swapBehavior")
    if sb is not None and not isinstance(sb, str):
        k.error = f"{path}: memorySwap.swapBehavior must be a string, got {sb!r}"
        return False
    if sb:
        k.swap_behavior, k.sources["memorySwap.swapBehavior"] = sb, path
    return True


def read_kubelet_swap(path: str | None = DEFAULT_KUBELET_CONFIG,
                      flags: KubeletFlags | None = None) -> KubeletSwap:
    """The kubelet's effective swap settings. Never raises: a missing file is
    ``present=False``, a broken one sets ``error``. *path* None: the file the kubelet's
    --config names, else kubeadm's. *flags* (kubelet_command_line) add its drop-ins and
    --fail-swap-on."""
    path = path or (flags.config if flags and flags.config else DEFAULT_KUBELET_CONFIG)
    k = KubeletSwap(path, flags=flags.argv if flags else None)
    if os.path.exists(path):
        k.present = True
        doc = _load(path, k, "config")
        if doc is None or not _apply(doc, path, k):
            return k
    if flags is not None:
        k.present = True  # a kubelet runs here, file or not
        if flags.config_dir and os.path.isdir(flags.config_dir):
            for name in sorted(os.listdir(flags.config_dir)):
                dropin = os.path.join(flags.config_dir, name)
                if not name.endswith(".conf") or not os.path.isfile(dropin):
                    continue  # the kubelet reads only *.conf
                doc = _load(dropin, k, "dropin")
                if doc is None or not _apply(doc, dropin, k):
                    return k
        if flags.fail_swap_on is not None:
            k.fail_swap_on, k.sources["failSwapOn"] = flags.fail_swap_on, "--fail-swap-on"
    return k


def verdict(k: KubeletSwap) -> tuple[str, str, str]:
    """(status, detail, fix) for doctor and the node agent's log."""
    if not k.present:
        return PASS, f"not a Kubernetes node (no kubelet config at {k.path})", ""
    if k.error:
        return WARN, k.error, "fix the kubelet config file (or point --kubelet-config at it)"
    if k.empty and not k.sources and k.flags is None:
        return (WARN, f"{k.path} is empty: not the file this kubelet runs with (the "
                      "DaemonSet's kubelet-config volume creates it where it is missing)",
                "point the kubelet-config volume (or --kubelet-config) at the file the "
                "kubelet's --config names (docs/KUBERNETES.md lists them per distribution)")
    if k.effective_fail_swap_on:
        how = "failSwapOn not set (default true)"
        if k.fail_swap_on:
            where = k.sources.get("failSwapOn", k.path)
            how = ("--fail-swap-on (a kubelet flag)" if where == "--fail-swap-on"
                   else f"failSwapOn: true in {where}")
        where = ("drop --fail-swap-on from the kubelet's flags (or give --fail-swap-on=false)"
                 if k.sources.get("failSwapOn") == "--fail-swap-on" else
                 f"set failSwapOn: false in {k.sources.get('failSwapOn', k.path)}")
        return (FAIL, f"{how}: the kubelet refuses to start while swap is on",
                f"{where} (and memorySwap.swapBehavior: LimitedSwap for Pods to swap), then "
                "restart the kubelet")
    b = k.effective_behavior
    if b == "NoSwap":
        how = "NoSwap" if k.swap_behavior else "not set (default NoSwap)"
        return (WARN, f"failSwapOn: false; memorySwap.swapBehavior {how}: Pods will not swap "
                      "(their containers get memory.swap.max 0); only non-Pod cgroups use the device",
                f"set memorySwap.swapBehavior: LimitedSwap in {k.path} for Burstable Pods to "
                "swap, then restart the kubelet")
    if b == "LimitedSwap":
        return (PASS, "failSwapOn: false; memorySwap.swapBehavior LimitedSwap: Burstable Pods "
                      "may swap (a share proportional to their memory request)", "")
    return (WARN, f"memorySwap.swapBehavior {b!r} is not one of {', '.join(BEHAVIORS)} "
                  "(UnlimitedSwap was removed in kubelet 1.30)",
            f"set memorySwap.swapBehavior: LimitedSwap or NoSwap in {k.path}")
