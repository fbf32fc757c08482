package dev.popgate.remotingdriver;

import static dev.popgate.driver.LoadStats.MIN_SIZE;
import static dev.popgate.driver.LoadStats.atLeast;
import static dev.popgate.driver.LoadStats.number;
import static dev.popgate.driver.LoadStats.parseHeader;
import static dev.popgate.driver.LoadStats.positive;
import static dev.popgate.driver.LoadStats.round;
import static dev.popgate.driver.LoadStats.sleepUntil;
import static dev.popgate.driver.LoadStats.writeHeader;

import dev.popgate.driver.Args;
import dev.popgate.driver.BadArgs;
import dev.popgate.driver.LoadStats.Consumed;
import dev.popgate.driver.LoadStats.Latencies;

import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;

import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;

/**
 * The `load` scenario: a steady load for comparing the paths a remoting app can take to the cluster (straight at the
 * name server, through popgate's remoting front, through Apache's proxy's remoting port) under the same traffic; the
 * gRPC driver's `load` in the remoting client's terms. `senders` threads call the synchronous
 * {@code DefaultMQProducer.send} in a loop on one shared producer for `seconds`, or until `count` messages were sent
 * (optionally capped at `rate` msgs/s per sender), while one {@code DefaultMQPushConsumer} with `consumers`
 * consumption threads takes them off, until everything sent was consumed or nothing new arrived for `drainSeconds`.
 * Prints throughput, counts and latency percentiles only.
 *
 * <p>The driver must not be the bottleneck: nothing is logged or kept per message except one long per latency sample
 * in a per-thread array, counters are {@link LongAdder}s, each sender reuses one body buffer (the client's Message
 * keeps a reference, so each send gets a copy of it: 1 KiB, next to a network round trip).
 *
 * <p>Body: the header of {@link dev.popgate.driver.LoadStats} then 'x' padding, exactly `size` bytes. The consumer
 * starts from the first offset on the (fresh) topic, so nothing sent before its first rebalance is skipped; sends
 * start `warmupSeconds` after its first rebalance gave it queues ("assignedMs"), so that neither that rebalance nor
 * its first pulls are in the latencies.
 *
 * <p>Counts: "consumed" is unique sequence numbers (the listener returned CONSUME_SUCCESS), a repeat is a "duplicate";
 * "lost" = sent - consumed (a send that failed on the client but was stored can make it negative).
 */
final class Load {
    private static final int MAX_FIRST_ERRORS = 5;
    private static final long ASSIGNMENT_WAIT_MS = 30_000;

    // ---- arguments
    private final Driver.Common common;
    private final String topic;
    private final String group;
    private final double seconds;
    private final long count;
    private final int senders;
    private final double rate;
    private final int size;
    private final int consumers;
    private final int sendTimeoutMs;
    private final double drainSeconds;
    private final double warmupSeconds;

    // ---- shared state
    private final long runId = ThreadLocalRandom.current().nextInt(1, Integer.MAX_VALUE);
    private final AtomicLong nextSeq = new AtomicLong();
    private final LongAdder sent = new LongAdder();
    private final LongAdder sendErrors = new LongAdder();
    private final Consumed consumed = new Consumed();
    private final Latencies sendLatency = new Latencies();
    private final Latencies endToEndLatency = new Latencies();
    private final List<Object> firstErrors = new ArrayList<>(); // guarded by itself

    private Load(Args a) {
        common = Driver.Common.parse(a);
        topic = a.required("topic");
        group = a.required("group");
        seconds = positive(a, "seconds", 15);
        count = a.longValue("count", 0);
        senders = (int) atLeast(a, "senders", 16, 1);
        rate = number(a, "rate", 0);
        size = (int) atLeast(a, "size", 1024, MIN_SIZE);
        consumers = (int) atLeast(a, "consumers", 4, 1);
        sendTimeoutMs = (int) atLeast(a, "sendTimeoutMs", 3000, 1);
        drainSeconds = number(a, "drainSeconds", 15);
        warmupSeconds = number(a, "warmupSeconds", 2);
        if (count < 0 || rate < 0 || drainSeconds < 0 || warmupSeconds < 0) {
            throw new BadArgs("count, rate, drainSeconds and warmupSeconds must not be negative");
        }
        a.rejectUnknown();
    }

