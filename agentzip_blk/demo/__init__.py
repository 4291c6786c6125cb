"""The demo: squeeze an agent-like heap into a swap device and measure what the host gets back.

`driver` runs it (`agentzip-blk demo`, tools/bench_demo.py), `backends` are the devices it
compares (zram, ours), `workload` the process it squeezes, whose script is in `scripts/`.
"""
