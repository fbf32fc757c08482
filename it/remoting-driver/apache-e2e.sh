#!/usr/bin/env bash
# Runs Apache's remoting e2e suite (apache/rocketmq-e2e, module java/e2e-v4) with one remoting client version,
# straight at a cluster's name server or through popgate's remoting front, and prints one line per test.
#
#   apache-e2e.sh SRC VERSION NAMESRV [ADMIN_NAMESRV] [TEST]
#
# SRC: a checkout of apache/rocketmq-e2e (this script fetches nothing); it is copied to
#      $HOME/.cache/popgate/apache-e2e/<VERSION> and patched there, never in place.
# VERSION: the rocketmq-client version (4.9.3, the suite's own, or 5.4.0).
# NAMESRV: the address every client of the suite is given (the name server, or popgate's remoting front).
# ADMIN_NAMESRV: where the suite creates its topics (default NAMESRV). popgate serves no admin request
#      (`UPDATE_AND_CREATE_TOPIC`, `GET_TOPIC_STATS_INFO`), as Apache's proxy serves none: through popgate give
#      the cluster's name server here, as an operator creates topics with mqadmin at the cluster.
# TEST: surefire's -Dtest (a class, e.g. ClusterTest); default the whole suite (89 tests run, about 7 min).
# Env: cluster (the brokers' cluster name, default DefaultCluster as the suite's config), MVN (default mvn).
#
# The patches: lombok 1.18.30 (the suite's 1.18.8 does not run on JDK 17); topics created at ADMIN_NAMESRV; for
# 5.x the classes that moved (org.apache.rocketmq.common.protocol -> remoting.protocol, ...), createTopic's
# attributes argument (empty: the topics have no message.type, as the suite's 4.x topics) and no rocketmq-acl
# artifact (5.4.0's rocketmq-client carries AclClientRPCHook).
# Output: "<class>.<test> pass|flaky|FAIL|skip" per test ("flaky": passed on surefire's one rerun), then a total;
# the surefire reports stay in the work dir. Exit status: maven's.
set -euo pipefail
src="${1:?usage: apache-e2e.sh SRC VERSION NAMESRV [ADMIN_NAMESRV] [TEST]}"
version="${2:?client version}"
namesrv="${3:?name server address}"
admin="${4:-$namesrv}"
tests="${5:-}"
work="$HOME/.cache/popgate/apache-e2e/$version"
rm -rf "$work" && mkdir -p "$work" && cp -a "$src/java/." "$work/"
cd "$work"
sed -i 's#<version>1.18.8</version>#<version>1.18.30</version>#' pom.xml
v4=e2e-v4/src/main/java/org/apache/rocketmq
sed -i 's/MQAdmin.initMQAdminExtInstance(namesrvAddr);/MQAdmin.initMQAdminExtInstance(System.getProperty("adminNamesrvAddr", namesrvAddr));/' \
  "$v4/frame/ResourceInit.java"
if [[ "$version" == 5.* ]]; then
  find e2e-v4/src -name '*.java' -exec sed -i \
    -e 's/org\.apache\.rocketmq\.common\.admin\.TopicStatsTable/org.apache.rocketmq.remoting.protocol.admin.TopicStatsTable/' \
    -e 's/org\.apache\.rocketmq\.common\.protocol\./org.apache.rocketmq.remoting.protocol./' \
    -e 's/org\.apache\.rocketmq\.common\.subscription\.SubscriptionGroupConfig/org.apache.rocketmq.remoting.protocol.subscription.SubscriptionGroupConfig/' {} +
  sed -i -e 's/mqAdminExt.createTopic(clusterName, topic, queueNum);/mqAdminExt.createTopic(clusterName, topic, queueNum, new HashMap<String, String>());/' \
    -e 's/HashMap<String, BrokerData> brokers = /java.util.Map<String, BrokerData> brokers = /' "$v4/utils/MQAdmin.java"
  python3 - e2e-v4/pom.xml <<'EOF'
import re, sys
pom = open(sys.argv[1]).read()
pom = re.sub(r'\s*<dependency>\s*<groupId>org.apache.rocketmq</groupId>\s*<artifactId>rocketmq-acl</artifactId>.*?</dependency>', '', pom, flags=re.S)
open(sys.argv[1], 'w').write(pom)
EOF
fi
rc=0
cluster="${cluster:-DefaultCluster}" "${MVN:-mvn}" -B -pl e2e-v4 -am test -Dcheckstyle.skip -Drat.skip \
  -Drocketmq.client.version="$version" -DnamesrvAddr="$namesrv" -DadminNamesrvAddr="$admin" -DfailIfNoTests=false \
  ${tests:+-Dtest="$tests"} > "$work/mvn.log" 2>&1 || rc=$?
# JUnit 5 runs the suite in parallel: surefire then writes a test's try and its rerun as separate entries, in any
# class's report, and sometimes cuts a report short; so the reports are read with patterns, every entry counted.
python3 - "$work/e2e-v4/target/surefire-reports" <<'EOF'
import glob, re, sys
seen = {}
for path in glob.glob(sys.argv[1] + "/TEST-*.xml"):
    for part in re.split(r"<testcase ", open(path, errors="replace").read())[1:]:
        m = re.match(r'name="([^"]*)" classname="([^"]*)"', part)
        if not m:
            continue
        head = part.split(">", 1)[0]
        body = "" if head.endswith("/") else part.split("</testcase>", 1)[0]
        tags = set(re.findall(r"<(skipped|failure|error|rerunFailure|rerunError|flakyFailure|flakyError)\b", body))
        outcome = ("skip" if "skipped" in tags else "fail" if tags & {"failure", "error", "rerunFailure", "rerunError"}
                   else "flaky" if tags else "pass")
        seen.setdefault(m.group(2).split(".")[-1] + "." + m.group(1), set()).add(outcome)
total = {}
for name in sorted(seen):
    o = seen[name]
    word = ("skip" if "skip" in o else "flaky" if "fail" in o and o & {"pass", "flaky"} else "FAIL" if "fail" in o
            else "flaky" if "flaky" in o else "pass")
    total[word] = total.get(word, 0) + 1
    print(name, word)
print("total:", ", ".join(f"{n} {w}" for w, n in sorted(total.items())))
EOF
echo "maven log: $work/mvn.log (exit $rc)"
exit "$rc"
