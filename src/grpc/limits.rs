//! What one token may hold open on the gRPC front: long-poll receives and Telemetry streams, each bounded per
//! token ([`TokenBudget`], as the HTTP front bounds its long polls and streams), so one application (or one
//! leaked client loop) cannot take every task and connection slot of the front from the others. A call past
//! its bound is refused at once with `TOO_MANY_REQUESTS`, which the SDKs back off on.

use std::sync::Arc;

use metrics::counter;

use super::proto::{self as pb, Code};
use super::status::status;
use crate::auth::{BudgetSlot, Caller, TokenBudget};
use crate::metrics as m;

/// Open calls of one kind, bounded per token.
pub(super) struct OpenCalls {
    what: &'static str,
    budget: Arc<TokenBudget>,
}

impl OpenCalls {
    /// At most `max_per_token` open calls (`what`: "receives", "Telemetry streams") per token.
    pub(super) fn new(what: &'static str, max_per_token: usize) -> OpenCalls {
        OpenCalls { what, budget: TokenBudget::new(max_per_token) }
    }

    /// A place for one more call of `caller`, or the refusal when its token holds its bound already.
    pub(super) fn take(&self, caller: &Caller) -> Result<BudgetSlot, pb::Status> {
        self.budget.take(caller).ok_or_else(|| {
            counter!(m::REQUESTS_REJECTED, "reason" => "too_many_open_calls").increment(1);
            let max = self.budget.max_per_token();
            status(
                Code::TooManyRequests,
                format!("token `{}` holds {max} open {} already, the most it may", caller.name, self.what),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_gets_its_bound_and_a_freed_place_is_taken_again() {
        let receives = OpenCalls::new("receives", 2);
        let caller = Caller::unrestricted();
        let (a, _b) = (receives.take(&caller).expect("first"), receives.take(&caller).expect("second"));
        let refused = receives.take(&caller).expect_err("third refused");
        assert_eq!(refused.code, Code::TooManyRequests as i32);
        drop(a);
        assert!(receives.take(&caller).is_ok(), "a freed place");
    }
}
