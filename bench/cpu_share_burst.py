#!/usr/bin/env python3
"""How the kernel holds one thread to a CPU share, against two models of it.

A worker held to a share of s CPUs (deploy/local/cpu_share.sh) is not a
CPU s times as slow: after an idle time it runs at full speed until its
quota is spent. This script runs spins of C CPU-milliseconds after an idle
time, under the share, and prints the median wall time of each C next to
C / s (the share as a slower CPU: pd-plan's simulator) and to a token
bucket of B CPU-seconds refilled at s a second, B measured here as the
mean over spins of C = 10 ms / (1 - s) of C - s * wall.
docs/capacity_planning.md run 7 says why the simulator keeps C / s.

    bench/cpu_share_burst.py [--share 0.4] [--idle_ms 100] [--reps 20]

Needs root and a cgroup cpu controller; re-runs itself under
deploy/local/cpu_share.sh.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spin(cpu_s):
    """Spins this thread for cpu_s of its CPU time; the wall time it took."""
    t0, c0 = time.monotonic(), time.thread_time()
    while time.thread_time() - c0 < cpu_s:
        pass
    return time.monotonic() - t0


def bucket_wall(cpu_s, share, burst_s):
    """A full bucket of burst_s CPU-s: full speed for burst_s / (1 - share)."""
    full_s = burst_s / (1 - share)
    return cpu_s if cpu_s <= full_s else full_s + (cpu_s - full_s) / share


def measure(args):
    # B: full speed for B / (1 - s), then the share, takes C / s - B / s.
    c = 0.010 / (1 - args.share)
    bursts = []
    for _ in range(args.reps):
        time.sleep(args.idle_ms / 1e3)
        bursts.append(c - args.share * spin(c))
    burst = max(0.0, statistics.mean(bursts))
    print(f"share {args.share} CPU, idle {args.idle_ms} ms before each spin, "
          f"{args.reps} spins each; burst B = {burst * 1e3:.2f} ms of CPU\n")
    print("| CPU of the spin (ms) | wall p50 (ms) | token bucket (ms) | error | "
          "CPU / share (ms) | error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for cpu_ms in (0.5, 1, 2, 3, 4, 6, 8, 12, 16, 32):
        walls = []
        for _ in range(args.reps):
            time.sleep(args.idle_ms / 1e3)
            walls.append(spin(cpu_ms / 1e3))
        wall = statistics.median(walls) * 1e3
        model = bucket_wall(cpu_ms / 1e3, args.share, burst) * 1e3
        fluid = cpu_ms / args.share
        print(f"| {cpu_ms:g} | {wall:.2f} | {model:.2f} | {100 * (model / wall - 1):+.0f}% | "
              f"{fluid:.2f} | {100 * (fluid / wall - 1):+.0f}% |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--share", type=float, default=0.4)
    parser.add_argument("--idle_ms", type=float, default=100)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.share < 1:
        sys.exit("cpu_share_burst.py: --share must be in (0, 1)")
    if args.inside:
        return measure(args)
    group = f"pdserve.burst.{os.getpid()}"
    script = os.path.join(ROOT, "deploy/local/cpu_share.sh")
    try:
        rc = subprocess.call([script, "run", str(args.share), group, sys.executable,
                              os.path.abspath(__file__), "--inside", "--share", str(args.share),
                              "--idle_ms", str(args.idle_ms), "--reps", str(args.reps)])
    finally:
        subprocess.call([script, "remove", group])
    sys.exit(rc)


if __name__ == "__main__":
    main()
