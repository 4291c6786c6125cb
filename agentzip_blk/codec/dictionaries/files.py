"""Dictionary files: the shipped manifest and content (package data in `codec/dicts/`, or
``AGENTZIP_DICT_DIR``), checked against their sha256, and the files `dict train` writes."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

from ...errors import ConfigError

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dicts")
MANIFEST = "manifest.json"
FILE_MAGIC = b"AZDICT1\n"  # `dict train -o FILE`: magic, one JSON line, then the content


class DictionaryError(ConfigError):
    """A dictionary file is missing, corrupt or unknown; the message names the file."""


@dataclass
class DictInfo:
    name: str
    runtime: str = ""
    version: str = ""
    corpus: str = ""
    size: int = 0
    params: dict = field(default_factory=dict)
    gain: dict = field(default_factory=dict)  # held-out workload -> relative gain over zstd
    sha256: str = ""
    file: str = ""

    @classmethod
    def from_dict(cls, data: dict) -> DictInfo:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def dict_dir() -> str:
    return os.environ.get("AGENTZIP_DICT_DIR") or PACKAGE_DIR


def load_manifest(directory: str | None = None) -> list[DictInfo]:
    directory = directory or dict_dir()
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return [DictInfo.from_dict(d) for d in data["dictionaries"]]
    except FileNotFoundError:
        raise DictionaryError(f"{path}: dictionary manifest missing (reinstall agentzip-blk, "
                              f"or set compression.dictionary: none)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DictionaryError(f"{path}: corrupt dictionary manifest: {exc}") from None


def load_content(info: DictInfo, directory: str | None = None) -> bytes:
    """The dictionary's content, checked against the manifest's size and sha256."""
    directory = directory or dict_dir()
    path = os.path.join(directory, info.file or f"{info.name}.dict")
    try:
        with open(path, "rb") as f:
            content = f.read()
    except FileNotFoundError:
        raise DictionaryError(f"dictionary {info.name!r}: {path} is missing (reinstall "
                              f"agentzip-blk, or drop it from compression.dictionary)") from None
    except OSError as exc:
        raise DictionaryError(f"dictionary {info.name!r}: cannot read {path}: {exc}") from None
    digest = hashlib.sha256(content).hexdigest()
    if len(content) != info.size or digest != info.sha256:
        raise DictionaryError(
            f"dictionary {info.name!r}: {path} is corrupt ({len(content)} bytes, sha256 "
            f"{digest[:12]}..., manifest says {info.size} bytes, {info.sha256[:12]}...); "
            f"reinstall agentzip-blk, or drop it from compression.dictionary")
    return content




# --- dictionary files made by `dict train` -------------------------------------------------

def write_file(path: str, content: bytes, meta: dict) -> None:
    meta = dict(meta, size=len(content), sha256=hashlib.sha256(content).hexdigest())
    with open(path, "wb") as f:
        f.write(FILE_MAGIC + json.dumps(meta, sort_keys=True).encode() + b"\n" + content)


def read_file(path: str) -> tuple[bytes, dict]:
    """(content, metadata) of a `dict train` file, or of a bare content file (a shipped
    .dict: its manifest entry becomes the metadata when the sha256 matches)."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(FILE_MAGIC):
        header, _, content = data[len(FILE_MAGIC):].partition(b"\n")
        try:
            meta = json.loads(header)
        except ValueError as exc:
            raise DictionaryError(f"{path}: corrupt dictionary header: {exc}") from None
        if meta.get("sha256") != hashlib.sha256(content).hexdigest():
            raise DictionaryError(f"{path}: corrupt dictionary (sha256 does not match its header)")
        return content, meta
    digest = hashlib.sha256(data).hexdigest()
    meta = {"size": len(data), "sha256": digest}
    try:
        for info in load_manifest(os.path.dirname(os.path.abspath(path))):
            if info.sha256 == digest:
                meta = asdict(info)
    except DictionaryError:
        pass
    return data, meta
