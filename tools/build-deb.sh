#!/usr/bin/env bash
# Build the Debian package: tools/build-deb.sh [OUT_DIR]  ->  OUT_DIR/agentzip-blk_VERSION_ARCH.deb
# (OUT_DIR defaults to dist/; VERSION is pyproject.toml's). Needs dpkg-deb, cc, strip, gzip and
# a Python ($PYTHON, default .venv/bin/python, as setup.sh makes it) with the package's
# dependencies and its `package` extra (argparse-manpage, shtab). No root, no network.
#
# DEB_SUITE=trixie builds the Debian 13 package on this Debian 12 host instead:
# agentzip-blk_VERSION+deb13_ARCH.deb, Depends python3 (>= 3.13), python3 (<< 3.14) (trixie's),
# the vendored zstandard's C backend from zstandard's cp313 wheel ($WHEELHOUSE, a directory
# holding it, or pip download: the one network access), and the native request path compiled
# against Python 3.13's headers ($PYTHON_INCLUDE: "-I ROOT/usr/include/python3.13 -idirafter
# ROOT/usr/include" from a trixie root ROOT with libpython3.13-dev); without them the package
# serves in Python (device.datapath auto; doctor says so). Tested in a trixie root
# (tests/test_deb.py, AGENTZIP_TEST_TRIXIE_CHROOT). One package cannot serve both: the compiled
# backends are per CPython ABI, and nbdkit-plugin-python embeds the suite's one libpython.
#
# What is in it, and why (measured on Debian 12, tests/test_deb.py):
# - /usr/lib/agentzip-blk/agentzip_blk: the package, in a private directory run by
#   /usr/bin/agentzip-blk (tools/debian/agentzip-blk.launcher). Its dependencies are Debian's
#   python3-* packages (Depends) wherever bookworm's version works: numpy 1.24, yaml 6.0,
#   tqdm 4.64, prometheus-client 0.16, sortedcontainers 2.4, lz4 4.0.2, xxhash 3.2, cryptography 38
#   (the suite's non-swap tests pass on them; pyproject.toml's floors say the same).
# - /usr/lib/agentzip-blk/zstandard: the one vendored dependency, copied from $PYTHON's own
#   install: bookworm's python3-zstandard 0.20 fails to decode the store's frames ("error
#   determining content size from frame header": they carry no content size; 0.22 and 0.23
#   fail the same way, 0.24 passes). Its C backend is compiled for one CPython, hence
#   python3 (>= 3.11), python3 (<< 3.12) in Depends (3.13 and 3.14 with DEB_SUITE=trixie).
# - /usr/lib/agentzip-blk/libagentzip-mlock.so: nbdfuse's mlockall preload shim (host/chain.py),
#   compiled here so that `up` needs no C compiler on the host.
# - agentzip_blk/datapath/nativeloop*.so: the native request path, compiled here for Debian's
#   python3 (setup.py builds the same source into the venv); liblz4-1, libzstd1 and libssl3 in Depends.
#   Those ELF objects make the package Architecture: amd64 (the build host's), not all:
#   lintian rejects ELF files in an arch-independent package, and neither can be avoided.
# - the systemd units in /usr/lib/systemd/system (install-units with --unit-dir), the default
#   /etc/agentzip/config.yaml (a conffile: every key commented out), the man page and the bash
#   completion generated from the CLI parser (tools/debian/gen_docs.py), copyright, changelog.
# - agentzip-blk.yaml(5) and the conffile, both from agentzip_blk/config/reference.py; zsh and
#   fish completion beside bash's (Debian's vendor directories: no shell package needed).
# - /usr/share/agentzip-blk: the Grafana dashboard and the Prometheus alert rules (deploy/).
# - maintainer scripts: prerm refuses `remove` while the device is attached, postinst reloads
#   systemd and restarts the exporter (never the swap server), postrm purge removes what the
#   programs wrote (/var/lib/agentzip, the scope drop-in, the run directory).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
DEB=tools/debian
PKG=agentzip-blk
LIBDIR=usr/lib/$PKG

