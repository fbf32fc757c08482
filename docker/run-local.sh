#!/usr/bin/env bash
# Runs popgate in front of a real RocketMQ. With POPGATE_BROKER__NAMESRV_ADDR unset (and no name server on
# 127.0.0.1:9876), it first fetches and starts a local Apache RocketMQ name server + broker.
# Extra arguments go to `popgate serve` (e.g. --config my.toml; default: the annotated popgate.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/setup.sh
# One word, both sides: the local broker's flush/replication and popgate's reliability profile.
profile="${ROCKETMQ_PROFILE:-balanced}"
export POPGATE_RELIABILITY__PROFILE="${POPGATE_RELIABILITY__PROFILE:-$profile}"
if [[ -z "${POPGATE_BROKER__NAMESRV_ADDR:-}" ]]; then
  docker/rocketmq/rocketmq.sh start "$profile"
fi
args=("$@")
((${#args[@]})) || args=(--config popgate.toml)
# Built exactly as the test command builds it (same features, same cache), so the two never rebuild each other.
cargo build --locked --all-targets
exec "$CARGO_TARGET_DIR/debug/popgate" serve "${args[@]}"
