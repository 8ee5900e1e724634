#!/usr/bin/env bash
# The container image end to end: builds it with podman from this build's
# binaries (deploy/container/build.sh), starts a router, a prefill and a
# decode worker from it on a podman network of their own, each bound to
# 0.0.0.0 and reached at its container address (as in a Kubernetes pod),
# serves a request over gRPC (pdctl, from the image) and over HTTP (curl on
# /v1/completions), checks that every process runs as the image's non-root
# user, stops each with SIGTERM and checks it exits 0, and removes what it
# made. The base image made by mmdebstrap is kept (one a day; older ones are
# removed), so that only the first run of a day pays for it.
#
#   tests/deploy/container_test.sh BUILD_DIR
#
# Exit 77 (skipped) when podman is missing or cannot run a container here,
# or the base image cannot be made (no mirror), with the reason on stderr.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:?usage: container_test.sh BUILD_DIR}"
skip() { echo "SKIPPED: $*" >&2; exit 77; }
fail() { echo "FAILED: $*" >&2; exit 1; }
start_time=$SECONDS
phase() { echo "[$((SECONDS - start_time)) s] $*"; }

command -v podman >/dev/null || skip "podman is not installed (deploy/install-deps.sh installs it)"
command -v curl >/dev/null || skip "curl is not installed"
# cgroupfs: no systemd here to delegate cgroups to.
podman=(podman --cgroup-manager cgroupfs)

phase "base image"
base="$(PODMAN="${podman[*]}" "$root/deploy/container/build.sh" --base-only 2>&1)" ||
  skip "cannot make the base image: $base"
base="$(tail -n 1 <<<"$base")"
# Older daily bases of earlier runs.
"${podman[@]}" images --format '{{.Repository}}:{{.Tag}}' |
  grep '^localhost/pdserve-base:bookworm-' | grep -vxF "$base" |
  xargs -r "${podman[@]}" rmi >/dev/null 2>&1 || true

# Podman raises RLIMIT_NOFILE/NPROC in the container by default, which a
# sandbox without CAP_SYS_RESOURCE refuses: keep this shell's hard limit of
# open files, and the largest process limit (halving from the hard one,
# down to 1024) that the runtime may set. crun (podman's default) refuses
# hybrid cgroup v1/v2 hierarchies; runc takes them. Use the first runtime
# that runs the base.
nofile="$(ulimit -Hn)" nproc="$(ulimit -Hu)"
[[ "$nofile" == unlimited ]] && nofile=1048576
[[ "$nproc" == unlimited ]] && nproc=1048576
runtime_args=() run_args=() probe_errors=""
for rt in "" runc; do
  args=()
  if [[ -n "$rt" ]]; then
    command -v "$rt" >/dev/null || continue
    args=(--runtime "$rt")
  fi
  for ((np = nproc; np >= 1024; np /= 2)); do
    limits=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$np:$np")
    if out="$("${podman[@]}" run --rm "${args[@]}" "${limits[@]}" "$base" true 2>&1)"; then
      runtime_args=("${args[@]}") run_args=("${limits[@]}") probe_errors=""
      break 2
    fi
  done
  probe_errors+="${rt:-default runtime}: $out; "
done
[[ -z "$probe_errors" ]] || skip "podman cannot run a container here: $probe_errors"

