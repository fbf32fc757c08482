package dev.popgate.grpcdriver;

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

import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;
import java.util.concurrent.locks.LockSupport;

import org.apache.rocketmq.client.apis.ClientConfiguration;
import org.apache.rocketmq.client.apis.ClientServiceProvider;
import org.apache.rocketmq.client.apis.consumer.ConsumeResult;
import org.apache.rocketmq.client.apis.consumer.FilterExpression;
import org.apache.rocketmq.client.apis.consumer.FilterExpressionType;
import org.apache.rocketmq.client.apis.consumer.PushConsumer;
import org.apache.rocketmq.client.apis.consumer.SimpleConsumer;
import org.apache.rocketmq.client.apis.message.Message;
import org.apache.rocketmq.client.apis.message.MessageView;
import org.apache.rocketmq.client.apis.producer.Producer;

/**
 * The `load` scenario: a steady load for comparing gRPC fronts (popgate's, Apache's proxy) under the same traffic.
 * `senders` threads call the synchronous {@code producer.send} in a loop on one shared Producer for `seconds`
 * (optionally capped at `rate` msgs/s per sender) while consumers (one shared SimpleConsumer polled by `consumers`
 * threads, or a PushConsumer with `consumers` consumption threads) take the messages off, until everything sent was
 * consumed or nothing new arrived for `drainSeconds`. Prints throughput, counts and latency percentiles only.
 *
 * <p>The driver must not be the bottleneck: nothing is logged or kept per message except one long per latency
 * sample in a per-thread array (merged and sorted at the end), counters are {@link LongAdder}s, and each sender
 * reuses one body buffer (the SDK's MessageBuilder copies the body anyway).
 *
 * <p>Body: {@code "<run>:<seq>:<sendStartNanos>:"} then 'x' padding, exactly `size` bytes (see
 * {@link dev.popgate.driver.LoadStats}, shared with the remoting driver's `load`); leftovers of earlier runs on the
 * same topic are acked and counted as "foreign".
 *
 * <p>Counts: "consumed" is unique sequence numbers (simple: acked OK; push: listener returned SUCCESS), a repeat is
 * a "duplicate"; "lost" = sent - consumed (a send that failed on the client but was stored can make it negative).
 * In push mode the SDK receives and acks by itself (retrying, logging at warn), so receiveErrors and ackErrors stay
 * 0 there; an ack that failed for good shows up as a duplicate when the message is redelivered within the run.
 */
final class Load {
    private static final int MAX_FIRST_ERRORS = 5;
    private static final long RECEIVE_ERROR_BACKOFF_MS = 100;

    // ---- arguments
    private final String topic;
    private final String group;
    private final boolean push;
    private final double seconds;
    private final int senders;
    private final double rate;
    private final int size;
    private final int consumers;
    private final int maxMessageNum;
    private final int invisibleSeconds;
    private final int awaitSeconds;
    private final double drainSeconds;
    private final double warmupSeconds;
    private final ClientConfiguration config;

    // ---- shared state, all lock-free or cheaply guarded
    private final ClientServiceProvider provider = ClientServiceProvider.loadService();
    private final long runId = ThreadLocalRandom.current().nextInt(1, Integer.MAX_VALUE);
    private final AtomicLong nextSeq = new AtomicLong();
    private final LongAdder sent = new LongAdder();
    private final LongAdder sendErrors = new LongAdder();
    private final LongAdder receiveCalls = new LongAdder();
    private final LongAdder receiveErrors = new LongAdder();
    private final LongAdder ackErrors = new LongAdder();
    private final Consumed consumed = new Consumed();
    private final Latencies sendLatency = new Latencies();
    private final Latencies endToEndLatency = new Latencies();
    private final List<Object> firstErrors = new ArrayList<>(); // guarded by itself
    private volatile boolean stopConsumers;
    /** Simple mode: pollers between a non-empty receive and the end of its acks. */
    private final AtomicInteger batchesInFlight = new AtomicInteger();

    private Load(Args a) {
        String endpoint = a.required("endpoint");
        topic = a.required("topic");
        group = a.required("group");
        String mode = a.string("mode", "simple");
        if (!mode.equals("simple") && !mode.equals("push")) {
            throw new BadArgs("mode must be simple or push, got '" + mode + "'");
        }
        push = mode.equals("push");
        seconds = positive(a, "seconds", 15);
        senders = (int) atLeast(a, "senders", 16, 1);
        rate = number(a, "rate", 0);
        size = (int) atLeast(a, "size", 1024, MIN_SIZE);
        consumers = (int) atLeast(a, "consumers", 4, 1);
        maxMessageNum = (int) atLeast(a, "maxMessageNum", 32, 1);
        invisibleSeconds = (int) atLeast(a, "invisibleSeconds", 30, 1);
        awaitSeconds = (int) atLeast(a, "awaitSeconds", 5, 0);
        drainSeconds = number(a, "drainSeconds", 15);
        warmupSeconds = number(a, "warmupSeconds", 2);
        if (rate < 0 || drainSeconds < 0 || warmupSeconds < 0) {
            throw new BadArgs("rate, drainSeconds and warmupSeconds must not be negative");
        }
        config = Driver.clientConfiguration(a, endpoint);
        a.rejectUnknown();
    }

