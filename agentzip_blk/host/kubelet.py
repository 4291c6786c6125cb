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
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_KUBELET_CONFIG = "/var/lib/kubelet/config.yaml"
BEHAVIORS = ("NoSwap", "LimitedSwap")
PASS, WARN, FAIL = "pass", "warn", "fail"


@dataclass
class KubeletSwap:
    path: str
    present: bool = False
    fail_swap_on: bool | None = None  # None: not set (the kubelet's default is true)
    swap_behavior: str | None = None  # None: not set (the kubelet's default is NoSwap)
    error: str = ""

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


def read_kubelet_swap(path: str = DEFAULT_KUBELET_CONFIG) -> KubeletSwap:
    """Never raises: a missing file is ``present=False``, a broken one sets ``error``."""
    import yaml

    k = KubeletSwap(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return k
    except OSError as e:
        k.present, k.error = True, f"cannot read {path}: {e.strerror or e}"
        return k
    k.present = True
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        k.error = f"{path} is not YAML: {str(e).splitlines()[0]}"
        return k
    if not isinstance(doc, dict):
        k.error = f"{path} is not a KubeletConfiguration (not a map)"
        return k
    fso = doc.get("failSwapOn")
    if fso is not None and not isinstance(fso, bool):
        k.error = f"{path}: failSwapOn must be true or false, got {fso!r}"
        return k
    k.fail_swap_on = fso
    ms = doc.get("memorySwap") or {}
    if not isinstance(ms, dict):
        k.error = f"{path}: memorySwap must be a map, got {ms!r}"
        return k
    sb = ms.get("swapBehavior")
    if sb is not None and not isinstance(sb, str):
        k.error = f"{path}: memorySwap.swapBehavior must be a string, got {sb!r}"
        return k
    k.swap_behavior = sb or None
    return k


def verdict(k: KubeletSwap) -> tuple[str, str, str]:
    """(status, detail, fix) for doctor and the node agent's log."""
    if not k.present:
        return PASS, f"not a Kubernetes node (no kubelet config at {k.path})", ""
    if k.error:
        return WARN, k.error, "fix the kubelet config file (or point --kubelet-config at it)"
    if k.effective_fail_swap_on:
        how = "failSwapOn: true" if k.fail_swap_on else "failSwapOn not set (default true)"
        return (FAIL, f"{how} in {k.path}: the kubelet refuses to start while swap is on",
                f"set failSwapOn: false in {k.path} (and memorySwap.swapBehavior: LimitedSwap "
                "for Pods to swap), then restart the kubelet")
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
