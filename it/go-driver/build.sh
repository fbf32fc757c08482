#!/usr/bin/env bash
# Builds the Go driver (Apache's Go RocketMQ client, github.com/apache/rocketmq-client-go/v2, at the version go.mod
# pins) into $HOME/.cache/popgate/go-driver/go-driver (never inside the repository), only when it is missing or
# build.sh / go.mod / go.sum / *.go changed since its last build (content hash, not mtimes), then prints the binary's
# absolute path on stdout. go's output goes to stderr. Idempotent; safe to call from every test run, also
# concurrently (one build at a time).
#
#   ./build.sh          build if needed, print the binary
#   ./build.sh --force  always rebuild
#
# Modules come from the Go module proxy (`go env GOPROXY`) into the module cache, checked against the committed
# go.sum; go.mod and go.sum are never rewritten (-mod=readonly): after changing the imports, run
# `go mod tidy` in it/go-driver and commit both.
#
# Env: GO (default go), GO_NICE (default 10; the machine is shared with long-running tests),
#      GO_DRIVER_DIR (default $HOME/.cache/popgate/go-driver).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../driver-common/cached-build.sh
source "$here/../driver-common/cached-build.sh"
force=""
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
out="${GO_DRIVER_DIR:-$HOME/.cache/popgate/go-driver}"
mkdir -p "$out"
bin="$out/go-driver"
stamp="$out/.go-driver.inputs.sha256"
go="${GO:-go}"

inputs_hash() {
  (cd "$here" && "$go" version &&
    { echo build.sh; echo go.mod; echo go.sum; echo ../driver-common/cached-build.sh;
      find . -maxdepth 1 -name '*.go' | LC_ALL=C sort; } | file_hashes) | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
reuse_or_lock "$bin" "$stamp" "$want" "$force"
start=$(date +%s)
# Built next to the old binary, then renamed over it: a driver still running keeps its file.
(cd "$here" && GOFLAGS="${GOFLAGS:-} -mod=readonly" nice -n "${GO_NICE:-10}" "$go" build -trimpath -o "$bin.new" .) >&2
mv -f "$bin.new" "$bin"
echo "$want" > "$stamp"
echo "build.sh: built $bin in $(( $(date +%s) - start )) s" >&2
echo "$bin"
