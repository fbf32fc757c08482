package dev.popgate.driver;

/** A bad argument: the driver exits with code 2. */
public final class BadArgs extends RuntimeException {
    public BadArgs(String message) {
        super(message);
    }
}
