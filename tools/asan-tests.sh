#!/usr/bin/env bash
# The native request path's tests under AddressSanitizer: a separate build of
# agentzip_blk/datapath/nativeloop.c and nativestore.c with -fsanitize=address, in a copy of the package, and
# the tests that drive it (model, malformed requests, interleaving) run against that copy.
#   tools/asan-tests.sh [pytest args...]      (after ./setup.sh test; .ci/run calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cp -r agentzip_blk "$WORK/agentzip_blk"
find "$WORK/agentzip_blk" -name 'nativeloop*.so' -delete
AGENTZIP_NATIVE_CFLAGS="-fsanitize=address -fno-omit-frame-pointer -O1 -g" \
AGENTZIP_NATIVE_LDFLAGS="-fsanitize=address" \
    "$PYTHON" setup.py -q build_ext --build-lib "$WORK/lib" --build-temp "$WORK/tmp" 2>&1 \
    | grep -v -i "beta\|warnings.warn" || true
cp "$WORK"/lib/agentzip_blk/datapath/nativeloop*.so "$WORK/agentzip_blk/datapath/"

export LD_PRELOAD
LD_PRELOAD=$(cc -print-file-name=libasan.so)
# CPython's own allocations are not ours to judge: leaks off, everything else fatal
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export PYTHONPATH="$WORK"
cp -r "$ROOT/tests" "$ROOT/tools" "$ROOT/bench" "$WORK/"  # tests/conftest.py takes the swap lock from bench/
cd "$WORK"
# The venv's editable install maps agentzip_blk to the checkout ahead of PYTHONPATH: drop
# its finder, so that the copy (with the ASan build) is what the tests import.
"$PYTHON" - "$WORK" "$ROOT/pyproject.toml" "$@" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
work, config, *args = sys.argv[1:]
from agentzip_blk.datapath import nativeloop
if not nativeloop.__file__.startswith(work):
    sys.exit(f"asan-tests.sh: imported {nativeloop.__file__}, not the ASan build")
import pytest
# -ra: a failure's test id in the last lines of the log (all CI keeps)
sys.exit(pytest.main(["-q", "-ra", "-p", "no:cacheprovider", "--rootdir", work, "-c", config,
                      "tests/datapath/test_native.py", "tests/datapath/test_native_writes.py",
                      "tests/datapath/test_native_pack.py",
                      *args]))
PY
