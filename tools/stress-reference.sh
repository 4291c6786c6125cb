#!/bin/bash
# The load of tests/reliability/test_swap_stress.py (stress-ng --vm and --pageswap, each in a
# memory cgroup of its own below this shell's) against a reference swap device, to tell the
# kernel's limits from the device's: how many runs OOM-kill at a given vm cgroup limit.
#   DEV=zram|swapfile LIM=<MiB> RUNS=<n> tools/stress-reference.sh      (as root)
# Needs no other swap active. Uses /dev/zram0 (reset afterwards) or a 1 GiB swapfile in
# /var/tmp (removed afterwards).
set -u
LIM=${LIM:-104}; RUNS=${RUNS:-8}; DEV=${DEV:-zram}
BASE=/sys/fs/cgroup/memory$(grep :memory: /proc/self/cgroup | cut -d: -f3)
if [ "$(wc -l < /proc/swaps)" -gt 1 ]; then echo "other swap areas are active" >&2; exit 1; fi
if [ "$DEV" = zram ]; then
  SW=/dev/zram0
  echo lz4 > /sys/block/zram0/comp_algorithm && echo 1G > /sys/block/zram0/disksize || exit 1
  trap 'swapoff $SW; echo 1 > /sys/block/zram0/reset' EXIT
else
  SW=/var/tmp/stress-reference-swapfile
  fallocate -l 1G $SW && chmod 600 $SW || exit 1
  trap 'swapoff $SW; rm -f $SW' EXIT
fi
mkswap $SW >/dev/null && swapon -p 10 $SW || exit 1
oom_kills() { grep '^oom_kill ' "$1/memory.oom_control" | cut -d' ' -f2; }
for i in $(seq 1 "$RUNS"); do
  VM=$BASE/stress-ref-vm-$$-$i; PG=$BASE/stress-ref-pages-$$-$i
  mkdir "$VM" "$PG"
  for cg in "$VM" "$PG"; do echo 100 > "$cg/memory.swappiness"; done
  echo $((LIM << 20)) > "$VM/memory.limit_in_bytes"
  echo $((160 << 20)) > "$PG/memory.limit_in_bytes"
  C="--verify --timeout 20s --metrics-brief --no-rand-seed"
  bash -c "echo \$\$ > $VM/cgroup.procs; exec stress-ng --vm 2 --vm-bytes $((96 << 20)) --vm-keep --vm-method all $C" > /dev/null 2>&1 &
  bash -c "echo \$\$ > $PG/cgroup.procs; exec stress-ng --pageswap 1 $C" > /dev/null 2>&1 &
  wait
  echo "$DEV limit=${LIM}MiB run $i: vm OOM kills $(oom_kills "$VM"), pageswap OOM kills $(oom_kills "$PG"), vm major faults $(grep -w total_pgmajfault "$VM/memory.stat" | cut -d' ' -f2)"
  for cg in "$VM" "$PG"; do
    for _ in $(seq 50); do rmdir "$cg" 2>/dev/null && break; sleep 0.2; done
  done
done
