"""Which file `down` removes as a dead server's disk tier (host.tierfile): only a tier file of
ours that nobody holds, and with the server's identity only that very file."""

from __future__ import annotations

import os
import pwd

import pytest

from agentzip_blk.host.tierfile import TierFile, remove_leftover
from agentzip_blk.store.disk import TIER_HEADER, DiskTier


def _file(path, data: bytes, mode: int = 0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_a_leftover_tier_is_removed(tmp_path):
    """What a killed server leaves: our header, sealed extents, nobody's lock."""
    path = _file(tmp_path / "tier", TIER_HEADER + os.urandom(4096))
    st = os.stat(path)
    assert remove_leftover(TierFile(str(path), st.st_dev, st.st_ino)) is None
    assert not path.exists()
    path = _file(tmp_path / "tier", TIER_HEADER + os.urandom(4096))
    assert remove_leftover(TierFile(str(path))) is None  # the operator's config named it
    assert not path.exists()


def test_a_tier_a_server_holds_is_left(tmp_path):
    tier = DiskTier(str(tmp_path / "tier"))
    why = remove_leftover(TierFile(str(tmp_path / "tier")))
    assert why == "in use by a running server"
    assert (tmp_path / "tier").exists()
    tier.close()


@pytest.mark.parametrize("kind", ["no-header", "mode", "symlink", "hardlink", "other-inode",
                                  "directory", "owner"])
def test_anything_else_is_left_alone(tmp_path, kind):
    path = tmp_path / "tier"
    ident = None
    expect = {"no-header": "no tier header", "mode": "mode 0644", "symlink": "symbolic link",
              "hardlink": "2 link", "other-inode": "another device or inode",
              "directory": "not a regular file", "owner": "owned by uid"}[kind]
    if kind == "no-header":
        _file(path, b"root:x:0:0::/root:/bin/bash\n")
    elif kind == "mode":
        _file(path, TIER_HEADER, 0o644)
    elif kind == "symlink":
        target = _file(tmp_path / "target", TIER_HEADER)
        path.symlink_to(target)
    elif kind == "hardlink":
        _file(path, TIER_HEADER)
        os.link(path, tmp_path / "second")
    elif kind == "other-inode":
        other = _file(tmp_path / "other", TIER_HEADER)
        st = os.stat(other)
        ident = (st.st_dev, st.st_ino)
        _file(path, TIER_HEADER)
    elif kind == "directory":
        path.mkdir(mode=0o700)
    elif kind == "owner":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        _file(path, TIER_HEADER)
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    why = remove_leftover(TierFile(str(path), *(ident or (None, None))))
    assert why is not None and expect in why, why
    assert os.path.lexists(path)


def test_an_absent_file_is_no_problem(tmp_path):
    assert remove_leftover(TierFile(str(tmp_path / "nothing"))) is None


def test_the_servers_reply_is_read_strictly():
    assert TierFile.from_reply(None) is None
    assert TierFile.from_reply({"path": None}) is None
    assert TierFile.from_reply({"path": "relative/tier", "dev": 1, "ino": 2}) is None
    assert TierFile.from_reply({"path": "/t", "dev": 1, "ino": 2}) == TierFile("/t", 1, 2)
    assert TierFile.from_reply({"path": "/t", "dev": True, "ino": 2}) == TierFile("/t")
