#!/usr/bin/env bash
# Runs a command held to a fixed share of the CPU, so that a cluster of many
# workers on a small machine behaves like one with a core (or part of one)
# per worker — what pd-plan profiles and validates under (docs/capacity_planning.md).
#
#   deploy/local/cpu_share.sh run SHARE GROUP COMMAND [ARGS...]
#       execs COMMAND in the cgroup GROUP limited to SHARE CPUs (0.5: half
#       a core's time in every 5 ms period; 2: two cores), creating it;
#       the pid stays the command's, so its caller can signal it.
#   deploy/local/cpu_share.sh remove GROUP...
#       removes the groups (once their processes have exited).
#   deploy/local/cpu_share.sh how
#       prints which mechanism this machine offers, or why none.
#
# The limit is the CFS bandwidth controller: cgroup v2 `cpu.max` where the
# unified hierarchy has the cpu controller, else cgroup v1
# `cpu.cfs_quota_us`. Both need root (or a delegated cgroup). A share is a
# time quota, not a core pinning: threads may run on any core, but the
# group gets at most SHARE x 5 ms of CPU time per 5 ms. The period is short
# (the default is 100 ms) because a quota is spent in bursts: a worker at
# 0.4 CPU with a 100 ms period runs 40 ms and then stalls 60 ms, so single
# engine steps took either their time or 60 ms more; at 5 ms the stall is
# at most 3 ms and step times follow the share (pd-plan profile, whose
# step-cost fit error this cut; docs/capacity_planning.md).
quota_min_us=1000  # The kernel's smallest quota.
set -euo pipefail

period_us=5000

# Sets $base and $kind for this machine, or fails saying why.
find_base() {
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]] && grep -qw cpu /sys/fs/cgroup/cgroup.controllers; then
    base=/sys/fs/cgroup kind=v2
    grep -qw cpu /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null \
      || echo +cpu >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
  else
    base="" kind=""
    for d in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct; do
      if [[ -f "$d/cpu.cfs_quota_us" ]]; then base="$d" kind=v1; break; fi
    done
  fi
  if [[ -z "$base" ]]; then
    echo "cpu_share.sh: no cgroup cpu controller is mounted (need cgroup v2 with cpu, or v1 cpu); run without a CPU share" >&2
    exit 1
  fi
  if [[ ! -w "$base" ]]; then
    echo "cpu_share.sh: $base is not writable; run as root (or in a delegated cgroup), or without a CPU share" >&2
    exit 1
  fi
}

cmd="${1:-}"
shift || true
case "$cmd" in
  run)
    (($# >= 3)) || { echo "usage: cpu_share.sh run SHARE GROUP COMMAND [ARGS...]" >&2; exit 2; }
    share="$1" group="$2"
    shift 2
    quota_us="$(awk -v s="$share" -v p="$period_us" 'BEGIN { if (s + 0 <= 0) exit 1; printf "%d", s * p }')" \
      || { echo "cpu_share.sh: SHARE must be a positive number of CPUs, not '$share'" >&2; exit 2; }
    ((quota_us >= quota_min_us)) || { echo "cpu_share.sh: SHARE must be at least $(awk -v q=$quota_min_us -v p=$period_us 'BEGIN{print q/p}') CPUs" >&2; exit 2; }
    [[ "$group" =~ ^[A-Za-z0-9._-]+$ ]] || { echo "cpu_share.sh: bad group name '$group'" >&2; exit 2; }
    find_base
    dir="$base/$group"
    mkdir -p "$dir"
    if [[ "$kind" == v2 ]]; then
      echo "$quota_us $period_us" >"$dir/cpu.max"
    else
      echo "$period_us" >"$dir/cpu.cfs_period_us"
      echo "$quota_us" >"$dir/cpu.cfs_quota_us"
    fi
    echo $$ >"$dir/cgroup.procs"
    exec "$@"
    ;;
  remove)
    (find_base) 2>/dev/null || exit 0  # No controller: nothing was made.
    find_base
    for group in "$@"; do
      [[ -d "$base/$group" ]] && rmdir "$base/$group" 2>/dev/null || true
    done
    ;;
  how)
    find_base
    if [[ "$kind" == v2 ]]; then echo "cgroup v2 cpu.max (period ${period_us} us) under $base"
    else echo "cgroup v1 cpu.cfs_quota_us (period ${period_us} us) under $base"; fi
    ;;
  *) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
