#!/usr/bin/env python3
"""Plots `pd-plan validate --summary_json` output: for every configuration,
predicted (dashed) next to measured (solid) TTFT p90, TPOT p90 and SLO
attainment against the request rate, one PNG per figure.

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

FIGURES = [
    ("ttft_p90", "TTFT p90 (ms)", lambda s: s["ttft_s"]["p90"] * 1e3),
    ("tpot_p90", "TPOT p90 (ms)", lambda s: s["tpot_s"]["p90"] * 1e3),
    ("attainment", "SLO attainment (%)", lambda s: s["slo_attainment"] * 100),
]


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
    for key, label, value in FIGURES:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for i, config in enumerate(configs):
            points = sorted((r for r in rows if r["config"] == config), key=lambda r: r["rate"])
            rates = [r["rate"] for r in points]
            color = f"C{i}"
            ax.plot(rates, [value(r["measured"]) for r in points], "-o", color=color,
                    label=f"{config} measured")
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
