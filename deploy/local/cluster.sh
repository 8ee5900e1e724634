#!/usr/bin/env bash
# Starts and stops a pdserve cluster on this machine: one pd-router, x
# pd-prefill and y pd-decode workers on loopback, with one model.
#
#   deploy/local/cluster.sh up   [options]   start, wait until healthy, return
#   deploy/local/cluster.sh down [--dir D]   stop: SIGTERM (workers drain), a
#                                            second SIGTERM after 1 s (ends
#                                            any drain still going), SIGKILL
#                                            after 10 s
#   deploy/local/cluster.sh run  [options]   up, then wait for Ctrl-C, then down
#   deploy/local/cluster.sh add  --dir D --role decode|prefill --name NAME
#                                            one more worker, with the flags of
#                                            that role given to `up` (--etcd
#                                            clusters: the routers find it)
#
# Options:
#   --prefill N        prefill workers (default 1; 0 = colocated: decode
#                      workers prefill locally)
#   --decode N         decode workers (default 1)
#   --model M          model directory or builtin:tiny (default builtin:tiny)
#   --dir D            run directory: ports, pids, logs, cluster.json
#                      (default build/local-cluster)
#   --bin B            build directory with the binaries (default build)
#   --router-port P    router's gRPC port (default 0: any free port; the
#                      chosen one is in D/router.port)
#   --http-port P      router's OpenAI-compatible HTTP port (default 0: any
#                      free port; the chosen one is in D/router.http_port)
#   --routing JSON     the config's routing section (docs/routing.md), e.g.
#                      '{"policy": "least_loaded"}' (default: none, so
#                      kv_aware with its defaults)
#   --routing-policy NAME
#                      shorthand for --routing '{"policy": "NAME"}':
#                      round_robin, least_loaded or kv_aware
#   --cpu-share S      hold every worker to S CPUs of time (e.g. 0.5), each in
#                      its own cgroup (deploy/local/cpu_share.sh; needs root);
#                      the router is not limited (default: no limit)
#   --etcd             discover the workers through etcd: start an etcd in D
#                      (etcd-server), register every worker there and let
#                      the router watch it; cluster.json lists no worker
#                      (docs/deployment.md, "Discovery")
#   --etcd-endpoints U use this etcd (http://HOST:PORT,...) instead
#   --tls D            TLS and mTLS end to end (docs/security.md): the router
#                      serves gRPC and HTTPS with D/node.crt, and every
#                      process authenticates its peers by D/ca.crt. Makes
#                      the CA and node.crt (for 127.0.0.1 and localhost)
#                      with openssl when D has no ca.crt; otherwise uses
#                      D/ca.crt, D/node.crt and D/node.key as they are.
#                      Clients: pdctl --tls_root_certs=D/ca.crt,
#                      curl --cacert D/ca.crt (default: plaintext). With
#                      --etcd, etcd serves https:// with node.crt too
#   --prefill-args A, --decode-args A, --router-args A
#                      extra flags for every worker of that kind, e.g.
#                      --decode-args "--kv_transport=ucx:shm,tcp" (KV
#                      transports: docs/development.md)
#
# Every process writes its bound port to D/<name>.port and its log to
# D/<name>.log; D/<name>.pid holds its pid. Each serves Prometheus /metrics
# on the port in D/<name>.metrics_port (the router's is its HTTP port), and
# D/prometheus_targets.json lists them all for Prometheus's file_sd_configs
# (docs/metrics.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"

cmd="${1:-}"
shift || true
prefill=1 decode=1 model=builtin:tiny dir="$root/build/local-cluster" bin="$root/build"
router_port=0 http_port=0 prefill_args="" decode_args="" router_args="" routing=""
routing_policy="" cpu_share="" etcd="" role="" name="" tls_dir=""
while (($#)); do
  case "$1" in
    --prefill) prefill="$2"; shift 2 ;;
    --decode) decode="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --router-port) router_port="$2"; shift 2 ;;
    --http-port) http_port="$2"; shift 2 ;;
    --prefill-args) prefill_args="$2"; shift 2 ;;
    --decode-args) decode_args="$2"; shift 2 ;;
    --router-args) router_args="$2"; shift 2 ;;
    --routing) routing="$2"; shift 2 ;;
    --etcd) etcd=local; shift ;;
    --etcd-endpoints) etcd="$2"; shift 2 ;;
    --role) role="$2"; shift 2 ;;
    --name) name="$2"; shift 2 ;;
    --routing-policy) routing_policy="$2"; shift 2 ;;
    --cpu-share) cpu_share="$2"; shift 2 ;;
    --tls) tls_dir="$2"; shift 2 ;;
    *) echo "cluster.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

