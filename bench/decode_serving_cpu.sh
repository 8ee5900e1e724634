#!/usr/bin/env bash
# What a disaggregated decode worker's serving threads (gRPC's: the
# Reserve and Decode calls, the KV landing, each token's write) cost in
# CPU, beside its engine thread: docs/capacity_planning.md run 19. A 1P1D
# cluster (builtin:tiny, the engine flags of capacity_validation.sh, every
# worker held to SHARE CPUs) takes REQUESTS single requests (one at a
# time) of each prompt and output length; around each shape, the decode
# worker's CPU by thread (/proc/PID/task/*/schedstat: "pd-engine" and the
# rest). Less what the serving threads spend idle (answering the router's
# load polls, measured over 5 s), a least-squares fit splits theirs into a
# cost per request, per prompt token landed and per token streamed. Needs
# root for the shares; keep the machine otherwise idle. About a minute.
#
#   bench/decode_serving_cpu.sh [BUILD_DIR] [SHARE] [REQUESTS]   (build 0.4 60)
set -euo pipefail
cd "$(dirname "$0")/.."
build="${1:-build}" share="${2:-0.4}" requests="${3:-60}"
dir="$(mktemp -d)"
trap 'deploy/local/cluster.sh down --dir "$dir/cluster" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
engine="--num_threads=1 --block_size=16 --max_batch_tokens=512 --max_running=32 --kv_blocks=2048"
deploy/local/cluster.sh up --bin "$build" --prefill 1 --decode 1 --cpu-share "$share" \
  --dir "$dir/cluster" --prefill-args "$engine" --decode-args "$engine" >/dev/null
pid="$(cat "$dir/cluster/decode-0.pid")"
address="127.0.0.1:$(cat "$dir/cluster/router.port")"

# "engine serving seconds" of the decode worker's threads so far.
cpu() {
  for t in /proc/"$pid"/task/*; do echo "$(tr ' ' _ <"$t/comm") $(cut -d' ' -f1 "$t/schedstat")"; done |
    awk '{ if ($1 == "pd-engine") e += $2; else s += $2 } END { printf "%.6f %.6f\n", e / 1e9, s / 1e9 }'
}
now() { date +%s.%N; }

# A line a measurement: "what requests seconds engine_cpu serving_cpu".
measure() {  # what requests command...
  local what="$1" n="$2" e0 s0 t0 e1 s1 t1
  shift 2
  read -r e0 s0 <<<"$(cpu)"; t0="$(now)"
  "$@"
  read -r e1 s1 <<<"$(cpu)"; t1="$(now)"
  python3 -c 'import sys; a = list(map(float, sys.argv[3:]));
print(sys.argv[1], sys.argv[2], a[3] - a[0], a[4] - a[1], a[5] - a[2])' \
    "$what" "$n" "$t0" "$e0" "$s0" "$t1" "$e1" "$s1" >>"$dir/runs"
}
: >"$dir/runs"
measure idle 0 sleep 5
shapes=(128:4 768:4 128:96 768:96)
for shape in "${shapes[@]}"; do
  prompt="${shape%:*}" output="${shape#*:}"
  echo "decode_serving_cpu: $requests requests of $prompt prompt and $output output tokens" >&2
  measure "$shape" "$requests" "$build/planner/pd-bench" --target=grpc --address="$address" \
    --input_len="$prompt" --output_len="$output" --num_requests="$requests" --concurrency=1 \
    --seed=1 --progress=false >/dev/null
done

python3 - "$dir/runs" <<'EOF2'
import sys

rows = [line.split() for line in open(sys.argv[1])]
_, _, idle_s, idle_engine, idle_serving = rows[0]
idle_engine, idle_serving = float(idle_engine) / float(idle_s), float(idle_serving) / float(idle_s)
print("| prompt, output tokens | serving threads' CPU per request (ms) | engine thread's (ms) |")
print("|---|---:|---:|")
cost = {}  # (prompt, streamed tokens) -> serving CPU per request, less the idle rate
for shape, n, seconds, engine, serving in rows[1:]:
    prompt, output = map(int, shape.split(":"))
    n, seconds, engine, serving = int(n), float(seconds), float(engine), float(serving)
    print(f"| {prompt}, {output} | {serving / n * 1e3:.2f} | {engine / n * 1e3:.2f} |")
    # The decode worker streams every token but the first (the prefill
    # worker's).
    cost[prompt, output - 1] = (serving - idle_serving * seconds) / n
print(f"| idle, per second | {idle_serving * 1e3:.1f} | {idle_engine * 1e3:.1f} |")
# Two prompt lengths by two output lengths: least squares of
# request + prompt * per_prompt_token + streamed * per_token is the mean
# difference along each side.
(p0, p1), (o0, o1) = sorted({p for p, _ in cost}), sorted({o for _, o in cost})
per_prompt_token = (cost[p1, o0] + cost[p1, o1] - cost[p0, o0] - cost[p0, o1]) / 2 / (p1 - p0)
per_token = (cost[p0, o1] + cost[p1, o1] - cost[p0, o0] - cost[p1, o0]) / 2 / (o1 - o0)
per_request = sum(cost.values()) / 4 - per_prompt_token * (p0 + p1) / 2 - per_token * (o0 + o1) / 2
print(f"\nServing threads' CPU, less the idle rate: {per_request * 1e3:.2f} ms a request, "
      f"{per_prompt_token * 1e6:.2f} us a prompt token landed, {per_token * 1e6:.1f} us a token "
      "streamed.")
EOF2
