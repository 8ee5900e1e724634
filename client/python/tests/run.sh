#!/usr/bin/env bash
# The Python SDK's pytest suite, as ctest runs it (test python_sdk):
#   PDSERVE_BUILD_DIR=build client/python/tests/run.sh [pytest args]
# Exits 77 (ctest: skipped) only when the Python test tools are missing;
# deploy/install-deps.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/../../.."
if ! python3 -c "import grpc, grpc_tools, google.protobuf, pytest, setuptools" 2>/dev/null; then
  echo "python_sdk: skipped: grpcio, grpcio-tools, protobuf, pytest or setuptools missing" \
       "for $(command -v python3) (deploy/install-deps.sh installs them)"
  exit 77
fi
# -p no:cacheprovider: no .pytest_cache in the checkout, nothing kept
# between runs.
exec python3 -m pytest -p no:cacheprovider -q client/python/tests "$@"
