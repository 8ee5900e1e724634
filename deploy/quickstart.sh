#!/usr/bin/env bash
# Sets pdserve up on this machine and runs it: installs dependencies, builds,
# starts a local disaggregated cluster (router + 1 prefill + 1 decode worker)
# and asks it for a story three ways — pdctl over gRPC, then curl on the
# OpenAI-compatible /v1/completions and /v1/chat/completions — then stops
# the cluster.
#
#   deploy/quickstart.sh [MODEL]
#
# MODEL is a Hugging Face model directory or builtin:tiny; by default the
# stories260K model shipped in deploy/models/ (a real tiny Llama that writes
# children's stories), converted to Hugging Face layout under build/models/.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --target pdctl pd-router pd-prefill pd-decode

model="${1:-}"
if [[ -z "$model" ]]; then
  model=build/models/stories260K
  shipped=deploy/models/stories260K
  build/client/pdctl convert-llama2c "$shipped/stories260K.bin" "$shipped/tok512.bin" "$model"
  cp "$shipped/chat_template.jinja" "$model/"
fi

cluster=deploy/local/cluster.sh
trap '$cluster down' EXIT
$cluster up --prefill 1 --decode 1 --model "$model"
grpc="127.0.0.1:$(cat build/local-cluster/router.port)"
http="http://127.0.0.1:$(cat build/local-cluster/router.http_port)"
name="$(basename "$model")"
[[ "$model" == builtin:* ]] && name="$model"

echo; echo "== pdctl generate (gRPC $grpc)"
build/client/pdctl generate --server="$grpc" --max_tokens=128 --temperature=0 "Once upon a time"

echo; echo "== curl $http/v1/completions"
curl -sS "$http/v1/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "$name", "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0}
JSON
echo

echo; echo "== curl $http/v1/chat/completions (streamed)"
curl -sSN "$http/v1/chat/completions" -H 'Content-Type: application/json' -d @- <<JSON
{"model": "$name", "messages": [{"role": "user", "content": "Tom had a red ball."}],
 "max_tokens": 64, "temperature": 0.8, "seed": 7, "stream": true}
JSON
