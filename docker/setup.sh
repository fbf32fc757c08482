#!/usr/bin/env bash
# Idempotent set-up shared by run-local.sh and test.sh (sourced): system packages, the RocketMQ jars, and a
# build cache under $HOME so a fresh clone does not rebuild rocksdb and the RocketMQ client from scratch.
set -euo pipefail

need_apt=()
dpkg -s libclang-dev >/dev/null 2>&1 || need_apt+=(libclang-dev clang)   # bindgen for rocksdb
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || need_apt+=(maven)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)                # promtool checks /metrics in it/
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)                      # the TLS test's certificates
[ -x /usr/sbin/haproxy ] || command -v haproxy >/dev/null 2>&1 || need_apt+=(haproxy) # the tier test's balancer
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv) # schemathesis, below
if ((${#need_apt[@]})); then
  echo "setup: installing ${need_apt[*]}" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/popgate/target}"
ROCKETMQ_JARS_DIR="$("$repo_root/docker/rocketmq/rocketmq.sh" jars)"
export ROCKETMQ_JARS_DIR

# Schemathesis (PyPI) fuzzes the running API from its /openapi.json in it/; pinned, in a venv under $HOME.
SCHEMATHESIS_VERSION=4.32.5
SCHEMATHESIS="$HOME/.cache/popgate/venv/bin/schemathesis"
if ! "$SCHEMATHESIS" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
  echo "setup: installing schemathesis $SCHEMATHESIS_VERSION" >&2
  python3 -m venv "$HOME/.cache/popgate/venv" >&2
  "$HOME/.cache/popgate/venv/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION" >&2
fi
export SCHEMATHESIS

# kubernetes-validate (PyPI, with the Kubernetes JSON schemas inside) checks docker/k8s/ in it/config.rs.
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBERNETES_VALIDATE="$HOME/.cache/popgate/venv/bin/kubernetes-validate"
# (grep without -q reads all of pip's output: with pipefail, an early exit would fail pip with SIGPIPE.)
if ! "$HOME/.cache/popgate/venv/bin/pip" show kubernetes-validate 2>/dev/null | grep "^Version: $KUBERNETES_VALIDATE_VERSION$" >/dev/null; then
  echo "setup: installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION" >&2
  "$HOME/.cache/popgate/venv/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" >&2
fi
export KUBERNETES_VALIDATE
