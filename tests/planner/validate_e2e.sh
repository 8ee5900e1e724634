#!/usr/bin/env bash
# End to end: pd-plan profiles this machine's workers, then validates its
# own predictions against pd-bench runs on real clusters (a colocated and a
# disaggregated one, two request rates), and fails when a P90 TTFT or TPOT
# prediction is off by more than MAX_ERROR or an attainment by more than
# MAX_ATTAINMENT points. Workers are held to a CPU share where the machine
# lets us (root and a cgroup cpu controller), else unlimited.
#
#   tests/planner/validate_e2e.sh BUILD_DIR SOURCE_DIR
#
# The bounds here are looser than docs/capacity_planning.md's targets (10%,
# 3 points), which the full validation does not meet either (its tables
# give the real errors): this run is short (60 requests per rate), shares
# CI's two cores with the router and the load generator, and this tiny
# model's TPOT is under a millisecond, where single token gaps under a 5 ms
# CPU-quota period are bimodal (measured: 0P1D P90 TPOT off by up to 60%
# while TTFT was within 2%). So TPOT is held to 75%, TTFT to 40% (seen up
# to +50% at 0P1D: an idle worker runs its first milliseconds of CPU at
# full speed, which the model does not have) and attainment to 10 points.
# 1P1D's P90 TPOT was 2-3x too high until its later tokens got their own
# delivery constant (docs/capacity_planning.md run 7; a CI run since:
# -16% to +6%); the TPOT bound catches that coming back.
#
# One more attempt, with a fresh profile, when the first is off: the
# profile is taken minutes before the runs it predicts, under a CPU quota
# on a shared VM, and its engine cost drifts between the two (three CI runs
# on 2026-11-24, same code: 62 and 81 us per token; the second put 0P1D's
# P90 TTFT 50% high). validate's drift check keeps each configuration's
# engines busy before its runs, prints their step time over the profile's
# and scales the profile by it (docs/capacity_planning.md, runs 4, 12 and
# 27). Both attempts' tables
# are printed; two misses fail the test. Missing or absurd engine step
# times fail at once.
#
# Then the drift check itself, on the passing attempt's profile: with
# every CPU cost of the profile doubled (--engine_scale=2), it must find
# the engines at about half of that and apply it.
set -euo pipefail
build="$1" source="$2"
max_error="${MAX_ERROR:-0.40}" max_tpot_error="${MAX_TPOT_ERROR:-0.75}"
max_attainment="${MAX_ATTAINMENT:-0.10}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
share=() share_cpus=1
if "$source/deploy/local/cpu_share.sh" how >/dev/null 2>&1; then
  share_cpus=0.5
  share=(--worker_cpus="$share_cpus")
fi
attempt() {  # attempt N: profile into $work/N, then validate.
  local dir="$work/$1"
  mkdir -p "$dir"
  "$build/planner/pd-plan" profile --out="$dir/profile.json" --run_dir="$dir/run" \
    --bin="$build" "${share[@]}" --reps=3 --max_batch_tokens=256 --max_running=16 \
    --max_context=512 --prefill_kv_cache_mb=16 --decode_kv_cache_mb=16
  "$build/planner/pd-plan" validate --profile="$dir/profile.json" --run_dir="$dir/run" \
    --bin="$build" --configs=0P1D,1P1D --input_len=uniform:64:384 --output_len=uniform:8:32 \
    --num_requests=60 --request_rates=2,6 --seed=7 --slo_ttft_ms=400 --slo_tpot_ms=50 \
    --max_error="$max_error" --max_tpot_error="$max_tpot_error" \
    --max_attainment_error="$max_attainment" --summary_json="$dir/validate.json"
  steps_measured "$dir/validate.json" || exit 1
}
# Every point has its engines' step time, predicted and measured from the
# workers' /metrics: one role on 0P1D, both on 1P1D, the prediction within
# 2x of the measurement, or up to 2 / share over it under a CPU share (a
# wrong metric or unit is 1000x off; the real error is in the table); and
# on 1P1D the count of prompts prefilled on the decode worker, a whole
# number no larger than the run's requests; the decode steps a positive
# whole number and the time between them predicted (not negative) and
# measured; and the decode engines' CPU in their steps measured, no more
# than the steps' wall time (the loop thread's CPU inside them), and the
# prediction within 3x of it (it holds no quota's waits, hence no
# 2 / share). Why 2 / share: the model's
# steps take their CPU over the share (docs/capacity_planning.md, "The
# share as a slower CPU"), while a lightly loaded worker's short steps run
# at full speed within its quota, up to 1 / share faster. A CI run on
# 2026-11-28 measured the 1P1D decode worker's steps at 6 req/s 2.01x
# under the prediction (0.5 share, decode steps under a millisecond),
# while its prefill steps and the 0P1D decode worker's were 1.3-1.4x.
steps_measured() {
  python3 - "$1" "$share_cpus" <<'PY'
import json, sys
over = 2 / float(sys.argv[2])
for point in json.load(open(sys.argv[1])):
    work = point.get("engine_work", {})
    where = f"validate_e2e: {point['config']} at {point['rate']} req/s:"
    roles = ["decode"] if point["config"].startswith("0P") else ["prefill", "decode"]
    for role in roles:
        s = work.get(f"{role}_step_s")
        if s is None or not s["measured"] > 0 or not 0.5 < s["predicted"] / s["measured"] < over:
            sys.exit(f"{where} {role} step time {s}")
    steps = work.get("decode_steps", {}).get("measured_runs", [None])[0]
    if steps is None or steps != int(steps) or not steps > 0:
        sys.exit(f"{where} decode steps: {steps}")
    gap = work.get("decode_gap_s", {})
    if not (gap.get("predicted", -1) >= 0 and gap.get("measured", -1) >= 0):
        sys.exit(f"{where} decode time between steps: {gap}")
    cpu, wall = work.get("decode_step_cpu_s", {}), work["decode_step_s"]["measured"]
    if not (0 < cpu.get("measured", 0) <= wall and 1 / 3 < cpu["predicted"] / cpu["measured"] < 3):
        sys.exit(f"{where} decode steps' CPU {cpu}, their wall time {wall}")
    if not point["config"].startswith("0P"):
        n = work.get("decode_prefills", {}).get("measured_runs", [None])[0]
        if n is None or n != int(n) or not 0 <= n <= 60:
            sys.exit(f"{where} prompts prefilled on the decode worker: {n}")
PY
}
# drift_found N: validate attempt N's profile, its costs doubled, on 1P1D.
drift_found() {
  local dir="$work/$1"
  "$build/planner/pd-plan" validate --profile="$dir/profile.json" --run_dir="$dir/run" \
    --bin="$build" --engine_scale=2 --configs=1P1D --input_len=64 --output_len=8 \
    --num_requests=4 --request_rates=2 --seed=7 --max_error=1e9 --max_attainment_error=1 \
    --summary_json="$dir/drift.json" >/dev/null
  python3 - "$dir/drift.json" <<'PY'
import json, sys
point = json.load(open(sys.argv[1]))[0]
if not (0.3 < point["drift"] < 0.75 and point["drift_applied"]):
    sys.exit(f"validate_e2e: with the profile's costs doubled the drift check found "
             f"{point['drift']:.2f} (applied: {point['drift_applied']}), not about 0.5")
print(f"validate_e2e: drift check on a profile with doubled costs: {point['drift']:.2f}")
PY
}
if attempt 1; then
  drift_found 1
  exit 0
fi
echo "validate_e2e: the predictions missed their bounds; profiling again for a second attempt"
attempt 2
drift_found 2
