#!/usr/bin/env bash
# The validation behind docs/capacity_planning.md: profile this machine's
# workers, then for each workload let pd-plan search the configurations of
# a worker budget and validate every one of them (pd-bench on a real
# cluster at each rate, next to the simulation), and plot predicted next to
# measured. Run from the source tree after building (build/planner has
# pd-plan); needs root for the CPU shares. Takes 15 to 35 minutes on a
# 2-core machine; keep the machine otherwise idle. A profile.json already
# in OUT_DIR is used as it is (the script says when). To predict again with a
# new profile against the same runs: pd-plan validate --measured_json. Each
# run's per-request records, predicted and measured, go to OUT_DIR/NAME.records
# (planner/compare_records.py reads them). REPEATS=3 measures every point
# three times and compares with the medians (three times as long). The
# request rates of each workload come from search's predicted goodputs
# (auto_rates) unless SYNTHETIC_RATES / TRACE_RATES give them; RATE_COUNT
# of them (default 7). REQUESTS requests a point (default 100): with 100, a
# measured P90's 90% confidence interval is about +-12% wide (the report's
# interval line), wider than the 10% the predictions are held to; 400
# halve it, at four times the time. AGAIN=DIR, a directory of an earlier
# run of this script at the same rates, adds to each report how well that
# run's measurements predict these (the measurement's repeatability across
# clusters and hours, against the same bounds as the model).
#
#   bench/capacity_validation.sh [OUT_DIR]   (default build/capacity)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-build/capacity}"
mkdir -p "$out"
plan=build/planner/pd-plan
cpus="${WORKER_CPUS:-0.4}"
budget="${WORKERS:-3}"
requests="${REQUESTS:-100}"
configs="${CONFIGS:-0P1D,0P2D,0P3D,1P1D,1P2D,2P1D}"
engine=(--max_batch_tokens=512 --max_running=32 --prefill_kv_cache_mb=64 --decode_kv_cache_mb=64)

if [[ -s "$out/profile.json" ]]; then
  # A profile from another build or another hour predicts another machine
  # (docs/capacity_planning.md run 25 reused one by accident): say so.
  echo "capacity_validation.sh: reusing $out/profile.json, taken $(date -r "$out/profile.json" '+%F %T %Z');" \
    "delete it to profile this machine now" >&2
else
  "$plan" profile --out="$out/profile.json" \
    --worker_cpus="$cpus" --max_context=1024 "${engine[@]}" --run_dir="$out/run" | tee "$out/profile.md"
fi

# Rates around the knees this machine's profile predicts: RATE_COUNT, evenly
# from 3/4 of the lowest goodput search finds (of the configurations that
# have one) to 6/5 of the highest, to 0.5 req/s. A machine twice as fast
# gets rates twice as high (runs 14 to 16 of docs/capacity_planning.md:
# fixed rates put most points of a slower machine past every knee).
auto_rates() {
  python3 - "$1" "${RATE_COUNT:-7}" <<'PY'
import json, sys
count = int(sys.argv[2])
goodputs = [c["goodput"] for c in json.load(open(sys.argv[1])) if c["goodput"] > 0]
if not goodputs:
    sys.exit("capacity_validation.sh: search found no configuration that meets the SLO at any "
             "rate; give the rates (SYNTHETIC_RATES, TRACE_RATES) or relax the SLO")
lo, hi = 0.75 * min(goodputs), 1.2 * max(goodputs)
rates = sorted({max(0.5, round((lo + (hi - lo) * i / max(1, count - 1)) * 2) / 2)
                for i in range(count)})
print(",".join(f"{r:g}" for r in rates))
PY
}

# name | workload flags | rates ("auto": auto_rates) | SLO flags
workloads=(
  "synthetic|--input_len=uniform:128:768 --output_len=uniform:16:96 --num_requests=$requests --seed=1|${SYNTHETIC_RATES:-auto}|--slo_ttft_ms=400 --slo_tpot_ms=15"
  "mooncake|--trace=../shared/traces/mooncake_conversation_trace.jsonl --length_scale=32 --max_input_len=1024 --max_output_len=64 --trace_max_requests=$requests|${TRACE_RATES:-auto}|--slo_ttft_ms=1500 --slo_tpot_ms=30"
)
for entry in "${workloads[@]}"; do
  IFS='|' read -r name flags rates slo <<<"$entry"
  # shellcheck disable=SC2086
  "$plan" search --profile="$out/profile.json" --workers="$budget" $flags $slo \
    --summary_json="$out/$name.search.json" | tee "$out/$name.search.md"
  if [[ "$rates" == auto ]]; then
    rates=$(auto_rates "$out/$name.search.json")
    echo "capacity_validation.sh: $name at $rates req/s (around the knees search predicts)"
  fi
  # shellcheck disable=SC2086
  "$plan" validate --profile="$out/profile.json" --configs="$configs" $flags $slo \
    --request_rates="$rates" --run_dir="$out/run" --summary_json="$out/$name.validate.json" \
    --records_dir="$out/$name.records" --repeats="${REPEATS:-1}" \
    --max_error=1e9 --max_attainment_error=1 | tee "$out/$name.validate.md"
  # The same points predicted again as profiled and with every CPU cost 5%
  # higher (neither with the drift check's scaling): where a P90 target
  # asks for more than the engine's speed is known to.
  for scale in 1 1.05; do
    # shellcheck disable=SC2086
    "$plan" validate --profile="$out/profile.json" --engine_scale="$scale" --drift_check=false \
      --configs="$configs" \
      $flags $slo --request_rates="$rates" --measured_json="$out/$name.validate.json" \
      --summary_json="$out/$name.scale-$scale.json" --max_error=1e9 --max_attainment_error=1 \
      >/dev/null
  done
  python3 planner/plot_validation.py "$out/$name.validate.json" "$out/$name" \
    --title "$name: predicted (dashed) vs measured (solid)"
  again=()
  [[ -n "${AGAIN:-}" ]] && again=(--again_json="$AGAIN/$name.validate.json")
  python3 planner/validation_report.py "$out/$name.validate.json" "$out/$name.search.json" \
    --base_json="$out/$name.scale-1.json" --scaled_json="$out/$name.scale-1.05.json" \
    --scale=1.05 "${again[@]}" | tee "$out/$name.report.md"
done
