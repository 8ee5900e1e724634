#!/usr/bin/env bash
# A serving decode worker's engine CPU per step, against the profile's step
# model: what docs/capacity_planning.md run 8 measured to find that a decode
# step's KV beyond one core's cache is read from memory under load.
#
#   bench/decode_step_cpu.sh --profile P [--profile Q ...] [--prefill 2]
#                            [--rates 8,16,24,32,48]
#
# For each rate: a fresh cluster of --prefill prefill workers and one
# decode worker, each held to the profile's CPU share (cluster.sh
# --cpu-share), the synthetic workload of capacity_validation.sh (prompts
# uniform 128-768, outputs 16-96, 200 requests, seed 1) sent open-loop by
# pd-bench; around it, the decode worker's threads' CPU time
# (/proc/PID/task) and its step metrics (/metrics). It prints, per rate, the
# engine thread's CPU per step, the mean batch, and the step the profile
# predicts for that batch (each profile given: fits of one machine side by
# side; the shares are the first's) at the workload's mean decode context (prompt
# mean + E[o^2] / (2 E[o]) of the outputs, 481 tokens), in CPU time (the
# profile's step times are CPU time over the share). Needs root (the
# shares) and a built tree (build/); about 15 s a rate. Keep the machine
# otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."
profiles=() prefill=2 rates=8,16,24,32,48
while [[ $# -gt 0 ]]; do
  case "$1" in
    --profile) profiles+=("$2"); shift 2 ;;
    --prefill) prefill="$2"; shift 2 ;;
    --rates) rates="$2"; shift 2 ;;
    *) echo "decode_step_cpu.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ ${#profiles[@]} -gt 0 ]] || { echo "decode_step_cpu.sh: give --profile (a pd-plan profile)" >&2; exit 2; }
for p in "${profiles[@]}"; do
  [[ -s "$p" ]] || { echo "decode_step_cpu.sh: no profile at '$p'" >&2; exit 2; }
done
share=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["worker_cpus"])' "${profiles[0]}")
dir=$(mktemp -d /tmp/pdserve-decode-step-cpu.XXXXXX)
trap 'deploy/local/cluster.sh down --dir "$dir/cluster" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
engine="--num_threads=1 --block_size=16 --max_batch_tokens=512 --max_running=32 --kv_blocks=2048"

threads_cpu() {  # pid -> "comm ticks" per thread
  for t in /proc/"$1"/task/*; do echo "$(tr ' ' '_' <"$t/comm") $(awk '{print $14 + $15}' "$t/stat")"; done
}
metrics() {
  curl -s "localhost:$1/metrics" |
    grep -E '^pdserve_decode_(step_seconds|batch_size)_(sum|count) ' || true
}

header="| ${prefill}P1D req/s | steps | mean batch | engine CPU per step (ms) |" rule="|---:|---:|---:|---:|"
for p in "${profiles[@]}"; do header+=" $p (ms) | error |"; rule+="---:|---:|"; done
echo "$header other threads' CPU per token (us) |"
echo "$rule---:|"
for rate in ${rates//,/ }; do
  rm -rf "$dir/cluster"
  deploy/local/cluster.sh up --prefill "$prefill" --decode 1 --cpu-share "$share" \
    --dir "$dir/cluster" --prefill-args "$engine" --decode-args "$engine" >/dev/null
  pid=$(cat "$dir/cluster/decode-0.pid")
  port=$(cat "$dir/cluster/decode-0.metrics_port")
  threads_cpu "$pid" >"$dir/threads.0"; metrics "$port" >"$dir/metrics.0"
  build/planner/pd-bench --target=grpc --address="127.0.0.1:$(cat "$dir/cluster/router.port")" \
    --input_len=uniform:128:768 --output_len=uniform:16:96 --num_requests=200 --seed=1 \
    --request_rate="$rate" --progress=false --summary_json="$dir/summary.json" >/dev/null
  threads_cpu "$pid" >"$dir/threads.1"; metrics "$port" >"$dir/metrics.1"
  deploy/local/cluster.sh down --dir "$dir/cluster" >/dev/null
  python3 - "$dir" "$rate" "${profiles[@]}" <<'EOF'
import json, os, sys
d, rate, *profiles = sys.argv[1:]
hz = os.sysconf("SC_CLK_TCK")

def dense(s, tokens):
    """planner/profile.h StepCost::Dense: the table, linear between its rows."""
    xs, ys = s["dense_tokens"], s["dense_s"]
    if len(xs) < 2:
        return ys[0] if ys else 0.0
    i = next((k for k in range(1, len(xs) - 1) if xs[k] > tokens), len(xs) - 1)
    f = (tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
    return max(0.0, (1 - f) * ys[i - 1] + f * ys[i])


def pairs(path):
    out = {}
    for line in open(path):
        k, v = line.split()
        out[k] = out.get(k, 0) + float(v)
    return out

t0, t1 = pairs(f"{d}/threads.0"), pairs(f"{d}/threads.1")
cpu = {k: (t1[k] - t0.get(k, 0)) / hz for k in t1}
m0, m1 = pairs(f"{d}/metrics.0"), pairs(f"{d}/metrics.1")
delta = {k: m1[k] - m0.get(k, 0) for k in m1}
steps = delta["pdserve_decode_step_seconds_count"]
batch = delta["pdserve_decode_batch_size_sum"] / delta["pdserve_decode_batch_size_count"]
tokens = delta["pdserve_decode_batch_size_sum"]
engine = cpu.get("pd-engine", 0) / steps
other = (sum(cpu.values()) - cpu.get("pd-engine", 0)) / tokens
context = (128 + 768) / 2 + (96**3 - 16**3) / (3 * (96 - 16)) / (96 + 16)  # prompt + E[o^2] / 2E[o]
kv = batch * context
row = f"| {rate} | {steps:.0f} | {batch:.1f} | {engine * 1e3:.2f} |"
for profile in profiles:
    p = json.load(open(profile))
    s = p["step"]
    seconds = (dense(s, batch) + s["base_s"] + batch * (s["per_token_s"] + s["per_sequence_s"])
               + s["per_decode_attention_s"] * kv
               + s["per_decode_kv_beyond_cache_s"] * max(0.0, kv - s["decode_cache_tokens"]))
    predicted = seconds * p["worker_cpus"]
    row += f" {predicted * 1e3:.2f} | {(predicted / engine - 1) * 100:+.0f}% |"
print(f"{row} {other * 1e6:.0f} |")
EOF
done
