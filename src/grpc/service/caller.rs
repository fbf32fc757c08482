//! Who a call comes from: the SDK's signature (`MQv2-HMAC-SHA1` over `x-mq-date-time`) checked against the
//! tokens and popgate's clock. Its own room because it is the front's one authentication step, and its
//! parsing is tested on its own.

use std::time::{Duration, SystemTime};

use metrics::counter;
use tonic::metadata::MetadataMap;
use tonic::Request;

use super::Front;
use crate::auth::Caller;
use crate::grpc::proto::{self as pb, Code};
use crate::grpc::status::status;
use crate::metrics as m;

impl Front {
    /// The caller of a request, from the SDK's signature (`authorization: MQv2-HMAC-SHA1 Credential=<AK>,
    /// SignedHeaders=x-mq-date-time, Signature=<hex>`); everyone when authentication is off.
    pub(super) fn caller<T>(&self, request: &Request<T>) -> Result<Caller, pb::Status> {
        let caller = self.signer(request.metadata())?;
        Ok(match request.remote_addr() {
            Some(peer) => caller.with_address(peer.ip()),
            None => caller,
        })
    }

    /// The caller a request's signature stands for, wherever it came from.
    fn signer(&self, metadata: &MetadataMap) -> Result<Caller, pb::Status> {
        if !self.tokens.enabled() {
            return Ok(Caller::unrestricted());
        }
        let header = |name: &str| metadata.get(name).and_then(|v| v.to_str().ok());
        let refused = |why: &str| {
            counter!(m::REQUESTS_REJECTED, "reason" => "unauthenticated").increment(1);
            status(Code::Unauthorized, why.to_owned())
        };
        let Some(authorization) = header("authorization") else {
            return Err(refused("authentication is required: configure the client's credentials"));
        };
        let Some((access_key, signature)) = parse_authorization(authorization) else {
            return Err(refused("the authorization header is not MQv2-HMAC-SHA1"));
        };
        let signed = header("x-mq-date-time").unwrap_or_default();
        let caller = self
            .tokens
            .authenticate_signature(access_key, signed, signature)
            .ok_or_else(|| refused("unknown access key or bad signature"))?;
        // The signature covers only the date: an old one would be a lasting credential for whoever saw it.
        let skew = Duration::from_secs(self.config.auth.max_clock_skew_secs);
        if !within_skew(signed, crate::clock::wall_clock(), skew) {
            counter!(m::REQUESTS_REJECTED, "reason" => "stale_signature").increment(1);
            let why = format!("x-mq-date-time `{signed}` is more than {} s away from popgate's clock", skew.as_secs());
            return Err(status(Code::Unauthorized, why));
        }
        Ok(caller)
    }

    /// The caller of a request ([`Front::caller`]); only an authenticated call marks its client alive (with
    /// its kind, when known), so an unauthenticated peer cannot insert client ids or keep another client's
    /// auto-renewed deliveries held.
    pub(super) fn authenticated<T>(
        &self,
        request: &Request<T>,
        kind: Option<&'static str>,
    ) -> Result<Caller, pb::Status> {
        let caller = self.caller(request)?;
        self.saw_client(&caller, request.metadata(), kind)?;
        Ok(caller)
    }
}

/// Whether `date_time` (the SDK's `x-mq-date-time`, `yyyyMMdd'T'HHmmss'Z'` in UTC) is within `skew` of `now`.
fn within_skew(date_time: &str, now: SystemTime, skew: Duration) -> bool {
    let Ok(signed) = chrono::NaiveDateTime::parse_from_str(date_time, "%Y%m%dT%H%M%SZ") else { return false };
    let now = chrono::DateTime::<chrono::Utc>::from(now).naive_utc();
    let apart = (now - signed).abs().to_std().unwrap_or(Duration::MAX);
    apart <= skew
}

/// `Credential=<AK>[/…], SignedHeaders=…, Signature=<hex>` after the algorithm name.
fn parse_authorization(header: &str) -> Option<(&str, &str)> {
    let rest = header.trim().strip_prefix("MQv2-HMAC-SHA1")?.trim();
    let mut access_key = None;
    let mut signature = None;
    for part in rest.split(',') {
        let (name, value) = part.trim().split_once('=')?;
        match name.trim() {
            // The Go SDK sends `AK//Rocketmq`; the access key is what comes before the first slash.
            "Credential" => access_key = value.split('/').next(),
            "Signature" => signature = Some(value.trim()),
            _ => {}
        }
    }
    Some((access_key?, signature?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_date_counts_only_within_the_skew_window_either_way() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_083_200); // 2026-12-01T00:00:00Z
        let window = Duration::from_secs(900);
        assert!(within_skew("20261201T000000Z", now, window));
        assert!(within_skew("20261130T234500Z", now, window), "15 minutes behind");
        assert!(within_skew("20261201T001500Z", now, window), "15 minutes ahead");
        assert!(!within_skew("20261130T234459Z", now, window));
        assert!(!within_skew("20261201T001501Z", now, window));
        assert!(!within_skew("not a date", now, window));
        assert!(!within_skew("", now, window));
    }

    #[test]
    fn the_authorization_header_of_each_sdk_is_read() {
        let java = "MQv2-HMAC-SHA1 Credential=app, SignedHeaders=x-mq-date-time, Signature=ABCD";
        assert_eq!(parse_authorization(java), Some(("app", "ABCD")));
        let go = "MQv2-HMAC-SHA1 Credential=app//Rocketmq, SignedHeaders=x-mq-date-time, Signature=ABCD";
        assert_eq!(parse_authorization(go), Some(("app", "ABCD")));
        assert_eq!(parse_authorization("Bearer token"), None);
    }
}
