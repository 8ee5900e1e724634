#!/usr/bin/env python3
"""Request by request, where a prediction and a measurement part: the
records `pd-plan validate --records_dir=DIR` writes, one pair of files
(CONFIG-LEVEL.predicted.jsonl, CONFIG-LEVEL.measured.jsonl) per run.

For every run: TTFT and TPOT p50/p90, predicted next to measured, and the
stalls (token gaps longer than --stall_ms) each side saw. With --run, that
run's requests whose TPOT differs most, in send order, with the stalls of
each: the requests that put a p90 where it is.

    planner/compare_records.py DIR [--run 1P2D-3rps] [--top 12] [--stall_ms 10]
"""
import argparse
import glob
import json
import os


def read(path):
    with open(path) as f:
        return {r["index"]: r for r in map(json.loads, f) if r.get("outcome", "OK") == "OK"}


def ttft(r):
    return r["token_s"][0] - r["send_s"] if r["token_s"] else None


def tpot(r):
    """summary.cc's TPOT: time after the first token over the tokens after it."""
    if r["output_tokens"] < 2 or not r["token_s"]:
        return None
    return (r["token_s"][-1] - r["token_s"][0]) / (r["output_tokens"] - 1)


def stalls(r, stall_s):
    gaps = [b - a for a, b in zip(r["token_s"], r["token_s"][1:])]
    return [g for g in gaps if g > stall_s]


def percentile(values, q):
    """summary.cc's Percentile: linear interpolation between closest ranks."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return 0.0
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def ms(x):
    return "-" if x is None else f"{x * 1000:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--run", help="CONFIG-LEVEL to show request by request, e.g. 1P2D-3rps")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--stall_ms", type=float, default=10)
    args = parser.parse_args()
    stall_s = args.stall_ms / 1000

    runs = sorted(p[: -len(".predicted.jsonl")]
                  for p in glob.glob(os.path.join(args.dir, "*.predicted.jsonl")))
    runs = [r for r in runs if os.path.exists(r + ".measured.jsonl")]
    if not runs:
        raise SystemExit(f"{args.dir}: no pair of .predicted.jsonl and .measured.jsonl files "
                         "(pd-plan validate --records_dir writes them)")

    print(f"| run | TTFT p50 pred / meas (ms) | TTFT p90 | TPOT p50 | TPOT p90 | "
          f"stalls > {args.stall_ms:g} ms pred / meas | their time pred / meas (s) |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        pred, meas = read(run + ".predicted.jsonl"), read(run + ".measured.jsonl")
        cells = []
        for fn in (ttft, tpot):
            for q in (50, 90):
                a = percentile([fn(r) for r in pred.values()], q)
                b = percentile([fn(r) for r in meas.values()], q)
                cells.append(f"{ms(a)} / {ms(b)}")
        sp = [g for r in pred.values() for g in stalls(r, stall_s)]
        sm = [g for r in meas.values() for g in stalls(r, stall_s)]
        cells.append(f"{len(sp)} / {len(sm)}")
        cells.append(f"{sum(sp):.2f} / {sum(sm):.2f}")
        print(f"| {os.path.basename(run)} | " + " | ".join(cells) + " |")

    if not args.run:
        return
    run = os.path.join(args.dir, args.run)
    pred, meas = read(run + ".predicted.jsonl"), read(run + ".measured.jsonl")
    both = [i for i in pred if i in meas and tpot(pred[i]) is not None
            and tpot(meas[i]) is not None]
    worst = sorted(both, key=lambda i: -abs(tpot(pred[i]) - tpot(meas[i])))[: args.top]
    start = min(r["send_s"] for r in meas.values())
    print(f"\n{args.run}: the {len(worst)} requests whose TPOT differs most, in send order "
          "(stalls: token gaps over the bound, ms)\n")
    print("| request | sent (s) | prompt | output | TTFT pred / meas (ms) | "
          "TPOT pred / meas (ms) | stalls pred | stalls meas |")
    print("|---:|---:|---:|---:|---|---|---|---|")
    for i in sorted(worst, key=lambda i: meas[i]["send_s"]):
        p, m = pred[i], meas[i]
        print(f"| {i} | {m['send_s'] - start:.2f} | {m['input_tokens']} | {m['output_tokens']} | "
              f"{ms(ttft(p))} / {ms(ttft(m))} | {ms(tpot(p))} / {ms(tpot(m))} | "
              f"{' '.join(ms(g) for g in stalls(p, stall_s)) or '-'} | "
              f"{' '.join(ms(g) for g in stalls(m, stall_s)) or '-'} |")


if __name__ == "__main__":
    main()
