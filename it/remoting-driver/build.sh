#!/usr/bin/env bash
# Builds the remoting driver against one version of Apache's remoting Java client (org.apache.rocketmq:rocketmq-client)
# into $HOME/.cache/popgate/remoting-driver/<version>/popgate-remoting-driver.jar (never inside the repository), only
# when it is missing or pom.xml / src/ changed since its last build (content hash, not mtimes, so a fresh checkout
# with an existing jar is not rebuilt needlessly), then prints the jar's absolute path on stdout. Maven's output goes
# to stderr. Idempotent; safe to call from every test run, also concurrently (one build per version at a time).
#
#   ./build.sh [VERSION]          build if needed (VERSION defaults to 5.4.0; 4.9.8, 4.9.3, ... work too), print the jar
#   ./build.sh --force [VERSION]  always rebuild
#
# Env: MVN (default mvn), MVN_NICE (default 10; the machine is shared with long-running tests),
#      REMOTING_DRIVER_DIR (default $HOME/.cache/popgate/remoting-driver).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../driver-common/cached-build.sh
source "$here/../driver-common/cached-build.sh"
force=""
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
version="${1:-5.4.0}"
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "build.sh: not a client version: $version" >&2; exit 2; }
out="${REMOTING_DRIVER_DIR:-$HOME/.cache/popgate/remoting-driver}/$version"
mkdir -p "$out"
jar="$out/popgate-remoting-driver.jar"
stamp="$out/.popgate-remoting-driver.inputs.sha256"

# AclClientRPCHook is in the separate artifact rocketmq-acl before 5.4.0 (not published for 5.4.0: rocketmq-client
# itself carries org.apache.rocketmq.acl.common from then on).
acl_separate=false
if [[ "$(printf '%s\n%s\n' "$version" 5.4.0 | sort -V | head -n1)" != "5.4.0" ]]; then acl_separate=true; fi

inputs_hash() {
  (cd "$here" && echo "client $version acl-separate $acl_separate" &&
    { echo build.sh; echo pom.xml; find src ../driver-common/src -type f | LC_ALL=C sort; } | file_hashes) |
    sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
reuse_or_lock "$jar" "$stamp" "$want" "$force"
start=$(date +%s)
nice -n "${MVN_NICE:-10}" "${MVN:-mvn}" -q -B -Dstyle.color=never -Ddriver.buildDir="$out" \
  -Drocketmq.client.version="$version" -Drocketmq.acl.separate="$acl_separate" -f "$here/pom.xml" package >&2
[[ -f "$jar" ]] || { echo "build.sh: maven succeeded but $jar is missing" >&2; exit 1; }
echo "$want" > "$stamp"
echo "build.sh: built $jar in $(( $(date +%s) - start )) s" >&2
echo "$jar"
