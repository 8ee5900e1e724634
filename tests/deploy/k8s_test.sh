#!/usr/bin/env bash
# deploy/k8s: renders the kustomize base and every overlay with `kubectl
# kustomize`, validates each document strictly (unknown fields fail) against
# the Kubernetes 1.30 schemas with kubernetes-validate (PyPI), and checks
# that every pdserve command line names real flags of this build's binaries
# (check_deploy_flags.py).
#
#   tests/deploy/k8s_test.sh BUILD_DIR
#
# Exit 77 (skipped) when kubectl, kubernetes-validate or PyYAML is missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:?usage: k8s_test.sh BUILD_DIR}"
k8s_version=1.30.0

command -v kubectl >/dev/null || { echo "SKIPPED: kubectl is not installed" >&2; exit 77; }
command -v kubernetes-validate >/dev/null ||
  { echo "SKIPPED: kubernetes-validate is not installed (deploy/install-deps.sh)" >&2; exit 77; }
python3 -c 'import yaml' 2>/dev/null || { echo "SKIPPED: PyYAML is not installed" >&2; exit 77; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rendered=()
for dir in "$root/deploy/k8s/base" "$root"/deploy/k8s/overlays/*/; do
  name="$(basename "$dir")"
  out="$work/$name.yaml"
  kubectl kustomize "$dir" >"$out"
  echo "== $name: $(grep -c '^kind:' "$out") documents"
  kubernetes-validate --strict --quiet --kubernetes-version "$k8s_version" "$out"
  rendered+=(--k8s "$out")
done
exec python3 "$root/tests/deploy/check_deploy_flags.py" --bin "$bin" "${rendered[@]}"
