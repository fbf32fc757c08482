#!/usr/bin/env bash
# Apache RocketMQ 5.x for popgate, from Maven Central, run with `java -cp` on 127.0.0.1.
#
#   rocketmq.sh jars                 fetch the name server + broker jars once (cached under $HOME), print the lib dir
#   rocketmq.sh proxy-jars           the same plus Apache's gRPC proxy (rocketmq-proxy), for the benchmark only
#   rocketmq.sh start [PROFILE]      start a local name server (9876) and broker-a (10911) unless one answers already;
#                                    PROFILE (profiles/*.conf, default balanced) sets flush and replication, and a
#                                    SYNC_MASTER profile also gets its slave (10921), or no send could be stored
#   rocketmq.sh stop                 stop what `start` started
#
# Idempotent: a second `jars` reuses the cache; `start` does nothing when port 9876 already answers.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version="$(sed -n 's:.*<rocketmq.version>\(.*\)</rocketmq.version>.*:\1:p' "$here/pom.xml")"
cache="${ROCKETMQ_CACHE_DIR:-$HOME/.cache/popgate}"
lib="$cache/rocketmq-$version/lib"
local_dir="$cache/local-rocketmq"

jars() {
  if [[ ! -f "$lib/.complete" ]]; then
    mkdir -p "$lib"
    mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies -DoutputDirectory="$lib" >&2
    touch "$lib/.complete"
  fi
  echo "$lib"
}

# Apache's proxy in a lib dir of its own: its dependencies (gRPC, netty-tcnative, ...) never reach the
# classpath the tests run the name server and broker with.
proxy_jars() {
  local proxy_lib="$cache/rocketmq-$version/proxy-lib"
  if [[ ! -f "$proxy_lib/.complete" ]]; then
    mkdir -p "$proxy_lib"
    mvn -q -B -Pproxy -f "$here/pom.xml" dependency:copy-dependencies -DoutputDirectory="$proxy_lib" >&2
    touch "$proxy_lib/.complete"
  fi
  echo "$proxy_lib"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 120); do port_open "$1" && return 0; sleep 0.5; done
  echo "rocketmq.sh: nothing listens on $1 after 60 s; see $2" >&2
  return 1
}

start() {
  local profile="${1:-balanced}"
  if port_open 9876; then
    echo "rocketmq.sh: a name server already answers on 127.0.0.1:9876; using it" >&2
    return 0
  fi
  jars >/dev/null
  mkdir -p "$local_dir/namesrv"
  printf 'listenPort=9876\nbindAddress=127.0.0.1\n' > "$local_dir/namesrv/namesrv.conf"
  [[ -f "$here/profiles/$profile.conf" ]] || { echo "rocketmq.sh: no profile $profile in $here/profiles" >&2; exit 2; }
  broker_conf broker-a 0 10911 "$(cat "$here/profiles/$profile.conf")"
  run_java "$local_dir/namesrv" 256 org.apache.rocketmq.namesrv.NamesrvStartup -c "$local_dir/namesrv/namesrv.conf"
  wait_port 9876 "$local_dir/namesrv/console.log"
  run_java "$local_dir/broker-a" 512 org.apache.rocketmq.broker.BrokerStartup -c "$local_dir/broker-a/broker.conf"
  wait_port 10911 "$local_dir/broker-a/console.log"
  if grep -q '^brokerRole=SYNC_MASTER' "$here/profiles/$profile.conf"; then
    broker_conf broker-a-s 1 10921 "$(grep '^flushDiskType' "$here/profiles/$profile.conf")
brokerRole=SLAVE"
    run_java "$local_dir/broker-a-s" 512 org.apache.rocketmq.broker.BrokerStartup -c "$local_dir/broker-a-s/broker.conf"
    wait_port 10921 "$local_dir/broker-a-s/console.log"
  fi
  echo "rocketmq.sh: name server 127.0.0.1:9876, broker-a 127.0.0.1:10911 ($profile); logs in $local_dir" >&2
}

# broker_conf DIR ID PORT EXTRA: writes $local_dir/DIR/broker.conf for brokerName broker-a.
broker_conf() {
  local dir="$1" id="$2" port="$3" extra="$4"
  mkdir -p "$local_dir/$dir"
  {
    cat "$here/broker-common.conf"
    printf '%s\n' "$extra"
    printf 'brokerName=broker-a\nbrokerId=%s\nlistenPort=%s\nnamesrvAddr=127.0.0.1:9876\n' "$id" "$port"
    printf 'storePathRootDir=%s\nstorePathCommitLog=%s/commitlog\n' "$local_dir/$dir/store" "$local_dir/$dir/store"
  } > "$local_dir/$dir/broker.conf"
}

run_java() {
  local home="$1" heap="$2"; shift 2
  (cd "$home" && nohup java "-Xms${heap}m" "-Xmx${heap}m" -XX:MaxDirectMemorySize=256m -XX:+UseSerialGC \
      "-Drocketmq.home.dir=$home/" "-Duser.home=$home" "-Djava.io.tmpdir=$home" -cp "$lib/*" "$@" \
      > "$home/console.log" 2>&1 &)
}

stop() {
  # Every process `start` launched carries -Drocketmq.home.dir=$local_dir/...: find them by that, not by pid files.
  local pattern="rocketmq.home.dir=$local_dir/"
  pkill -TERM -f "$pattern" 2>/dev/null || return 0
  for _ in $(seq 1 30); do pgrep -f "$pattern" >/dev/null || return 0; sleep 0.5; done
  pkill -KILL -f "$pattern" 2>/dev/null || true
}

case "${1:-}" in
  jars) jars ;;
  proxy-jars) proxy_jars ;;
  start) start "${2:-balanced}" ;;
  stop) stop ;;
  *) echo "usage: rocketmq.sh jars|proxy-jars|start [profile]|stop" >&2; exit 2 ;;
esac
