#!/usr/bin/env bash
# kv_aware's prefill_queue_limit_tokens (docs/routing.md): past it, on every
# prefill worker, a decode worker with no request waiting prefills a prompt
# itself when that is cheaper. Predicted for several limits, and measured
# on real clusters for a few, on the Mooncake conversation workload and the
# CPU shares of docs/capacity_planning.md (run 3). Run from the source tree
# after building (build/planner has pd-plan); needs root for the CPU shares;
# keep the machine otherwise idle.
#
#   bench/prefill_queue_limit.sh [--out DIR] [--limits L,...] [--measure L,...]
#
#   --limits   simulated (default 0,256,1024,2048,4096,8192,1000000000;
#              0: any queue at all, 1000000000: never)
#   --measure  measured with pd-plan validate on 1P1D (default: none)
#
# 1. pd-plan profile of this machine's workers (0.4 CPU each), unless
#    DIR/profile.json exists;
# 2. pd-plan simulate of 1P1D, 1P2D and 2P1D at 3, 6 and 12 req/s per limit;
# 3. pd-plan validate of 1P1D at 3, 6 and 12 req/s per measured limit;
# 4. DIR/limits.md: per limit, configuration and rate the P90 TTFT and TPOT
#    and the attainment, predicted, and measured where it was.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/prefill-queue-limit limits=0,256,1024,2048,4096,8192,1000000000 measure=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --limits) limits="$2"; shift 2 ;;
    --measure) measure="$2"; shift 2 ;;
    *) echo "prefill_queue_limit.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
plan=build/planner/pd-plan
[[ -x "$plan" ]] || { echo "prefill_queue_limit.sh: build pd-plan first (cmake --build build --target pd-plan)" >&2; exit 2; }
mkdir -p "$out"
say() { echo "prefill_queue_limit: $*" >&2; }
workload=(--trace=../shared/traces/mooncake_conversation_trace.jsonl --length_scale=32
          --max_input_len=1024 --max_output_len=64 --trace_max_requests=100
          --slo_ttft_ms=1500 --slo_tpot_ms=30)
rates=3,6,12

if [[ ! -s "$out/profile.json" ]]; then
  say "profiling the workers (about 1.5 minutes)"
  "$plan" profile --out="$out/profile.json" --worker_cpus=0.4 --max_context=1024 \
    --max_batch_tokens=512 --max_running=32 --prefill_kv_cache_mb=64 --decode_kv_cache_mb=64 \
    --run_dir="$out/run" >"$out/profile.md"
fi
for limit in ${limits//,/ }; do
  for config in 1P1D 1P2D 2P1D; do
    say "simulating $config, limit $limit"
    "$plan" simulate --profile="$out/profile.json" --prefill="${config:0:1}" --decode="${config:2:1}" \
      --routing="{\"prefill_queue_limit_tokens\": $limit}" "${workload[@]}" \
      --request_rates="$rates" --summary_json="$out/sim-$config-$limit.json" >/dev/null
  done
done
for limit in ${measure//,/ }; do
  say "measuring 1P1D, limit $limit"
  "$plan" validate --profile="$out/profile.json" --configs=1P1D \
    --routing="{\"prefill_queue_limit_tokens\": $limit}" "${workload[@]}" \
    --request_rates="$rates" --run_dir="$out/run" --summary_json="$out/measured-$limit.json" \
    --max_error=1e9 --max_attainment_error=1 --max_tpot_error=1e9 >"$out/measured-$limit.md"
done

python3 - "$out" "$limits" "$measure" <<'EOF'
import json, os, sys
out, limits, measure = sys.argv[1], sys.argv[2].split(","), [m for m in sys.argv[3].split(",") if m]
ms = lambda s: f"{s * 1e3:.0f}" if s is not None else "-"
lines = ["| limit | xPyD | req/s | TTFT p90 (ms) pred / meas | TPOT p90 (ms) pred / meas | attainment pred / meas |",
         "|---:|---|---:|---|---|---|"]
for limit in limits:
    measured = {}
    if limit in measure:
        for row in json.load(open(f"{out}/measured-{limit}.json")):
            measured[(row["config"], row["rate"])] = row["measured"]
    for config in ("1P1D", "1P2D", "2P1D"):
        for p in json.load(open(f"{out}/sim-{config}-{limit}.json"))["points"]:
            m = measured.get((config, p["rate"]))
            pair = lambda key, f: f"{f(p[key]['p90'] if key != 'slo_attainment' else p[key])}" + (
                f" / {f(m[key]['p90'] if key != 'slo_attainment' else m[key])}" if m else "")
            pct = lambda a: f"{a * 100:.0f}%"
            lines.append(f"| {limit} | {config} | {p['rate']:g} | {pair('ttft_s', ms)} | "
                         f"{pair('tpot_s', lambda s: f'{s * 1e3:.1f}')} | {pair('slo_attainment', pct)} |")
open(f"{out}/limits.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "table in $out/limits.md"
