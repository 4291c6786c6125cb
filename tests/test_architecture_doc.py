"""docs/ARCHITECTURE.md names code: every module, file, class, function and config key it
cites in backticks exists. A rename that forgets the page fails here."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

from agentzip_blk.config import reference

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agentzip_blk"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

CONFIG_KEYS = {key.name for key in reference.KEYS}
CONFIG_SECTIONS = {name.split(".")[0] for name in CONFIG_KEYS}
# dotted names that are not code: stats keys and the kernel's and cgroupfs' names
NOT_CODE = ("stats.", "native.writes_served", "memory.", "si->")


def cited() -> list[str]:
    return re.findall(r"`([^`\n]+)`", DOC.read_text(encoding="utf-8"))


@cache
def modules() -> dict[str, str]:
    """Dotted names of the package's modules, each also under every shorter suffix
    (store.objects and objects both name agentzip_blk.store.objects), first found wins."""
    found: dict[str, str] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "scripts" in path.parts or path.stem in ("__main__", "nbdkit_plugin"):
            continue  # programs: the demo's scripts, `python -m`, the module nbdkit loads
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        full = ".".join(parts)
        for i in range(1, len(parts)):
            found.setdefault(".".join(parts[i:]), full)
    return found


@cache
def classes() -> dict[str, list[type]]:
    """The package's classes by name (found in the source, imported only when cited)."""
    where: dict[str, list[str]] = {}
    for full in sorted(set(modules().values())):
        path = ROOT / (full.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / full.replace(".", "/") / "__init__.py"
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(full)
    return {name: [getattr(importlib.import_module(m), name) for m in mods]
            for name, mods in where.items()}


def _defines(source: str, name: str) -> bool:
    """``name`` is defined in this source: a def, a class, an assignment or an annotated
    field, an attribute set on self, or a key of the store's state arrays."""
    return re.search(rf"(def |class |self\.|\b){re.escape(name)}\b\s*(\(|:|=|\[|,|\))", source) \
        is not None or f'"{name}"' in source


def _has(obj, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    try:
        return _defines(inspect.getsource(obj), attr)
    except (OSError, TypeError):
        return False


def problem(token: str) -> str | None:
    """Why ``token`` names nothing, or None when it does (or is not a code name)."""
    token = token.strip()
    if token.startswith(NOT_CODE) or " " in token.split(":")[0].strip():
        return None
    # a file or a directory: `store/pool.py`, `agentzip_blk/host/`, `store/objects.py: a / b`
    path, _, names = token.partition(": ")
    if "/" in path and re.fullmatch(r"[\w./-]+", path):
        if not path.endswith(("/", ".py", ".c", ".h")):
            return None
        where = [ROOT / path, PACKAGE / path]
        if re.fullmatch(r"\w+/", path):  # a subpackage or data folder: `tuner/`, `dicts/`
            where += [p for p in PACKAGE.rglob(path[:-1]) if p.is_dir()]
        hit = next((p for p in where if p.exists()), None)
        if hit is None:
            return f"no file {path}"
        for name in re.findall(r"\w+", names):
            if hit.is_file() and not _defines(hit.read_text(encoding="utf-8"), name):
                return f"{path} defines no {name}"
        return None
    name = re.sub(r"\(.*\)$", "", token)  # `PageStore.write(buf, offset)`, `check()`
    if re.search(r"\.(yaml|yml|json|md|txt|so)$", name):
        return None  # a file name: `config.yaml`
    if not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)+", name):
        return None
    parts = name.split(".")
    if name in CONFIG_KEYS or token.split(":")[0] in CONFIG_KEYS:
        return None
    if parts[0] in CONFIG_SECTIONS and ".".join(parts[:2]) not in modules() \
            and parts[0] not in modules():
        return f"no config key {name}"
    if parts[0][0].isupper():  # a class of the package, then its attributes
        owners = classes().get(parts[0])
        if not owners:
            return f"no class {parts[0]}"
        if not any(_has(cls, parts[1]) for cls in owners):
            return f"{parts[0]} has no {parts[1]}"
        return None
    # the longest prefix that is a module, then attributes of it
    for i in range(len(parts), 0, -1):
        full = modules().get(".".join(parts[:i]))
        if full is None:
            continue
        obj = importlib.import_module(full)
        for j in range(i, len(parts)):
            attr = parts[j]
            if not _has(obj, attr):
                return f"{'.'.join(parts[:j])} has no {attr}"
            found = getattr(obj, attr, None)
            if found is None or not (inspect.isclass(found) or inspect.ismodule(found)):
                break  # a function, or a column/field named in the source: enough
            obj = found
        return None
    return None  # not a name of ours (a kernel function, a stats key)


def layout_problems() -> list[str]:
    """The layout table: each package's row names its modules and subpackages."""
    found = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `agentzip_blk/(\w+)/` \| (.*) \|$", line)
        if not m:
            continue
        package, text = PACKAGE / m.group(1), m.group(2)
        for name in re.findall(r"`(\w+)(?:/|\.py|\.c)?`", text):
            hits = [p for p in package.rglob(f"{name}*") if p.stem == name or p.name == name]
            if not hits and not any(_defines(p.read_text(encoding="utf-8"), name)
                                    for p in package.rglob("*.py")):
                found.append(f"agentzip_blk/{m.group(1)}/ has no module {name}")
    return found


def test_every_name_the_architecture_page_cites_exists():
    problems = sorted({f"`{t}`: {p}" for t in cited() if (p := problem(t)) is not None})
    problems += layout_problems()
    assert not problems, "docs/ARCHITECTURE.md cites what is not there:\n" + "\n".join(problems)


def test_the_check_catches_a_stale_name():
    assert problem("store.pagestore.PageStore.write") is None
    assert problem("PageStore.no_such_method") == "PageStore has no no_such_method"
    assert problem("store/no_such_module.py") == "no file store/no_such_module.py"
    assert problem("placement.Placer.no_such") == "placement.Placer has no no_such"
    assert problem("compression.no_such_key") == "no config key compression.no_such_key"
    assert problem("compression.frame_pages") is None


def test_parse_of_this_file_stays_valid():
    ast.parse(Path(__file__).read_text())  # the regexes above are raw strings
