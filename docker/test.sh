#!/usr/bin/env bash
# Runs every check and test: formatting, clippy, unit tests, and the it/ suite against a real Apache RocketMQ
# (name servers and brokers are started and stopped by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/setup.sh
# The gRPC tests drive Apache's Java SDK through it/grpc-driver, built once here (Maven Central, cached under
# $HOME, rebuilt only when its sources change) rather than by the first test that needs it. The variable is not
# named POPGATE_*: popgate reads every POPGATE_* variable as config.
SDK_DRIVER_JAR="$(it/grpc-driver/build.sh)"
export SDK_DRIVER_JAR
# The bench's smoke run (part of --all-targets) also starts Apache's own gRPC proxy: fetch its jars up front.
docker/rocketmq/rocketmq.sh proxy-jars >/dev/null
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --all-targets --locked -- --test-threads="${TEST_THREADS:-4}"
