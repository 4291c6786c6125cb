"""The native request path (agentzip_blk/datapath/nativeloop.c) as an optional extension.

Everything else is in pyproject.toml. `optional=True`: where the compiler or the headers
(liblz4-dev, libssl-dev, libxxhash-dev, libzstd-dev, python3-dev) are missing the build goes on without it, and the
server serves every request in Python (`device.datapath: auto`; `doctor` says which path runs).
"""

import os

from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Wno-missing-field-initializers", "-Wno-cast-function-type"]
# The CI's AddressSanitizer build (tools/asan-tests.sh) adds its flags through this.
CFLAGS += os.environ.get("AGENTZIP_NATIVE_CFLAGS", "").split()

setup(ext_modules=[Extension(
    "agentzip_blk.datapath.nativeloop",
    sources=["agentzip_blk/datapath/nativeloop.c", "agentzip_blk/datapath/nativestore.c"],
    depends=["agentzip_blk/datapath/nativestore.h"],
    libraries=["lz4", "zstd", "crypto", "pthread"],
    extra_compile_args=CFLAGS,
    extra_link_args=os.environ.get("AGENTZIP_NATIVE_LDFLAGS", "").split(),
    optional=True,
)])
