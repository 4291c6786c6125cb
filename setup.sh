#!/usr/bin/env bash
# One entry point for a fresh machine (run as root):
#   ./setup.sh demo   install what is missing, then run the demo
#   ./setup.sh test   install what is missing for the tests and benchmarks too, then run the suite
set -euo pipefail
cd "$(dirname "$0")"

# What the demo needs: the server (nbdkit + its Python plugin), the FUSE front door's
# fusermount3, losetup/mkswap/swapon (util-linux, mount) and a venv from Debian's python3.
APT_PACKAGES=(nbdkit nbdkit-plugin-python fuse3 python3-venv util-linux mount
              python3-cryptography  # the disk tier's AES-GCM, importable by nbdkit's embedded libpython
              gcc python3-dev liblz4-dev libssl-dev libxxhash-dev libzstd-dev)  # the native request path (setup.py)
# What the tests and the benchmarks need on top (./setup.sh test)
APT_TEST_PACKAGES=(libnbd-bin python3-libnbd  # nbdfuse (the nbdfuse front door), the tests' NBD client
              chromium nodejs  # chromium, nodejs: tests/test_workloads.py runs workloads C and D
              fio stress-ng gcc libfuse3-dev  # tests/reliability: fio, stress-ng, failfs (FUSE); gcc: the mlock shim
              systemd openssl  # test_systemd_units: systemd-analyze verify (no PID 1 needed); test_k8s: TLS cert
              lintian groff-base man-db  # tests/test_deb.py: lintian on the .deb, its man page rendered
              zsh fish  # tests/test_deb.py: the packaged zsh and fish completions load and complete
              prometheus)  # tests/fleet/test_prometheus.py: promtool check rules / test rules / check metrics
# tests/test_deb.py: the packaged CLI runs on Debian's python3-* (the .deb's Depends). Installed
# after the venv: the venv sees the system's packages (for python3-libnbd), and pip takes a
# Debian package that meets a floor as installed; so on a fresh machine the venv gets PyPI's
# versions, as before, and these serve /usr/bin/python3 only.
APT_DEB_TEST_PACKAGES=(python3-numpy python3-yaml python3-tqdm python3-prometheus-client
                       python3-sortedcontainers python3-lz4 python3-xxhash)
VENV=.venv

need_root() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup.sh: must run as root (swap, loop devices, cgroups and apt need it)" >&2
        exit 2
    fi
}

install_debian_packages() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "setup.sh: installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

install_venv() {
    # nbdkit embeds Debian's libpython, so the venv must come from /usr/bin/python3;
    # --system-site-packages brings Debian's libnbd bindings (python3-libnbd) along.
    if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.base_prefix != "/usr")'; then
        rm -rf "$VENV"
        /usr/bin/python3 -m venv --system-site-packages "$VENV"
    fi
    # $1: the extras (demo: none; test: the suite, the benchmarks, the .deb build)
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".${1:-}"
}

build_mlock_shim() {
    # nbdfuse's preload shim, built once here (the .deb ships its own) instead of by `up`;
    # rebuilt every run, so that it always matches host/chain.py. Without cc `up` compiles it
    # itself if it can, or says why it cannot.
    if command -v cc >/dev/null; then
        "$VENV/bin/python" -m agentzip_blk.host.chain agentzip_blk/host/libagentzip-mlock.so >/dev/null
    fi
}

case "${1:-}" in
    demo) need_root; install_debian_packages "${APT_PACKAGES[@]}"; install_venv
          build_mlock_shim; shift; exec "$VENV/bin/agentzip-blk" demo "$@" ;;
    test) need_root; install_debian_packages "${APT_PACKAGES[@]}" "${APT_TEST_PACKAGES[@]}"
          install_venv "[test,bench,package]"; install_debian_packages "${APT_DEB_TEST_PACKAGES[@]}"
          build_mlock_shim
          shift; exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
    *) echo "usage: $0 demo|test [args...]" >&2; exit 2 ;;
esac
