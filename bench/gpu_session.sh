#!/usr/bin/env bash
# One GPU session of pdserve: build, the gpu-labelled tests, pd-cuda-bench,
# its PyTorch peer (bench/torch_peer.py, eager and compiled) and
# pd-kv-transfer-bench and pd-cluster-bench, each stage under a timeout,
# logs into $OUT.
#
#   bench/gpu_session.sh [STAGE...]        # from the repository root
#
# Stages, run in the order given (none given: env build test cuda-bench
# torch-peer kv-bench cluster-bench summary):
#   env             nvidia-smi, nvcc --version, compilers, torch/transformers
#   deps            unpack carried Debian packages (.gpudeps/, made by
#                   pack-deps) into $BUILD_DIR/deps when the machine lacks
#                   the C++ dependencies; build does this by itself
#   build           configure (Ninja, -DPDSERVE_BUILD_BENCH=ON) and build
#                   only the gpu-labelled test binaries, pd-cuda-bench,
#                   pd-kv-transfer-bench and pd-cluster-bench with the
#                   workers
#   test            ctest -L gpu --output-on-failure
#   cuda-bench      build/bench/pd-cuda-bench
#   torch-peer      torch-eager, then torch-compiled
#   torch-eager     bench/torch_peer.py --modes eager
#   torch-compiled  bench/torch_peer.py --modes compiled
#   kv-bench        pd-kv-transfer-bench
#   cluster-bench   pd-cluster-bench --backend=cuda over cuda_ipc and tcp
#                   (staged): TTFT, the transfer's hidden share at 512 /
#                   2048 / 8192 tokens, decode rate
#   profile         per-kernel device time (Nsight Compute) of a decode step
#                   and of 512- and 2048-token prefills, as tables, and the
#                   prefill attention kernel's throughput, occupancy and
#                   warp stall reasons at 2048 tokens
#   summary         stage results and pd-cuda-bench / PyTorch time ratios
#   pack-deps       (on the development machine, not the GPU one) download
#                   the Debian packages of deploy/install-deps.sh into
#                   .gpudeps/ for carrying (git-ignored through
#                   .git/info/exclude)
#
#   pack-build      (on the development machine) build what the stages
#                   need into $BUILD_DIR and pack it for carrying into
#                   .gpupack/carry.tar.xz (about 11 MB): the test and
#                   bench binaries (stripped), the ctest files, the shared
#                   libraries they load beyond the C and C++ runtimes, and
#                   ../shared/models. A call that carries .gpupack then
#                   builds nothing: the script unpacks it first and every
#                   stage uses it (the device tool's first H100 session
#                   spent no device time on building this way)
#
# Every stage that needs binaries builds what is missing first, so a call
# that lands on a fresh machine still works, only slower. The build tree,
# the unpacked dependencies, the inductor cache and the logs of earlier
# calls live under $BUILD_DIR (an ignored path, kept on the device machine
# while it stays warm); each call copies its own logs, the summary and a
# tarball of every log so far into $OUT (at most 8 files come back).
#
# Environment (defaults in brackets): OUT [gpu-session-out], BUILD_DIR
# [build-gpusession], JOBS [16], DEPS_DEBS [.gpudeps], CUDA_BENCH_ARGS,
# TORCH_PEER_ARGS, KV_BENCH_ARGS, CLUSTER_BENCH_ARGS (extra flags), T_<STAGE> (seconds, e.g.
# T_BUILD=540; see the defaults below), CARRIED [.gpupack/carry.tar.xz] (a
# pack-build tarball, used where the C++ dependencies are not installed;
# CARRIED= never uses one), TARGETS (build these instead of the
# gpu tests and the two benches), FORCE_CARRIED_DEPS=1 (use .gpudeps even
# where the system has the packages: to try that path on a dev machine).
# shellcheck disable=SC2317  # Stage functions run through "$SELF" __run.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-session-out}
BUILD_DIR=${BUILD_DIR:-build-gpusession}
[[ $BUILD_DIR = /* ]] || BUILD_DIR=$ROOT/$BUILD_DIR
JOBS=${JOBS:-16}
DEPS_DEBS=${DEPS_DEBS:-$ROOT/.gpudeps}
LOGS=$BUILD_DIR/session-logs
DEPS_PREFIX=$BUILD_DIR/deps
PYTHON=${PYTHON:-python3}

# Per-stage limits, chosen so that the calls docs/benchmarks.md suggests
# stay under the device tool's 600 s per command.
T_ENV=${T_ENV:-60}
T_DEPS=${T_DEPS:-120}
T_BUILD=${T_BUILD:-480}
T_TEST=${T_TEST:-300}
T_CUDA_BENCH=${T_CUDA_BENCH:-240}
T_TORCH_EAGER=${T_TORCH_EAGER:-240}
T_TORCH_COMPILED=${T_TORCH_COMPILED:-480}
T_KV_BENCH=${T_KV_BENCH:-180}
T_CLUSTER_BENCH=${T_CLUSTER_BENCH:-300}
T_PROFILE=${T_PROFILE:-240}

# The packages deploy/install-deps.sh installs for building, with the
# run-time libraries and -dev packages they pull in beyond a CUDA image's
# base system (libc, libstdc++, gcc, cmake and ninja are there).
DEPS_PACKAGES=(
  libabsl-dev libabsl20220623 nlohmann-json3-dev
  libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 protobuf-compiler-grpc
  libprotobuf-dev libprotobuf32 libprotobuf-lite32 libprotoc-dev libprotoc32
  protobuf-compiler libgtest-dev libgmock-dev googletest
  libre2-dev libre2-9 libc-ares-dev libc-ares2 libssl-dev libssl3 zlib1g-dev
  libisal-dev libisal2
)

mkdir -p "$OUT" "$LOGS"
RUN_FILES=()  # This call's other outputs, copied to $OUT at the end.

log() { printf '[gpu_session %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# run_stage NAME TIMEOUT_S COMMAND...: the command's output to the terminal
# and to NAME.log in $LOGS and in $OUT (there at once, so that a command
# the device tool kills still brings it back); a line NAME rc seconds into
# $LOGS/stages.tsv.
run_stage() {
  local name=$1 limit=$2
  shift 2
  local logf=$LOGS/$name.log start rc
  log "stage $name (timeout ${limit}s): $*"
  start=$(date +%s)
  # The stage's function runs in a fresh copy of this script, so that
  # timeout can end it; --kill-after ends one that ignores SIGTERM.
  timeout --kill-after=10 "$limit" "$SELF" __run "$@" 2>&1 |
    tee "$logf" "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  local secs=$(($(date +%s) - start))
  [[ $rc -eq 124 || $rc -eq 137 ]] && log "stage $name TIMED OUT after ${limit}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$(date -u +%FT%TZ)" >>"$LOGS/stages.tsv"
  log "stage $name: rc=$rc in ${secs}s"
  return "$rc"
}

have_system_deps() {
  [[ ${FORCE_CARRIED_DEPS:-0} != 1 ]] &&
  [[ -f /usr/include/absl/status/status.h && -f /usr/include/grpcpp/grpcpp.h &&
     -f /usr/include/gtest/gtest.h && -f /usr/include/nlohmann/json.hpp &&
     -f /usr/include/isa-l/crc.h ]]
}

# Point CMake, the compilers and the loader at the unpacked packages.
use_deps() {
  [[ -f $DEPS_PREFIX/.unpacked ]] || return 0
  local usr=$DEPS_PREFIX/usr lib=$DEPS_PREFIX/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH=$usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export PATH=$usr/bin:$PATH
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export CPLUS_INCLUDE_PATH=$usr/include:$usr/include/x86_64-linux-gnu${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
  # gRPC finds RE2 through pkg-config: only the unpacked .pc files, their
  # /usr paths moved under the prefix.
  export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$DEPS_PREFIX
}

unpack_deps() {
  if have_system_deps; then
    log "the C++ dependencies are installed; nothing to unpack"
    return 0
  fi
  if [[ -f $DEPS_PREFIX/.unpacked ]]; then
    log "dependencies already unpacked in $DEPS_PREFIX"
    return 0
  fi
  shopt -s nullglob
  local debs=("$DEPS_DEBS"/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    log "no absl/grpc/gtest headers here and no .deb files in $DEPS_DEBS:" \
      "run 'bench/gpu_session.sh pack-deps' on the development machine and" \
      "carry .gpudeps"
    return 1
  fi
  mkdir -p "$DEPS_PREFIX"
  local d
  for d in "${debs[@]}"; do
    dpkg-deb -x "$d" "$DEPS_PREFIX" || return 1
  done
  touch "$DEPS_PREFIX/.unpacked"
  log "unpacked ${#debs[@]} packages into $DEPS_PREFIX"
}

configure() {
  use_deps
  [[ -f $BUILD_DIR/build.ninja ]] && return 0
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export CUDACXX=/usr/local/cuda/bin/nvcc
  fi
  local extra=()
  # Debian 12's Abseil 20220623 predates GCC 13's header clean-up; an
  # explicit <cstdint> keeps it compiling with a newer host compiler.
  [[ -f $DEPS_PREFIX/.unpacked ]] && extra+=("-DCMAKE_CXX_FLAGS=-include cstdint")
  # A CMake 4 (pip's) refuses packages' configs that name policies older
  # than 3.5 unless told so; older CMakes ignore this variable.
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  cmake -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPDSERVE_BUILD_BENCH=ON "${extra[@]}"
}

# The test executables whose tests carry the ctest label gpu, read from the
# gtest_discover_tests post-build steps in build.ninja.
gpu_test_targets() {
  grep -oE 'TEST_TARGET=[A-Za-z0-9_]+ .*TEST_PROPERTIES=[^"]*LABELS;gpu[;"]' \
      "$BUILD_DIR/build.ninja" |
    sed -E 's/^TEST_TARGET=([A-Za-z0-9_]+) .*/\1/' | sort -u
}

# What the stages run besides the gpu-labelled tests (CMake target names,
# which are also the executables' names).
SESSION_TARGETS=(
  pd-cuda-bench pd-kv-transfer-bench pd-cluster-bench pd-router pd-prefill
  pd-decode pdctl kv-transfer-device-peer kv-transfer-peer
)

build_targets() {
  configure || return 1
  local targets
  if [[ -n ${TARGETS:-} ]]; then
    read -ra targets <<<"$TARGETS"
    cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}"
    return
  fi
  mapfile -t targets < <(gpu_test_targets)
  if ((${#targets[@]} == 0)); then
    # Another CMake may write the discovery step differently: the known ones.
    mapfile -t targets < <(ninja -C "$BUILD_DIR" -t targets all |
      grep -oE '^(cuda_kernels_test|cuda_model_runner_test):' | tr -d :)
  fi
  if ((${#targets[@]} == 0)); then
    log "no gpu-labelled tests found in build.ninja (is nvcc found? see" \
      "'pdserve cuda backend' in the configure output)"
    return 1
  fi
  log "gpu test targets: ${targets[*]}"
  cmake --build "$BUILD_DIR" -j "$JOBS" --target "${targets[@]}" \
    "${SESSION_TARGETS[@]}"
}

stage_env() {
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  echo "cpus: $(nproc)"
  [[ -r /etc/os-release ]] && grep PRETTY_NAME /etc/os-release
  echo
  nvidia-smi || echo "nvidia-smi: failed"
  echo
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit,persistence_mode --format=csv || true
  echo
  nvcc --version || echo "nvcc: not found"
  echo
  for tool in cmake ninja g++; do
    printf '%s: %s\n' "$tool" "$("$tool" --version 2>/dev/null | head -1)"
  done
  "$PYTHON" -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' ||
    echo "torch/transformers: not importable"
  if have_system_deps; then echo "C++ dependencies: system"; else echo "C++ dependencies: not installed (deps stage needed)"; fi
}

need_binary() {  # need_binary PATH: build if PATH is missing.
  [[ -x $1 ]] && return 0
  log "$1 missing: building first"
  unpack_deps && build_targets
}

stage_build() {
  unpack_deps && build_targets
}

stage_timeout() {
  case $1 in
    torch-eager) echo "$T_TORCH_EAGER" ;;
    torch-compiled) echo "$T_TORCH_COMPILED" ;;
  esac
}

stage_test() {
  need_binary "$BUILD_DIR/bench/pd-cuda-bench" || return 1
  use_deps
  ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure --timeout 300
}

stage_cuda_bench() {
  need_binary "$BUILD_DIR/bench/pd-cuda-bench" || return 1
  use_deps
  # shellcheck disable=SC2086  # CUDA_BENCH_ARGS is a list of flags.
  "$BUILD_DIR/bench/pd-cuda-bench" ${CUDA_BENCH_ARGS:-}
}

stage_torch() {  # stage_torch MODE
  export PYTHONUNBUFFERED=1
  # The compiled graphs outlive this process while the machine is warm.
  export TORCHINDUCTOR_CACHE_DIR=$BUILD_DIR/torchinductor-cache
  # shellcheck disable=SC2086  # TORCH_PEER_ARGS is a list of flags.
  "$PYTHON" "$ROOT/bench/torch_peer.py" --modes "$1" \
    --json "$LOGS/torch_$1.json" ${TORCH_PEER_ARGS:-}
}

stage_kv_bench() {
  need_binary "$BUILD_DIR/bench/pd-kv-transfer-bench" || return 1
  use_deps
  # shellcheck disable=SC2086  # KV_BENCH_ARGS is a list of flags.
  "$BUILD_DIR/bench/pd-kv-transfer-bench" ${KV_BENCH_ARGS:-}
}

# Per-kernel device time of one forward, read by Nsight Compute: a decode
# step (batch 1, context 512) and prefills of 512 and 2048 tokens, eager
# (no graphs), PROFILE_LAYERS [4] layers of the Llama-3-8B shape. Each
# table lists the kernels by their share of the forward.
stage_profile() {
  need_binary "$BUILD_DIR/bench/pd-cuda-bench" || return 1
  use_deps
  local ncu
  ncu=$(command -v ncu || find /opt/nvidia /usr/local/cuda* -name ncu -type f 2>/dev/null | head -1)
  if [[ -z $ncu ]]; then
    log "Nsight Compute (ncu) is not installed here"
    return 1
  fi
  local name rows rc=0
  for name in decode-b1-ctx512 prefill-512 prefill-2048; do
    case $name in
      decode-*) rows=(--batches=1 --contexts=512 --prefill=0) ;;
      prefill-*) rows=(--batches=0 --contexts=0 "--prefill=${name#prefill-}") ;;
    esac
    # --reps=1: two forwards (one untimed), so each count is per forward x2.
    "$ncu" --metrics gpu__time_duration.sum --print-summary per-kernel \
      "$BUILD_DIR/bench/pd-cuda-bench" "--num_layers=${PROFILE_LAYERS:-4}" \
      --cuda_graphs=false --measure_limits=false --reps=1 "${rows[@]}" \
      >"$LOGS/ncu-$name.txt" 2>&1 || rc=1
    echo "## $name (${PROFILE_LAYERS:-4} layers)"
    "$PYTHON" - "$LOGS/ncu-$name.txt" <<'PY'
import re, sys
rows, cur = [], None
for line in open(sys.argv[1]):
    m = re.match(r"\s{2}(\S.*?) \((\d+), (\d+), (\d+)\)x\((\d+), \d+, \d+\).*Invocations (\d+)", line)
    if m:
        cur = (m.group(1).split("(")[0][:60], "x".join(m.group(2, 3, 4)), m.group(5), int(m.group(6)))
        continue
    m = re.match(r"\s+gpu__time_duration.sum\s+(\w+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)", line)
    if m and cur:
        us = float(m.group(2)) * {"ns": 1e-3, "us": 1.0, "ms": 1e3}[m.group(1)]
        rows.append(cur + (us,))
        cur = None
total = sum(r[3] * r[4] for r in rows) / 2 or 1.0
print("| kernel | grid | threads | per forward | mean us | us per forward | share |")
print("|---|---|---:|---:|---:|---:|---:|")
for name, grid, threads, n, us in sorted(rows, key=lambda r: -r[3] * r[4]):
    print(f"| {name} | {grid} | {threads} | {n / 2:g} | {us:.1f} | {n * us / 2:.0f} | {100 * n * us / 2 / total:.1f}% |")
print(f"\nkernels' total per forward: {total / 1e3:.2f} ms (ncu serializes kernels and fixes clocks)\n")
PY
  done
  # One launch of the prefill attention (one layer, 2048 tokens) in
  # detail: its throughput, occupancy and where its warps stall.
  echo "## prefill attention at 2048 tokens (one launch)"
  "$ncu" --clock-control none -k regex:PagedAttentionMma -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section ComputeWorkloadAnalysis \
    "$BUILD_DIR/bench/pd-cuda-bench" --num_layers=1 --cuda_graphs=false \
    --measure_limits=false --reps=1 --batches=0 --contexts=0 --prefill=2048 \
    >"$LOGS/ncu-attention-2048.txt" 2>&1 || rc=1
  grep -vE '^==PROF==|^\s*$' "$LOGS/ncu-attention-2048.txt" | tail -n 120
  return "$rc"
}

stage_cluster_bench() {
  need_binary "$BUILD_DIR/bench/pd-cluster-bench" || return 1
  use_deps
  # shellcheck disable=SC2086  # CLUSTER_BENCH_ARGS is a list of flags.
  "$BUILD_DIR/bench/pd-cluster-bench" --backend=cuda \
    --kv_transports=cuda_ipc,tcp --prompt_lens=512,2048,8192 \
    ${CLUSTER_BENCH_ARGS:-}
}

stage_summary() {
  echo "# GPU session summary ($(date -u +%FT%TZ))"
  echo
  echo "| stage | rc | seconds | finished (UTC) |"
  echo "|---|---|---|---|"
  [[ -f $LOGS/stages.tsv ]] && awk -F'\t' '{ printf "| %s | %s | %s | %s |\n", $1, $2, $3, $4 }' "$LOGS/stages.tsv"
  echo
  [[ -f $LOGS/env.log ]] && grep -m1 -E '^\| +[0-9]+ +NVIDIA|NVIDIA H' "$LOGS/env.log"
  if [[ -f $LOGS/test.log ]]; then
    echo
    grep -E 'tests passed|tests failed|Total Test time|\*\*\*Failed|Not Run' "$LOGS/test.log"
  fi
  if [[ -f $LOGS/cuda-bench.log ]]; then
    echo
    echo "## pd-cuda-bench"
    echo
    cat "$LOGS/cuda-bench.log"
  fi
  local jsons=() m
  for m in eager compiled; do
    [[ -f $LOGS/torch_$m.json ]] && jsons+=("$LOGS/torch_$m.json")
  done
  for m in torch-eager torch-compiled; do
    if [[ -f $LOGS/$m.log ]]; then
      echo
      echo "## $m"
      echo
      grep -E '^(device|torch|\|)' "$LOGS/$m.log"
    fi
  done
  if [[ -f $LOGS/cuda-bench.log && ${#jsons[@]} -gt 0 ]]; then
    echo
    echo "## ratios"
    echo
    "$PYTHON" "$ROOT/bench/torch_peer.py" --load-json "${jsons[@]}" \
      --compare "$LOGS/cuda-bench.log"
  fi
  for m in kv-bench cluster-bench; do
    if [[ -f $LOGS/$m.log ]]; then
      echo
      echo "## $m"
      echo
      grep -E '^(\||model|decode|skipped)' "$LOGS/$m.log" || true
    fi
  done
}

stage_pack_deps() {
  mkdir -p "$DEPS_DEBS"
  (cd "$DEPS_DEBS" && apt-get download "${DEPS_PACKAGES[@]}") || return 1
  local exclude
  exclude=$(git rev-parse --git-path info/exclude) || return 1
  mkdir -p "$(dirname "$exclude")"
  local rel=/${DEPS_DEBS#"$ROOT"/}/
  grep -qxF "$rel" "$exclude" 2>/dev/null || echo "$rel" >>"$exclude"
  du -sh "$DEPS_DEBS"
  echo "carry it: run(carry=[\"${rel//\//}\"], ...)"
}

CARRIED=${CARRIED-$ROOT/.gpupack/carry.tar.xz}

stage_pack_build() {
  configure || return 1
  local targets t
  mapfile -t targets < <(gpu_test_targets)
  build_targets || return 1
  local stage
  stage=$(mktemp -d) || return 1
  local b=$stage/build
  mkdir -p "$b" "$stage/lib" "$stage/shared"
  # ctest's files name the build directory and the sources by absolute
  # path: the device links this checkout and build there (use_carried).
  (cd "$BUILD_DIR" && find . -name CTestTestfile.cmake -o -name '*_include.cmake' \
    -o -name '*_tests.cmake') | while read -r f; do
    mkdir -p "$b/$(dirname "$f")" && cp "$BUILD_DIR/$f" "$b/$f"
  done
  local bins=() name
  for name in "${targets[@]}" "${SESSION_TARGETS[@]}"; do
    t=$(cd "$BUILD_DIR" && find . -type f -name "$name" -perm -u+x | head -1)
    [[ -n $t ]] || { log "no executable $name under $BUILD_DIR"; return 1; }
    bins+=("$t")
  done
  for t in "${bins[@]}"; do
    mkdir -p "$b/$(dirname "$t")"
    cp "$BUILD_DIR/$t" "$b/$t" && strip "$b/$t"
  done
  # Every shared library they load but the C and C++ runtimes, which a
  # newer distribution has in a compatible version.
  find "$b" -type f -perm -u+x -exec ldd {} + 2>/dev/null |
    awk '/=> \// {print $3}' | sort -u |
    grep -vE '/(libc|libm|libgcc_s|libstdc\+\+|ld-linux-x86-64|libpthread|libdl|librt)\.so' |
    while read -r l; do cp -L "$l" "$stage/lib/"; done
  [[ -d $ROOT/../shared/models ]] && cp -r "$ROOT/../shared/models" "$stage/shared/"
  printf '%s\n%s\n' "$ROOT" "$BUILD_DIR" >"$stage/paths"
  mkdir -p "$(dirname "$CARRIED")"
  tar -cJf "$CARRIED" -C "$stage" . || return 1
  rm -rf "$stage"
  local exclude rel
  exclude=$(git rev-parse --git-path info/exclude) || return 1
  mkdir -p "$(dirname "$exclude")"
  rel=/$(dirname "${CARRIED#"$ROOT"/}")/
  grep -qxF "$rel" "$exclude" 2>/dev/null || echo "$rel" >>"$exclude"
  du -h "$CARRIED"
  echo "carry it: run(carry=[\"${rel//\//}\"], ...)"
}

# On the device: unpack a pack-build tarball and put its build where the
# ctest files expect it (the packing machine's absolute paths, linked to
# this checkout), its libraries first on the loader's path, and the CUDA
# libraries the backend opens (cuBLAS, NCCL: the toolkit's or pip's) after.
use_carried() {
  local dir=$ROOT/.gpupack/unpacked
  rm -rf "$dir" && mkdir -p "$dir" && tar -xJf "$CARRIED" -C "$dir" || return 1
  local packed_root packed_build
  { read -r packed_root; read -r packed_build; } <"$dir/paths"
  if [[ -e $packed_build && ! -L $packed_build ]]; then
    log "$packed_build is a build tree of this machine; not replacing it" \
      "with the carried one (CARRIED= to build here instead)"
    return 1
  fi
  if [[ $packed_root != "$ROOT" ]]; then
    if [[ -e $packed_root && ! -L $packed_root ]]; then
      log "the carried build was packed at $packed_root, which exists here"
      return 1
    fi
    mkdir -p "$(dirname "$packed_root")"
    ln -sfn "$ROOT" "$packed_root" || return 1
  fi
  local shared
  shared=$(dirname "$packed_root")/shared
  [[ -e $shared ]] || ln -sfn "$dir/shared" "$shared"
  rm -rf "$packed_build" && ln -sfn "$dir/build" "$packed_build" || return 1
  BUILD_DIR=$packed_build
  LOGS=$BUILD_DIR/session-logs
  mkdir -p "$LOGS"
  local cuda_libs
  cuda_libs=$(find /usr/local/cuda* /opt /usr/lib -xdev \( -name libnccl.so.2 \
    -o -name libcublas.so.13 -o -name libcublas.so.12 \) -printf '%h\n' \
    2>/dev/null | sort -u | tr '\n' :)
  export LD_LIBRARY_PATH=$dir/lib:$cuda_libs${LD_LIBRARY_PATH:-}
  export BUILD_DIR LOGS
  log "using the carried build ($CARRIED, packed at $packed_root)"
}

SELF=$ROOT/bench/gpu_session.sh
if [[ ${1:-} == __run ]]; then  # One stage's function, under run_stage.
  shift
  "$@"
  exit
fi

# Copies this call's logs, the summary and a tarball of all logs to $OUT.
finish() {
  local f n=0
  tar -czf "$OUT/session-logs.tgz" -C "$LOGS" . 2>/dev/null && n=1
  n=$((n + $(find "$OUT" -maxdepth 1 -name '*.log' | wc -l)))
  for f in "${RUN_FILES[@]}"; do
    [[ -f $f && ! -f $OUT/$(basename "$f") ]] || continue
    ((n < 8)) || break
    cp "$f" "$OUT/" && n=$((n + 1))
  done
}
trap finish EXIT

if [[ ${1:-} != pack-build && -n $CARRIED && -f $CARRIED ]] &&
   ! have_system_deps; then
  use_carried || exit 1
fi

if (($# == 0)); then
  set -- env build test cuda-bench torch-peer kv-bench cluster-bench summary
fi
failed=0
for stage in "$@"; do
  case $stage in
    env) run_stage env "$T_ENV" stage_env ;;
    deps) run_stage deps "$T_DEPS" unpack_deps ;;
    build) run_stage build "$T_BUILD" stage_build ;;
    test) run_stage test "$T_TEST" stage_test ;;
    cuda-bench) run_stage cuda-bench "$T_CUDA_BENCH" stage_cuda_bench ;;
    torch-eager | torch-compiled)
      RUN_FILES+=("$LOGS/torch_${stage#torch-}.json")
      run_stage "$stage" "$(stage_timeout "$stage")" stage_torch "${stage#torch-}" ;;
    torch-peer)
      RUN_FILES+=("$LOGS/torch_eager.json" "$LOGS/torch_compiled.json")
      run_stage torch-eager "$T_TORCH_EAGER" stage_torch eager || failed=1
      run_stage torch-compiled "$T_TORCH_COMPILED" stage_torch compiled ;;
    kv-bench) run_stage kv-bench "$T_KV_BENCH" stage_kv_bench ;;
    cluster-bench)
      run_stage cluster-bench "$T_CLUSTER_BENCH" stage_cluster_bench ;;
    profile) run_stage profile "$T_PROFILE" stage_profile ;;
    summary) run_stage summary 60 stage_summary ;;
    pack-deps) stage_pack_deps ;;
    pack-build) stage_pack_build ;;
    *) log "unknown stage '$stage'"; false ;;
  esac || failed=1
done
exit "$failed"