    static Map<String, Object> run(Args a) throws Exception {
        return new Load(a).execute();
    }

    private Map<String, Object> execute() throws Exception {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("scenario", "load");
        out.put("mode", push ? "push" : "simple");
        out.put("seconds", seconds);
        out.put("senders", senders);
        out.put("consumers", consumers);
        out.put("size", size);
        out.put("rate", rate);
        out.put("maxMessageNum", maxMessageNum);
        long started = System.currentTimeMillis();
        Producer producer;
        try {
            producer = provider.newProducerBuilder().setClientConfiguration(config).setTopics(topic).build();
        } catch (Throwable t) {
            return Driver.startupFailed(out, started, "producer", t);
        }
        // Consumers start before the first send: popgate and Apache's proxy both consume from the group's position,
        // which a new group gets on its first receive (at the queue's end), so an earlier message could be skipped.
        AutoCloseable consumer;
        try {
            consumer = push ? startPushConsumer() : startSimpleConsumer();
        } catch (Throwable t) {
            Driver.close(producer, 5000);
            return Driver.startupFailed(out, started, push ? "push consumer" : "simple consumer", t);
        }
        out.put("startupMs", System.currentTimeMillis() - started);
        // Let the consumers' first receives (the push consumer's after its first assignment scan) reach the server.
        Thread.sleep((long) (warmupSeconds * 1000));

        long sendStart = System.nanoTime();
        runSenders(producer, sendStart);
        long sendEnd = System.nanoTime();
        long drainMs = drain(sendEnd);
        stopConsumers();

        report(out, sendStart, sendEnd, drainMs);
        Map<String, Object> closeMs = new LinkedHashMap<>();
        closeMs.put("consumer", Driver.close(consumer, 5000));
        closeMs.put("producer", Driver.close(producer, 5000));
        out.put("closeMs", closeMs);
        return out;
    }

    // ---------------------------------------------------------------------------------------------- senders

