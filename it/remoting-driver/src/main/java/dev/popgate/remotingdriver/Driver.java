package dev.popgate.remotingdriver;

import dev.popgate.driver.Args;
import dev.popgate.driver.BadArgs;
import dev.popgate.driver.Json;

import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.IOException;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.Comparator;
import java.util.HashMap;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

import org.apache.rocketmq.acl.common.AclClientRPCHook;
import org.apache.rocketmq.acl.common.SessionCredentials;
import org.apache.rocketmq.client.ClientConfig;
import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.ConsumeOrderlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.consumer.listener.MessageListenerOrderly;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.exception.MQBrokerException;
import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.MessageQueueSelector;
import org.apache.rocketmq.client.producer.SendCallback;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.client.producer.TransactionSendResult;
import org.apache.rocketmq.client.producer.selector.SelectMessageQueueByHash;
import org.apache.rocketmq.common.MQVersion;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageClientExt;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.common.message.MessageQueue;
import org.apache.rocketmq.remoting.RPCHook;

/**
 * popgate's remoting test driver: runs one scenario with Apache's RocketMQ remoting Java client
 * (org.apache.rocketmq:rocketmq-client, 4.9.x or 5.x: the same source compiles against both) and prints exactly one
 * JSON object on stdout. Logs (the client's and the driver's) go to stderr; nothing is written under ~/logs.
 *
 * <pre>
 *   java -jar popgate-remoting-driver.jar produce      '{"namesrv":"127.0.0.1:9876","topic":"T","count":3}'
 *   java -jar popgate-remoting-driver.jar push-consume '{"namesrv":"127.0.0.1:9876","group":"G","topic":"T","expect":3}'
 *   java -jar popgate-remoting-driver.jar lite-pull    '{"namesrv":"127.0.0.1:9876","group":"G","topic":"T","expect":3}'
 *   java -jar popgate-remoting-driver.jar transact     '{"namesrv":"127.0.0.1:9876","topic":"T","resolution":"commit"}'
 *   java -jar popgate-remoting-driver.jar load         '{"namesrv":"127.0.0.1:9876","group":"G","topic":"T","seconds":15}'
 * </pre>
 *
 * Arguments may also be given as key=value words instead of one JSON object; unknown arguments are an error. Exit
 * codes: 0 the scenario ran (its JSON says what happened, including per-message errors and "timedOut"); 1 the client
 * could not be started or the scenario failed as a whole ({"error":...} on stdout); 2 bad usage or arguments
 * ({"error":...} on stdout); 3 the result could not be written to stdout.
 *
 * <p>Common arguments: namesrv (host:port[;host:port], the client's namesrvAddr; required), group, topic,
 * timeoutMs (overall, default 30000), accessKey + secretKey (AclClientRPCHook), useTLS, instanceName, namespace,
 * pollNameServerIntervalMs, heartbeatBrokerIntervalMs, persistConsumerOffsetIntervalMs. The VIP channel (broker
 * port - 2) is always off.
 */
public final class Driver {
    private static final String SCENARIOS = "<produce|push-consume|lite-pull|transact|load>";

    private Driver() {
    }

