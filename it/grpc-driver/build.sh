#!/usr/bin/env bash
# Builds the driver against one version of Apache's Java SDK (rocketmq-client-java) into
# $HOME/.cache/popgate/grpc-driver/<version>/popgate-grpc-driver.jar (never inside the repository), only when it is
# missing or pom.xml / src/ changed since its last build (content hash, not mtimes, so a fresh checkout with an
# existing jar is not rebuilt needlessly), then prints the jar's absolute path on stdout. Maven's output goes to
# stderr. Idempotent; safe to call from every test run.
#
#   ./build.sh [VERSION]          build if needed (VERSION defaults to the newest tested, 5.2.0), print the jar path
#   ./build.sh --force [VERSION]  always rebuild
#
# Env: MVN (default mvn), MVN_NICE (default 10; the machine is shared with long-running tests).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../driver-common/cached-build.sh
source "$here/../driver-common/cached-build.sh"
force=""
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
version="${1:-5.2.0}"
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "build.sh: not an SDK version: $version" >&2; exit 2; }
out="${SDK_DRIVER_DIR:-$HOME/.cache/popgate/grpc-driver}/$version"
mkdir -p "$out"
jar="$out/popgate-grpc-driver.jar"
stamp="$out/.popgate-grpc-driver.inputs.sha256"

inputs_hash() {
  (cd "$here" && echo "sdk $version" && { echo pom.xml; find src ../driver-common/src -type f | LC_ALL=C sort; } |
    file_hashes) | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
reuse_or_lock "$jar" "$stamp" "$want" "$force"
start=$(date +%s)
nice -n "${MVN_NICE:-10}" "${MVN:-mvn}" -q -B -Dstyle.color=never -Ddriver.buildDir="$out" \
  -Drocketmq.client.version="$version" -f "$here/pom.xml" package >&2
[[ -f "$jar" ]] || { echo "build.sh: maven succeeded but $jar is missing" >&2; exit 1; }
echo "$want" > "$stamp"
echo "build.sh: built $jar in $(( $(date +%s) - start )) s" >&2
echo "$jar"
