#!/usr/bin/env bash
# What a CPU share does to a serving prefill worker's engine: a 1P1D
# cluster (builtin:tiny, the engine flags of docs/capacity_planning.md)
# takes the same 100 synthetic requests (prompts uniform 128..768, seed 1)
# at each rate, once with every worker held to SHARE CPUs and once without
# a share; for each run, the prefill worker's CPU by thread (from
# /proc/PID/task/*/schedstat) and its engine's step time
# (pdserve_prefill_batch_seconds_sum). Same prompts, same steps: the
# ratio column says how much the share changes the engine's CPU, and the
# last two how far the steps' time is from (engine + KV push CPU) / SHARE,
# the simulator's view of a share. pd-plan's step model predicts the
# engine CPU of these prompts from the profile (Profile::
# prefill_engine_scale calibrates it to a serving worker;
# docs/capacity_planning.md run 10). Needs root for the shares; keep the
# machine otherwise idle. About a minute per run.
#
#   bench/prefill_engine_cpu.sh [BUILD_DIR] [SHARE] [RATES]   (build 0.4 4,16)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}" share="${2:-0.4}" rates="${3:-4,16}"
dir="$(mktemp -d)"
trap 'deploy/local/cluster.sh down --dir "$dir/cluster" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
engine="--num_threads=1 --block_size=16 --max_batch_tokens=512 --max_running=32 --kv_blocks=2048"

# run SHARE RATE: prints "engine push other step_s" for one run.
run() {
  local cpus="$1" rate="$2" c="$dir/cluster"
  deploy/local/cluster.sh down --dir "$c" >/dev/null 2>&1 || true
  rm -rf "$c"
  local share_args=()
  [[ "$cpus" != 0 ]] && share_args=(--cpu-share "$cpus")
  deploy/local/cluster.sh up --bin "$build" --prefill 1 --decode 1 "${share_args[@]}" --dir "$c" \
    --prefill-args "$engine" --decode-args "$engine" >/dev/null
  local pid metrics
  pid="$(cat "$c/prefill-0.pid")" metrics="$(cat "$c/prefill-0.metrics_port")"
  threads() { for t in /proc/"$pid"/task/*; do echo "$(cat "$t/comm" | tr ' ' _) $(cut -d' ' -f1 "$t/schedstat")"; done; }
  steps() { curl -s "localhost:$metrics/metrics" | awk '/^pdserve_prefill_batch_seconds_sum /{print $2}'; }
  local before after s0 s1
  before="$(threads)" s0="$(steps)"
  "$build/planner/pd-bench" --target=grpc --address="127.0.0.1:$(cat "$c/router.port")" \
    --input_len=uniform:128:768 --output_len=uniform:16:96 --num_requests=100 --seed=1 \
    --request_rate="$rate" --progress=false >"$dir/bench.txt" 2>&1 || { cat "$dir/bench.txt" >&2; exit 1; }
  after="$(threads)" s1="$(steps)"
  deploy/local/cluster.sh down --dir "$c" >/dev/null 2>&1 || true
  python3 - "$before" "$after" "$s0" "$s1" <<'PY'
import sys
def read(text):
    out = {}
    for line in text.splitlines():
        name, ns = line.split()
        out[name] = out.get(name, 0) + int(ns) / 1e9
    return out
b, a = read(sys.argv[1]), read(sys.argv[2])
d = {k: a[k] - b.get(k, 0) for k in a}
engine, push = d.get("pd-engine", 0), d.get("pd-kv-push", 0)
other = sum(d.values()) - engine - push
print(f"{engine:.3f} {push:.3f} {other:.3f} {float(sys.argv[4]) - float(sys.argv[3]):.3f}")
PY
}

echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs; flags: $(grep -m1 '^flags' /proc/cpuinfo | grep -oE 'avx2|avx512f|avx512_vnni|avx512_bf16|amx_tile' | tr '\n' ' ')"
echo
echo "| req/s | share (CPU) | engine CPU (s) | x the unshared | KV push CPU (s) | other threads (s) | step time (s) | (engine + push) / share (s) |"
echo "|---:|---:|---:|---:|---:|---:|---:|---:|"
IFS=, read -ra rate_list <<<"$rates"
for rate in "${rate_list[@]}"; do
  echo "run: $rate req/s without a share" >&2
  read -r e0 p0 o0 t0 < <(run 0 "$rate")
  echo "run: $rate req/s at $share CPU" >&2
  read -r e1 p1 o1 t1 < <(run "$share" "$rate")
  echo "| $rate | none | $e0 | 1.00 | $p0 | $o0 | $t0 | - |"
  awk -v r="$rate" -v s="$share" -v e="$e1" -v p="$p1" -v o="$o1" -v t="$t1" -v e0="$e0" \
    'BEGIN { printf "| %s | %s | %.3f | %.2f | %.3f | %.3f | %.3f | %.3f |\n", r, s, e, e / e0, p, o, t, (e + p) / s }'
done