    public static void main(String[] argv) {
        // stdout carries only the result (written to fd 1 by finish); anything else printing to System.out goes to
        // stderr.
        System.setOut(System.err);
        long startMs = System.currentTimeMillis();
        Map<String, Object> logging = configureLogging();
        if (argv.length == 0 || argv[0].equals("-h") || argv[0].equals("--help") || argv[0].equals("help")) {
            System.err.println("usage: java -jar popgate-remoting-driver.jar " + SCENARIOS
                + " ['{json args}' | key=value ...]");
            Map<String, Object> usage = new LinkedHashMap<>();
            usage.put("usage", SCENARIOS + " ['{json args}' | key=value ...]");
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
                    result = produce(args, startMs);
                    break;
                case "push-consume":
                    result = pushConsume(args, startMs);
                    break;
                case "lite-pull":
                    result = litePull(args, startMs);
                    break;
                case "transact":
                    result = transact(args, startMs);
                    break;
                case "load":
                    result = Load.run(args, startMs);
                    break;
                default:
                    finish(error("unknown scenario '" + scenario + "'; expected " + SCENARIOS, null), 2);
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
        result.put("clientVersion", clientVersion());
        if (!logging.isEmpty()) {
            result.put("logging", logging);
        }
        finish(result, code);
    }

    // ---------------------------------------------------------------------------------------------- logging

    /**
     * Sends the client's logging to stderr at level warn and keeps it from writing files under ~/logs, for both
     * client generations (unless the caller set the properties involved with -D):
     * <ul>
     * <li>5.x clients log through a shaded slf4j + logback (io.github.aliyunmq rocketmq-slf4j-api /
     * rocketmq-logback-classic, packages org.apache.rocketmq.logging.org.slf4j / ...ch.qos.logback). rocketmq-common's
     * DefaultJoranConfiguratorExt first reads the system property rmq.logback.configurationFile, else the first of
     * rmq.logback-test.xml, rmq.logback.xml, ..., rmq.client.logback.xml on the classpath; the client's own
     * rmq.client.logback.xml logs to the console and to ${rocketmq.log.root:-~/logs/rocketmqlogs}/rocketmq_client.log.
     * The driver points the property at its stderr-only popgate-remoting-driver-logback.xml (level from
     * rocketmq.log.level, default warn), and rocketmq.log.root at a temp directory as a safety net.</li>
     * <li>4.9.x clients log through rocketmq-logging's InternalLoggerFactory. org.apache.rocketmq.client.log.ClientLogger
     * (unless rocketmq.client.logUseSlf4j=true, which needs an slf4j binding the jar does not have) selects the
     * "inner" logger and hangs a lazily created RollingFileAppender (${rocketmq.client.logRoot:-~/logs/rocketmqlogs}/
     * rocketmq_client.log, created on the first event) on the loggers RocketmqClient, RocketmqCommon,
     * RocketmqRemoting and the root. The driver initializes ClientLogger before any client starts, replaces that
     * appender with a stderr console appender (through reflection: these classes are not in 5.x), and sets
     * rocketmq.client.logLevel to WARN. rocketmq.client.logRoot is pointed at a temp directory as a safety net.</li>
     * </ul>
     * Netty logs through java.util.logging here (no plain slf4j on the classpath): its root level is set to WARNING.
     */
    private static Map<String, Object> configureLogging() {
        Map<String, Object> notes = new LinkedHashMap<>();
        setDefault("rmq.logback.configurationFile", "popgate-remoting-driver-logback.xml");
        // Only read by the client's own rmq.client.logback.xml, which the property above replaces: a safety net.
        setDefault("rocketmq.log.root",
            Paths.get(System.getProperty("java.io.tmpdir"), "popgate-remoting-driver-logs").toString());
        setDefault("rocketmq.client.logLevel", "WARN");
        setDefault("rocketmq.client.logRoot",
            Paths.get(System.getProperty("java.io.tmpdir"), "popgate-remoting-driver-logs").toString());
        java.util.logging.Logger.getLogger("").setLevel(java.util.logging.Level.WARNING);
        Class<?> clientLogger;
        try {
            clientLogger = Class.forName("org.apache.rocketmq.client.log.ClientLogger");
        } catch (ClassNotFoundException e) {
            return notes; // a 5.x client: the logback configuration above is all it takes
        }
        if (Boolean.parseBoolean(System.getProperty("rocketmq.client.logUseSlf4j", "false"))) {
            return notes;
        }
        try {
            clientLogger.getMethod("getLog").invoke(null); // runs its static initializer
            Class<?> builder = Class.forName("org.apache.rocketmq.logging.inner.LoggingBuilder");
            Class<?> layoutClass = Class.forName("org.apache.rocketmq.logging.inner.Layout");
            Class<?> appenderClass = Class.forName("org.apache.rocketmq.logging.inner.Appender");
            Class<?> loggerClass = Class.forName("org.apache.rocketmq.logging.inner.Logger");
            Class<?> levelClass = Class.forName("org.apache.rocketmq.logging.inner.Level");
            Object layoutBuilder = builder.getMethod("newLayoutBuilder").invoke(null);
            call(layoutBuilder, "withDefaultLayout");
            Object layout = call(layoutBuilder, "build");
            Object appenderBuilder = builder.getMethod("newAppenderBuilder").invoke(null);
            String systemErr = (String) builder.getField("SYSTEM_ERR").get(null);
            appenderBuilder.getClass().getMethod("withConsoleAppender", String.class).invoke(appenderBuilder, systemErr);
            appenderBuilder.getClass().getMethod("withLayout", layoutClass).invoke(appenderBuilder, layout);
            appenderBuilder.getClass().getMethod("withName", String.class).invoke(appenderBuilder, "PopgateDriverStderr");
            Object appender = call(appenderBuilder, "build");
            Object level = levelClass.getMethod("toLevel", String.class)
                .invoke(null, System.getProperty("rocketmq.client.logLevel"));
            List<Object> loggers = new ArrayList<>();
            loggers.add(loggerClass.getMethod("getRootLogger").invoke(null));
            for (String name : new String[] {"RocketmqClient", "RocketmqCommon", "RocketmqRemoting"}) {
                loggers.add(loggerClass.getMethod("getLogger", String.class).invoke(null, name));
            }
            for (Object logger : loggers) {
                call(logger, "removeAllAppenders");
                loggerClass.getMethod("addAppender", appenderClass).invoke(logger, appender);
                loggerClass.getMethod("setLevel", levelClass).invoke(logger, level);
            }
        } catch (ReflectiveOperationException | LinkageError | RuntimeException e) {
            System.err.println("popgate-remoting-driver: could not redirect the 4.x client's logging to stderr"
                + " (it may log to " + System.getProperty("rocketmq.client.logRoot") + "): " + e);
            notes.put("redirectFailed", String.valueOf(e));
        }
        return notes;
    }

    private static Object call(Object target, String method) throws ReflectiveOperationException {
        Method m = target.getClass().getMethod(method);
        m.setAccessible(true);
        return m.invoke(target);
    }

    private static void setDefault(String property, String value) {
        if (System.getProperty(property) == null) {
            System.setProperty(property, value);
        }
    }

    private static String clientVersion() {
        try {
            // Read reflectively: MQVersion.CURRENT_VERSION is a plain static field, but never inline it.
            int v = MQVersion.class.getField("CURRENT_VERSION").getInt(null);
            return MQVersion.getVersionDesc(v);
        } catch (ReflectiveOperationException | LinkageError e) {
            return "unknown";
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
            System.err.println("popgate-remoting-driver: writing the result to stdout failed: " + e);
            code = 3;
        }
        System.err.flush();
        // The client leaves non-daemon threads behind (netty, schedulers): exit explicitly.
        Runtime.getRuntime().halt(code);
    }

    // ---------------------------------------------------------------------------------------------- produce

    /**
     * `count` messages, body i `<bodyPrefix>-<i>` (i from `startIndex`, default 0), sent `mode` = sync | async |
     * oneway | batch (one send(Collection) of all). `queueId` (optionally with `brokerName`) sends through a
     * MessageQueueSelector picking that queue, `orderKey` through SelectMessageQueueByHash on the key (`{i}` in it,
     * in `tag` and in `keys` becomes the index); each sent entry then has "selectedQueue".
     */
    private static Map<String, Object> produce(Args a, long startMs) throws Exception {
        Common c = Common.parse(a);
        String topic = a.required("topic");
        String producerGroup = a.string("producerGroup", a.string("group", "driver_producer"));
        int count = a.integer("count", 1);
        int startIndex = a.integer("startIndex", 0);
        String mode = a.string("mode", "sync");
        Integer queueId = a.has("queueId") ? a.integer("queueId", 0) : null;
        String brokerName = a.string("brokerName", null);
        String orderKey = a.string("orderKey", null);
        MessageSpec spec = MessageSpec.parse(a);
        int retryTimes = a.integer("retryTimes", 2);
        int sendTimeoutMs = a.integer("sendTimeoutMs", 3000);
        Integer compressOverBytes = a.has("compressOverBytes") ? a.integer("compressOverBytes", 4096) : null;
        a.rejectUnknown();
        if (!Arrays.asList("sync", "async", "oneway", "batch").contains(mode)) {
            throw new BadArgs("mode is sync, async, oneway or batch");
        }
        if (queueId != null && orderKey != null) {
            throw new BadArgs("give either queueId or orderKey, not both");
        }
        if (brokerName != null && queueId == null) {
            throw new BadArgs("brokerName goes with queueId");
        }
        if (count < 0) {
            throw new BadArgs("count must be >= 0");
        }

        Map<String, Object> out = new LinkedHashMap<>();
        out.put("startMs", startMs);
        out.put("mode", mode);
        out.put("producerGroup", producerGroup);
        DefaultMQProducer producer = new DefaultMQProducer(producerGroup, c.hook);
        c.apply(producer);
        producer.setSendMsgTimeout(sendTimeoutMs);
        producer.setRetryTimesWhenSendFailed(retryTimes);
        producer.setRetryTimesWhenSendAsyncFailed(retryTimes);
        if (compressOverBytes != null) {
            producer.setCompressMsgBodyOverHowmuch(compressOverBytes);
        }
        try {
            producer.start();
        } catch (Throwable t) {
            return startupFailed(out, "producer", t);
        }
        out.put("clientId", producer.buildMQClientId());
        out.put("startedMs", System.currentTimeMillis());

        // What each selector call chose, by message index (the client hands the selector a copy of the message).
        Map<Integer, MessageQueue> chosen = new ConcurrentHashMap<>();
        MessageQueueSelector selector = null;
        if (queueId != null) {
            selector = (mqs, msg, arg) -> {
                MessageQueue mq = pickQueue(mqs, queueId, brokerName);
                chosen.put(((Selection) arg).index, mq);
                return mq;
            };
        } else if (orderKey != null) {
            SelectMessageQueueByHash hash = new SelectMessageQueueByHash();
            selector = (mqs, msg, arg) -> {
                Selection s = (Selection) arg;
                MessageQueue mq = hash.select(mqs, msg, s.key);
                chosen.put(s.index, mq);
                return mq;
            };
        }

        List<Map<String, Object>> sent = new ArrayList<>();
        List<Map<String, Object>> errors = new ArrayList<>();
        long sendStarted = System.currentTimeMillis();
        if (mode.equals("batch")) {
            List<Message> batch = new ArrayList<>();
            for (int n = 0; n < count; n++) {
                batch.add(spec.build(topic, startIndex + n));
            }
            long t0 = System.currentTimeMillis();
            try {
                SendResult r;
                if (selector != null) {
                    // There is no send(Collection, selector, ...): pick the queue among the topic's published ones
                    // (the topic must have a route) and send the batch to it, as an app would.
                    List<MessageQueue> mqs = producer.fetchPublishMessageQueues(topic);
                    MessageQueue mq = selector.select(mqs, batch.isEmpty() ? null : batch.get(0),
                        new Selection(startIndex, orderKey == null ? null : subst(orderKey, startIndex)));
                    r = producer.send(batch, mq, sendTimeoutMs);
                } else {
                    r = producer.send(batch, sendTimeoutMs);
                }
                sent.addAll(batchEntries(spec, startIndex, count, r, t0, chosen.get(startIndex)));
                out.put("batchResult", resultEntry(r));
            } catch (Throwable t) {
                for (int n = 0; n < count; n++) {
                    errors.add(sendError(startIndex + n, spec.label(startIndex + n), t, t0));
                }
            }
        } else if (mode.equals("async")) {
            CountDownLatch done = new CountDownLatch(count);
            Set<Integer> pending = ConcurrentHashMap.newKeySet();
            for (int n = 0; n < count; n++) {
                int i = startIndex + n;
                String label = spec.label(i);
                Message m = spec.build(topic, i);
                long t0 = System.currentTimeMillis();
                pending.add(i);
                SendCallback cb = new SendCallback() {
                    @Override
                    public void onSuccess(SendResult r) {
                        if (pending.remove(i)) {
                            synchronized (sent) {
                                sent.add(sentEntry(i, label, spec, r, t0, chosen.get(i)));
                            }
                            done.countDown();
                        }
                    }

                    @Override
                    public void onException(Throwable t) {
                        if (pending.remove(i)) {
                            synchronized (sent) {
                                errors.add(sendError(i, label, t, t0));
                            }
                            done.countDown();
                        }
                    }
                };
                try {
                    if (selector == null) {
                        producer.send(m, cb, sendTimeoutMs);
                    } else {
                        producer.send(m, selector, new Selection(i, orderKey == null ? null : subst(orderKey, i)),
                            cb, sendTimeoutMs);
                    }
                } catch (Throwable t) {
                    cb.onException(t);
                }
            }
            long left = c.timeoutMs - (System.currentTimeMillis() - startMs);
            boolean all = done.await(Math.max(left, 0), TimeUnit.MILLISECONDS);
            synchronized (sent) {
                for (Integer i : new ArrayList<>(pending)) {
                    if (pending.remove(i)) {
                        Map<String, Object> e = new LinkedHashMap<>();
                        e.put("index", i);
                        e.put("body", spec.label(i));
                        e.put("error", "no callback within timeoutMs (" + c.timeoutMs + " ms)");
                        e.put("noCallback", true);
                        errors.add(e);
                    }
                }
            }
            out.put("timedOut", !all);
        } else {
            boolean oneway = mode.equals("oneway");
            for (int n = 0; n < count; n++) {
                int i = startIndex + n;
                String label = spec.label(i);
                Message m = spec.build(topic, i);
                Selection sel = new Selection(i, orderKey == null ? null : subst(orderKey, i));
                long t0 = System.currentTimeMillis();
                try {
                    if (oneway) {
                        if (selector == null) {
                            producer.sendOneway(m);
                        } else {
                            producer.sendOneway(m, selector, sel);
                        }
                        Map<String, Object> e = new LinkedHashMap<>();
                        e.put("index", i);
                        e.put("body", label);
                        MessageQueue mq = chosen.get(i);
                        if (mq != null) {
                            e.put("selectedQueue", queueEntry(mq));
                        }
                        sent.add(e);
                    } else {
                        SendResult r = selector == null ? producer.send(m, sendTimeoutMs)
                            : producer.send(m, selector, sel, sendTimeoutMs);
                        sent.add(sentEntry(i, label, spec, r, t0, chosen.get(i)));
                    }
                } catch (Throwable t) {
                    errors.add(sendError(i, label, t, t0));
                }
            }
        }
        sent.sort(Comparator.comparingInt(e -> (Integer) e.get("index")));
        errors.sort(Comparator.comparingInt(e -> (Integer) e.get("index")));
        out.put("sendMs", System.currentTimeMillis() - sendStarted);
        out.put("sent", sent);
        out.put("errors", errors);
        out.put("shutdownMs", shutdown(producer::shutdown, 10000));
        out.put("finishedMs", System.currentTimeMillis());
        return out;
    }

    /** What a MessageQueueSelector gets as its argument: the message's index, and its order key if any. */
    private static final class Selection {
        final int index;
        final String key;

        Selection(int index, String key) {
            this.index = index;
            this.key = key;
        }
    }

    private static MessageQueue pickQueue(List<MessageQueue> mqs, int queueId, String brokerName) {
        for (MessageQueue mq : mqs) {
            if (mq.getQueueId() == queueId && (brokerName == null || brokerName.equals(mq.getBrokerName()))) {
                return mq;
            }
        }
        throw new IllegalArgumentException("no queue " + queueId + (brokerName == null ? "" : " of " + brokerName)
            + " among " + mqs);
    }

    private static Map<String, Object> queueEntry(MessageQueue mq) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("broker", mq.getBrokerName());
        e.put("queueId", mq.getQueueId());
        return e;
    }

