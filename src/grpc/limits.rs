//! What one token may hold open on the gRPC front: long-poll receives and Telemetry streams, each bounded per
//! token, so one application (or one leaked client loop) cannot take every connection slot and task of the
//! front from the others. A call past its bound is refused at once with `TOO_MANY_REQUESTS`, which the SDKs
//! back off on.

use std::collections::HashMap;
use std::sync::Arc;

use metrics::counter;
use parking_lot::Mutex;

use super::proto::{self as pb, Code};
use super::status::status;
use crate::metrics as m;

/// Open calls of one kind, counted per token.
pub(super) struct OpenCalls {
    what: &'static str,
    max_per_token: usize,
    open: Mutex<HashMap<String, usize>>,
}

/// One open call; dropping it frees its place.
pub(super) struct Slot {
    calls: Arc<OpenCalls>,
    token: String,
}

impl OpenCalls {
    /// At most `max_per_token` open calls (`what`: "receives", "Telemetry streams") per token.
    pub(super) fn new(what: &'static str, max_per_token: usize) -> Arc<OpenCalls> {
        Arc::new(OpenCalls { what, max_per_token, open: Mutex::new(HashMap::new()) })
    }

    /// A place for one more call of `token`, or the refusal when it holds its bound already.
    pub(super) fn take(self: &Arc<Self>, token: &str) -> Result<Slot, pb::Status> {
        let mut open = self.open.lock();
        let count = open.entry(token.to_owned()).or_insert(0);
        if *count >= self.max_per_token {
            counter!(m::REQUESTS_REJECTED, "reason" => "too_many_open_calls").increment(1);
            let message =
                format!("token `{token}` holds {} open {} already, the most it may", self.max_per_token, self.what);
            return Err(status(Code::TooManyRequests, message));
        }
        *count += 1;
        Ok(Slot { calls: Arc::clone(self), token: token.to_owned() })
    }

    #[cfg(test)]
    fn open_for(&self, token: &str) -> usize {
        self.open.lock().get(token).copied().unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.calls.open.lock();
        if let Some(count) = open.get_mut(&self.token) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.token);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_gets_its_bound_and_a_freed_place_is_taken_again() {
        let receives = OpenCalls::new("receives", 2);
        let (a, _b) = (receives.take("app").expect("first"), receives.take("app").expect("second"));
        let refused = receives.take("app").err().expect("third refused");
        assert_eq!(refused.code, Code::TooManyRequests as i32);
        assert!(receives.take("other-app").is_ok(), "per token");
        drop(a);
        assert!(receives.take("app").is_ok(), "a freed place");
        assert_eq!(receives.open_for("other-app"), 0, "dropped at once");
    }
}