tag="localhost/pdserve-test:$$"
net="pdserve-test-$$"
names=("pdserve-test-$$-decode" "pdserve-test-$$-prefill" "pdserve-test-$$-router")
work="$(mktemp -d)"
cleanup() {
  "${podman[@]}" rm -f -t 0 "${names[@]}" >/dev/null 2>&1 || true
  "${podman[@]}" network rm -f "$net" >/dev/null 2>&1 || true
  "${podman[@]}" rmi -f "$tag" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

phase "build $tag"
PODMAN="${podman[*]}" PODMAN_BUILD_ARGS="${runtime_args[*]} ${run_args[*]}" \
  "$root/deploy/container/build.sh" --bin "$bin" --tag "$tag" --base "$base" >"$work/build.log" 2>&1 ||
  fail "image build: $(tail -n 20 "$work/build.log")"

"${podman[@]}" network create "$net" >/dev/null
subnet="$("${podman[@]}" network inspect --format '{{range .Subnets}}{{.Subnet}} {{end}}' "$net")"
subnet="${subnet%% *}"
[[ "$subnet" =~ ^([0-9]+\.[0-9]+\.[0-9]+)\.0/24$ ]] || fail "unexpected subnet of $net: '$subnet'"
decode_ip="${BASH_REMATCH[1]}.10" prefill_ip="${BASH_REMATCH[1]}.11" router_ip="${BASH_REMATCH[1]}.12"

run() {  # run NAME IP ARGS...: a detached container of the image
  local name="$1" ip="$2"
  shift 2
  "${podman[@]}" run -d "${runtime_args[@]}" "${run_args[@]}" --name "$name" \
    --network "$net" --ip "$ip" "$@" >/dev/null
}
phase "start decode $decode_ip, prefill $prefill_ip, router $router_ip"
run "${names[0]}" "$decode_ip" "$tag" pd-decode --listen=0.0.0.0:50051 \
  --metrics_listen=0.0.0.0:9090 --kv_listen="$decode_ip:50061" \
  --worker_id=decode-0 --model=builtin:tiny --kv_cache_mb=64
run "${names[1]}" "$prefill_ip" "$tag" pd-prefill --listen=0.0.0.0:50051 \
  --metrics_listen=0.0.0.0:9090 --worker_id=prefill-0 --model=builtin:tiny
cat >"$work/cluster.json" <<JSON
{
  "model": "builtin:tiny",
  "prefill_workers": [{"id": "prefill-0", "address": "$prefill_ip:50051"}],
  "decode_workers": [{"id": "decode-0", "address": "$decode_ip:50051"}]
}
JSON
chmod -R a+rX "$work"
run "${names[2]}" "$router_ip" -v "$work/cluster.json:/etc/pdserve/cluster.json:ro" \
  "$tag" pd-router --config=/etc/pdserve/cluster.json --listen=0.0.0.0:50051 \
  --http_listen=0.0.0.0:8000

logs() {
  for n in "${names[@]}"; do echo "--- $n"; "${podman[@]}" logs "$n" 2>&1 | tail -n 15; done
}
pdctl() {
  "${podman[@]}" run --rm "${runtime_args[@]}" "${run_args[@]}" --network "$net" \
    "$tag" pdctl "$@"
}

phase "wait for the router to see both workers"
healthy=0
for _ in $(seq 1 60); do
  status="$(pdctl status --server="$router_ip:50051" 2>&1 || true)"
  if grep -q "serving: true" <<<"$status" &&
     grep -q "prefill_workers: 1 decode_workers: 1" <<<"$status"; then
    healthy=1
    break
  fi
  sleep 1
done
((healthy)) || fail "cluster not healthy in 60 s; last status: $status; logs: $(logs)"

phase "/health of every process"
for addr in "$router_ip:8000" "$prefill_ip:9090" "$decode_ip:9090"; do
  curl -fsS --max-time 10 "http://$addr/health" >/dev/null ||
    fail "GET http://$addr/health failed; logs: $(logs)"
done

phase "a request over gRPC (pdctl) and over HTTP (curl)"
out="$(pdctl generate --server="$router_ip:50051" "Hello" 2>&1)" ||
  fail "pdctl generate: $out; logs: $(logs)"
[[ -n "$out" ]] || fail "pdctl generate printed nothing"
body="$(curl -fsS --max-time 60 "http://$router_ip:8000/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "builtin:tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}')" ||
  fail "POST /v1/completions failed; logs: $(logs)"
grep -q '"completion_tokens":8' <<<"$body" || fail "unexpected completion: $body"

phase "every process runs as uid 10001"
for n in "${names[@]}"; do
  pid="$("${podman[@]}" inspect --format '{{.State.Pid}}' "$n")"
  uid="$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")"
  [[ "$uid" == 10001 ]] || fail "$n runs as uid $uid, not pdserve (10001)"
done

phase "SIGTERM: every process exits 0"
for n in "${names[@]}"; do
  "${podman[@]}" stop -t 30 "$n" >/dev/null
  code="$("${podman[@]}" inspect --format '{{.State.ExitCode}}' "$n")"
  [[ "$code" == 0 ]] || fail "$n exited $code on SIGTERM; logs: $(logs)"
done
phase "passed"