die() { echo "build-deb.sh: $*" >&2; exit 2; }
for tool in dpkg-deb cc strip gzip; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install dpkg-dev gcc binutils gzip)"
done
VERSION=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
CHANGELOG_VERSION=$(sed -n '1s/^[^ ]* (\([^)]*\)).*/\1/p' "$DEB/changelog")
[ "$VERSION" = "$CHANGELOG_VERSION" ] || \
    die "pyproject.toml says $VERSION but $DEB/changelog's top entry is $CHANGELOG_VERSION: add an entry"
ARCH=$(dpkg --print-architecture)
SUITE=${DEB_SUITE:-bookworm}
case "$SUITE" in
    bookworm) PYVER=3.11; PYNEXT=3.12; DEB_VERSION=$VERSION ;;
    trixie) PYVER=3.13; PYNEXT=3.14; DEB_VERSION=$VERSION+deb13 ;;
    *) die "DEB_SUITE=$SUITE: bookworm or trixie" ;;
esac
HOST_PYVER=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# reproducible: file times and the man page date come from the changelog's top entry
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date -d "$(sed -n 's/^ -- .*>  //p' "$DEB/changelog" | head -1)" +%s)}
export SOURCE_DATE_EPOCH

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
S=$STAGE/$PKG
mkdir -p "$S/DEBIAN" "$S/$LIBDIR" "$S/usr/bin" "$S/etc/agentzip" "$S/usr/share/man/man1" \
         "$S/usr/share/man/man5" "$S/usr/share/bash-completion/completions" \
         "$S/usr/share/zsh/vendor-completions" "$S/usr/share/fish/vendor_completions.d" \
         "$S/usr/share/doc/$PKG" "$S/usr/share/$PKG"

# the package: its sources and package data, not what running it left behind
(cd "$ROOT" && find agentzip_blk -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' \
    -print0 | xargs -0 cp --parents -t "$S/$LIBDIR")
install -m 0755 "$DEB/agentzip-blk.launcher" "$S/usr/bin/$PKG"

# vendored zstandard: the files of $PYTHON's installed distribution, licence aside; for another
# CPython than $PYTHON's (DEB_SUITE=trixie), the same version's wheel for that CPython
ZSTD_WHEEL=
PY_SELF=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$PY_SELF" != "$PYVER" ]; then
    ZSTD_VERSION=$("$PYTHON" -c 'import zstandard; print(zstandard.__version__)')
    CP=cp${PYVER/./}
    WHEELS=${WHEELHOUSE:-$STAGE/wheels}
    if ! ls "$WHEELS"/zstandard-"$ZSTD_VERSION"-"$CP"-*manylinux*x86_64*.whl >/dev/null 2>&1; then
        "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
            --implementation cp --abi "$CP" --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$WHEELS" "zstandard==$ZSTD_VERSION" >/dev/null 2>&1 \
            || die "zstandard $ZSTD_VERSION for $CP: no wheel in \$WHEELHOUSE and pip download failed"
    fi
    ZSTD_WHEEL=$(ls "$WHEELS"/zstandard-"$ZSTD_VERSION"-"$CP"-*manylinux*x86_64*.whl | head -1)
fi
ZSTD_LICENSE=$("$PYTHON" - "$S/$LIBDIR" "$ZSTD_WHEEL" <<'EOF'
import shutil, sys, zipfile
from importlib.metadata import distribution
from pathlib import Path
import zstandard
major, minor = (int(x) for x in zstandard.__version__.split(".")[:2])
if (major, minor) < (0, 24):  # pyproject.toml's floor: older ones cannot read the store's frames
    sys.exit(f"build-deb.sh: zstandard {zstandard.__version__} in {sys.executable} is older than 0.24")
dest, wheel, licence = Path(sys.argv[1]), sys.argv[2], ""


def skip(parts, name) -> bool:  # the C backend is the one used; cffi's would need python3-cffi
    return "__pycache__" in parts or name.startswith("_cffi") or name == "backend_cffi.py"


if wheel:
    with zipfile.ZipFile(wheel) as zf:
        for n in zf.namelist():
            if n.endswith("/"):
                continue  # a directory entry
            p = Path(n)
            if p.parts[0] == "zstandard" and not skip(p.parts, p.name):
                (dest / p).parent.mkdir(parents=True, exist_ok=True)
                (dest / p).write_bytes(zf.read(n))
            elif ".dist-info" in p.parts[0] and (p.name.upper().startswith("LICENSE")
                                                 or "licenses" in p.parts):
                licence = zf.read(n).decode()
else:
    dist = distribution("zstandard")
    for f in dist.files:
        src = Path(dist.locate_file(f))
        if skip(f.parts, f.name):
            continue
        if f.parts[0] == "zstandard":
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / f)
        elif "licenses" in f.parts or f.name.upper().startswith("LICENSE"):
            licence = src.read_text()
if not licence:
    sys.exit("build-deb.sh: zstandard's licence file not found in its dist-info")
print("\n".join(" " + (line.rstrip() or ".") for line in licence.strip().splitlines()))
EOF
)

