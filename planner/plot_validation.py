#!/usr/bin/env python3
"""Plots `pd-plan validate --summary_json` output: for every configuration,
predicted (dashed) next to measured (solid) TTFT p90, TPOT p90 and SLO
attainment against the request rate, one PNG per figure; a measured P90
carries its 90% confidence interval (summary.h) as an error bar where the
validation recorded one.

    planner/plot_validation.py VALIDATION.json OUT_PREFIX [--title TEXT]

writes OUT_PREFIX_ttft_p90.png, OUT_PREFIX_tpot_p90.png and
OUT_PREFIX_attainment.png and prints their paths.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (file name, axis label, the figure of a summary, its distribution or None)
FIGURES = [
    ("ttft_p90", "TTFT p90 (ms)", lambda s: s["ttft_s"]["p90"] * 1e3, "ttft_s"),
    ("tpot_p90", "TPOT p90 (ms)", lambda s: s["tpot_s"]["p90"] * 1e3, "tpot_s"),
    ("attainment", "SLO attainment (%)", lambda s: s["slo_attainment"] * 100, None),
]


def interval(summary, key):
    """The P90's confidence interval as error bar lengths (ms) below and
    above it; None where the summary has no interval or a bound is missing."""
    ci = summary[key].get("p90_ci") if key else None
    if not ci or ci[0] is None or ci[1] is None:
        return None
    p90 = summary[key]["p90"]
    return (max(0.0, p90 - ci[0]) * 1e3, max(0.0, ci[1] - p90) * 1e3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validation_json")
    parser.add_argument("out_prefix")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    with open(args.validation_json) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not rows:
        sys.exit(f"{args.validation_json}: not the JSON of pd-plan validate (a list of rows)")
    configs = []
    for row in rows:
        if row["config"] not in configs:
            configs.append(row["config"])
    for key, label, value, dist in FIGURES:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, config in enumerate(configs):
            points = sorted((r for r in rows if r["config"] == config), key=lambda r: r["rate"])
            rates = [r["rate"] for r in points]
            color = f"C{i}"
            measured = [value(r["measured"]) for r in points]
            bars = [interval(r["measured"], dist) for r in points]
            if all(bars):
                ax.errorbar(rates, measured, yerr=[[b[0] for b in bars], [b[1] for b in bars]],
                            fmt="-o", color=color, capsize=3, label=f"{config} measured (90% CI)")
            else:
                ax.plot(rates, measured, "-o", color=color, label=f"{config} measured")
            ax.plot(rates, [value(r["predicted"]) for r in points], "--x", color=color,
                    label=f"{config} predicted")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if args.title:
            ax.set_title(args.title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{args.out_prefix}_{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