    private static Map<String, Object> resultEntry(SendResult r) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("msgId", r.getMsgId());
        e.put("offsetMsgId", r.getOffsetMsgId());
        e.put("status", String.valueOf(r.getSendStatus()));
        MessageQueue mq = r.getMessageQueue();
        e.put("broker", mq == null ? null : mq.getBrokerName());
        e.put("queueId", mq == null ? null : mq.getQueueId());
        e.put("queueOffset", r.getQueueOffset());
        return e;
    }

    private static Map<String, Object> sentEntry(int i, String label, MessageSpec spec, SendResult r, long t0,
        MessageQueue selected) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("index", i);
        e.put("body", label);
        e.putAll(resultEntry(r));
        if (spec.bodyBytes != null) {
            e.put("bodyLength", spec.body(i).length);
        }
        if (selected != null) {
            e.put("selectedQueue", queueEntry(selected));
        }
        e.put("sentAtMs", t0);
        e.put("latencyMs", System.currentTimeMillis() - t0);
        return e;
    }

    /** One entry per message of a batch: its msgId / offsetMsgId split out of the comma-joined ones. */
    private static List<Map<String, Object>> batchEntries(MessageSpec spec, int startIndex, int count, SendResult r,
        long t0, MessageQueue selected) {
        String[] ids = r.getMsgId() == null ? new String[0] : r.getMsgId().split(",");
        String[] offsetIds = r.getOffsetMsgId() == null ? new String[0] : r.getOffsetMsgId().split(",");
        List<Map<String, Object>> entries = new ArrayList<>();
        for (int n = 0; n < count; n++) {
            int i = startIndex + n;
            Map<String, Object> e = sentEntry(i, spec.label(i), spec, r, t0, selected);
            e.put("msgId", ids.length == count ? ids[n] : r.getMsgId());
            e.put("offsetMsgId", offsetIds.length == count ? offsetIds[n] : r.getOffsetMsgId());
            e.put("queueOffset", r.getQueueOffset() + n);
            entries.add(e);
        }
        return entries;
    }

    private static Map<String, Object> sendError(int i, String label, Throwable t, long t0) {
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("index", i);
        e.put("body", label);
        e.putAll(describe(t));
        e.put("sentAtMs", t0);
        return e;
    }

    // ---------------------------------------------------------------------------------------------- consume

    /**
     * A DefaultMQPushConsumer on `topic` / `subExpression` (default "*"), concurrently or `orderly`, clustering or
     * `broadcasting`, until `expect` distinct bodies were received or `timeoutMs` (from the driver's start), then
     * `settleMs` more (to see redeliveries and duplicates). The first `failTimes` deliveries of each body (of each
     * of `failBodies` when given) are answered RECONSUME_LATER (with `retryDelayLevel` as the context's
     * delayLevelWhenNextConsume when given; else the broker picks 3 + reconsumeTimes, 10 s for the first retry) or,
     * `orderly`, SUSPEND_CURRENT_QUEUE_A_MOMENT (for `suspendMs`, default 1000). "received" lists every delivery in
     * arrival order, each with its "delivery" number (per body) and the "result" the listener answered;
     * "consumedBodies" counts the bodies answered with success. `clientRebalance` false (5.x clients) makes the
     * consumer ask its queues of the broker and consume by POP when told to, with `popInvisibleTimeMs`.
     * `instances` [names] starts one such consumer per name in this one process (each its own instanceName, so its
     * own client instance, as an app with two consumers of a group has), waits for each to reach `expect`, and
     * reports each in "consumers" (instanceName, clientId, timedOut, received, ...). `sendOnStart` N sends N
     * messages "m-<i>" (with `sendTag`) from a producer of this process right after the consumers started, as
     * Apache's e2e suite does; "sentOnStart" lists them (broker, queueId, queueOffset, sentAtMs). A file named by
     * `startedFile` is created once every consumer's start() returned, for a test that must not disturb a start.
     */
    private static Map<String, Object> pushConsume(Args a, long startMs) throws Exception {
        Common c = Common.parse(a);
        String group = a.required("group");
        String topic = a.required("topic");
        String subExpression = a.string("subExpression", "*");
        int expect = a.integer("expect", 0);
        boolean orderly = a.bool("orderly", false);
        boolean broadcasting = a.bool("broadcasting", false);
        int failTimes = a.integer("failTimes", 0);
        Set<String> failBodies = a.has("failBodies") ? new HashSet<>(a.list("failBodies")) : null;
        Integer maxReconsumeTimes = a.has("maxReconsumeTimes") ? a.integer("maxReconsumeTimes", 16) : null;
        Integer retryDelayLevel = a.has("retryDelayLevel") ? a.integer("retryDelayLevel", 0) : null;
        Long suspendMs = a.has("suspendMs") ? a.longValue("suspendMs", 1000) : null;
        ConsumeFromWhere from = consumeFromWhere(a);
        String consumeTimestamp = a.string("consumeTimestamp", null);
        long settleMs = a.longValue("settleMs", 0);
        Long pullIntervalMs = a.has("pullIntervalMs") ? a.longValue("pullIntervalMs", 0) : null;
        Integer pullBatchSize = a.has("pullBatchSize") ? a.integer("pullBatchSize", 32) : null;
        Integer consumeBatchSize = a.has("consumeBatchSize") ? a.integer("consumeBatchSize", 1) : null;
        long holdMs = a.longValue("holdMs", 0);
        String offsetStoreDir = a.string("offsetStoreDir", null);
        boolean pop = !a.bool("clientRebalance", true);
        Long popInvisibleTimeMs = a.has("popInvisibleTimeMs") ? a.longValue("popInvisibleTimeMs", 60000) : null;
        // Several consumers in this one process, one per name: each its own instanceName, so its own client instance.
        List<String> instances = a.has("instances") ? a.list("instances") : null;
        // Messages this process sends as soon as its consumers started, as an app (or Apache's e2e suite) does.
        int sendOnStart = a.integer("sendOnStart", 0);
        String sendTag = a.string("sendTag", null);
        String startedFile = a.string("startedFile", null);
        if (instances != null && (instances.isEmpty() || c.instanceName != null)) {
            throw new BadArgs("instances names at least one consumer, and goes without instanceName");
        }
        a.rejectUnknown();
        Path tempOffsets = broadcasting ? localOffsetStore(offsetStoreDir) : null;

        Map<String, Object> out = new LinkedHashMap<>();
        out.put("startMs", startMs);
        List<DefaultMQPushConsumer> consumers = new ArrayList<>();
        List<Deliveries> deliveriesOf = new ArrayList<>();
        for (String instance : instances == null ? Collections.singletonList(c.instanceName) : instances) {
            Deliveries deliveries = new Deliveries(failTimes, failBodies);
            DefaultMQPushConsumer consumer =
                new DefaultMQPushConsumer(group, c.hook, new AllocateMessageQueueAveragely());
            c.apply(consumer);
            if (instance != null) {
                consumer.setInstanceName(instance);
            }
            consumer.subscribe(topic, subExpression);
            consumer.setConsumeFromWhere(from);
            if (consumeTimestamp != null) {
                consumer.setConsumeTimestamp(consumeTimestamp);
            }
            if (broadcasting) {
                setBroadcasting(consumer);
            }
            if (maxReconsumeTimes != null) {
                consumer.setMaxReconsumeTimes(maxReconsumeTimes);
            }
            if (suspendMs != null) {
                consumer.setSuspendCurrentQueueTimeMillis(suspendMs);
            }
            if (pullIntervalMs != null) {
                consumer.setPullInterval(pullIntervalMs);
            }
            if (pullBatchSize != null) {
                consumer.setPullBatchSize(pullBatchSize);
            }
            if (consumeBatchSize != null) {
                consumer.setConsumeMessageBatchMaxSize(consumeBatchSize);
            }
            if (pop) {
                // 5.x only: the consumer asks the broker for its queues (QUERY_ASSIGNMENT) and consumes by POP when
                // the answer says so.
                setter(consumer, "setClientRebalance", boolean.class).invoke(consumer, false);
            }
            if (popInvisibleTimeMs != null) {
                setter(consumer, "setPopInvisibleTime", long.class).invoke(consumer, popInvisibleTimeMs);
            }
            // Shutdown waits (bounded) for listener calls in flight, so what they answered is what gets committed.
            consumer.setAwaitTerminationMillisWhenShutdown(5000);
            if (orderly) {
                consumer.registerMessageListener((MessageListenerOrderly) (msgs, ctx) -> {
                    boolean fail = deliveries.record(msgs, ctx.getMessageQueue(), holdMs);
                    if (fail && suspendMs != null) {
                        ctx.setSuspendCurrentQueueTimeMillis(suspendMs);
                    }
                    return fail ? ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT : ConsumeOrderlyStatus.SUCCESS;
                });
            } else {
                consumer.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
                    boolean fail = deliveries.record(msgs, ctx.getMessageQueue(), holdMs);
                    if (fail && retryDelayLevel != null) {
                        ctx.setDelayLevelWhenNextConsume(retryDelayLevel);
                    }
                    return fail ? ConsumeConcurrentlyStatus.RECONSUME_LATER : ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
                });
            }
            deliveries.failAnswer = orderly ? "SUSPEND_CURRENT_QUEUE_A_MOMENT" : "RECONSUME_LATER";
            deliveries.okAnswer = orderly ? "SUCCESS" : "CONSUME_SUCCESS";
            try {
                consumer.start();
            } catch (Throwable t) {
                for (DefaultMQPushConsumer started : consumers) {
                    shutdown(started::shutdown, 15000);
                }
                deleteTree(tempOffsets);
                return startupFailed(out, "push consumer", t);
            }
            consumers.add(consumer);
            deliveriesOf.add(deliveries);
        }
        if (startedFile != null) {
            java.nio.file.Files.write(java.nio.file.Paths.get(startedFile), new byte[0]);
        }
        if (sendOnStart > 0) {
            out.put("sentOnStart", sendOnStart(c, topic, sendTag, sendOnStart));
        }
        // One consumer reports at the top level; several, each in "consumers".
        List<Map<String, Object>> reports = new ArrayList<>();
        for (DefaultMQPushConsumer consumer : consumers) {
            Map<String, Object> report = instances == null ? out : new LinkedHashMap<>();
            report.put("instanceName", consumer.getInstanceName());
            report.put("clientId", consumer.buildMQClientId());
            report.put("messageModel", String.valueOf(consumer.getMessageModel()));
            report.put("startedMs", System.currentTimeMillis());
            reports.add(report);
        }

        boolean reachedAll = true;
        for (int n = 0; n < consumers.size(); n++) {
            boolean reached = deliveriesOf.get(n).await(expect, startMs + c.timeoutMs);
            reports.get(n).put("timedOut", expect > 0 && !reached);
            reachedAll &= reached;
        }
        if (reachedAll && settleMs > 0) {
            Thread.sleep(settleMs);
        }
        out.put("timedOut", expect > 0 && !reachedAll);
        for (int n = 0; n < consumers.size(); n++) {
            reports.get(n).put("shutdownMs", shutdown(consumers.get(n)::shutdown, 15000));
            deliveriesOf.get(n).report(reports.get(n));
        }
        if (instances != null) {
            out.put("consumers", reports);
        }
        out.put("finishedMs", System.currentTimeMillis());
        deleteTree(tempOffsets);
        return out;
    }

    /** Sends `count` messages `m-<i>` (tag `tag` when given) from a producer of this process, one after another. */
    private static List<Map<String, Object>> sendOnStart(Common c, String topic, String tag, int count)
        throws Exception {
        DefaultMQProducer producer = new DefaultMQProducer("driver_on_start_producer", c.hook);
        c.apply(producer);
        producer.setInstanceName("driver-on-start");
        producer.setSendMsgTimeout(10000);
        producer.start();
        List<Map<String, Object>> sent = new ArrayList<>();
        try {
            for (int i = 0; i < count; i++) {
                Message m = new Message(topic, tag, ("m-" + i).getBytes(StandardCharsets.UTF_8));
                long t0 = System.currentTimeMillis();
                try {
                    SendResult r = producer.send(m);
                    Map<String, Object> e = resultEntry(r);
                    e.put("body", "m-" + i);
                    e.put("sentAtMs", t0);
                    sent.add(e);
                } catch (Exception e) {
                    sent.add(sendError(i, "m-" + i, e, t0));
                }
            }
        } finally {
            shutdown(producer::shutdown, 15000);
        }
        return sent;
    }

    /**
     * A DefaultLitePullConsumer in subscribe mode: poll(`pollTimeoutMs`, default 1000) until `expect` distinct
     * bodies or `timeoutMs`, then `settleMs` more. With `autoCommit` false (the default) each poll batch is committed
     * with commitSync(); `commitCount` stops committing after that many messages (a batch that crosses it has only
     * its first messages committed, per queue, with commitSync(offsets, true)), so a later run re-reads the rest.
     */
    private static Map<String, Object> litePull(Args a, long startMs) throws Exception {
        Common c = Common.parse(a);
        String group = a.required("group");
        String topic = a.required("topic");
        String subExpression = a.string("subExpression", "*");
        int expect = a.integer("expect", 0);
        boolean autoCommit = a.bool("autoCommit", false);
        Integer commitCount = a.has("commitCount") ? a.integer("commitCount", 0) : null;
        long pollTimeoutMs = a.longValue("pollTimeoutMs", 1000);
        boolean broadcasting = a.bool("broadcasting", false);
        ConsumeFromWhere from = consumeFromWhere(a);
        String consumeTimestamp = a.string("consumeTimestamp", null);
        Integer pullBatchSize = a.has("pullBatchSize") ? a.integer("pullBatchSize", 10) : null;
        long settleMs = a.longValue("settleMs", 0);
        String offsetStoreDir = a.string("offsetStoreDir", null);
        a.rejectUnknown();
        if (autoCommit && commitCount != null) {
            throw new BadArgs("commitCount needs autoCommit false");
        }
        Path tempOffsets = broadcasting ? localOffsetStore(offsetStoreDir) : null;

        Map<String, Object> out = new LinkedHashMap<>();
        out.put("startMs", startMs);
        DefaultLitePullConsumer consumer = new DefaultLitePullConsumer(group, c.hook);
        c.apply(consumer);
        consumer.setAutoCommit(autoCommit);
        consumer.setPollTimeoutMillis(pollTimeoutMs);
        consumer.setConsumeFromWhere(from);
        if (consumeTimestamp != null) {
            consumer.setConsumeTimestamp(consumeTimestamp);
        }
        if (broadcasting) {
            setBroadcasting(consumer);
        }
        // commitSync(Map<MessageQueue, Long>, boolean) (4.9.4+; 5.x also has commit(Map, boolean)) commits part of a
        // batch. Without it (4.9.3) a batch is all or nothing, so with commitCount the driver pulls one message at a
        // time unless told otherwise.
        Method partialCommit = null;
        for (String name : new String[] {"commitSync", "commit"}) {
            try {
                partialCommit = DefaultLitePullConsumer.class.getMethod(name, Map.class, boolean.class);
                break;
            } catch (NoSuchMethodException e) {
                // try the next
            }
        }
        if (commitCount != null && partialCommit == null && pullBatchSize == null) {
            pullBatchSize = 1;
            out.put("pullBatchSizeForced", 1);
        }
        if (pullBatchSize != null) {
            consumer.setPullBatchSize(pullBatchSize);
        }
        consumer.subscribe(topic, subExpression);
        try {
            consumer.start();
        } catch (Throwable t) {
            deleteTree(tempOffsets);
            return startupFailed(out, "lite pull consumer", t);
        }
        out.put("clientId", consumer.buildMQClientId());
        out.put("messageModel", String.valueOf(consumer.getMessageModel()));
        out.put("startedMs", System.currentTimeMillis());

        Deliveries deliveries = new Deliveries(0, null);
        deliveries.okAnswer = "polled";
        int polls = 0;
        int committed = 0;
        int commits = 0;
        boolean commitStopped = false;
        List<Object> commitErrors = new ArrayList<>();
        long deadline = startMs + c.timeoutMs;
        long settleUntil = -1;
        while (true) {
            long now = System.currentTimeMillis();
            if (settleUntil < 0 && expect > 0 && deliveries.distinctBodies() >= expect) {
                settleUntil = now + settleMs;
            }
            long end = settleUntil >= 0 ? settleUntil : deadline;
            if (now >= end) {
                break;
            }
            List<MessageExt> msgs = consumer.poll(Math.max(1, Math.min(pollTimeoutMs, end - now)));
            polls++;
            if (msgs == null || msgs.isEmpty()) {
                continue;
            }
            deliveries.record(msgs, null, 0);
            if (autoCommit || commitStopped) {
                continue;
            }
            try {
                if (commitCount == null || committed + msgs.size() <= commitCount) {
                    consumer.commitSync();
                    committed += msgs.size();
                    commits++;
                } else if (committed < commitCount && partialCommit == null) {
                    commitStopped = true;
                    throw new UnsupportedOperationException("this client cannot commit part of a poll batch"
                        + " (no commitSync(Map, boolean)): not committed, and no further commits; give pullBatchSize"
                        + " 1 with commitCount");
                } else if (committed < commitCount) {
                    // Commit only the first (commitCount - committed) of this batch: per queue, the offset after
                    // the last of them.
                    Map<MessageQueue, Long> offsets = new HashMap<>();
                    for (MessageExt m : msgs.subList(0, commitCount - committed)) {
                        MessageQueue mq = consumer.queueWithNamespace(
                            new MessageQueue(m.getTopic(), m.getBrokerName(), m.getQueueId()));
                        offsets.merge(mq, m.getQueueOffset() + 1, Math::max);
                    }
                    partialCommit.invoke(consumer, offsets, true);
                    committed = commitCount;
                    commits++;
                }
            } catch (Throwable t) {
                commitErrors.add(describe(t));
            }
        }
        out.put("timedOut", expect > 0 && settleUntil < 0);
        out.put("polls", polls);
        if (!autoCommit) {
            out.put("committed", committed);
            out.put("commits", commits);
            out.put("commitErrors", commitErrors);
        }
        out.put("shutdownMs", shutdown(consumer::shutdown, 15000));
        deliveries.report(out);
        out.put("finishedMs", System.currentTimeMillis());
        deleteTree(tempOffsets);
        return out;
    }

    /** Every delivery a consumer saw, in arrival order, and which bodies were consumed (answered success). */
    private static final class Deliveries {
        private final int failTimes;
        private final Set<String> failBodies; // null: every body
        private final List<Map<String, Object>> received = new ArrayList<>();
        private final Map<String, Integer> perBody = new HashMap<>();
        private final Set<String> consumed = new LinkedHashSet<>();
        String okAnswer = "CONSUME_SUCCESS";
        String failAnswer = "RECONSUME_LATER";

        Deliveries(int failTimes, Set<String> failBodies) {
            this.failTimes = failTimes;
            this.failBodies = failBodies;
        }

        /** Records a listener call's (or a poll's) messages; whether the call is to be answered with a failure. */
        boolean record(List<MessageExt> msgs, MessageQueue mq, long holdMs) {
            long at = System.currentTimeMillis();
            List<Map<String, Object>> entries = new ArrayList<>();
            boolean fail = false;
            synchronized (this) {
                for (MessageExt m : msgs) {
                    Map<String, Object> e = messageEntry(m, mq);
                    String body = (String) e.get("body");
                    int n = perBody.merge(body, 1, Integer::sum);
                    e.put("delivery", n);
                    e.put("atMs", at);
                    e.put("thread", Thread.currentThread().getName());
                    fail |= n <= failTimes && (failBodies == null || failBodies.contains(body));
                    entries.add(e);
                    received.add(e);
                }
            }
            if (holdMs > 0) {
                try {
                    Thread.sleep(holdMs);
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
            }
            synchronized (this) {
                for (Map<String, Object> e : entries) {
                    e.put("result", fail ? failAnswer : okAnswer);
                    if (!fail) {
                        consumed.add((String) e.get("body"));
                    }
                }
                notifyAll();
            }
            return fail;
        }

        synchronized int distinctBodies() {
            return perBody.size();
        }

        /** Waits until `expect` distinct bodies were received (true) or the deadline (false); expect 0: the deadline. */
        synchronized boolean await(int expect, long deadline) throws InterruptedException {
            while (true) {
                if (expect > 0 && perBody.size() >= expect) {
                    return true;
                }
                long left = deadline - System.currentTimeMillis();
                if (left <= 0) {
                    return false;
                }
                wait(Math.min(left, 200));
            }
        }

        synchronized void report(Map<String, Object> out) {
            List<Object> copy = new ArrayList<>();
            for (Map<String, Object> e : received) {
                copy.add(new LinkedHashMap<>(e));
            }
            out.put("deliveries", received.size());
            out.put("distinctBodies", perBody.size());
            out.put("consumedBodies", consumed.size());
            out.put("received", copy);
        }
    }

    private static Map<String, Object> messageEntry(MessageExt m, MessageQueue mq) {
        Map<String, Object> e = new LinkedHashMap<>();
        byte[] body = m.getBody() == null ? new byte[0] : m.getBody();
        e.put("body", bodyText(body));
        e.put("bodyLength", body.length);
        e.put("msgId", m.getMsgId());
        if (m instanceof MessageClientExt) {
            e.put("offsetMsgId", ((MessageClientExt) m).getOffsetMsgId());
        }
        e.put("topic", m.getTopic());
        e.put("tags", m.getTags());
        e.put("keys", m.getKeys());
        e.put("broker", mq != null ? mq.getBrokerName() : m.getBrokerName());
        e.put("queueId", m.getQueueId());
        e.put("queueOffset", m.getQueueOffset());
        e.put("reconsumeTimes", m.getReconsumeTimes());
        e.put("sysFlag", m.getSysFlag()); // bit 0: the body travelled compressed
        e.put("bornTimestamp", m.getBornTimestamp());
        e.put("storeTimestamp", m.getStoreTimestamp());
        e.put("bornHost", m.getBornHost() == null ? null : String.valueOf(m.getBornHost()));
        e.put("storeHost", m.getStoreHost() == null ? null : String.valueOf(m.getStoreHost()));
        e.put("properties", m.getProperties() == null ? new TreeMap<>() : new TreeMap<>(m.getProperties()));
        return e;
    }

    private static ConsumeFromWhere consumeFromWhere(Args a) {
        String from = a.string("consumeFromWhere", "first");
        switch (from) {
            case "first":
                return ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET;
            case "last":
                return ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET;
            case "timestamp":
                return ConsumeFromWhere.CONSUME_FROM_TIMESTAMP; // with consumeTimestamp yyyyMMddHHmmss
            default:
                throw new BadArgs("consumeFromWhere is first, last or timestamp");
        }
    }

    /**
     * MessageModel moved from org.apache.rocketmq.common.protocol.heartbeat (4.x) to
     * org.apache.rocketmq.remoting.protocol.heartbeat (5.x): set BROADCASTING through whichever setMessageModel the
     * consumer has.
     */
    /** A setter this client version may not have (5.x POP settings): a clear error on 4.9.x. */
    private static Method setter(Object target, String name, Class<?> type) {
        try {
            return target.getClass().getMethod(name, type);
        } catch (NoSuchMethodException e) {
            throw new BadArgs("this client (" + MQVersion.getVersionDesc(MQVersion.CURRENT_VERSION) + ") has no "
                + name + ": POP consumption needs a 5.x client");
        }
    }

    private static void setBroadcasting(Object consumer) throws ReflectiveOperationException {
        for (Method m : consumer.getClass().getMethods()) {
            if (m.getName().equals("setMessageModel") && m.getParameterCount() == 1
                && m.getParameterTypes()[0].isEnum()) {
                @SuppressWarnings({"unchecked", "rawtypes"})
                Object broadcasting = Enum.valueOf((Class) m.getParameterTypes()[0], "BROADCASTING");
                m.invoke(consumer, broadcasting);
                return;
            }
        }
        throw new NoSuchMethodException(consumer.getClass().getName() + ".setMessageModel(MessageModel)");
    }

    /**
     * A broadcasting consumer keeps its offsets in ${rocketmq.client.localOffsetStoreDir:-~/.rocketmq_offsets}
     * (read once, when LocalFileOffsetStore is loaded). Unless the caller set the property or gave `offsetStoreDir`
     * (to keep offsets across runs), a temporary directory, removed at the end, keeps ~ clean.
     */
    private static Path localOffsetStore(String offsetStoreDir) throws IOException {
        if (System.getProperty("rocketmq.client.localOffsetStoreDir") != null) {
            return null;
        }
        if (offsetStoreDir != null) {
            System.setProperty("rocketmq.client.localOffsetStoreDir", offsetStoreDir);
            return null;
        }
        Path dir = Files.createTempDirectory("popgate-remoting-driver-offsets");
        System.setProperty("rocketmq.client.localOffsetStoreDir", dir.toString());
        return dir;
    }

    private static void deleteTree(Path dir) {
        if (dir == null) {
            return;
        }
        try (Stream<Path> paths = Files.walk(dir)) {
            paths.sorted(Comparator.reverseOrder()).forEach(p -> p.toFile().delete());
        } catch (IOException e) {
            System.err.println("popgate-remoting-driver: could not remove " + dir + ": " + e);
        }
    }

    // ---------------------------------------------------------------------------------------------- transact

    /**
     * A TransactionMQProducer sends `count` half messages with sendMessageInTransaction; executeLocalTransaction
     * answers `resolution` (commit | rollback | unknown), checkLocalTransaction answers `checkResolution` (default
     * commit) and records every check-back. With `sendAfterMs`, the first send waits that long after the start.
     * The producer then stays up `lingerMs`, and, with `holdFile`, until that
     * file exists (at most until `timeoutMs` from the start: "holdTimedOut"). With `endWhenFile`, each local
     * transaction waits until that file exists before it answers (so before the end is sent).
     */
    private static Map<String, Object> transact(Args a, long startMs) throws Exception {
        Common c = Common.parse(a);
        String topic = a.required("topic");
        String producerGroup = a.string("producerGroup", a.string("group", "driver_producer"));
        int count = a.integer("count", 1);
        int startIndex = a.integer("startIndex", 0);
        MessageSpec spec = MessageSpec.parse(a);
        LocalTransactionState local = transactionState(a.string("resolution", "commit"), "resolution");
        LocalTransactionState check = transactionState(a.string("checkResolution", "commit"), "checkResolution");
        long lingerMs = a.longValue("lingerMs", 0);
        String holdFile = a.string("holdFile", null);
        String endWhenFile = a.string("endWhenFile", null);
        int sendTimeoutMs = a.integer("sendTimeoutMs", 3000);
        long sendAfterMs = a.longValue("sendAfterMs", 0);
        a.rejectUnknown();
        long endWaitDeadline = startMs + c.timeoutMs;

        Map<String, Object> out = new LinkedHashMap<>();
        out.put("startMs", startMs);
        out.put("producerGroup", producerGroup);
        List<Map<String, Object>> checks = new ArrayList<>();
        TransactionMQProducer producer = new TransactionMQProducer(producerGroup, c.hook);
        c.apply(producer);
        producer.setSendMsgTimeout(sendTimeoutMs);
        producer.setTransactionListener(new TransactionListener() {
            @Override
            public LocalTransactionState executeLocalTransaction(Message msg, Object arg) {
                // With endWhenFile, the local transaction "runs" until that file exists: the half message is
                // stored and the end not yet sent (a test restarts popgate meanwhile).
                while (endWhenFile != null && !new java.io.File(endWhenFile).exists()
                    && System.currentTimeMillis() < endWaitDeadline) {
                    try {
                        Thread.sleep(50);
                    } catch (InterruptedException e) {
                        Thread.currentThread().interrupt();
                        break;
                    }
                }
                return local;
            }

            @Override
            public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                Map<String, Object> e = new LinkedHashMap<>();
                e.put("msgId", msg.getMsgId());
                e.put("transactionId", msg.getTransactionId());
                e.put("uniqKey", msg.getProperty("UNIQ_KEY"));
                e.put("body", bodyText(msg.getBody() == null ? new byte[0] : msg.getBody()));
                e.put("topic", msg.getTopic());
                e.put("queueId", msg.getQueueId());
                e.put("queueOffset", msg.getQueueOffset());
                e.put("answer", String.valueOf(check));
                e.put("atMs", System.currentTimeMillis());
                e.put("thread", Thread.currentThread().getName());
                synchronized (checks) {
                    checks.add(e);
                }
                return check;
            }
        });
        try {
            producer.start();
        } catch (Throwable t) {
            return startupFailed(out, "transaction producer", t);
        }
        out.put("clientId", producer.buildMQClientId());
        out.put("startedMs", System.currentTimeMillis());
        // An app that starts its producer at boot and sends later: the client's first scheduled heartbeat (1 s
        // after the start) goes out before the send has told it of any broker.
        Thread.sleep(sendAfterMs);

        List<Map<String, Object>> sent = new ArrayList<>();
        List<Map<String, Object>> errors = new ArrayList<>();
        for (int n = 0; n < count; n++) {
            int i = startIndex + n;
            String label = spec.label(i);
            long t0 = System.currentTimeMillis();
            try {
                TransactionSendResult r = producer.sendMessageInTransaction(spec.build(topic, i), null);
                Map<String, Object> e = new LinkedHashMap<>();
                e.put("index", i);
                e.put("body", label);
                e.put("msgId", r.getMsgId());
                e.put("offsetMsgId", r.getOffsetMsgId());
                e.put("transactionId", r.getTransactionId());
                e.put("status", String.valueOf(r.getSendStatus()));
                e.put("localState", String.valueOf(r.getLocalTransactionState()));
                MessageQueue mq = r.getMessageQueue();
                e.put("broker", mq == null ? null : mq.getBrokerName());
                e.put("queueId", mq == null ? null : mq.getQueueId());
                e.put("queueOffset", r.getQueueOffset());
                e.put("sentAtMs", t0);
                e.put("latencyMs", System.currentTimeMillis() - t0);
                sent.add(e);
            } catch (Throwable t) {
                errors.add(sendError(i, label, t, t0));
            }
        }
        out.put("sent", sent);
        out.put("errors", errors);
        out.put("sentMs", System.currentTimeMillis());
        if (lingerMs > 0) {
            Thread.sleep(lingerMs);
        }
        if (holdFile != null) {
            long deadline = startMs + c.timeoutMs;
            Path hold = Paths.get(holdFile);
            while (!Files.exists(hold) && System.currentTimeMillis() < deadline) {
                Thread.sleep(100);
            }
            out.put("holdTimedOut", !Files.exists(hold));
        }
        out.put("shutdownMs", shutdown(producer::shutdown, 10000));
        synchronized (checks) {
            List<Object> copy = new ArrayList<>();
            for (Map<String, Object> e : checks) {
                copy.add(new LinkedHashMap<>(e));
            }
            out.put("checks", copy);
        }
        out.put("finishedMs", System.currentTimeMillis());
        return out;
    }

    private static LocalTransactionState transactionState(String s, String what) {
        switch (s) {
            case "commit":
                return LocalTransactionState.COMMIT_MESSAGE;
            case "rollback":
                return LocalTransactionState.ROLLBACK_MESSAGE;
            case "unknown":
                return LocalTransactionState.UNKNOW;
            default:
                throw new BadArgs(what + " is commit, rollback or unknown");
        }
    }

    // ---------------------------------------------------------------------------------------------- helpers

    /** The arguments every scenario shares, applied to a client's ClientConfig. */
    static final class Common {
        String namesrv;
        long timeoutMs;
        RPCHook hook;
        String instanceName;
        String namespace;
        Integer pollNameServerIntervalMs;
        Integer heartbeatBrokerIntervalMs;
        Integer persistConsumerOffsetIntervalMs;
        boolean useTLS;

        static Common parse(Args a) {
            Common c = new Common();
            c.namesrv = a.required("namesrv");
            c.timeoutMs = a.longValue("timeoutMs", 30000);
            String accessKey = a.string("accessKey", null);
            String secretKey = a.string("secretKey", null);
            if (accessKey != null || secretKey != null) {
                if (accessKey == null || secretKey == null) {
                    throw new BadArgs("accessKey and secretKey go together");
                }
                c.hook = new AclClientRPCHook(new SessionCredentials(accessKey, secretKey));
            }
            c.instanceName = a.string("instanceName", null);
            c.namespace = a.string("namespace", null);
            c.pollNameServerIntervalMs = a.has("pollNameServerIntervalMs")
                ? a.integer("pollNameServerIntervalMs", 30000) : null;
            c.heartbeatBrokerIntervalMs = a.has("heartbeatBrokerIntervalMs")
                ? a.integer("heartbeatBrokerIntervalMs", 30000) : null;
            c.persistConsumerOffsetIntervalMs = a.has("persistConsumerOffsetIntervalMs")
                ? a.integer("persistConsumerOffsetIntervalMs", 5000) : null;
            // TLS to popgate; the client accepts any certificate (its default tls.test.mode.enable=true).
            c.useTLS = a.bool("useTLS", false);
            return c;
        }

        void apply(ClientConfig config) {
            config.setNamesrvAddr(namesrv);
            // Never the VIP channel (broker port - 2): popgate listens on one port.
            config.setVipChannelEnabled(false);
            if (instanceName != null) {
                config.setInstanceName(instanceName);
            }
            if (namespace != null) {
                config.setNamespace(namespace);
            }
            if (pollNameServerIntervalMs != null) {
                config.setPollNameServerInterval(pollNameServerIntervalMs);
            }
            if (heartbeatBrokerIntervalMs != null) {
                config.setHeartbeatBrokerInterval(heartbeatBrokerIntervalMs);
            }
            if (persistConsumerOffsetIntervalMs != null) {
                config.setPersistConsumerOffsetInterval(persistConsumerOffsetIntervalMs);
            }
            config.setUseTLS(useTLS);
        }
    }

    /**
     * How the driver builds message i: body `<bodyPrefix>-<i>` (UTF-8), or, with `bodyBytes`, that label, a space
     * and 'x's up to exactly `bodyBytes` bytes (consumers report such a body by its label, see bodyText); `tag`,
     * `keys` (space separated) with `{i}` replaced by i; `delayLevel`; user `properties`.
     */
    static final class MessageSpec {
        String bodyPrefix;
        Integer bodyBytes;
        String tag;
        String keys;
        int delayLevel;
        Map<String, String> properties;

        static MessageSpec parse(Args a) {
            MessageSpec s = new MessageSpec();
            s.bodyPrefix = a.string("bodyPrefix", "m");
            s.bodyBytes = a.has("bodyBytes") ? a.integer("bodyBytes", 0) : null;
            s.tag = a.string("tag", null);
            s.keys = a.string("keys", null);
            s.delayLevel = a.integer("delayLevel", 0);
            s.properties = a.stringMap("properties");
            if (s.bodyBytes != null && s.bodyPrefix.indexOf(' ') >= 0) {
                throw new BadArgs("bodyPrefix cannot contain a space when bodyBytes is given");
            }
            return s;
        }

        String label(int i) {
            return bodyPrefix + "-" + i;
        }

        byte[] body(int i) {
            byte[] label = label(i).getBytes(StandardCharsets.UTF_8);
            if (bodyBytes == null || bodyBytes <= label.length) {
                return label;
            }
            byte[] b = new byte[bodyBytes];
            System.arraycopy(label, 0, b, 0, label.length);
            b[label.length] = ' ';
            Arrays.fill(b, label.length + 1, b.length, (byte) 'x');
            return b;
        }

        Message build(String topic, int i) {
            Message m = new Message(topic, body(i));
            if (tag != null) {
                m.setTags(subst(tag, i));
            }
            if (keys != null) {
                m.setKeys(subst(keys, i));
            }
            if (delayLevel > 0) {
                m.setDelayTimeLevel(delayLevel);
            }
            for (Map.Entry<String, String> p : properties.entrySet()) {
                m.putUserProperty(p.getKey(), subst(p.getValue(), i));
            }
            return m;
        }
    }

    /** A body as text: a driver-padded body ("label xxx...x") by its label, anything else in full. */
    static String bodyText(byte[] body) {
        String s = new String(body, StandardCharsets.UTF_8);
        int sp = s.lastIndexOf(' ');
        if (sp <= 0 || sp == s.length() - 1) {
            return s;
        }
        for (int k = sp + 1; k < s.length(); k++) {
            if (s.charAt(k) != 'x') {
                return s;
            }
        }
        return s.substring(0, sp);
    }

    private static String subst(String template, int i) {
        return template.replace("{i}", Integer.toString(i));
    }

    interface Shutdown {
        void run() throws Exception;
    }

    /** Shuts a client down on a daemon thread; returns how long it took, or -1 if it did not finish in time. */
    static long shutdown(Shutdown client, long timeoutMillis) {
        long t0 = System.currentTimeMillis();
        Thread closer = new Thread(() -> {
            try {
                client.run();
            } catch (Throwable t) {
                System.err.println("popgate-remoting-driver: shutdown failed: " + t);
            }
        }, "driver-shutdown");
        closer.setDaemon(true);
        closer.start();
        try {
            closer.join(timeoutMillis);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        return closer.isAlive() ? -1 : System.currentTimeMillis() - t0;
    }

    static Map<String, Object> startupFailed(Map<String, Object> out, String what, Throwable t) {
        t.printStackTrace(System.err);
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

    /**
     * {"error": "<SimpleClass>: <message>", "errorClass", "code" (the response code of an MQClientException or
     * MQBrokerException, when it has one), "errorMessage" (theirs, without the client's FAQ link), "brokerAddr",
     * "causes": [...]} of a throwable.
     */
    static Map<String, Object> describe(Throwable t) {
        while ((t instanceof ExecutionException || t instanceof InvocationTargetException) && t.getCause() != null) {
            t = t.getCause();
        }
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("error", t.getClass().getSimpleName() + ": " + t.getMessage());
        e.put("errorClass", t.getClass().getName());
        if (t instanceof MQClientException) {
            MQClientException m = (MQClientException) t;
            if (m.getResponseCode() != 0 && m.getResponseCode() != -1) {
                e.put("code", m.getResponseCode());
            }
            if (m.getErrorMessage() != null) {
                e.put("errorMessage", m.getErrorMessage());
            }
        } else if (t instanceof MQBrokerException) {
            MQBrokerException m = (MQBrokerException) t;
            e.put("code", m.getResponseCode());
            e.put("errorMessage", m.getErrorMessage());
            if (m.getBrokerAddr() != null) {
                e.put("brokerAddr", m.getBrokerAddr());
            }
        }
        List<Object> causes = new ArrayList<>();
        for (Throwable c = t.getCause(); c != null && c != t && causes.size() < 5; c = c.getCause()) {
            causes.add(c.getClass().getName() + ": " + c.getMessage());
        }
        if (!causes.isEmpty()) {
            e.put("causes", causes);
        }
        return e;
    }
}
