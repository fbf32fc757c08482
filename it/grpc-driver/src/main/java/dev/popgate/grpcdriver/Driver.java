package dev.popgate.grpcdriver;

import dev.popgate.driver.Args;
import dev.popgate.driver.BadArgs;
import dev.popgate.driver.Json;

import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.ExecutionException;

import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientConfigurationBuilder;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.StaticSessionCredentialsProvider;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.PushConsumer;
import org.apache.rocketmq.client.apis.consumer.PushConsumerBuilder;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.message.MessageBuilder;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;
import org.apache.rocketmq.client.apis.producer.SendReceipt;
import org.apache.rocketmq.client.apis.producer.Transaction;
import org.apache.rocketmq.client.apis.producer.TransactionChecker;
import org.apache.rocketmq.client.apis.producer.TransactionResolution;

/**
 * popgate's gRPC test driver: runs one scenario with Apache's official RocketMQ 5 Java SDK and prints one JSON
 * object on stdout. Logs (the SDK's and the driver's) go to stderr.
 *
 * <pre>
 *   java -jar popgate-grpc-driver.jar produce        '{"endpoint":"127.0.0.1:8081","topic":"T","count":3}'
 *   java -jar popgate-grpc-driver.jar simple-consume '{"endpoint":"127.0.0.1:8081","group":"G","topic":"T","expect":3}'
 *   java -jar popgate-grpc-driver.jar push-consume   '{"endpoint":"127.0.0.1:8081","group":"G","topic":"T","expect":3}'
 *   java -jar popgate-grpc-driver.jar load           '{"endpoint":"127.0.0.1:8081","group":"G","topic":"T","mode":"simple"}'
 *   java -jar popgate-grpc-driver.jar transact       '{"endpoint":"127.0.0.1:8081","topic":"T","resolution":"commit"}'
 * </pre>
 *
 * Arguments may also be given as key=value words instead of one JSON object. Exit codes: 0 the scenario ran (its
 * JSON says what happened, including per-message errors and "timedOut"); 1 the SDK client could not be built or the
 * scenario failed as a whole ({"error":...} on stdout); 2 bad usage or arguments ({"error":...} on stdout); 3 the
 * result could not be written to stdout.
 */
public final class Driver {
    private Driver() {
    }

    public static void main(String[] argv) {
        // stdout carries only the result (written to fd 1 by finish); anything else printing to System.out,
        // such as the SDK's console appender when mq.consoleAppender.enabled=true, goes to stderr.
        System.setOut(System.err);
        configureLogging();
        if (argv.length == 0 || argv[0].equals("-h") || argv[0].equals("--help") || argv[0].equals("help")) {
            System.err.println("usage: java -jar popgate-grpc-driver.jar <produce|simple-consume|push-consume|load|transact>"
                + " ['{json args}' | key=value ...]");
            Map<String, Object> usage = new LinkedHashMap<>();
            usage.put("usage", "<produce|simple-consume|push-consume|load|transact> ['{json args}' | key=value ...]");
            finish(argv.length == 0 ? error("missing scenario", null) : usage, argv.length == 0 ? 2 : 0);
            return;
        }
        String scenario = argv[0];
        Args args;
        try {
            args = Args.parse(Arrays.copyOfRange(argv, 1, argv.length));
        } catch (IllegalArgumentException e) {
            finish(error(e.getMessage(), null), 2);
            return;
        }
        Map<String, Object> result;
        int code;
        try {
            switch (scenario) {
                case "produce":
                    result = produce(args);
                    break;
                case "simple-consume":
                    result = simpleConsume(args);
                    break;
                case "push-consume":
                    result = pushConsume(args);
                    break;
                case "load":
                    result = Load.run(args);
                    break;
                case "transact":
                    result = transact(args);
                    break;
                default:
                    finish(error("unknown scenario '" + scenario + "'", null), 2);
                    return;
            }
            code = result.containsKey("error") ? 1 : 0;
        } catch (BadArgs e) {
            result = error(e.getMessage(), null);
            code = 2;
        } catch (Throwable t) {
            t.printStackTrace(System.err);
            result = error("scenario failed", t);
            code = 1;
        }
        result.put("scenario", scenario);
        finish(result, code);
    }

