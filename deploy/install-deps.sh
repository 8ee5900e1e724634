#!/usr/bin/env bash
# Installs every build and test dependency of pdserve by package name.
# Idempotent: packages already present are left as they are.
#
#   deploy/install-deps.sh            build + test dependencies (Debian packages,
#                                     and the PyPI tools of the Python tests)
#   deploy/install-deps.sh --fixtures also the PyPI tools that regenerate test
#                                     fixtures (torch, transformers, tokenizers)
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libabsl-dev            # Status/StatusOr, flags, strings, synchronization
  nlohmann-json3-dev     # config.json, tokenizer.json, safetensors headers
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler  # RPC
  libgtest-dev libgmock-dev googletest  # unit tests
  libucx-dev             # kv_transfer "ucx" transport (built when found)
  libisal-dev            # ISA-L: the tcp transport's frame checksum (CRC-32C)
  libboost-dev           # Boost.Beast/Asio: the router's HTTP server
  libssl-dev             # OpenSSL: TLS certificates (common/tls.h) and HTTPS (Asio SSL)
  openssl curl           # the TLS tests make certificates with openssl and speak HTTPS with curl;
                         # cluster.sh --tls makes a local CA with openssl; curl also reaches
                         # the containers' HTTP API in tests/deploy/container_test.sh
  libcpp-httplib-dev     # pd-http-bench only: the HTTP library Beast was measured against
  clang libclang-rt-dev  # the libFuzzer targets (tests/fuzz): clang and its fuzzer runtime
  prometheus             # promtool and the server: the /metrics tests (tests/common, tests/metrics)
  etcd-server etcd-client  # discovery: the etcd tests, cluster.sh --etcd (etcdctl checks its health)
  iproute2               # ip netns, veth, bridge, tc: the multi-host and network-fault tests
  python3
  podman buildah runc    # the container image and its test (deploy/container, tests/deploy);
                         # runc: crun refuses hybrid cgroup v1/v2 hosts
  mmdebstrap             # the image's Debian base where no registry is reachable
  systemd                # systemd-analyze: ctest systemd_units_test (deploy/systemd)
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
    || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi

# --- PyPI: the Python test tools --------------------------------------------
# For the python3 on PATH (a pyenv Python on the development machines and
# CI): the Python SDK's pytest suite (ctest python_sdk, client/python/tests),
# which builds the SDK with grpcio-tools and setuptools into a fresh
# temporary directory on every run (the SDK itself is not installed here),
# the OpenAI-compatible HTTP API's tests (openai), and pd-bench's plots and
# its cross-check against AIPerf.
PYPI_TEST_PACKAGES=(
  grpcio grpcio-tools protobuf  # the SDK's runtime and its stub generator
  setuptools                    # builds client/python (pyproject + setup.py)
  pytest                        # the runner
  openai                        # the official client, against /v1 of pd-router
  aiperf                        # NVIDIA's load generator: pd-bench's cross-check
                                # (ctest pd_bench_aiperf_crosscheck; brings
                                # tokenizers and transformers)
  matplotlib                    # pd-bench --plot_dir (planner/plot_bench.py)
  kubernetes-validate           # deploy/k8s against the Kubernetes schemas
                                # (ctest k8s_manifests_test; brings PyYAML;
                                # kubectl itself is not a bookworm package)
)
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  "${PYPI_TEST_PACKAGES[@]}"
# ------------------------------------------------------------------------------

if [[ "${1:-}" == "--fixtures" ]]; then
  # Only needed to regenerate tests/fixtures; the tests read committed files.
  python3 -m pip install --quiet torch transformers tokenizers safetensors sentencepiece protobuf numpy gguf
fi