# nbdfuse's mlock shim, compiled now (hardening flags as dpkg-buildflags gives them)
PYTHONPATH=$ROOT "$PYTHON" -m agentzip_blk.host.chain "$S/$LIBDIR/libagentzip-mlock.so" \
    -g0 -fstack-protector-strong -D_FORTIFY_SOURCE=2 -Wl,-z,relro -Wl,-z,now >/dev/null
# the native request path (agentzip_blk/datapath/nativeloop.c, nativestore.c), for Debian's
# python3 (Depends)
for header in /usr/include/lz4.h /usr/include/xxhash.h /usr/include/zstd.h /usr/include/openssl/evp.h; do
    [ -f "$header" ] || die "$header not found (apt-get install liblz4-dev libssl-dev libxxhash-dev libzstd-dev python3-dev)"
done
if [ "$PYVER" = "$HOST_PYVER" ]; then
    PY_INCLUDE=${PYTHON_INCLUDE:-$(/usr/bin/python3-config --includes)}
else
    PY_INCLUDE=${PYTHON_INCLUDE:-}
fi
EXT_SUFFIX=.cpython-${PYVER/./}-$(uname -m)-linux-gnu.so
if [ -n "$PY_INCLUDE" ]; then
    # shellcheck disable=SC2086  # PY_INCLUDE is a list of -I flags
    cc -shared -fPIC -O2 -g0 -std=gnu11 -fstack-protector-strong -D_FORTIFY_SOURCE=2 \
        $PY_INCLUDE agentzip_blk/datapath/nativeloop.c agentzip_blk/datapath/nativestore.c \
        -Wl,-z,relro -Wl,-z,now -llz4 -lzstd -lcrypto -lpthread \
        -o "$S/$LIBDIR/agentzip_blk/datapath/nativeloop$EXT_SUFFIX"
else
    echo "build-deb.sh: no Python $PYVER headers (\$PYTHON_INCLUDE): no native request path; the package serves in Python" >&2
fi
find "$S/$LIBDIR" -name '*.so' -exec strip --strip-unneeded --remove-section=.comment \
    --remove-section=.note {} +

# the units, with the packaged program in ExecStart=
PYTHONPATH=$ROOT "$PYTHON" -m agentzip_blk.cli install-units --prefix "$S" \
    --unit-dir usr/lib/systemd/system --bin /usr/bin/$PKG >/dev/null

install -m 0644 "$DEB/config.yaml" "$S/etc/agentzip/config.yaml"
echo /etc/agentzip/config.yaml > "$S/DEBIAN/conffiles"

