#!/usr/bin/env bash
# One entry point for a fresh machine (run as root):
#   ./setup.sh demo   install what is missing, then run the demo
#   ./setup.sh test   install what is missing, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES=(nbdkit nbdkit-plugin-python libnbd-bin python3-libnbd fuse3 python3-venv util-linux
              chromium nodejs  # chromium, nodejs: tests/test_workloads.py runs workloads C and D
              fio stress-ng gcc libfuse3-dev  # tests/reliability: fio, stress-ng, failfs (FUSE)
              systemd openssl  # test_systemd_units: systemd-analyze verify (no PID 1 needed); test_k8s: TLS cert
              prometheus)  # tests/fleet/test_prometheus.py: promtool check rules / test rules / check metrics
VENV=.venv

need_root() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "setup.sh: must run as root (swap, loop devices, cgroups and apt need it)" >&2
        exit 2
    fi
}

install_debian_packages() {
    local missing=()
    for pkg in "${APT_PACKAGES[@]}"; do
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
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,bench]"
}

need_root
install_debian_packages
install_venv

case "${1:-}" in
    demo) shift; exec "$VENV/bin/agentzip-blk" demo "$@" ;;
    test) shift; exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
    *) echo "usage: $0 demo|test [args...]" >&2; exit 2 ;;
esac
