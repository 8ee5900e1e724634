#!/usr/bin/env bash
# pdserve's CPU engine against llama.cpp on this machine, the same weights,
# one interleaved session (issue 19's table):
#
#   bench/llama_cpp_peer.sh LLAMA_CPP_SRC [--rounds N] [--threads T] [--out DIR]
#
# LLAMA_CPP_SRC is a llama.cpp source tree you fetched (never vendored
# here); its commit is read with git, or from a .commit file in the tree
# (for an exported tree). The script
#   1. builds its llama-bench and llama-quantize (Release, GGML_NATIVE, in
#      DIR/llama-build, ccache when present);
#   2. writes one random ~110M Llama (bench/peer_model.py) as Hugging Face
#      directories in f32, bf16 and f16 for pdserve and as an F32 GGUF, and
#      quantizes the GGUF to F16, BF16 and Q8_0 with llama-quantize;
#   3. runs, ROUNDS times, each weight type of both engines back to back
#      (llama.cpp first in odd rounds, pdserve first in even ones):
#      llama-bench -t T -p 128,512 -n 64, and pd-engine-bench on the same
#      directory (prefill of 128 and 512 tokens, decode at batch 1 at
#      context 32, the middle of llama-bench's 64 generated tokens);
#   4. writes DIR/peer.md: per row the range over the rounds of each
#      engine's tokens/s, the ratio of their medians, the median of each
#      round's ratio (the figure a machine whose speed swings within
#      minutes moves least) and, for decode,
#      pdserve's weight + KV bytes read per second over the copy bandwidth
#      and over the read bandwidth pd-engine-bench measured in the same
#      run; with the machine line (CPU flags) pd-engine-bench printed.
#
# Pairs: F32 with F32; llama.cpp F16 and BF16 with pdserve F16 and BF16,
# and llama.cpp F16 with pdserve BF16; llama.cpp Q8_0 (quantized from the
# F32 GGUF) with pdserve's int8 weights (the f32 directory, --int8_weights); pdserve's BF16 rows twice, with
# fp32 activations (its default) and with bf16 ones (--bf16_activations,
# what llama.cpp does with BF16 weights). pd-engine-bench is taken from
# BUILD_DIR (default build/).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:?usage: bench/llama_cpp_peer.sh LLAMA_CPP_SRC [--rounds N] [--threads T] [--out DIR] [--avx2]}"
shift
rounds=2 threads=2 out="$here/peer-out" avx2=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --avx2) avx2=1; shift ;;
    *) echo "llama_cpp_peer.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
build="${BUILD_DIR:-$here/build}"
bench="$build/bench/pd-engine-bench"
[[ -f "$src/examples/llama-bench/llama-bench.cpp" ]] ||
  { echo "llama_cpp_peer.sh: $src is not a llama.cpp source tree (no examples/llama-bench)" >&2; exit 2; }
[[ -x "$bench" ]] ||
  { echo "llama_cpp_peer.sh: build pd-engine-bench first (cmake -DPDSERVE_BUILD_BENCH=ON; ninja -C $build pd-engine-bench)" >&2; exit 2; }
mkdir -p "$out"
say() { echo "llama_cpp_peer: $*" >&2; }

# --avx2: both engines as on a CPU with AVX2/FMA/F16C and nothing newer
# (llama.cpp built for exactly those, pdserve's kernels capped by
# PDSERVE_CPU_ISA); otherwise llama.cpp is built for this CPU (GGML_NATIVE).
isa_flags=(-DGGML_NATIVE=ON) lbuild="$out/llama-build"
if ((avx2)); then
  isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF)
  lbuild="$out/llama-build-avx2"
  export PDSERVE_CPU_ISA=avx2
fi
say "building llama-bench and llama-quantize in $lbuild"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$src" -B "$lbuild" -G Ninja -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF "${launcher[@]}" >"$lbuild.cmake.log" 2>&1
cmake --build "$lbuild" --target llama-bench llama-quantize >"$lbuild.build.log"
lbin="$lbuild/bin"
commit="$(git -C "$src" rev-parse --short HEAD 2>/dev/null || cat "$src/.commit" 2>/dev/null || echo unknown)"

if [[ ! -f "$out/model/model-f32.gguf" ]]; then
  say "writing the model"
  python3 "$here/bench/peer_model.py" "$out/model" --gguf_py "$src/gguf-py"
fi
for q in F16 BF16 Q8_0; do
  f="$out/model/model-${q,,}.gguf"
  [[ -f "$f" ]] || "$lbin/llama-quantize" "$out/model/model-f32.gguf" "$f" "$q" >"$out/quantize-$q.log" 2>&1
done

