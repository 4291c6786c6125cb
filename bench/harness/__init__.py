"""What the benches share: the swap lock (``lock``), zram setup (``zram``), the workload
programs and their table (``workloads``), the cgroup host model (``host``), result JSON and
the command line a result records (``results``), the BENCHMARKS.md block writer (``md``) and
its table cells (``cells``), O_DIRECT block reads (``blockio``) and the C FUSE floor
(``floor``). The harness imports agentzip_blk and the standard library, never a bench."""