    static Map<String, Object> run(Args a, long startMs) throws Exception {
        return new Load(a).execute(startMs);
    }

    private Map<String, Object> execute(long startMs) throws Exception {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("startMs", startMs);
        out.put("seconds", seconds);
        out.put("count", count);
        out.put("senders", senders);
        out.put("consumers", consumers);
        out.put("size", size);
        out.put("rate", rate);
        long started = System.currentTimeMillis();
        DefaultMQProducer producer = new DefaultMQProducer(group + "_producer", common.hook);
        common.apply(producer);
        producer.setSendMsgTimeout(sendTimeoutMs);
        try {
            producer.start();
        } catch (Throwable t) {
            return Driver.startupFailed(out, "producer", t);
        }
        DefaultMQPushConsumer consumer;
        try {
            consumer = startConsumer();
        } catch (Throwable t) {
            Driver.shutdown(producer::shutdown, 5000);
            return Driver.startupFailed(out, "push consumer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);
        out.put("assignedMs", awaitAssignment(consumer));
        Thread.sleep((long) (warmupSeconds * 1000));

        long sendStart = System.nanoTime();
        runSenders(producer, sendStart);
        long sendEnd = System.nanoTime();
        long drainMs = drain(sendEnd);
        // Late deliveries (until the consumer is shut down) must not change the figures while they are read.
        consumed.frozen = true;

        report(out, sendStart, sendEnd, drainMs);
        Map<String, Object> closeMs = new LinkedHashMap<>();
        closeMs.put("consumer", Driver.shutdown(consumer::shutdown, 15000));
        closeMs.put("producer", Driver.shutdown(producer::shutdown, 5000));
        out.put("closeMs", closeMs);
        return out;
    }

    // ---------------------------------------------------------------------------------------------- senders

    private void runSenders(DefaultMQProducer producer, long sendStart) throws InterruptedException {
        long sendEnd = sendStart + (long) (seconds * 1e9);
        List<Thread> threads = new ArrayList<>();
        for (int i = 0; i < senders; i++) {
            Latencies.Recorder rec = sendLatency.newRecorder();
            int index = i;
            Thread t = new Thread(() -> sendLoop(producer, rec, index, sendStart, sendEnd), "load-sender-" + i);
            t.setDaemon(true);
            threads.add(t);
        }
        threads.forEach(Thread::start);
        for (Thread t : threads) {
            t.join();
        }
    }

    private void sendLoop(DefaultMQProducer producer, Latencies.Recorder rec, int index, long sendStart,
        long sendEnd) {
        byte[] body = new byte[size];
        Arrays.fill(body, (byte) 'x');
        // Fixed-rate schedule, senders spread over one interval (as in the gRPC driver's load).
        long interval = rate > 0 ? (long) (1e9 / rate) : 0;
        long next = sendStart + interval * index / senders;
        while (true) {
            if (interval > 0) {
                sleepUntil(next);
                next += interval;
            }
            long t0 = System.nanoTime();
            if (t0 - sendEnd >= 0) {
                return;
            }
            long seq = nextSeq.getAndIncrement();
            if (count > 0 && seq >= count) {
                return;
            }
            writeHeader(body, runId, seq, t0);
            Message message = new Message(topic, body.clone());
            try {
                producer.send(message);
                rec.add(System.nanoTime() - t0);
                sent.increment();
            } catch (Throwable t) {
                sendErrors.increment();
                noteError("send", t);
            }
        }
    }

    // ---------------------------------------------------------------------------------------------- consumer

    private DefaultMQPushConsumer startConsumer() throws Exception {
        DefaultMQPushConsumer consumer =
            new DefaultMQPushConsumer(group, common.hook, new AllocateMessageQueueAveragely());
        common.apply(consumer);
        consumer.subscribe(topic, "*");
        consumer.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        // The client checks min <= max on each setter: move the bound that makes room first.
        if (consumers > consumer.getConsumeThreadMax()) {
            consumer.setConsumeThreadMax(consumers);
            consumer.setConsumeThreadMin(consumers);
        } else {
            consumer.setConsumeThreadMin(consumers);
            consumer.setConsumeThreadMax(consumers);
        }
        consumer.setAwaitTerminationMillisWhenShutdown(5000);
        // The listener runs on the consumption threads: one recorder and header scratch array per thread.
        ThreadLocal<Latencies.Recorder> recs = ThreadLocal.withInitial(endToEndLatency::newRecorder);
        ThreadLocal<long[]> headers = ThreadLocal.withInitial(() -> new long[3]);
        consumer.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
            long at = System.nanoTime();
            for (MessageExt m : msgs) {
                record(m.getBody(), headers.get(), at, recs.get());
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        consumer.start();
        return consumer;
    }

    /**
     * Waits (at most ASSIGNMENT_WAIT_MS) until the consumer's first rebalance gave it queues, so that sends do not
     * start against a consumer still asking for its route and its share: on a loaded machine that took seconds, which
     * would be counted as end-to-end latency (and, longer than drainSeconds, as loss). Returns how long it took, or
     * -1 if it got no queue in time (the run goes on: its result shows what that cost).
     */
    private static long awaitAssignment(DefaultMQPushConsumer consumer) throws InterruptedException {
        long t0 = System.currentTimeMillis();
        while (consumer.getDefaultMQPushConsumerImpl().getRebalanceImpl().getProcessQueueTable().isEmpty()) {
            if (System.currentTimeMillis() - t0 > ASSIGNMENT_WAIT_MS) {
                return -1;
            }
            Thread.sleep(20);
        }
        return System.currentTimeMillis() - t0;
    }

    /** Counts one consumed message: unique, duplicate or foreign; a unique one adds an end-to-end sample. */
    private void record(byte[] body, long[] header, long at, Latencies.Recorder rec) {
        if (consumed.frozen) {
            return;
        }
        if (body == null || !parseHeader(ByteBuffer.wrap(body), header) || header[0] != runId) {
            consumed.foreign.increment();
            return;
        }
        if (consumed.mark(header[1], at)) {
            rec.add(at - header[2]);
        }
    }

    /** Waits until all sent messages were consumed or none arrived for drainSeconds; returns how long it took. */
    private long drain(long sendEnd) throws InterruptedException {
        long idleLimit = (long) (drainSeconds * 1e9);
        while (consumed.unique.sum() < sent.sum()) {
            long lastActivity = Math.max(sendEnd, consumed.lastAt.get());
            if (System.nanoTime() - lastActivity >= idleLimit) {
                break;
            }
            Thread.sleep(20);
        }
        return TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - sendEnd);
    }

    // ---------------------------------------------------------------------------------------------- results

    private void report(Map<String, Object> out, long sendStart, long sendEnd, long drainMs) {
        long sentCount = sent.sum();
        long unique = consumed.unique.sum();
        double sendSecs = (sendEnd - sendStart) / 1e9;
        double consumeSecs = unique > 0 ? (consumed.lastAt.get() - sendStart) / 1e9 : 0;
        out.put("sent", sentCount);
        out.put("sendErrors", sendErrors.sum());
        out.put("sendSeconds", round(sendSecs));
        out.put("sendMsgsPerSec", round(sendSecs > 0 ? sentCount / sendSecs : 0));
        out.put("consumed", unique);
        out.put("duplicates", consumed.duplicates.sum());
        out.put("foreign", consumed.foreign.sum());
        out.put("lost", sentCount - unique);
        out.put("drainMs", drainMs);
        out.put("endToEndMsgsPerSec", round(consumeSecs > 0 ? unique / consumeSecs : 0));
        out.put("sendLatencyMs", sendLatency.percentilesMs());
        out.put("endToEndLatencyMs", endToEndLatency.percentilesMs());
        synchronized (firstErrors) {
            out.put("firstErrors", new ArrayList<>(firstErrors));
        }
    }

    private void noteError(String op, Throwable t) {
        synchronized (firstErrors) {
            if (firstErrors.size() < MAX_FIRST_ERRORS) {
                Map<String, Object> e = Driver.describe(t);
                e.put("op", op);
                firstErrors.add(e);
            }
        }
    }
}