    /**
     * The SDK logs through a shaded logback whose config file property is renamed to
     * rocketmq.logback.configurationFile; its own rocketmq.logback.xml writes ~/logs/rocketmq/rocketmq-client.log
     * (and the console only when mq.consoleAppender.enabled=true). Point it at a stderr-only config, level warn,
     * unless the caller set these properties with -D.
     */
    private static void configureLogging() {
        if (System.getProperty("rocketmq.logback.configurationFile") == null) {
            System.setProperty("rocketmq.logback.configurationFile", "popgate-grpc-driver-logback.xml");
        }
        if (System.getProperty("rocketmq.log.level") == null) {
            System.setProperty("rocketmq.log.level", "warn");
        }
    }

    private static void finish(Map<String, Object> result, int code) {
        byte[] line = (Json.write(result) + "\n").getBytes(StandardCharsets.UTF_8);
        try {
            // Written straight to fd 1: a PrintStream would swallow a failed write.
            FileOutputStream stdout = new FileOutputStream(FileDescriptor.out);
            stdout.write(line);
            stdout.flush();
        } catch (IOException e) {
            System.err.println("popgate-grpc-driver: writing the result to stdout failed: " + e);
            code = 3;
        }
        System.err.flush();
        // The SDK leaves non-daemon threads behind (gRPC, schedulers): exit explicitly.
        Runtime.getRuntime().halt(code);
    }

    // ---------------------------------------------------------------------------------------------- scenarios

