#!/usr/bin/env python3
"""Markdown report of a `pd-plan validate --summary_json` run, with the
`pd-plan search --summary_json` of the same workload: per configuration and
rate, predicted next to measured TTFT p50/p90, TPOT p50/p90 and attainment
with their errors, and how well each point's requests pin its measured
P90s (their confidence intervals); the goodput of every configuration, predicted and
measured (from the sweep); how far search's pick lands from the best
measured goodput per worker; and the error statistics against the targets
(P90 TTFT and TPOT within 10%, attainment within 3 points); and, where
validate measured them, the engines' step times and the prompts prefilled
on decode workers, with the latency errors at the points where the step
times held; what validate's drift check found per configuration; and, given the same validation predicted again with
`pd-plan validate --engine_scale=S --measured_json`, how far that engine
speed moves each P90 prediction: the points where the 10% target asks
for an engine speed known to better than S - 1; and how well the
measurement predicts itself against the same bounds (a point's repeated
runs, and another validation of the same points given --again_json): the
most any model can be expected to reach on that machine.

    planner/validation_report.py VALIDATE.json SEARCH.json [--attainment_target 0.9]
        [--scaled_json SCALED.json --scale 1.05 [--base_json BASE.json]]
        [--again_json OTHER_VALIDATE.json]

BASE.json: the same points predicted again at --engine_scale=1, to
compare the scaled predictions with when validate's drift check scaled
some of its own (default: VALIDATE.json's predictions).
"""
import argparse
import json
import statistics


# The targets' bounds (docs/capacity_planning.md): P90 TTFT and TPOT within
# 10%, attainment within 3 points, each inclusive.
LATENCY_BOUND = 0.1
ATTAINMENT_BOUND = 0.03


def err(p, m):
    """A prediction's relative error against a measurement."""
    return (p - m) / m if m else 0.0


def within(error, bound):
    """Whether an error (relative, or in attainment's fraction) is within a
    bound, the bound included (up to rounding)."""
    return abs(error) <= bound + 1e-9


def goodput(points, target):
    """summary.h's Goodput: the highest rate meeting the target with every
    lower rate of the sweep meeting it too."""
    best = 0.0
    for rate, attainment in sorted(points):
        if attainment < target:
            break
        best = rate
    return best


def drift_report(rows, configs):
    """What validate's drift check found before each configuration's runs
    (its engines' step time over the profile's) and whether it scaled the
    predictions by it."""
    drifts = []
    for c in configs:
        r = next(r for r in rows if r["config"] == c)
        if "drift" in r:
            drifts.append(f"{c} {r['drift']:.2f}" + (" (applied)" if r.get("drift_applied") else ""))
    if drifts:
        print()
        print("Drift check, engines' step time over the profile's: " + ", ".join(drifts) + ".")


