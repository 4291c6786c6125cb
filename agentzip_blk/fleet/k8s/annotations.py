"""The Pod annotations agentzip understands, and their validation.

``agentzip.io/enable: "true"``            the Pod's cgroup joins the scopes (its cold pages
                                           may be pushed into the compressed swap device)
``agentzip.io/compression-level: "3"``    requested zstd level, 1..19; needs enable "true"

The webhook records what it accepted in ``agentzip.io/admission`` (JSON), so the node agent
and operators see the validated request, not a raw string. How the level is honored: see
``nodeagent`` (one device per node, one level: per-Pod levels are approximated).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

PREFIX = "agentzip.io/"
ENABLE = PREFIX + "enable"
LEVEL = PREFIX + "compression-level"
RECORD = PREFIX + "admission"
KNOWN = (ENABLE, LEVEL, RECORD)
LEVEL_MIN, LEVEL_MAX = 1, 19  # zstd's levels; lz4hc's 1..12 fit inside


class AnnotationError(ValueError):
    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class PodSettings:
    enabled: bool
    level: int | None = None
    warnings: list[str] = field(default_factory=list)

    def record(self) -> str:
        """The JSON the webhook stores in ``agentzip.io/admission``."""
        return json.dumps({"enabled": self.enabled, "compression_level": self.level},
                          sort_keys=True)


def parse(annotations: dict | None) -> PodSettings | None:
    """None when the Pod carries no agentzip.io/ annotation; else its settings.
    Raises AnnotationError naming every bad annotation and value (also for a metadata.annotations
    that is not a map of strings: the API server guarantees one, a hand-made object may not)."""
    if annotations is not None and not isinstance(annotations, dict):
        raise AnnotationError([f"metadata.annotations must be a map, got "
                               f"{type(annotations).__name__}"])
    ann = {k: v for k, v in (annotations or {}).items()
           if isinstance(k, str) and k.startswith(PREFIX)}
    bad = sorted(k for k, v in ann.items() if not isinstance(v, str))
    if bad:
        raise AnnotationError([f"{k} must be a string, got {type(ann[k]).__name__}" for k in bad])
    if not ann:
        return None
    problems: list[str] = []
    warnings: list[str] = []
    for k in sorted(ann):
        if k not in KNOWN:
            problems.append(f"unknown annotation {k!r} (known: {ENABLE}, {LEVEL})")
    enabled = False
    raw = ann.get(ENABLE)
    if raw is None:
        if LEVEL in ann:
            problems.append(f"{LEVEL} needs {ENABLE}: \"true\"")
    elif raw == "true":
        enabled = True
    elif raw == "false":
        enabled = False
    else:
        problems.append(f"{ENABLE} must be \"true\" or \"false\", got {raw!r}")
    level = None
    raw = ann.get(LEVEL)
    if raw is not None:
        text = raw.strip() if isinstance(raw, str) else raw
        if not isinstance(text, str) or not text.isdigit():
            problems.append(f"{LEVEL} must be an integer {LEVEL_MIN}..{LEVEL_MAX}, got {raw!r}")
        elif not LEVEL_MIN <= int(text) <= LEVEL_MAX:
            problems.append(f"{LEVEL} must be {LEVEL_MIN}..{LEVEL_MAX}, got {raw!r}")
        else:
            level = int(text)
            if ann.get(ENABLE) == "false":
                warnings.append(f"{LEVEL} has no effect with {ENABLE}: \"false\"")
    if problems:
        raise AnnotationError(problems)
    return PodSettings(enabled, level, warnings)


def to_dict(s: PodSettings) -> dict:
    return asdict(s)
