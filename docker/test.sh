#!/usr/bin/env bash
# Runs every check and test: formatting, clippy, unit tests, and the it/ suite against a real Apache RocketMQ
# (name servers and brokers are started and stopped by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/setup.sh
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --all-targets --locked -- --test-threads="${TEST_THREADS:-4}"
