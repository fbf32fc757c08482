package dev.popgate.driver;

import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.BitSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.LongAccumulator;
import java.util.concurrent.atomic.LongAdder;
import java.util.concurrent.locks.LockSupport;

/**
 * What the drivers' `load` scenarios share (the gRPC driver's over the SDK, the remoting driver's over the remoting
 * client), so the two measure alike: the body header that carries a message's run, sequence number and send time,
 * the tracker of consumed sequence numbers (unique, duplicate, foreign), the latency recorders and their
 * percentiles, and the numeric argument checks.
 *
 * <p>Body: {@code "<run>:<seq>:<sendStartNanos>:"} then padding. The consumer runs in the sending JVM, so
 * System.nanoTime() of the send start gives the end-to-end latency; `run` (random per run) tells a run's messages
 * from leftovers of earlier runs on the same topic.
 */
public final class LoadStats {
    /** Longest possible header: 10-digit run, 19-digit seq, 20-char nanos (with sign), three ':'. */
    public static final int MIN_SIZE = 64;

    private LoadStats() {
    }

    public static double round(double v) {
        return Math.round(v * 1000) / 1000.0;
    }

    // ---------------------------------------------------------------------------------------------- body header

    /** Writes "run:seq:nanos:" at the front of body (the rest stays as it is: padding, or stale digits). */
    /** Parks the calling thread until System.nanoTime() reaches deadlineNanos (a paced sender's next slot). */
    public static void sleepUntil(long deadlineNanos) {
        long wait;
        while ((wait = deadlineNanos - System.nanoTime()) > 0) {
            LockSupport.parkNanos(wait);
        }
    }

    public static void writeHeader(byte[] body, long run, long seq, long nanos) {
        int p = writeLong(body, 0, run);
        body[p++] = ':';
        p = writeLong(body, p, seq);
        body[p++] = ':';
        p = writeLong(body, p, nanos);
        body[p] = ':';
    }

    private static int writeLong(byte[] b, int p, long v) {
        String s = Long.toString(v); // at most 20 chars; cheap next to a gRPC call
        for (int i = 0; i < s.length(); i++) {
            b[p++] = (byte) s.charAt(i);
        }
        return p;
    }

    /** Reads "run:seq:nanos:" into out[0..2] without copying the body; false if it is not ours. */
    public static boolean parseHeader(ByteBuffer body, long[] out) {
        int p = body.position();
        int end = body.limit();
        for (int field = 0; field < 3; field++) {
            boolean negative = p < end && body.get(p) == '-';
            if (negative) {
                p++;
            }
            long v = 0;
            int digits = 0;
            while (p < end && body.get(p) >= '0' && body.get(p) <= '9' && digits < 19) {
                v = v * 10 + (body.get(p++) - '0');
                digits++;
            }
            if (digits == 0 || p >= end || body.get(p++) != ':') {
                return false;
            }
            out[field] = negative ? -v : v;
        }
        return true;
    }

    // ---------------------------------------------------------------------------------------------- trackers

    /** Which sequence numbers were consumed: striped bit sets, so consumer threads rarely wait on each other. */
    public static final class Consumed {
        private static final int STRIPES = 16; // power of two
        private final BitSet[] seen = new BitSet[STRIPES];
        public final LongAdder unique = new LongAdder();
        public final LongAdder duplicates = new LongAdder();
        public final LongAdder foreign = new LongAdder();
        /** System.nanoTime() of the last unique consumption (Long.MIN_VALUE: none yet). */
        public final LongAccumulator lastAt = new LongAccumulator(Math::max, Long.MIN_VALUE);
        public volatile boolean frozen;

        public Consumed() {
            for (int i = 0; i < STRIPES; i++) {
                seen[i] = new BitSet();
            }
        }

        /** Marks seq consumed at atNanos; true if it is the first time (and counting is not frozen). */
        public boolean mark(long seq, long atNanos) {
            if (frozen || seq < 0 || (seq / STRIPES) > Integer.MAX_VALUE) {
                return false;
            }
            BitSet bits = seen[(int) (seq & (STRIPES - 1))];
            int index = (int) (seq / STRIPES);
            boolean first;
            synchronized (bits) {
                first = !bits.get(index);
                if (first) {
                    bits.set(index);
                }
            }
            if (first) {
                unique.increment();
                lastAt.accumulate(atNanos);
            } else {
                duplicates.increment();
            }
            return first;
        }
    }

    /** Latency samples (nanos) kept in per-thread arrays, merged and sorted only when the figures are read. */
    public static final class Latencies {
        private final List<Recorder> recorders = new ArrayList<>(); // guarded by itself

        public Recorder newRecorder() {
            Recorder r = new Recorder();
            synchronized (recorders) {
                recorders.add(r);
            }
            return r;
        }

        /** {"samples","p50","p90","p99","p999","max"} in ms; percentiles null without samples. */
        public Map<String, Object> percentilesMs() {
            long[] all = merge();
            Arrays.sort(all);
            Map<String, Object> m = new LinkedHashMap<>();
            m.put("samples", all.length);
            m.put("p50", percentileMs(all, 0.50));
            m.put("p90", percentileMs(all, 0.90));
            m.put("p99", percentileMs(all, 0.99));
            m.put("p999", percentileMs(all, 0.999));
            m.put("max", all.length == 0 ? null : round(all[all.length - 1] / 1e6));
            return m;
        }

        private long[] merge() {
            List<long[]> parts = new ArrayList<>();
            synchronized (recorders) {
                for (Recorder r : recorders) {
                    parts.add(r.snapshot());
                }
            }
            long[] all = new long[parts.stream().mapToInt(p -> p.length).sum()];
            int at = 0;
            for (long[] p : parts) {
                System.arraycopy(p, 0, all, at, p.length);
                at += p.length;
            }
            return all;
        }

        /** Nearest-rank percentile of sorted samples, in ms. */
        private static Double percentileMs(long[] sorted, double p) {
            if (sorted.length == 0) {
                return null;
            }
            int rank = (int) Math.ceil(p * sorted.length);
            return round(sorted[Math.max(0, rank - 1)] / 1e6);
        }

        /**
         * One thread's samples. Synchronized only so that reading them at the end is safe even if a straggler still
         * writes; uncontended, that costs next to nothing compared with one gRPC call.
         */
        public static final class Recorder {
            private long[] samples = new long[1 << 14];
            private int count;

            public synchronized void add(long nanos) {
                if (count == samples.length) {
                    samples = Arrays.copyOf(samples, samples.length * 2);
                }
                samples[count++] = nanos;
            }

            public synchronized long[] snapshot() {
                return Arrays.copyOf(samples, count);
            }
        }
    }

    public static double positive(Args a, String key, double dflt) {
        double v = number(a, key, dflt);
        if (!(v > 0)) {
            throw new BadArgs(key + " must be positive");
        }
        return v;
    }

    public static long atLeast(Args a, String key, int dflt, int min) {
        int v = a.integer(key, dflt);
        if (v < min) {
            throw new BadArgs(key + " must be at least " + min);
        }
        return v;
    }

    public static double number(Args a, String key, double dflt) {
        String v = a.string(key, null);
        if (v == null) {
            return dflt;
        }
        try {
            return Double.parseDouble(v.trim());
        } catch (NumberFormatException e) {
            throw new BadArgs(key + " must be a number, got '" + v + "'");
        }
    }
}
