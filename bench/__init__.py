"""The benchmarks: one module per question, one shared harness, one entry point.

    .venv/bin/python -m bench --help          # every bench, one line each
    .venv/bin/python -m bench NAME --help     # one bench's options

Run from the repository's root (the benches measure this tree's agentzip_blk). ``harness``
holds what the benches share: the swap lock, zram setup, the workload programs and their
table, the cgroup host model, result JSON and the BENCHMARKS.md block writer. A bench
imports the harness and agentzip_blk, never another bench; ``workloads/`` holds standalone
programs that the benches start, not modules.
"""
