"""Cgroups: cgroupfs access (`fs`), v1/v2 backends, scopes and the ledger of original values,
per-cgroup stats (`cgstats`, over `procmem`), and the tuner."""
