#!/usr/bin/env bash
# Sets pdserve up on this machine and runs it: installs dependencies, builds,
# and streams a generation from builtin:tiny and from a model directory.
# The model directory is the first argument, or, when ../shared holds the
# stories260K llama2.c checkpoint, that model converted to Hugging Face
# layout under build/models/.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --target pdctl

echo "== builtin:tiny (random weights: the text is gibberish by design)"
build/client/pdctl generate --local --model=builtin:tiny --max_tokens=32 --stats "Hello"

model_dir="${1:-}"
stories=../shared/models/stories260K
if [[ -z "$model_dir" && -f "$stories/stories260K.bin" ]]; then
  model_dir=build/models/stories260K
  build/client/pdctl convert-llama2c "$stories/stories260K.bin" "$stories/tok512.bin" "$model_dir"
fi
if [[ -n "$model_dir" ]]; then
  echo "== $model_dir"
  build/client/pdctl generate --local --model="$model_dir" --max_tokens=128 --stats "Once upon a time"
fi