    private static Map<String, Object> produce(Args a) throws Exception {
        String endpoint = a.required("endpoint");
        String topic = a.required("topic");
        int count = a.integer("count", 1);
        String prefix = a.string("prefix", "msg");
        int startIndex = a.integer("startIndex", 0);
        String tag = a.string("tag", null);
        List<String> keys = a.list("keys");
        String messageGroup = a.string("messageGroup", null);
        // Message i gets messageGroups[i % size]: many groups, several messages each, in one producer.
        List<String> messageGroups = a.list("messageGroups");
        if (messageGroup != null && !messageGroups.isEmpty()) {
            throw new BadArgs("give either messageGroup or messageGroups, not both");
        }
        long deliveryDelayMs = a.longValue("deliveryDelayMs", 0);
        boolean async = a.bool("async", false);
        ClientConfiguration config = clientConfiguration(a, endpoint);
        a.rejectUnknown();

        ClientServiceProvider provider = ClientServiceProvider.loadService();
        Map<String, Object> out = new LinkedHashMap<>();
        long started = System.currentTimeMillis();
        out.put("startedAtMs", started);
        Producer producer;
        try {
            producer = startClient(out,
                () -> provider.newProducerBuilder().setClientConfiguration(config).setTopics(topic).build());
        } catch (Throwable t) {
            return startupFailed(out, started, "producer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);

        List<Object> sent = new ArrayList<>();
        List<Object> errors = new ArrayList<>();
        long sendStarted = System.currentTimeMillis();
        List<CompletableFuture<SendReceipt>> futures = new ArrayList<>();
        List<Long> submittedAt = new ArrayList<>();
        for (int n = 0; n < count; n++) {
            int i = startIndex + n;
            String body = prefix + "-" + i;
            MessageBuilder mb = provider.newMessageBuilder().setTopic(topic)
                .setBody(body.getBytes(StandardCharsets.UTF_8));
            if (tag != null) {
                mb.setTag(subst(tag, i));
            }
            if (!keys.isEmpty()) {
                mb.setKeys(keys.stream().map(k -> subst(k, i)).toArray(String[]::new));
            }
            if (messageGroup != null) {
                mb.setMessageGroup(subst(messageGroup, i));
            }
            if (!messageGroups.isEmpty()) {
                mb.setMessageGroup(messageGroups.get(i % messageGroups.size()));
            }
            if (deliveryDelayMs > 0) {
                mb.setDeliveryTimestamp(System.currentTimeMillis() + deliveryDelayMs);
            }
            Message message = mb.build();
            long t0 = System.currentTimeMillis();
            if (async) {
                futures.add(producer.sendAsync(message));
                submittedAt.add(t0);
                continue;
            }
            try {
                SendReceipt receipt = producer.send(message);
                sent.add(sentEntry(i, body, receipt, t0));
            } catch (Throwable t) {
                errors.add(sendError(i, body, t, t0));
            }
        }
        for (int n = 0; n < futures.size(); n++) {
            int i = startIndex + n;
            String body = prefix + "-" + i;
            try {
                sent.add(sentEntry(i, body, futures.get(n).get(), submittedAt.get(n)));
            } catch (Throwable t) {
                errors.add(sendError(i, body, t, submittedAt.get(n)));
            }
        }
        out.put("sendMs", System.currentTimeMillis() - sendStarted);
        out.put("sent", sent);
        out.put("errors", errors);
        out.put("closeMs", close(producer, 5000));
        out.put("finishedAtMs", System.currentTimeMillis());
        return out;
    }

    private static Map<String, Object> simpleConsume(Args a) throws Exception {
        String endpoint = a.required("endpoint");
        String group = a.required("group");
        String topic = a.required("topic");
        FilterExpression filter = filter(a);
        int expect = a.integer("expect", 0);
        int invisibleSeconds = a.integer("invisibleSeconds", 30);
        int awaitSeconds = a.integer("awaitSeconds", 5);
        int timeoutSeconds = a.integer("timeoutSeconds", 30);
        int maxMessageNum = a.integer("maxMessageNum", 16);
        boolean ack = a.bool("ack", true);
        // Wait this long after a receive before acking its messages (a consumer slower than its invisible time).
        long ackAfterMs = a.longValue("ackAfterMs", 0);
        Integer changeInvisibleFirst = a.has("changeInvisibleFirst") ? a.integer("changeInvisibleFirst", 0) : null;
        boolean stopOnRejection = a.bool("stopOnRejection", true);
        // `expect` counts distinct bodies, not receipts (a consumer whose ACKs may be lost sees some twice).
        boolean distinct = a.bool("distinct", false);
        // After an ACK failed (a connection cut under it), go on receiving this long for the message to come back
        // and be ACKed again: the failed ACK may or may not have landed. Bodies that did not come back are listed
        // in `ackUnconfirmed` (their ACK most likely landed; the caller checks where the messages are).
        long ackFailedGraceMs = a.integer("ackFailedGraceSeconds", 0) * 1000L;
        ClientConfiguration config = clientConfiguration(a, endpoint);
        a.rejectUnknown();

        ClientServiceProvider provider = ClientServiceProvider.loadService();
        Map<String, Object> out = new LinkedHashMap<>();
        long started = System.currentTimeMillis();
        out.put("startedAtMs", started);
        SimpleConsumer consumer;
        try {
            consumer = startClient(out, () -> provider.newSimpleConsumerBuilder().setClientConfiguration(config)
                .setConsumerGroup(group).setSubscriptionExpressions(Collections.singletonMap(topic, filter))
                .setAwaitDuration(Duration.ofSeconds(awaitSeconds)).build());
        } catch (Throwable t) {
            return startupFailed(out, started, "simple consumer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);

        List<Object> received = new ArrayList<>();
        List<Object> ackErrors = new ArrayList<>();
        List<Object> changeInvisibleErrors = new ArrayList<>();
        List<Object> receiveErrors = new ArrayList<>();
        List<Object> receiveMs = new ArrayList<>(); // how long each successful receive call took
        List<Object> receiveStartedAtMs = new ArrayList<>(); // and when it started
        long deadline = System.currentTimeMillis() + timeoutSeconds * 1000L; // from when the client is up
        int receiveCalls = 0;
        boolean stoppedOnError = false;
        Set<String> bodies = new HashSet<>();
        Map<String, Long> ackFailedAtMs = new LinkedHashMap<>(); // body -> when its last ACK failed, until one succeeds
        while (System.currentTimeMillis() < deadline
            && (expect <= 0 || (distinct ? bodies.size() : received.size()) < expect
                || awaitingReturn(ackFailedAtMs, ackFailedGraceMs))) {
            int seen = distinct ? bodies.size() : received.size();
            int want = expect > 0 ? Math.max(1, Math.min(maxMessageNum, expect - seen)) : maxMessageNum;
            List<MessageView> views;
            receiveCalls++;
            long t0 = System.currentTimeMillis();
            try {
                views = consumer.receive(want, Duration.ofSeconds(invisibleSeconds));
            } catch (Throwable t) {
                Map<String, Object> e = describe(t);
                e.put("atMs", t0);
                e.put("tookMs", System.currentTimeMillis() - t0);
                receiveErrors.add(e);
                if (stopOnRejection && isRejection(t)) {
                    // A 4xx-like answer (bad request, forbidden, not found, ...) will not change by retrying.
                    stoppedOnError = true;
                    break;
                }
                Thread.sleep(200);
                continue;
            }
            long at = System.currentTimeMillis();
            receiveMs.add(at - t0);
            receiveStartedAtMs.add(t0);
            for (MessageView view : views) {
                Map<String, Object> entry = viewEntry(view);
                entry.put("receivedAtMs", at);
                received.add(entry);
                bodies.add((String) entry.get("body"));
                if (changeInvisibleFirst != null) {
                    try {
                        consumer.changeInvisibleDuration(view, Duration.ofSeconds(changeInvisibleFirst));
                        entry.put("changedInvisible", true);
                    } catch (Throwable t) {
                        entry.put("changedInvisible", false);
                        changeInvisibleErrors.add(messageError(view, entry, t));
                    }
                }
                if (ack) {
                    if (ackAfterMs > 0) {
                        Thread.sleep(ackAfterMs);
                    }
                    try {
                        long a0 = System.currentTimeMillis();
                        entry.put("ackAtMs", a0);
                        consumer.ack(view);
                        entry.put("acked", true);
                        entry.put("ackMs", System.currentTimeMillis() - a0);
                        ackFailedAtMs.remove((String) entry.get("body"));
                    } catch (Throwable t) {
                        entry.put("acked", false);
                        ackErrors.add(messageError(view, entry, t));
                        ackFailedAtMs.put((String) entry.get("body"), System.currentTimeMillis());
                    }
                } else {
                    entry.put("acked", false);
                }
            }
        }
        out.put("receiveCalls", receiveCalls);
        out.put("received", received);
        out.put("ackErrors", ackErrors);
        out.put("ackUnconfirmed", new ArrayList<>(ackFailedAtMs.keySet()));
        out.put("changeInvisibleErrors", changeInvisibleErrors);
        out.put("receiveErrors", receiveErrors);
        out.put("receiveMs", receiveMs);
        out.put("receiveStartedAtMs", receiveStartedAtMs);
        out.put("stoppedOnError", stoppedOnError);
        out.put("timedOut", !stoppedOnError && expect > 0 && (distinct ? bodies.size() : received.size()) < expect);
        out.put("closeMs", close(consumer, 5000));
        out.put("finishedAtMs", System.currentTimeMillis());
        return out;
    }

    private static Map<String, Object> pushConsume(Args a) throws Exception {
        String endpoint = a.required("endpoint");
        String group = a.required("group");
        String topic = a.required("topic");
        FilterExpression filter = filter(a);
        int expect = a.integer("expect", 0);
        int expectSuccess = a.integer("expectSuccess", 0);
        int timeoutSeconds = a.integer("timeoutSeconds", 30);
        Set<String> failBodies = new HashSet<>(a.list("failBodies"));
        // Bodies whose first listener call fails and later ones succeed.
        Set<String> failOnce = Collections.synchronizedSet(new HashSet<>(a.list("failOnce")));
        long holdMillis = a.longValue("holdMillis", 0);
        long settleMillis = a.longValue("settleMillis", 0);
        long closeTimeoutMillis = a.longValue("closeTimeoutMillis", 5000);
        Integer threads = a.has("consumptionThreadCount") ? a.integer("consumptionThreadCount", 20) : null;
        Integer maxCache = a.has("maxCacheMessageCount") ? a.integer("maxCacheMessageCount", 1024) : null;
        // `expect`/`expectSuccess` count distinct bodies, not listener calls.
        boolean distinct = a.bool("distinct", false);
        ClientConfiguration config = clientConfiguration(a, endpoint);
        a.rejectUnknown();

        ClientServiceProvider provider = ClientServiceProvider.loadService();
        Map<String, Object> out = new LinkedHashMap<>();
        List<Map<String, Object>> invocations = new ArrayList<>();
        int[] counts = new int[2]; // [done, succeeded], guarded by invocations
        Set<String> doneBodies = new HashSet<>(); // with `distinct`, what counts replaces: guarded by invocations
        Set<String> succeededBodies = new HashSet<>();
        long started = System.currentTimeMillis();
        out.put("startedAtMs", started);
        PushConsumerBuilder builder = provider.newPushConsumerBuilder().setClientConfiguration(config)
            .setConsumerGroup(group).setSubscriptionExpressions(Collections.singletonMap(topic, filter))
            .setMessageListener(view -> {
                long at = System.currentTimeMillis();
                Map<String, Object> entry = viewEntry(view);
                entry.put("atMs", at);
                entry.put("thread", Thread.currentThread().getName());
                synchronized (invocations) {
                    entry.put("seq", invocations.size());
                    invocations.add(entry);
                }
                String body = (String) entry.get("body");
                if (holdMillis > 0) {
                    try {
                        Thread.sleep(holdMillis);
                    } catch (InterruptedException e) {
                        Thread.currentThread().interrupt();
                    }
                }
                boolean fail = failBodies.contains(body) || failOnce.remove(body);
                ConsumeResult r = fail ? ConsumeResult.FAILURE : ConsumeResult.SUCCESS;
                synchronized (invocations) {
                    entry.put("result", r.name());
                    entry.put("doneAtMs", System.currentTimeMillis());
                    if (!distinct || doneBodies.add(body)) {
                        counts[0]++;
                    }
                    if (r == ConsumeResult.SUCCESS && (!distinct || succeededBodies.add(body))) {
                        counts[1]++;
                    }
                    invocations.notifyAll();
                }
                return r;
            });
        if (threads != null) {
            builder.setConsumptionThreadCount(threads);
        }
        if (maxCache != null) {
            builder.setMaxCacheMessageCount(maxCache);
        }
        PushConsumer consumer;
        try {
            consumer = startClient(out, builder::build);
        } catch (Throwable t) {
            return startupFailed(out, started, "push consumer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);

        long deadline = System.currentTimeMillis() + timeoutSeconds * 1000L; // from when the client is up
        boolean reached = false;
        synchronized (invocations) {
            while (true) {
                // Counted when a listener call has returned, so a test never sees a result still pending.
                boolean target = (expect > 0 || expectSuccess > 0)
                    && (expect <= 0 || counts[0] >= expect) && (expectSuccess <= 0 || counts[1] >= expectSuccess);
                if (target) {
                    reached = true;
                    break;
                }
                long left = deadline - System.currentTimeMillis();
                if (left <= 0) {
                    break;
                }
                invocations.wait(Math.min(left, 200));
            }
        }
        if (reached && settleMillis > 0) {
            Thread.sleep(settleMillis);
        }
        out.put("timedOut", (expect > 0 || expectSuccess > 0) && !reached);
        // Closing waits for in-flight listener calls, gives the SDK 1 s to ack, but first waits up to
        // requestTimeout + longPollingTimeout (33 s) for in-flight receives: bounded here by closeTimeoutMillis.
        long closeMs = close(consumer, closeTimeoutMillis);
        out.put("closeMs", closeMs);
        out.put("closeTimedOut", closeMs < 0);
        synchronized (invocations) {
            out.put("invocations", invocations.size());
            out.put("succeeded", counts[1]);
            out.put("received", snapshot(invocations));
        }
        out.put("finishedAtMs", System.currentTimeMillis());
        return out;
    }

    /**
     * Transactional messages: `count` messages, each in its own transaction, sent with a producer that has a
     * TransactionChecker, then each transaction ended with `resolution` (commit, rollback, or none: left for
     * the broker's check-back) `endAfterMs` after its send. The checker answers `checker` (commit, rollback,
     * unknown) and records every check-back it gets; the producer stays up `stayMs` after the ends for them.
     * A file named by `readyFile` is created once the messages are sent (a test may kill popgate then); with
     * `endWhenFile`, the ends wait (after `endAfterMs`) until a file of that name exists (the test restarted it);
     * an end that did not reach the endpoint (UNAVAILABLE) or was not answered in time (DEADLINE_EXCEEDED) is
     * tried again for `retryUnavailableMs`.
     */
    private static Map<String, Object> transact(Args a) throws Exception {
        String endpoint = a.required("endpoint");
        String topic = a.required("topic");
        int count = a.integer("count", 1);
        String prefix = a.string("prefix", "tx");
        String resolution = a.string("resolution", "commit");
        String checkerAnswer = a.string("checker", "commit");
        long endAfterMs = a.longValue("endAfterMs", 0);
        long stayMs = a.longValue("stayMs", 0);
        String readyFile = a.string("readyFile", null);
        String endWhenFile = a.string("endWhenFile", null);
        long retryUnavailableMs = a.longValue("retryUnavailableMs", 0);
        ClientConfiguration config = clientConfiguration(a, endpoint);
        a.rejectUnknown();
        if (!Arrays.asList("commit", "rollback", "none").contains(resolution)) {
            throw new BadArgs("resolution is commit, rollback or none");
        }
        TransactionResolution answer;
        switch (checkerAnswer) {
            case "commit": answer = TransactionResolution.COMMIT; break;
            case "rollback": answer = TransactionResolution.ROLLBACK; break;
            case "unknown": answer = TransactionResolution.UNKNOWN; break;
            default: throw new BadArgs("checker is commit, rollback or unknown");
        }

        ClientServiceProvider provider = ClientServiceProvider.loadService();
        Map<String, Object> out = new LinkedHashMap<>();
        long started = System.currentTimeMillis();
        out.put("startedAtMs", started);
        List<Map<String, Object>> checks = Collections.synchronizedList(new ArrayList<>());
        TransactionChecker checker = view -> {
            Map<String, Object> check = viewEntry(view);
            check.put("atMs", System.currentTimeMillis());
            checks.add(check);
            return answer;
        };
        Producer producer;
        try {
            producer = startClient(out, () -> provider.newProducerBuilder().setClientConfiguration(config)
                .setTopics(topic).setTransactionChecker(checker).build());
        } catch (Throwable t) {
            return startupFailed(out, started, "producer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);

        List<Object> sent = new ArrayList<>();
        List<Object> errors = new ArrayList<>();
        List<Transaction> transactions = new ArrayList<>();
        for (int i = 0; i < count; i++) {
            String body = prefix + "-" + i;
            Message message = provider.newMessageBuilder().setTopic(topic)
                .setBody(body.getBytes(StandardCharsets.UTF_8)).build();
            long t0 = System.currentTimeMillis();
            try {
                Transaction transaction = producer.beginTransaction();
                SendReceipt receipt = producer.send(message, transaction);
                sent.add(sentEntry(i, body, receipt, t0));
                transactions.add(transaction);
            } catch (Throwable t) {
                errors.add(sendError(i, body, t, t0));
            }
        }
        out.put("sent", sent);
        out.put("errors", errors);
        if (readyFile != null) {
            java.nio.file.Files.write(java.nio.file.Paths.get(readyFile), new byte[0]);
        }
        if (endAfterMs > 0) {
            Thread.sleep(endAfterMs);
        }
        while (endWhenFile != null && !java.nio.file.Files.exists(java.nio.file.Paths.get(endWhenFile))) {
            Thread.sleep(100);
        }
        List<Object> ended = new ArrayList<>();
        for (int i = 0; i < transactions.size() && !resolution.equals("none"); i++) {
            long t0 = System.currentTimeMillis();
            Map<String, Object> e = new LinkedHashMap<>();
            e.put("index", i);
            // As an app would: an end that never reached the endpoint (UNAVAILABLE, the channel reconnecting
            // after the endpoint restarted) or that a just-restarted endpoint did not answer in time
            // (DEADLINE_EXCEEDED; ending is idempotent) is tried again for up to `retryUnavailableMs`.
            int tries = 0;
            while (true) {
                tries++;
                try {
                    if (resolution.equals("commit")) {
                        transactions.get(i).commit();
                    } else {
                        transactions.get(i).rollback();
                    }
                    e.put("ok", true);
                    break;
                } catch (Throwable t) {
                    Map<String, Object> error = describe(t);
                    String message = String.valueOf(error.get("message"));
                    boolean unanswered = message.startsWith("UNAVAILABLE") || message.startsWith("DEADLINE_EXCEEDED");
                    if (unanswered && System.currentTimeMillis() - t0 < retryUnavailableMs) {
                        Thread.sleep(200);
                        continue;
                    }
                    e.putAll(error);
                    e.put("ok", false);
                    break;
                }
            }
            e.put("tries", tries);
            e.put("endMs", System.currentTimeMillis() - t0);
            e.put("endedAtMs", System.currentTimeMillis());
            ended.add(e);
        }
        out.put("ended", ended);
        if (stayMs > 0) {
            Thread.sleep(stayMs);
        }
        synchronized (checks) {
            out.put("checks", snapshot(checks));
        }
        out.put("closeMs", close(producer, 5000));
        out.put("finishedAtMs", System.currentTimeMillis());
        return out;
    }

    // ---------------------------------------------------------------------------------------------- helpers

    /** A stock configuration: the endpoint, plus credentials when given; `ssl` only when the caller asks for it. */
    static ClientConfiguration clientConfiguration(Args a, String endpoint) {
        ClientConfigurationBuilder b = ClientConfiguration.newBuilder().setEndpoints(endpoint);
        String accessKey = a.string("accessKey", null);
        String secretKey = a.string("secretKey", null);
        String securityToken = a.string("securityToken", null);
        if (accessKey != null || secretKey != null) {
            if (accessKey == null || secretKey == null) {
                throw new BadArgs("accessKey and secretKey go together");
            }
            b.setCredentialProvider(securityToken == null
                ? new StaticSessionCredentialsProvider(accessKey, secretKey)
                : new StaticSessionCredentialsProvider(accessKey, secretKey, securityToken));
        }
        if (a.has("requestTimeoutMs")) {
            // The SDK's own default is 3 s; a receive's call deadline is this plus its await duration.
            b.setRequestTimeout(Duration.ofMillis(a.integer("requestTimeoutMs", 3000)));
        }
        if (a.has("ssl")) {
            // Not part of the stock configuration: the SDK's default is TLS on (trusting any certificate).
            // SDK 5.0.3 has no `enableSsl`, and the driver is built against it too: the method is looked up.
            boolean ssl = a.bool("ssl", true);
            try {
                ClientConfigurationBuilder.class.getMethod("enableSsl", boolean.class).invoke(b, ssl);
            } catch (NoSuchMethodException e) {
                if (!ssl) {
                    throw new BadArgs("this SDK version always uses TLS (no enableSsl)");
                }
            } catch (ReflectiveOperationException e) {
                throw new IllegalStateException(e);
            }
        }
        return b.build();
    }

    private static FilterExpression filter(Args a) {
        String sql = a.string("sql", null);
        String tag = a.string("tag", null);
        if (sql != null && tag != null) {
            throw new BadArgs("give either tag or sql, not both");
        }
        if (sql != null) {
            return new FilterExpression(sql, FilterExpressionType.SQL92);
        }
        return new FilterExpression(tag == null ? "*" : tag, FilterExpressionType.TAG);
    }

    /** Whether the SDK mapped the answer to a client-side (4xx) error other than throttling. */
    private static boolean isRejection(Throwable t) {
        while ((t instanceof ExecutionException || t instanceof CompletionException) && t.getCause() != null) {
            t = t.getCause();
        }
        switch (t.getClass().getSimpleName()) {
            case "BadRequestException":
            case "UnauthorizedException":
            case "PaymentRequiredException":
            case "ForbiddenException":
            case "NotFoundException":
            case "PayloadTooLargeException":
            case "RequestHeaderFieldsTooLargeException":
            case "UnsupportedException":
                return true;
            default:
                return false;
        }
    }

    private static String subst(String template, int i) {
        return template.replace("{i}", Integer.toString(i));
    }

    private static Map<String, Object> sentEntry(int i, String body, SendReceipt receipt, long t0) {
        long now = System.currentTimeMillis();
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("index", i);
        e.put("messageId", receipt.getMessageId().toString());
        e.put("body", body);
        e.put("sentAtMs", t0);
        e.put("latencyMs", now - t0);
        return e;
    }

    private static Map<String, Object> sendError(int i, String body, Throwable t, long t0) {
        Map<String, Object> e = describe(t);
        e.put("index", i);
        e.put("body", body);
        e.put("sentAtMs", t0);
        return e;
    }

    /** Whether a message whose ACK failed may still come back: its last failed ACK is younger than `graceMs`. */
    private static boolean awaitingReturn(Map<String, Long> ackFailedAtMs, long graceMs) {
        long now = System.currentTimeMillis();
        return ackFailedAtMs.values().stream().anyMatch(at -> now - at < graceMs);
    }

    private static Map<String, Object> messageError(MessageView view, Map<String, Object> entry, Throwable t) {
        Map<String, Object> e = describe(t);
        e.put("messageId", view.getMessageId().toString());
        e.put("body", entry.get("body"));
        e.put("atMs", System.currentTimeMillis());
        return e;
    }

    private static Map<String, Object> viewEntry(MessageView view) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("messageId", view.getMessageId().toString());
        ByteBuffer buf = view.getBody().duplicate();
        byte[] bytes = new byte[buf.remaining()];
        buf.get(bytes);
        e.put("body", new String(bytes, StandardCharsets.UTF_8));
        e.put("deliveryAttempt", view.getDeliveryAttempt());
        e.put("topic", view.getTopic());
        e.put("tag", view.getTag().orElse(null));
        e.put("keys", new ArrayList<>(view.getKeys()));
        e.put("messageGroup", view.getMessageGroup().orElse(null));
        e.put("deliveryTimestamp", view.getDeliveryTimestamp().orElse(null));
        e.put("bornTimestamp", view.getBornTimestamp());
        e.put("bornHost", view.getBornHost());
        e.put("properties", new LinkedHashMap<>(view.getProperties()));
        return e;
    }

    private static List<Object> snapshot(List<Map<String, Object>> entries) {
        List<Object> copy = new ArrayList<>();
        for (Map<String, Object> e : entries) {
            copy.add(new LinkedHashMap<>(e));
        }
        return copy;
    }

    /** Builds (starts) one SDK client. */
    interface ClientStart<T> {
        T start() throws Exception;
    }

    /**
     * Starts an SDK client. Its start makes a few RPCs under the SDK's own short deadlines (the first also opens the
     * connection: TLS, on a cold JVM), and on a loaded machine one of them outlasted its deadline: "DEADLINE_EXCEEDED
     * ... waiting_for_connection", or "... buffered_nanos=935788635" (the call sat in the SDK's own executor), and
     * the client failed to start. An app would start it again; so does the driver, at most twice more, and
     * `startupRetries` in the result says how often. Any other failure is the scenario's.
     */
    /**
     * Starts a client as an app's supervisor would: again when its start outlasted an SDK deadline (a loaded
     * machine) or its connection was closed under it (UNAVAILABLE: a balancer moved it), up to 5 times.
     */
    static <T> T startClient(Map<String, Object> out, ClientStart<T> start) throws Exception {
        for (int retries = 0; ; retries++) {
            try {
                T client = start.start();
                out.put("startupRetries", retries);
                return client;
            } catch (Exception e) {
                if (retries >= 5 || !startWorthRetrying(e)) {
                    throw e;
                }
                System.err.println("driver: the client's start outlasted an SDK deadline or lost its connection;"
                    + " starting it again: " + e);
            }
        }
    }

    private static boolean startWorthRetrying(Throwable t) {
        for (Throwable c = t; c != null; c = c.getCause()) {
            String message = String.valueOf(c.getMessage());
            if (message.contains("DEADLINE_EXCEEDED") || message.contains("UNAVAILABLE")) {
                return true;
            }
        }
        return false;
    }

    static Map<String, Object> startupFailed(Map<String, Object> out, long started, String what,
        Throwable t) {
        t.printStackTrace(System.err);
        out.put("startupMs", System.currentTimeMillis() - started);
        out.putAll(error("could not start the " + what, t));
        return out;
    }

    private static Map<String, Object> error(String message, Throwable t) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("error", message);
        if (t != null) {
            e.put("cause", describe(t));
        }
        return e;
    }

    /** {"errorClass", "message", "causes": [...]} of a throwable, unwrapping future wrappers. */
    static Map<String, Object> describe(Throwable t) {
        while ((t instanceof ExecutionException || t instanceof CompletionException) && t.getCause() != null) {
            t = t.getCause();
        }
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("errorClass", t.getClass().getName());
        e.put("message", String.valueOf(t.getMessage()));
        List<Object> causes = new ArrayList<>();
        for (Throwable c = t.getCause(); c != null && causes.size() < 5; c = c.getCause()) {
            causes.add(c.getClass().getName() + ": " + c.getMessage());
        }
        if (!causes.isEmpty()) {
            e.put("causes", causes);
        }
        return e;
    }

    /** Closes a client on a daemon thread; returns how long it took, or -1 if it did not finish in time. */
    static long close(AutoCloseable client, long timeoutMillis) {
        long t0 = System.currentTimeMillis();
        Thread closer = new Thread(() -> {
            try {
                client.close();
            } catch (Throwable t) {
                System.err.println("close failed: " + t);
            }
        }, "driver-close");
        closer.setDaemon(true);
        closer.start();
        try {
            closer.join(timeoutMillis);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        return closer.isAlive() ? -1 : System.currentTimeMillis() - t0;
    }
}
