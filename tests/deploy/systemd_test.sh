#!/usr/bin/env bash
# deploy/systemd: `systemd-analyze verify` on every unit (any complaint
# fails, but that the binaries are not installed in /usr/local/bin on this
# machine), then checks that the example environment files give only real
# flags of this build's binaries (check_deploy_flags.py).
#
#   tests/deploy/systemd_test.sh BUILD_DIR
#
# Exit 77 (skipped) when systemd-analyze or PyYAML is missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:?usage: systemd_test.sh BUILD_DIR}"
units="$root/deploy/systemd"

command -v systemd-analyze >/dev/null ||
  { echo "SKIPPED: systemd-analyze is not installed" >&2; exit 77; }
python3 -c 'import yaml' 2>/dev/null || { echo "SKIPPED: PyYAML is not installed" >&2; exit 77; }

complaints="$(systemd-analyze verify "$units"/*.service 2>&1 |
  grep -Ev '^pdserve-[a-z@]+\.service: Command /usr/local/bin/pd-(router|prefill|decode) is not executable: No such file or directory$' || true)"
if [[ -n "$complaints" ]]; then
  echo "FAILED: systemd-analyze verify:" >&2
  echo "$complaints" >&2
  exit 1
fi
echo "systemd-analyze verify: $(ls "$units"/*.service | wc -l) units, no complaints"
exec python3 "$root/tests/deploy/check_deploy_flags.py" --bin "$bin" --systemd "$units"