die() { echo "cluster.sh: $*" >&2; exit 1; }

# Waits for D/<name>.port; fails if the process died first.
wait_port() {
  local name="$1" pid
  pid="$(cat "$dir/$name.pid")"
  for _ in $(seq 1 600); do
    [[ -s "$dir/$name.port" ]] && return 0
    kill -0 "$pid" 2>/dev/null || die "$name exited; see $dir/$name.log: $(tail -n 3 "$dir/$name.log")"
    sleep 0.1
  done
  die "$name did not start within 60 s; see $dir/$name.log"
}

# --tls: a CA and one certificate for every process of this machine, unless
# the directory has them already.
make_certificates() {
  local d="$1"
  [[ -s "$d/ca.crt" ]] && return 0
  mkdir -p "$d"
  (
    cd "$d"
    umask 077
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
      -keyout ca.key -out ca.crt -days 365 -subj "/CN=pdserve local CA" \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
      -keyout node.key -out node.csr -subj "/CN=pdserve local node"
    printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" \
      "extendedKeyUsage=serverAuth,clientAuth" "basicConstraints=CA:FALSE" >node.ext
    openssl x509 -req -in node.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -extfile node.ext -out node.crt
    rm -f node.csr node.ext
  ) >"$d/openssl.log" 2>&1 || die "openssl could not make certificates in $d: $(tail -n 3 "$d/openssl.log")"
}

# The cgroup of a worker under --cpu-share: one per run directory and name.
cgroup_of() { echo "pdserve.$(printf %s "$dir" | cksum | cut -d' ' -f1).$1"; }

start() {  # start NAME BINARY ARGS...
  local name="$1" binary="$2"
  shift 2
  rm -f "$dir/$name.port"
  local limit=()
  if [[ -n "$cpu_share" && "$name" != router ]]; then
    limit=("$root/deploy/local/cpu_share.sh" run "$cpu_share" "$(cgroup_of "$name")")
  fi
  "${limit[@]}" "$binary" --port_file="$dir/$name.port" "$@" >"$dir/$name.log" 2>&1 &
  echo $! >"$dir/$name.pid"
}

