#!/usr/bin/env python3
"""Plots of a pd-bench run: pd-bench --plot_dir=DIR runs this on its summary.

  plot_bench.py --summary SUMMARY.json --out_dir DIR

Reads the summary pd-bench wrote (planner/summary.h's SweepToJson plus a
"pd_bench" object whose "runs" name each run's records file and summary
window) and writes, in DIR:
  ttft_cdf.png, tpot_cdf.png, itl_cdf.png   one CDF per run, from the
                                            records of the successful
                                            requests sent in the window
  rate_sweep.png                            SLO attainment and throughput
                                            against the offered rate (the
                                            open-loop runs at finite rates;
                                            left out when there is none)
Prints the path of each PNG written, one per line, for pd-bench to name in
the summary. Definitions are planner/summary.h's.
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latencies(records, begin, end):
    """TTFT, TPOT and ITL values (seconds) of the counted successful requests."""
    ttft, tpot, itl = [], [], []
    for r in records:
        if r["outcome"] != "OK" or not (begin <= r["send_s"] < end):
            continue
        tokens = r["token_s"]
        if not tokens:
            continue
        first = tokens[0] - r["send_s"]
        ttft.append(first)
        n = r["output_tokens"]
        if n >= 2:
            e2e = tokens[-1] - r["send_s"]
            tpot.append((e2e - first) / (n - 1))
        itl.extend(b - a for a, b in zip(tokens, tokens[1:]))
    return ttft, tpot, itl


def window_bound(value, default):
    return default if value is None else value


def plot_cdfs(runs, values_of, name, title, out_dir):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for run in runs:
        values = sorted(v * 1e3 for v in values_of(run))
        if not values:
            continue
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", label=run["label"])
        drawn = True
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("share of values")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{title} CDF")
    if drawn:
        ax.legend(fontsize="small")
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(summary, out_dir):
    points = [p for p in summary["points"] if p.get("rate") not in (None, 0)]
    if not points:
        return None
    points.sort(key=lambda p: p["rate"])
    rates = [p["rate"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(rates, [p["slo_attainment"] * 100 for p in points], "o-")
    target = summary.get("attainment_target")
    if target is not None:
        left.axhline(target * 100, color="gray", linestyle="--", label=f"target {target:.0%}")
        left.legend(fontsize="small")
    goodput = summary.get("goodput")
    left.set_title("SLO attainment" + (f" (goodput {goodput:g} req/s)" if goodput else ""))
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("attainment (%)")
    left.set_ylim(0, 102)
    left.grid(True, alpha=0.3)
    right.plot(rates, [p["request_throughput"] for p in points], "o-", label="requests/s")
    right.plot(rates, rates, ":", color="gray", label="offered")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("completed requests/s")
    right.grid(True, alpha=0.3)
    tokens = right.twinx()
    tokens.plot(rates, [p["output_token_throughput"] for p in points], "s--", color="tab:orange",
                label="output tokens/s")
    tokens.set_ylabel("output tokens/s")
    lines = right.get_legend_handles_labels()
    more = tokens.get_legend_handles_labels()
    right.legend(lines[0] + more[0], lines[1] + more[1], fontsize="small", loc="upper left")
    right.set_title("throughput")
    path = os.path.join(out_dir, "rate_sweep.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", required=True)
    parser.add_argument("--out_dir", required=True)
    args = parser.parse_args()
    with open(args.summary) as f:
        summary = json.load(f)
    runs = summary.get("pd_bench", {}).get("runs", [])
    if not any("records" in run for run in runs):
        sys.exit("plot_bench.py: the summary names no records file")
    os.makedirs(args.out_dir, exist_ok=True)
    for run in runs:
        begin = window_bound(run.get("window_begin_s"), 0.0)
        end = window_bound(run.get("window_end_s"), float("inf"))
        run["ttft"], run["tpot"], run["itl"] = (
            latencies(read_records(run["records"]), begin, end) if "records" in run else ([], [], []))
    written = [
        plot_cdfs(runs, lambda r: r["ttft"], "ttft_cdf.png", "TTFT", args.out_dir),
        plot_cdfs(runs, lambda r: r["tpot"], "tpot_cdf.png", "TPOT", args.out_dir),
        plot_cdfs(runs, lambda r: r["itl"], "itl_cdf.png", "ITL", args.out_dir),
        plot_sweep(summary, args.out_dir),
    ]
    for path in written:
        if path:
            print(path)


if __name__ == "__main__":
    main()
