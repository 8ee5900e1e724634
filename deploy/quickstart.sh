#!/usr/bin/env bash
# Sets pdserve up on this machine and runs it: installs dependencies, builds,
# starts a local disaggregated cluster (router + 1 prefill + 1 decode worker)
# and streams a generation through it with pdctl, then stops the cluster.
# The model is the first argument, or, when ../shared holds the stories260K
# llama2.c checkpoint, that model converted to Hugging Face layout under
# build/models/, or else builtin:tiny (random weights: gibberish by design).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --target pdctl pd-router pd-prefill pd-decode

model="${1:-}"
stories=../shared/models/stories260K
if [[ -z "$model" && -f "$stories/stories260K.bin" ]]; then
  model=build/models/stories260K
  build/client/pdctl convert-llama2c "$stories/stories260K.bin" "$stories/tok512.bin" "$model"
fi
model="${model:-builtin:tiny}"

cluster=deploy/local/cluster.sh
trap '$cluster down' EXIT
$cluster up --prefill 1 --decode 1 --model "$model"
build/client/pdctl generate --server="127.0.0.1:$(cat build/local-cluster/router.port)" \
  --max_tokens=128 --temperature=0 "Once upon a time"
