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
  release() { echo 1 > /sys/block/zram0/reset; }
else
  SW=/var/tmp/stress-reference-swapfile
  fallocate -l 1G $SW && chmod 600 $SW || exit 1
  release() { rm -f $SW; }
fi
PIDS=""; VM=""; PG=""
remove_cgroups() {
  for cg in $VM $PG; do
    [ -d "$cg" ] || continue
    for _ in $(seq 50); do rmdir "$cg" 2>/dev/null && break; sleep 0.2; done
  done
}
# the safe order, on any exit: the workload stopped and its cgroups removed, then swapoff
cleanup() {
  for pid in $PIDS; do kill -9 "$pid" 2>/dev/null; done
  for cg in $VM $PG; do  # stress-ng's workers: only what this script started lives there
    [ -f "$cg/cgroup.procs" ] && for pid in $(cat "$cg/cgroup.procs"); do kill -9 "$pid" 2>/dev/null; done
  done
  wait 2>/dev/null
  remove_cgroups
  swapoff $SW 2>/dev/null
  release
}
trap cleanup EXIT
trap 'exit 130' INT TERM
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
  PIDS="$!"
  bash -c "echo \$\$ > $PG/cgroup.procs; exec stress-ng --pageswap 1 $C" > /dev/null 2>&1 &
  PIDS="$PIDS $!"
  wait
  PIDS=""
  echo "$DEV limit=${LIM}MiB run $i: vm OOM kills $(oom_kills "$VM"), pageswap OOM kills $(oom_kills "$PG"), vm major faults $(grep -w total_pgmajfault "$VM/memory.stat" | cut -d' ' -f2)"
  remove_cgroups
done