    /** Runs the senders for `seconds` from sendStart and waits for them; a send in flight at the end completes. */
    private void runSenders(Producer producer, long sendStart) throws InterruptedException {
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

    private void sendLoop(Producer producer, Latencies.Recorder rec, int index, long sendStart, long sendEnd) {
        byte[] body = new byte[size];
        Arrays.fill(body, (byte) 'x');
        // Fixed-rate schedule (like scheduleAtFixedRate): a send that ran late is followed by catch-up sends.
        // Senders are spread over one interval, so that with a rate cap they do not all send at the same instant.
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
            writeHeader(body, runId, nextSeq.getAndIncrement(), t0);
            Message message = provider.newMessageBuilder().setTopic(topic).setBody(body).build();
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

    // ---------------------------------------------------------------------------------------------- consumers

    private SimpleConsumer startSimpleConsumer() throws Exception {
        SimpleConsumer consumer = provider.newSimpleConsumerBuilder().setClientConfiguration(config)
            .setConsumerGroup(group).setSubscriptionExpressions(Collections.singletonMap(topic, everything()))
            .setAwaitDuration(Duration.ofSeconds(awaitSeconds)).build();
        for (int i = 0; i < consumers; i++) {
            Latencies.Recorder rec = endToEndLatency.newRecorder();
            Thread t = new Thread(() -> pollLoop(consumer, rec), "load-consumer-" + i);
            t.setDaemon(true);
            t.start();
        }
        return consumer;
    }

    /** One poller: receive a batch, ack all of it asynchronously, wait for those acks, count, repeat. */
    private void pollLoop(SimpleConsumer consumer, Latencies.Recorder rec) {
        long[] header = new long[3];
        Duration invisible = Duration.ofSeconds(invisibleSeconds);
        while (!stopConsumers) {
            List<MessageView> views = receive(consumer, invisible);
            if (views.isEmpty()) {
                continue;
            }
            batchesInFlight.incrementAndGet();
            try {
                ackAndRecord(consumer, views, header, rec);
            } finally {
                batchesInFlight.decrementAndGet();
            }
        }
    }

    private void ackAndRecord(SimpleConsumer consumer, List<MessageView> views, long[] header,
        Latencies.Recorder rec) {
        long receivedAt = System.nanoTime();
        List<CompletableFuture<Void>> acks = new ArrayList<>(views.size());
        for (MessageView view : views) {
            acks.add(ackAsync(consumer, view));
        }
        for (int i = 0; i < views.size(); i++) {
            if (awaitAck(acks.get(i))) {
                // Counted as consumed once acked; the latency is to when it was received.
                record(views.get(i), header, receivedAt, System.nanoTime(), rec);
            }
        }
    }

    private List<MessageView> receive(SimpleConsumer consumer, Duration invisible) {
        receiveCalls.increment();
        try {
            return consumer.receive(maxMessageNum, invisible);
        } catch (Throwable t) {
            receiveErrors.increment();
            noteError("receive", t);
            // Do not spin on an immediate failure (proxy down, rejection).
            LockSupport.parkNanos(TimeUnit.MILLISECONDS.toNanos(RECEIVE_ERROR_BACKOFF_MS));
            return Collections.emptyList();
        }
    }

    private static CompletableFuture<Void> ackAsync(SimpleConsumer consumer, MessageView view) {
        try {
            return consumer.ackAsync(view);
        } catch (Throwable t) {
            return CompletableFuture.failedFuture(t);
        }
    }

    private boolean awaitAck(CompletableFuture<Void> ack) {
        try {
            ack.get();
            return true;
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return false;
        } catch (Throwable t) {
            ackErrors.increment();
            noteError("ack", t);
            return false;
        }
    }

    private PushConsumer startPushConsumer() throws Exception {
        // The listener runs on the SDK's consumption threads: one recorder and header scratch array per thread.
        ThreadLocal<Latencies.Recorder> recs = ThreadLocal.withInitial(endToEndLatency::newRecorder);
        ThreadLocal<long[]> headers = ThreadLocal.withInitial(() -> new long[3]);
        return provider.newPushConsumerBuilder().setClientConfiguration(config).setConsumerGroup(group)
            .setSubscriptionExpressions(Collections.singletonMap(topic, everything()))
            .setConsumptionThreadCount(consumers)
            .setMessageListener(view -> {
                long at = System.nanoTime();
                record(view, headers.get(), at, at, recs.get());
                return ConsumeResult.SUCCESS;
            }).build();
    }

    private static FilterExpression everything() {
        return new FilterExpression("*", FilterExpressionType.TAG);
    }

    /** Counts one consumed message: unique, duplicate or foreign; a unique one adds an end-to-end sample. */
    private void record(MessageView view, long[] header, long receivedAt, long consumedAt, Latencies.Recorder rec) {
        if (consumed.frozen) {
            return;
        }
        if (!parseHeader(view.getBody(), header) || header[0] != runId) {
            consumed.foreign.increment();
            return;
        }
        if (consumed.mark(header[1], consumedAt)) {
            rec.add(receivedAt - header[2]);
        }
    }

    // ---------------------------------------------------------------------------------------------- drain, stop

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

    /**
     * Lets the pollers finish the acks of batches already received (bounded: an ack times out after the SDK's 3 s
     * request timeout), then freezes the counts so that late deliveries (the push consumer until it is closed, a
     * receive returning after the stop) do not change the figures while they are read. Pollers waiting in a long
     * poll are not waited for (up to awaitSeconds for nothing): closing the client ends them.
     */
    private void stopConsumers() throws InterruptedException {
        stopConsumers = true;
        long deadline = System.currentTimeMillis() + 5000;
        while (batchesInFlight.get() > 0 && System.currentTimeMillis() < deadline) {
            Thread.sleep(5);
        }
        consumed.frozen = true;
    }

    // ---------------------------------------------------------------------------------------------- results

    private void report(Map<String, Object> out, long sendStart, long sendEnd, long drainMs) {
        long sentCount = sent.sum();
        long unique = consumed.unique.sum();
        double sendSecs = (sendEnd - sendStart) / 1e9;
        long lastAt = consumed.lastAt.get();
        double consumeSecs = unique > 0 ? (lastAt - sendStart) / 1e9 : 0;
        out.put("sent", sentCount);
        out.put("sendErrors", sendErrors.sum());
        out.put("sendSeconds", round(sendSecs));
        out.put("sendMsgsPerSec", round(sendSecs > 0 ? sentCount / sendSecs : 0));
        out.put("consumed", unique);
        out.put("duplicates", consumed.duplicates.sum());
        out.put("foreign", consumed.foreign.sum());
        if (!push) {
            out.put("receiveCalls", receiveCalls.sum());
        }
        out.put("receiveErrors", receiveErrors.sum());
        out.put("ackErrors", ackErrors.sum());
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
