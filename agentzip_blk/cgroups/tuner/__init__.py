"""The tuner: push scoped cgroups' cold pages into the device, in the manner of senpai/TMO.

`controller` decides (Controller, PressureMeter), `loop` applies the decisions to every scoped
cgroup (Tuner), `daemon` runs it as a process (its wiring, signals and the restore; `agentzip-blk tune`
in the foreground, `up --tune` in the background, stopped by `down`).

One :class:`Controller` per scoped cgroup keeps a *resident target*. Every interval:

- **pressure above target** -> back off at once: the target rises by a fraction that grows
  with the overshoot (``min_backoff``..``max_backoff``), and probing pauses for ``hold``
  seconds (``policy.warm_threshold_ms``: pages that were just faulted back are warm, not cold);
- **pressure below target** -> probe: the target drops below current usage by up to
  ``max_probe`` of it, scaled by how far below target the pressure is (TMO's rule: reclaim in
  proportion to the headroom, never in big steps);
- never below ``floor``, never above ``ceiling`` (the cgroup's own limit before we came);
- a newly seen cgroup is left alone for ``grace`` seconds (``policy.cold_grace_period``):
  nothing of it can be cold before then.

Pressure (fraction of wall time some task stalled on memory):

- **PSI** ``some`` where the cgroup has it: v2, or a v1 cgroup mirrored on the cgroup2 tree of
  a hybrid host (see cgroups.backends.V1Backend.psi_file);
- otherwise **estimated** from ``memory.stat``: major faults x ``fault_cost_us`` per second,
  plus the device's ``pingpong`` counter (pages written again within
  ``policy.hot_threshold_ms`` of being read: hot pages we evicted and had to take again),
  shared out over the cgroups by their major faults. The refault rate is logged next to it
  but not added: on v1 ``workingset_refault_*`` also counts pages that swap readahead
  brought in and nobody waited for (measured: 1585 refaults/s against 436 major faults/s),
  and every refault a task does wait for is a major fault already. Unlike PSI, which counts
  only refaults of recently active pages, the estimate also counts the first read of a
  long-cold page, so a v1 target is a budget for all fault stalls (set it higher than a PSI
  target; 1 % of wall time costs a single-threaded workload at most about 1 %).

The target becomes kernel action in one of two modes:

- ``reclaim`` (default, like TMO): push out ``usage - target`` once (v2 ``memory.reclaim``, v1
  a pulse of ``memory.limit_in_bytes``); the cgroup may grow again freely, and the workload
  never stalls in direct reclaim because of us.
- ``limit`` (like senpai): keep the target as the cgroup's cap (v2 ``memory.high``, v1
  ``memory.limit_in_bytes``).

Every write goes through the ledger (cgroups.ledger.Ledger): originals are restored on exit, on
``scope disable/remove`` and on ``down``. Each decision is one log line.
"""
