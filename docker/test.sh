#!/usr/bin/env bash
# Runs every check and test: formatting, clippy, unit tests, and the it/ suite against a real Apache RocketMQ
# (name servers and brokers are started and stopped by the tests themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
source docker/setup.sh
# The gRPC tests drive Apache's Java SDK, the oldest 5.0.x that resolves here and the newest, through
# it/grpc-driver: built against both once here (Maven Central, cached under $HOME, rebuilt only when its sources
# change) rather than by the first tests that need them.
for sdk_version in 5.0.3 5.2.0; do
  it/grpc-driver/build.sh "$sdk_version" >/dev/null
done
# The remoting tests drive Apache's remoting Java client (rocketmq-client) through it/remoting-driver, built the
# same way: 4.9.3 (before clients named their broker), 4.9.8, 5.1.0 (the oldest whose POP consumer popgate
# serves) and the newest 5.x.
for client_version in 4.9.3 4.9.8 5.1.0 5.4.0; do
  it/remoting-driver/build.sh "$client_version" >/dev/null
done
# it/go_client.rs drives Apache's Go client (rocketmq-client-go) through it/go-driver, built the same way (modules
# from the Go module proxy, the binary cached under $HOME).
it/go-driver/build.sh >/dev/null
# The bench's smoke run (part of --all-targets) also starts Apache's own gRPC proxy: fetch its jars up front.
docker/rocketmq/rocketmq.sh proxy-jars >/dev/null
cargo fmt --check
cargo clippy --all-targets --locked -- -D warnings
test_output="$(mktemp)"
if ! cargo test --all-targets --locked -- --test-threads="${TEST_THREADS:-4}" 2>&1 | tee "$test_output"; then
  # CI keeps only the end of the output, where popgate's logs of the last failed test fill the view: each
  # failure's panic message is repeated here, last.
  echo "=== the failures' panic messages (repeated from above) ==="
  grep -A6 "panicked at" "$test_output" | cut -c1-800
  exit 101
fi
