#!/usr/bin/env bash
# Builds the pdserve container image (deploy/container/Containerfile) from a
# build directory's binaries.
#
#   deploy/container/build.sh [--bin DIR] [--tag TAG] [--model DIR]... [--base REF]
#   deploy/container/build.sh --base-only   make the default base if absent, print its name
#
#   --bin DIR    build directory with the binaries (default: build)
#   --tag TAG    image name (default: localhost/pdserve:latest)
#   --model DIR  a model directory (Hugging Face layout) to put in the image
#                as /opt/pdserve/models/<basename DIR>; repeatable; default:
#                none (the image serves builtin:tiny or a mounted model)
#   --base REF   base image (e.g. docker.io/library/debian:bookworm-slim where
#                a registry is reachable). Default: a Debian bookworm minbase
#                made here with mmdebstrap from this machine's apt mirrors and
#                imported as localhost/pdserve-base:bookworm-YYYYMMDD (kept in
#                podman's storage, so made at most once a day)
#
# Environment: PODMAN, the podman command with its global options (default
# "podman"); PODMAN_BUILD_ARGS, extra arguments of `podman build` (e.g.
# "--runtime runc --ulimit nofile=1024:1024"). Prints the image id last.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$root/build" tag=localhost/pdserve:latest base="" models=() base_only=0
while (($#)); do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --model) models+=("$2"); shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --base-only) base_only=1; shift ;;
    *) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
read -r -a podman <<<"${PODMAN:-podman}"
read -r -a build_args <<<"${PODMAN_BUILD_ARGS:-}"
die() { echo "build.sh: $*" >&2; exit 1; }

# This machine's apt sources for bookworm as one-line entries, so that the
# base comes from the mirror the host already reaches (apt has parsed both
# sources.list and deb822 .sources files by then).
bookworm_sources() {
  apt-get indextargets --format '$(TARGET_OF) $(REPO_URI) $(RELEASE) $(COMPONENT)' 2>/dev/null |
    awk '$1 == "deb" && $3 ~ /^bookworm/ { key = $2 " " $3; if (!(key in c)) order[n++] = key;
           if (index(" " c[key] " ", " " $4 " ") == 0) c[key] = c[key] " " $4 }
         END { for (i = 0; i < n; i++) print "deb " order[i] c[order[i]] }'
}

if [[ -z "$base" ]]; then
  base="localhost/pdserve-base:bookworm-$(date -u +%Y%m%d)"
  if ! "${podman[@]}" image exists "$base"; then
    command -v mmdebstrap >/dev/null || die "no base image: install mmdebstrap or pass --base"
    mapfile -t sources < <(bookworm_sources)
    echo "build.sh: making $base with mmdebstrap from: ${sources[*]:-deb.debian.org (default)}" >&2
    mmdebstrap --quiet --variant=minbase bookworm - "${sources[@]}" |
      "${podman[@]}" import - "$base" >/dev/null
  fi
fi
if ((base_only)); then echo "$base"; exit 0; fi

for b in router/pd-router prefill_worker/pd-prefill decode_worker/pd-decode client/pdctl; do
  [[ -x "$bin/$b" ]] || die "$bin/$b is missing; build it first"
done
context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
mkdir -p "$context/bin" "$context/models"
cp "$bin/router/pd-router" "$bin/prefill_worker/pd-prefill" \
   "$bin/decode_worker/pd-decode" "$bin/client/pdctl" "$context/bin/"
for m in "${models[@]}"; do
  [[ -d "$m" ]] || die "--model $m is not a directory"
  cp -r "$m" "$context/models/$(basename "$m")"
done
chmod -R a+rX "$context"
"${podman[@]}" build "${build_args[@]}" --network host --build-arg "BASE=$base" \
  -f "$root/deploy/container/Containerfile" -t "$tag" "$context" >&2
"${podman[@]}" image inspect --format '{{.Id}}' "$tag"