rm -f "$out"/round*.json
run_llama() {  # run_llama ROUND WEIGHTS
  say "round $1/$rounds: llama.cpp $2"
  "$lbin/llama-bench" -m "$out/model/model-$2.gguf" -t "$threads" -p 128,512 -n 64 -o json \
    >"$out/round$1-llama-$2.json" 2>"$out/round$1-llama-$2.log"
}
run_ours() {  # run_ours ROUND WEIGHTS
  # Q8_0's peer: the f32 weights quantized to int8 at load.
  local ours=$2 dir=$2 extra=()
  [[ $2 == q8_0 ]] && ours=int8 dir=f32 extra=(--int8_weights)
  say "round $1/$rounds: pdserve $ours"
  "$bench" --model="$out/model/$dir" --threads="$threads" --prefill_lengths=128,512 \
    --decode_batches=1 --decode_context=32 "${extra[@]}" \
    --json="$out/round$1-pdserve-$ours.json" >"$out/round$1-pdserve-$ours.md"
}
for ((r = 1; r <= rounds; ++r)); do
  for weights in f32 f16 bf16 q8_0; do
    # Odd rounds run llama.cpp first, even rounds pdserve: a machine that
    # speeds up or slows down within a pair favours neither engine.
    if ((r % 2)); then
      run_llama "$r" "$weights"; run_ours "$r" "$weights"
    else
      run_ours "$r" "$weights"; run_llama "$r" "$weights"
    fi
  done
  # bf16 weights again with bf16 activations, as llama.cpp multiplies them.
  say "round $r/$rounds: pdserve bf16, bf16 activations"
  "$bench" --model="$out/model/bf16" --threads="$threads" --prefill_lengths=128,512 \
    --decode_batches=1 --decode_context=32 --bf16_activations \
    --json="$out/round$r-pdserve-bf16a.json" >"$out/round$r-pdserve-bf16a.md"
done

python3 - "$out" "$rounds" "$threads" "$commit" "$avx2" <<'EOF'
import json, statistics, sys
out, rounds, threads, commit = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
avx2 = sys.argv[5] == "1"
def rounds_of(name):
    """The JSON of every round of one run (llama-<q> or pdserve-<weights>);
    none when a round did not run it."""
    try:
        return [json.load(open(f"{out}/round{r}-{name}.json")) for r in range(1, rounds + 1)]
    except FileNotFoundError:
        return []
def llama(q, key):  # tokens/s per round
    return [t["avg_ts"] for tests in rounds_of(f"llama-{q}") for t in tests
            if (t["n_prompt"], t["n_gen"]) == key]
def ours(w, phase, key="tokens_per_s"):
    """Per round: tokens/s, or with key="copy" / "read" the GB/s read over
    the copy / read bandwidth of the same run."""
    return [x["gbps"] / run[f"{key}_gbps"] if key in ("copy", "read") else x[key]
            for run in rounds_of(f"pdserve-{w}") for x in run["rows"] if x["phase"] == phase]
def rng(v):
    return f"{min(v):.1f}–{max(v):.1f}" if v else "n/a"
first = rounds_of("pdserve-f32")[0]
machine = first["machine"]  # bench/bench_process.h MachineDescription.
kernels = first.get("bf16_activation_kernels", "avx2")
int8_kernels = first.get("int8_kernels", "avx2")
fp32_kernels = first.get("fp32_kernels", "avx2")
isa = ("both limited to AVX2/FMA/F16C (llama.cpp built without GGML_NATIVE, PDSERVE_CPU_ISA=avx2)"
       if avx2 else f"llama.cpp built with GGML_NATIVE; pdserve kernels: {fp32_kernels} for fp32 "
                    f"activations, {kernels} for bf16 activations, "
                    f"{int8_kernels} for int8 weights")
lines = [f"llama.cpp {commit} vs pdserve, {threads} threads, {rounds} interleaved rounds; {machine}; {isa}",
         "",
         "| weights (llama.cpp / pdserve) | phase | llama.cpp tok/s | pdserve tok/s | ratio of medians | median of the rounds' ratios | pdserve GB/s read / copy BW, / read BW |",
         "|---|---|---|---|---|---|---|"]
names = {"bf16a": "BF16, bf16 activations", "int8": "int8 (f32 quantized at load)"}
for lq, w in (("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("bf16", "bf16a"), ("f16", "bf16"),
              ("f16", "bf16a"), ("q8_0", "int8")):
    for phase, key in (("prefill 128", (128, 0)), ("prefill 512", (512, 0)), ("decode b=1", (0, 64))):
        a, b = llama(lq, key), ours(w, phase)
        if not a or not b:
            continue
        ratio = statistics.median(b) / statistics.median(a)
        # Each round runs both engines back to back: the ratio within a
        # round cancels the machine's slower swings.
        paired = statistics.median(y / x for x, y in zip(a, b)) if len(a) == len(b) else float("nan")
        share = ""
        if phase.startswith("decode"):
            share = " / ".join(f"{statistics.median(ours(w, phase, bw)) * 100:.0f}%"
                               for bw in ("copy", "read"))
        lines.append(f"| {lq.upper()} / {names.get(w, w.upper())} | {phase} | {rng(a)} | {rng(b)} | {ratio:.2f} | {paired:.2f} | {share} |")
open(f"{out}/peer.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
say "table in $out/peer.md"