# man pages and completions: agentzip-blk(1) and bash/zsh/fish from the parser,
# agentzip-blk.yaml(5) from config/reference.py (the conffile's source too)
PYTHONPATH=$ROOT "$PYTHON" "$DEB/gen_docs.py" "$STAGE/docs"
gzip -9n < "$STAGE/docs/$PKG.1" > "$S/usr/share/man/man1/$PKG.1.gz"
gzip -9n < "$STAGE/docs/$PKG.yaml.5" > "$S/usr/share/man/man5/$PKG.yaml.5.gz"
install -m 0644 "$STAGE/docs/$PKG.bash" "$S/usr/share/bash-completion/completions/$PKG"
install -m 0644 "$STAGE/docs/_$PKG" "$S/usr/share/zsh/vendor-completions/_$PKG"
install -m 0644 "$STAGE/docs/$PKG.fish" "$S/usr/share/fish/vendor_completions.d/$PKG.fish"

# documentation
awk -v lic="$ZSTD_LICENSE" '{ if ($0 == "@ZSTANDARD_LICENSE@") print lic; else print }' \
    "$DEB/copyright" > "$S/usr/share/doc/$PKG/copyright"
gzip -9n < "$DEB/changelog" > "$S/usr/share/doc/$PKG/changelog.gz"
# uncompressed: the units' Documentation= names it (file:/usr/share/doc/agentzip-blk/README.md)
install -m 0644 README.md "$S/usr/share/doc/$PKG/README.md"
# for the monitoring side to import: the Grafana dashboard (with __inputs) and the alert rules
install -m 0644 deploy/grafana-dashboard.json "$S/usr/share/$PKG/grafana-dashboard.json"
install -m 0644 deploy/prometheus/alerts.yaml "$S/usr/share/$PKG/prometheus-alerts.yaml"
# the exporter as no one, where device.control_group is set (the unit's comment says how)
install -D -m 0644 "$DEB/examples/agentzip-blk-metrics-nonroot.conf" \
    "$S/usr/share/doc/$PKG/examples/agentzip-blk-metrics-nonroot.conf"

install -m 0755 "$DEB/postinst" "$DEB/prerm" "$DEB/postrm" "$S/DEBIAN/"
DEPENDS="nbdkit, nbdkit-plugin-python, fuse3, util-linux (>= 2.38), mount, python3 (>= $PYVER), python3 (<< $PYNEXT),"
DEPENDS+=" python3-numpy (>= 1:1.24), python3-yaml (>= 6.0), python3-tqdm (>= 4.64),"
DEPENDS+=" python3-prometheus-client (>= 0.16), python3-sortedcontainers (>= 2.4),"
DEPENDS+=" python3-lz4 (>= 4.0.2), python3-xxhash (>= 3.2), python3-cryptography (>= 38), libc6,"
DEPENDS+=" liblz4-1, libzstd1, libssl3"  # the native request path (xxhash is compiled in;
                                        # libssl3 has libcrypto: the disk tier's AES-GCM)
SIZE=$(du -sk --exclude=DEBIAN "$S" | cut -f1)
sed -e "s/@VERSION@/$DEB_VERSION/" -e "s/@ARCH@/$ARCH/" -e "s/@SIZE@/$SIZE/" -e "s/@DEPENDS@/$DEPENDS/" \
    "$DEB/control.in" > "$S/DEBIAN/control"

# permissions and times as a package wants them; md5sums of everything but DEBIAN/
find "$S" -type d -exec chmod 0755 {} +
find "$S" -type f ! -path "$S/DEBIAN/*" ! -path "$S/usr/bin/*" -exec chmod 0644 {} +
(cd "$S" && find . -type f ! -path './DEBIAN/*' ! -path ./etc/agentzip/config.yaml -printf '%P\0' \
    | sort -z | xargs -0 md5sum > DEBIAN/md5sums)
chmod 0644 "$S/DEBIAN/md5sums" "$S/DEBIAN/control" "$S/DEBIAN/conffiles"
find "$S" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

FILE=$OUT/${PKG}_${DEB_VERSION}_${ARCH}.deb
dpkg-deb --root-owner-group -Zxz --build "$S" "$FILE" >/dev/null
echo "$FILE"
