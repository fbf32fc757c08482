package dev.popgate.driver;

import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/** Scenario arguments, from one JSON object or key=value words; unknown keys are an error (typos). */
public final class Args {
    private final Map<String, Object> values;
    private final Set<String> used = new HashSet<>();

    private Args(Map<String, Object> values) {
        this.values = values;
    }

    @SuppressWarnings("unchecked")
    public static Args parse(String[] words) {
        Map<String, Object> m = new LinkedHashMap<>();
        if (words.length == 1 && words[0].trim().startsWith("{")) {
            Object v = Json.parse(words[0]);
            if (!(v instanceof Map)) {
                throw new IllegalArgumentException("arguments must be a JSON object");
            }
            m.putAll((Map<String, Object>) v);
        } else {
            for (String w : words) {
                int eq = w.indexOf('=');
                if (eq <= 0) {
                    throw new IllegalArgumentException("expected a JSON object or key=value words, got '" + w
                        + "'");
                }
                m.put(w.substring(0, eq), w.substring(eq + 1));
            }
        }
        return new Args(m);
    }

    public boolean has(String key) {
        used.add(key);
        return values.get(key) != null;
    }

    public String string(String key, String dflt) {
        used.add(key);
        Object v = values.get(key);
        if (v == null) {
            return dflt;
        }
        if (v instanceof Map || v instanceof List) {
            throw new BadArgs(key + " must be a string");
        }
        if (v instanceof Double && ((Double) v) == Math.rint((Double) v)) {
            return Long.toString(((Double) v).longValue());
        }
        return v.toString();
    }

    public String required(String key) {
        String v = string(key, null);
        if (v == null || v.isEmpty()) {
            throw new BadArgs("missing required argument '" + key + "'");
        }
        return v;
    }

    public long longValue(String key, long dflt) {
        String v = string(key, null);
        if (v == null) {
            return dflt;
        }
        try {
            return Long.parseLong(v.trim());
        } catch (NumberFormatException e) {
            throw new BadArgs(key + " must be an integer, got '" + v + "'");
        }
    }

    public int integer(String key, int dflt) {
        long v = longValue(key, dflt);
        if (v < Integer.MIN_VALUE || v > Integer.MAX_VALUE) {
            throw new BadArgs(key + " out of range");
        }
        return (int) v;
    }

    public boolean bool(String key, boolean dflt) {
        String v = string(key, null);
        if (v == null) {
            return dflt;
        }
        switch (v.trim().toLowerCase()) {
            case "true": case "1": case "yes": return true;
            case "false": case "0": case "no": return false;
            default: throw new BadArgs(key + " must be true or false, got '" + v + "'");
        }
    }

    /** A JSON array of strings, or one comma-separated string; empty when absent. */
    public List<String> list(String key) {
        used.add(key);
        Object v = values.get(key);
        List<String> out = new ArrayList<>();
        if (v == null) {
            return out;
        }
        if (v instanceof List) {
            for (Object o : (List<?>) v) {
                out.add(String.valueOf(o));
            }
            return out;
        }
        for (String part : string(key, "").split(",")) {
            if (!part.trim().isEmpty()) {
                out.add(part.trim());
            }
        }
        return out;
    }

    /** A JSON object of strings (or, as a key=value word, one JSON object in a string); empty when absent. */
    public Map<String, String> stringMap(String key) {
        used.add(key);
        Object v = values.get(key);
        Map<String, String> out = new LinkedHashMap<>();
        if (v == null) {
            return out;
        }
        if (v instanceof String) {
            try {
                v = Json.parse((String) v);
            } catch (IllegalArgumentException e) {
                throw new BadArgs(key + " must be a JSON object: " + e.getMessage());
            }
        }
        if (!(v instanceof Map)) {
            throw new BadArgs(key + " must be a JSON object");
        }
        for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
            Object val = e.getValue();
            if (val instanceof Map || val instanceof List) {
                throw new BadArgs(key + "." + e.getKey() + " must be a string");
            }
            out.put(String.valueOf(e.getKey()), val == null ? "" : String.valueOf(val));
        }
        return out;
    }

    public void rejectUnknown() {
        List<String> unknown = new ArrayList<>();
        for (String k : values.keySet()) {
            if (!used.contains(k)) {
                unknown.add(k);
            }
        }
        if (!unknown.isEmpty()) {
            throw new BadArgs("unknown argument(s) " + unknown + "; known: " + new java.util.TreeSet<>(used));
        }
    }
}