down() {
  [[ -d "$dir" ]] || return 0
  local pids=() groups=()
  for f in "$dir"/*.pid; do
    [[ -e "$f" && "$f" != "$dir/etcd.pid" ]] || continue
    local pid
    pid="$(cat "$f")"
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
    groups+=("$(cgroup_of "$(basename "$f" .pid)")")
    rm -f "$f"
  done
  # A worker drains on SIGTERM (docs/router.md, "Drain"): it finishes its
  # requests and waits (at most 2 s) for a router to read that it drains.
  # `down` is quick rather than graceful: a second SIGTERM after 1 s ends
  # the drain. (For a graceful stop of one worker, send it one SIGTERM and
  # wait.)
  local stopped=0 i
  for i in $(seq 1 100); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || { stopped=1; break; }
    if ((i == 10)); then
      for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    fi
    sleep 0.1
  done
  if ((!stopped)); then
    for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    sleep 0.2
  fi
  "$root/deploy/local/cpu_share.sh" remove "${groups[@]}"
  # etcd last, so that the workers could withdraw their registrations.
  if [[ -e "$dir/etcd.pid" ]]; then
    local pid
    pid="$(cat "$dir/etcd.pid")"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$dir/etcd.pid"
  fi
}

free_port() {  # A TCP port nobody listens on now.
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Starts etcd in $dir (client port in $dir/etcd.port) and sets $etcd to it.
start_etcd() {
  command -v etcd >/dev/null || die "--etcd needs etcd (Debian package etcd-server; deploy/install-deps.sh)"
  local client peer scheme=http tls=() etcdctl_tls=()
  client="$(free_port)" peer="$(free_port)"
  if [[ -n "$tls_dir" ]]; then
    # Under --tls etcd serves https:// only and wants the cluster's client
    # certificate; every process gets the --etcd_*_file flags.
    scheme=https
    tls=(--cert-file "$tls_dir/node.crt" --key-file "$tls_dir/node.key"
      --trusted-ca-file "$tls_dir/ca.crt" --client-cert-auth)
    etcdctl_tls=(--cacert "$tls_dir/ca.crt" --cert "$tls_dir/node.crt" --key "$tls_dir/node.key")
    mtls_args+=" --etcd_cert_file=$tls_dir/node.crt --etcd_key_file=$tls_dir/node.key --etcd_ca_file=$tls_dir/ca.crt"
  fi
  rm -rf "$dir/etcd.data"
  etcd --name pdserve --data-dir "$dir/etcd.data" \
    --listen-client-urls "$scheme://127.0.0.1:$client" --advertise-client-urls "$scheme://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "pdserve=http://127.0.0.1:$peer" "${tls[@]}" >"$dir/etcd.log" 2>&1 &
  echo $! >"$dir/etcd.pid"
  printf %s "$client" >"$dir/etcd.port"
  etcd="$scheme://127.0.0.1:$client"
  for _ in $(seq 1 100); do
    ETCDCTL_API=3 etcdctl --endpoints="$etcd" "${etcdctl_tls[@]}" endpoint health >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "etcd did not come up; see $dir/etcd.log"
}

# Starts worker NAME of ROLE with the flags of its role.
start_worker() {  # start_worker ROLE NAME
  local etcd_flags=()
  [[ -z "$etcd" ]] || etcd_flags=(--etcd="$etcd")
  if [[ "$1" == decode ]]; then
    # shellcheck disable=SC2086
    start "$2" "$bin/decode_worker/pd-decode" --listen=127.0.0.1:0 --worker_id="$2" \
      --metrics_listen=127.0.0.1:0 --metrics_port_file="$dir/$2.metrics_port" \
      --model="$model" "${etcd_flags[@]}" $mtls_args $decode_args
  else
    # shellcheck disable=SC2086
    start "$2" "$bin/prefill_worker/pd-prefill" --listen=127.0.0.1:0 \
      --metrics_listen=127.0.0.1:0 --metrics_port_file="$dir/$2.metrics_port" \
      --worker_id="$2" --model="$model" "${etcd_flags[@]}" $mtls_args $prefill_args
  fi
}

add() {
  [[ -f "$dir/cluster.env" ]] || die "no cluster in $dir (run up first)"
  [[ "$role" == decode || "$role" == prefill ]] || die "--role must be decode or prefill"
  [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "--name must be a worker id (letters, digits, . _ -)"
  [[ ! -e "$dir/$name.pid" ]] || die "$name exists already in $dir"
  # shellcheck disable=SC1091
  source "$dir/cluster.env"
  start_worker "$role" "$name"
  wait_port "$name"
  echo "started $role worker $name at 127.0.0.1:$(cat "$dir/$name.port")${etcd:+ (registered in etcd $etcd)}"
}

up() {
  for b in pd-router pd-prefill pd-decode; do
    [[ -x "$bin/$(dirname_of "$b")/$b" ]] || die "$bin/$(dirname_of "$b")/$b is missing; build first"
  done
  [[ "$decode" -ge 1 ]] || die "--decode must be at least 1"
  if [[ -n "$cpu_share" ]]; then
    "$root/deploy/local/cpu_share.sh" how >/dev/null || die "--cpu-share needs a cgroup cpu controller (see above)"
  fi
  mkdir -p "$dir"
  down  # A cluster left over in this directory.
  local mtls_args="" router_tls_args="" pdctl_tls_args="" scheme=http
  if [[ -n "$tls_dir" ]]; then
    make_certificates "$tls_dir"
    tls_dir="$(cd "$tls_dir" && pwd)"
    mtls_args="--mtls_cert_file=$tls_dir/node.crt --mtls_key_file=$tls_dir/node.key --mtls_ca_file=$tls_dir/ca.crt"
    router_tls_args="--tls_cert_file=$tls_dir/node.crt --tls_key_file=$tls_dir/node.key"
    pdctl_tls_args="--tls_root_certs=$tls_dir/ca.crt"
    scheme=https
  fi
  [[ "$etcd" != local ]] || start_etcd
  # What `add` needs to start more workers like these.
  declare -p bin model prefill_args decode_args etcd cpu_share mtls_args >"$dir/cluster.env"
  local workers=()
  for ((i = 0; i < decode; i++)); do
    start_worker decode "decode-$i"
    workers+=("decode-$i")
  done
  for ((i = 0; i < prefill; i++)); do
    start_worker prefill "prefill-$i"
    workers+=("prefill-$i")
  done
  for w in "${workers[@]}"; do wait_port "$w"; done

  local json_list
  json_list() {  # json_list ROLE COUNT
    local sep="" out=""
    for ((i = 0; i < $2; i++)); do
      out+="$sep{\"id\": \"$1-$i\", \"address\": \"127.0.0.1:$(cat "$dir/$1-$i.port")\"}"
      sep=", "
    done
    echo "[$out]"
  }
  if [[ -n "$routing_policy" ]]; then
    [[ -z "$routing" ]] || die "give --routing or --routing-policy, not both"
    routing="{\"policy\": \"$routing_policy\"}"
  fi
  routing_entry=""
  [ -z "$routing" ] || routing_entry=",
  \"routing\": $routing"
  local router_etcd=()
  if [[ -n "$etcd" ]]; then
    # The workers are in etcd; the config gives the model and the routing.
    cat >"$dir/cluster.json" <<JSON
{
  "model": "$model"$routing_entry
}
JSON
    router_etcd=(--etcd="$etcd")
  else
    cat >"$dir/cluster.json" <<JSON
{
  "model": "$model",
  "prefill_workers": $(json_list prefill "$prefill"),
  "decode_workers": $(json_list decode "$decode")$routing_entry
}
JSON
  fi
  # shellcheck disable=SC2086
  rm -f "$dir/router.http_port"
  start router "$bin/router/pd-router" --listen="127.0.0.1:$router_port" \
    --http_listen="127.0.0.1:$http_port" --http_port_file="$dir/router.http_port" \
    --config="$dir/cluster.json" "${router_etcd[@]}" $mtls_args $router_tls_args $router_args
  wait_port router
  if [[ -s "$dir/router.http_port" ]]; then cp "$dir/router.http_port" "$dir/router.metrics_port"; fi
  # Every process's /metrics, for Prometheus's file_sd_configs.
  local targets="" sep="" w
  for w in router "${workers[@]}"; do
    [[ -s "$dir/$w.metrics_port" ]] || continue
    # Under --tls the router's /metrics is on its HTTPS port (the workers'
    # stay plaintext): Prometheus needs tls_config.ca_file for it.
    local scheme_label=""
    [[ -n "$tls_dir" && "$w" == router ]] && scheme_label=", \"__scheme__\": \"https\""
    targets+="$sep{\"targets\": [\"127.0.0.1:$(cat "$dir/$w.metrics_port")\"], \"labels\": {\"process\": \"$w\"$scheme_label}}"
    sep=", "
  done
  echo "[$targets]" >"$dir/prometheus_targets.json"

  # Healthy: the router sees every worker.
  local want="prefill_workers: $prefill decode_workers: $decode" status=""
  for _ in $(seq 1 300); do
    # shellcheck disable=SC2086
    status="$("$bin/client/pdctl" status --server="127.0.0.1:$(cat "$dir/router.port")" $pdctl_tls_args 2>&1 || true)"
    if grep -q "serving: true" <<<"$status" && grep -q "$want" <<<"$status"; then
      echo "cluster up: router 127.0.0.1:$(cat "$dir/router.port") (gRPC${tls_dir:+ over TLS}), $scheme://127.0.0.1:$(cat "$dir/router.http_port") (OpenAI API), $prefill prefill, $decode decode, model $model (logs in $dir)"
      return 0
    fi
    sleep 0.1
  done
  down
  die "cluster not healthy within 30 s; last status: $status"
}

dirname_of() {
  case "$1" in
    pd-router) echo router ;;
    pd-prefill) echo prefill_worker ;;
    pd-decode) echo decode_worker ;;
  esac
}

case "$cmd" in
  up) up ;;
  down) down ;;
  add) add ;;
  run)
    up
    trap 'down; exit 0' INT TERM
    echo "Ctrl-C stops the cluster."
    while true; do sleep 1; done
    ;;
  *) sed -n '2,60p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