def step_report(rows, ttft_err, tpot_err):
    """The engines' step time per point, predicted and measured, the
    decode engines' CPU in their steps (validate runs that recorded it: the
    step time less the CPU share's waits), their time between back-to-back
    steps and the prompts
    prefilled on decode workers (validate runs that recorded them);
    then the latency errors where the step time held: what is left there is
    the model's queueing, routing and serving, not the machine's speed
    during the run."""
    def measured(work, figure):
        """The figure's entry where validate measured it, else None."""
        entry = work.get(figure)
        return entry if entry and "measured" in entry else None

    if not any(measured(r.get("engine_work", {}), "decode_step_s") for r in rows):
        return
    print()
    print("| xPyD | req/s | prefill step time pred / meas (s) | error | decode step time pred / meas (s) | error | decode CPU in steps pred / meas (s) | error | decode time between busy steps pred / meas (s) | prefilled on D pred / meas |")
    print("|---|---:|---|---:|---|---:|---|---:|---|---|")
    step_err = {"prefill": [], "decode": []}
    cpu_err = []
    held = []  # Indices of points whose every role's step time is within 5%.
    for i, r in enumerate(rows):
        work = r.get("engine_work", {})
        cells, worst = [], 0.0
        for role in ("prefill", "decode"):
            s = measured(work, f"{role}_step_s")
            if s is None:
                cells.append("- | -")
                continue
            e = err(s["predicted"], s["measured"])
            step_err[role].append(abs(e))
            worst = max(worst, abs(e))
            cells.append(f"{s['predicted']:.3g} / {s['measured']:.3g} | {e*100:+.0f}%")
        cpu = measured(work, "decode_step_cpu_s")
        if cpu and cpu["measured"] > 0:
            e = err(cpu["predicted"], cpu["measured"])
            cpu_err.append(abs(e))
            cells.append(f"{cpu['predicted']:.3g} / {cpu['measured']:.3g} | {e*100:+.0f}%")
        else:
            cells.append("- | -")
        gap = measured(work, "decode_gap_s")
        if gap and "predicted" in gap:  # Validations before 2026-11-28 measured it only.
            cells.append(f"{gap['predicted']:.3g} / {gap['measured']:.3g}")
        else:
            cells.append(f"- / {gap['measured']:.3g}" if gap else "-")
        local = measured(work, "decode_prefills")
        cells.append(f"{local['predicted']:.0f} / {local['measured']:.0f}" if local else "-")
        if measured(work, "decode_step_s") and worst <= 0.05:
            held.append(i)
        print(f"| {r['config']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    print()
    parts = [f"{role} median {statistics.median(e)*100:.0f}% over {len(e)} points"
             for role, e in step_err.items() if e]
    line = "Engine step time |error|: " + "; ".join(parts) + "."
    if cpu_err:
        line += (f" Decode engines' CPU in their steps |error|: median "
                 f"{statistics.median(cpu_err)*100:.0f}% over {len(cpu_err)} points.")
    if held:
        t = [ttft_err[i] for i in held]
        p = [tpot_err[i] for i in held]
        line += (f" At the {len(held)} points where it held within 5% on every worker role, "
                 f"P90 TTFT |error| median {statistics.median(t)*100:.0f}% (within 10% in "
                 f"{sum(within(e, LATENCY_BOUND) for e in t)}), P90 TPOT {statistics.median(p)*100:.0f}% "
                 f"(within 10% in {sum(within(e, LATENCY_BOUND) for e in p)}).")
    print(line)


def interval_report(rows):
    """How well each point's requests pin its measured P90s (the 90%
    confidence interval of summary.h, validations that recorded it): the
    interval's half-width relative to the P90, and at how many points the
    prediction falls inside it, next to how many are within 10%."""
    lines = []
    for figure, key in (("P90 TTFT", "ttft_s"), ("P90 TPOT", "tpot_s")):
        widths, inside, close, n = [], 0, 0, 0
        for r in rows:
            m = r["measured"][key]
            ci = m.get("p90_ci")
            if not ci or ci[0] is None or ci[1] is None or not m["p90"]:
                continue
            n += 1
            widths.append((ci[1] - ci[0]) / 2 / m["p90"])
            predicted = r["predicted"][key]["p90"]
            inside += ci[0] <= predicted <= ci[1]
            close += within(err(predicted, m["p90"]), LATENCY_BOUND)
        if n:
            lines.append(f"{figure}: half-width median {statistics.median(widths)*100:.0f}% "
                         f"(from {min(widths)*100:.0f}% to {max(widths)*100:.0f}%), the "
                         f"prediction inside it at {inside} of {n} points (within 10%: {close})")
    if lines:
        print()
        print("The measured P90's 90% confidence interval from each point's requests "
              "(order statistics, summary.h): " + "; ".join(lines) + ".")


def within_bounds(predicted, measured):
    """Whether a summary `predicted` lands within the targets' bounds of
    `measured`: (P90 TTFT within 10%, P90 TPOT within 10%, attainment
    within 3 points)."""
    return (within(err(predicted["ttft_s"]["p90"], measured["ttft_s"]["p90"]), LATENCY_BOUND),
            within(err(predicted["tpot_s"]["p90"], measured["tpot_s"]["p90"]), LATENCY_BOUND),
            within(predicted["slo_attainment"] - measured["slo_attainment"], ATTAINMENT_BOUND))


def mean_summary(runs):
    """The figures within_bounds reads, averaged over `runs`."""
    return {"ttft_s": {"p90": statistics.fmean(r["ttft_s"]["p90"] for r in runs)},
            "tpot_s": {"p90": statistics.fmean(r["tpot_s"]["p90"] for r in runs)},
            "slo_attainment": statistics.fmean(r["slo_attainment"] for r in runs)}


def repeatability(rows, again=None):
    """How often the measurement predicts itself within the targets' bounds:
    per figure (P90 TTFT, P90 TPOT, attainment), over the points of `rows`
    with two runs or more, each run taken as the prediction of the mean of
    the point's other runs (the count averaged over the runs); and, given
    `again` (another validate of the same points: another cluster, another
    hour), its measurement as the prediction of this one's. No model can be
    expected to do better than the first on this machine in this hour, nor
    than the second across hours. Returns ((ttft, tpot, attainment, points),
    the same for `again` or None)."""
    hits, points = [0.0, 0.0, 0.0], 0
    for r in rows:
        runs = r.get("measured_runs", [])
        if len(runs) < 2:
            continue
        points += 1
        for i, run in enumerate(runs):
            others = mean_summary(runs[:i] + runs[i + 1:])
            for k, ok in enumerate(within_bounds(run, others)):
                hits[k] += ok / len(runs)
    across = None
    if again is not None:
        by_point = {(a["config"], a["rate"]): a for a in again}
        a_hits, a_points = [0, 0, 0], 0
        for r in rows:
            a = by_point.get((r["config"], r["rate"]))
            if a is None:
                continue
            a_points += 1
            for k, ok in enumerate(within_bounds(a["measured"], r["measured"])):
                a_hits[k] += ok
        across = (*a_hits, a_points)
    return (*hits, points), across


def repeatability_report(rows, model_hits, again=None):
    """repeatability() in words, beside the model's own counts."""
    inside, across = repeatability(rows, again)
    lines = []
    if inside[3]:
        lines.append(f"each run of a point taken as the prediction of the mean of its other runs "
                     f"is within the bounds at {inside[0]:.1f} (P90 TTFT), {inside[1]:.1f} (P90 "
                     f"TPOT) and {inside[2]:.1f} (attainment) of {inside[3]} points, on average "
                     f"over the runs")
    if across and across[3]:
        lines.append(f"the other validation's measurements (--again_json) as the prediction of "
                     f"these: {across[0]}, {across[1]} and {across[2]} of {across[3]}")
    if lines:
        print()
        print("The measurement's own repeatability, against the same bounds: " + "; ".join(lines)
              + f". The model: {model_hits[0]}, {model_hits[1]} and {model_hits[2]} of {len(rows)}.")


def sensitivity_report(rows, scaled, scale):
    """Per P90 figure, the points where predicting with every CPU cost
    times `scale` moves the prediction of `rows` by more than 10%."""
    print()
    for figure, key in (("P90 TTFT", "ttft_s"), ("P90 TPOT", "tpot_s")):
        moved = []
        for r, s in zip(rows, scaled):
            if (r["config"], r["rate"]) != (s["config"], s["rate"]):
                raise SystemExit("the scaled predictions are not of the same points")
            base = r["predicted"][key]["p90"]
            change = err(s["predicted"][key]["p90"], base)
            if abs(change) > 0.10:
                moved.append(f"{r['config']} at {r['rate']:g} ({change*100:+.0f}%)")
        print(f"Every CPU cost of the profile {(scale - 1)*100:+.0f}% (--engine_scale={scale:g}) "
              f"moves the {figure} prediction by more than 10% at {len(moved)} of {len(rows)} "
              f"points" + (": " + ", ".join(moved) if moved else "") + ".")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("validate_json")
    parser.add_argument("search_json")
    parser.add_argument("--attainment_target", type=float, default=0.9)
    parser.add_argument("--scaled_json", help="the same points predicted with --engine_scale")
    parser.add_argument("--scale", type=float, default=1.05, help="the --engine_scale of --scaled_json")
    parser.add_argument("--base_json", help="the same points predicted at --engine_scale=1")
    parser.add_argument("--again_json",
                        help="another validate of the same points (another cluster or hour), "
                             "whose measurements are taken as the prediction of these")
    args = parser.parse_args()
    rows = json.load(open(args.validate_json))
    search = json.load(open(args.search_json))
    configs = []
    for r in rows:
        if r["config"] not in configs:
            configs.append(r["config"])


    print("| xPyD | req/s | TTFT p50 pred / meas (ms) | TTFT p90 pred / meas (ms) | error | "
          "TPOT p50 pred / meas (ms) | TPOT p90 pred / meas (ms) | error | attainment pred / meas | error |")
    print("|---|---:|---|---|---:|---|---|---:|---|---:|")
    ttft_err, tpot_err, att_err = [], [], []
    for r in rows:
        p, m = r["predicted"], r["measured"]
        e1 = err(p["ttft_s"]["p90"], m["ttft_s"]["p90"])
        e2 = err(p["tpot_s"]["p90"], m["tpot_s"]["p90"])
        e3 = p["slo_attainment"] - m["slo_attainment"]
        ttft_err.append(abs(e1))
        tpot_err.append(abs(e2))
        att_err.append(abs(e3))
        print(f"| {r['config']} | {r['rate']:g} | {p['ttft_s']['p50']*1e3:.0f} / {m['ttft_s']['p50']*1e3:.0f} "
              f"| {p['ttft_s']['p90']*1e3:.0f} / {m['ttft_s']['p90']*1e3:.0f} | {e1*100:+.0f}% "
              f"| {p['tpot_s']['p50']*1e3:.1f} / {m['tpot_s']['p50']*1e3:.1f} "
              f"| {p['tpot_s']['p90']*1e3:.1f} / {m['tpot_s']['p90']*1e3:.1f} | {e2*100:+.0f}% "
              f"| {p['slo_attainment']*100:.0f}% / {m['slo_attainment']*100:.0f}% | {e3*100:+.0f} pt |")

    n = len(rows)
    # The model's points within each bound: (P90 TTFT, P90 TPOT, attainment).
    model_hits = (sum(within(e, LATENCY_BOUND) for e in ttft_err),
                  sum(within(e, LATENCY_BOUND) for e in tpot_err),
                  sum(within(e, ATTAINMENT_BOUND) for e in att_err))
    print()
    print(f"Over {n} (configuration, rate) points: |error| of P90 TTFT median "
          f"{statistics.median(ttft_err)*100:.0f}%, within 10% in {model_hits[0]} of {n}; "
          f"P90 TPOT median {statistics.median(tpot_err)*100:.0f}%, within 10% in "
          f"{model_hits[1]} of {n}; attainment median "
          f"{statistics.median(att_err)*100:.0f} points, within 3 points in "
          f"{model_hits[2]} of {n}.")
    interval_report(rows)
    repeatability_report(rows, model_hits,
                         json.load(open(args.again_json)) if args.again_json else None)
    drift_report(rows, configs)
    step_report(rows, ttft_err, tpot_err)
    if args.scaled_json:
        base = json.load(open(args.base_json)) if args.base_json else rows
        sensitivity_report(base, json.load(open(args.scaled_json)), args.scale)
    print()
    print("| xPyD | goodput predicted by the sweep (req/s) | measured (req/s) | measured per worker | search's goodput (bisection) |")
    print("|---|---:|---:|---:|---:|")
    searched = {s["config"]: s for s in search}
    measured_per_worker = {}
    for c in configs:
        pts = [r for r in rows if r["config"] == c]
        pg = goodput([(r["rate"], r["predicted"]["slo_attainment"]) for r in pts], args.attainment_target)
        mg = goodput([(r["rate"], r["measured"]["slo_attainment"]) for r in pts], args.attainment_target)
        x, y = c.split("P")
        workers = int(x) + int(y.rstrip("D"))
        measured_per_worker[c] = mg / workers
        sg = searched.get(c, {}).get("goodput", float("nan"))
        print(f"| {c} | {pg:g} | {mg:g} | {mg/workers:.2f} | {sg:.3g} |")
    pick = search[0]["config"]
    best = max(measured_per_worker, key=measured_per_worker.get)
    print()
    if pick in measured_per_worker and measured_per_worker[best] > 0:
        share = measured_per_worker[pick] / measured_per_worker[best]
        print(f"search picks {pick}; measured, it gives {measured_per_worker[pick]:.2f} req/s per worker, "
              f"{share*100:.0f}% of the best measured ({best}, {measured_per_worker[best]:.2f}).")
    else:
        print(f"search picks {pick}, which was not measured (or nothing met the target).")


if __name__ == "__main__":
    main()
