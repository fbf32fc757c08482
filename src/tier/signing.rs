//! The peer link's signatures: how an instance signs a request to another, and how the other refuses one that
//! is not signed with the tier's secret, was changed, is out of time, is meant for another instance, or came
//! before.
//!
//! Every request carries one metadata entry, [`SIGNATURE_HEADER`]:
//!
//! ```text
//! x-popgate-peer-signature: <unix ms>:<nonce: 32 hex digits>:<recipient's instance id, or nothing>:<hex MAC>
//! ```
//!
//! The MAC is HMAC-SHA256, keyed by `tier.secret`, of
//!
//! ```text
//! popgate-peer/2\n<call>\n<unix ms>\n<nonce>\n<recipient>\n<the request message's protobuf encoding>
//! ```
//!
//! so it covers every field of the request (caller, source address, delivery, action, commit flag, deadline,
//! asker): the receiver encodes the message it decoded again, and prost encodes a message the same way every
//! time. A field the receiver's version does not know is dropped as it decodes, so such a request fails: the
//! instances of a tier speak one version of the link (the lines before `\n` contain no `\n`, so nothing can
//! move from one part to another).
//!
//! The receiver ([`Verifier`]) takes a request only
//! - signed within [`MAX_SKEW_MS`] of its own clock;
//! - meant for it: the recipient is its own id. Only `Identify` may name none (the asker does not know yet who
//!   answers on an address), and is then answered with the id alone;
//! - whose nonce it has not taken before: each nonce taken is remembered for [`REMEMBERED_FOR`], longer than
//!   any signature time stays acceptable, at most [`MAX_NONCES`] of them (see [`Nonces`]).

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use prost::Message;

use super::InstanceId;
use crate::clock::Epoch;

/// The metadata entry that carries a peer request's signature.
pub(super) const SIGNATURE_HEADER: &str = "x-popgate-peer-signature";
/// How far a peer request's time may be from the answering instance's clock.
pub(super) const MAX_SKEW_MS: i64 = 30_000;
/// How long a nonce taken is remembered: a request signed up to [`MAX_SKEW_MS`] ahead of this instance's clock
/// stays acceptable until as long after it, so twice that from when it came.
pub(super) const REMEMBERED_FOR: Duration = Duration::from_millis(2 * MAX_SKEW_MS.unsigned_abs());
/// At most this many nonces are remembered: about 56 bytes each (the set and the queue), so about 30 MB at the
/// bound, which holds 8 000 signed requests a second, every second, from all peers together. Past it, requests
/// are refused until the oldest are forgotten (see [`Nonces`]).
pub(super) const MAX_NONCES: usize = 500_000;
/// What starts the signed text: the version of the signature, so that no other text signed with the tier's
/// secret (a sealed lease) can pass for a peer request's.
const SIGNED_TAG: &str = "popgate-peer/2";

/// Why a peer request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refused {
    /// No signature, a malformed one, or one the tier's secret does not make for this request.
    #[error("not signed with the tier's secret for this request")]
    Unsigned,
    /// Signed more than [`MAX_SKEW_MS`] from this instance's clock.
    #[error("signed more than 30 s from this instance's clock")]
    OutOfTime,
    /// Signed for another instance, or for none where the call must name one.
    #[error("signed for another instance")]
    NotForMe,
    /// Its nonce was taken before: a replay.
    #[error("a replayed request")]
    Replayed,
    /// [`MAX_NONCES`] requests taken within [`REMEMBERED_FOR`].
    #[error("too many signed requests within a minute; try again")]
    TooMany,
}

impl Refused {
    /// The refusal's label in `popgate_tier_settlements_served_total{result}`.
    pub(super) fn label(self) -> &'static str {
        match self {
            Refused::Replayed => "replayed",
            Refused::TooMany => "busy",
            Refused::Unsigned | Refused::OutOfTime | Refused::NotForMe => "unauthenticated",
        }
    }

    /// The status the peer is answered with.
    pub(super) fn status(self) -> tonic::Status {
        match self {
            Refused::TooMany => tonic::Status::resource_exhausted(self.to_string()),
            _ => tonic::Status::unauthenticated(self.to_string()),
        }
    }
}

/// Whom a request that passed [`Verifier::check`] was signed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Recipient {
    /// This instance.
    This,
    /// Nobody named (an `Identify` to an address whose instance the asker does not know yet).
    Unnamed,
}

/// Signs `request` for call `rpc` to instance `to` (empty: not known yet; only for `identify`) with `secret`.
pub(super) fn sign_request<M: Message>(request: &mut tonic::Request<M>, secret: &[u8], rpc: &str, to: &str) {
    let at_ms = Epoch::now().as_millis();
    let nonce = format!("{:032x}", rand::random::<u128>());
    let encoded = request.get_ref().encode_to_vec();
    let Some(mac) = mac_of(secret, rpc, at_ms, &nonce, to, &encoded) else { return };
    let signature = hex::encode(mac.finalize().into_bytes());
    if let Ok(value) = format!("{at_ms}:{nonce}:{to}:{signature}").parse() {
        request.metadata_mut().insert(SIGNATURE_HEADER, value);
    }
}

fn mac_of(secret: &[u8], rpc: &str, at_ms: i64, nonce: &str, to: &str, message: &[u8]) -> Option<Hmac<sha2::Sha256>> {
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).ok()?;
    mac.update(format!("{SIGNED_TAG}\n{rpc}\n{at_ms}\n{nonce}\n{to}\n").as_bytes());
    mac.update(message);
    Some(mac)
}

/// The receiving side: checks each request's signature, time, recipient and nonce.
pub(super) struct Verifier {
    secret: Vec<u8>,
    instance: InstanceId,
    nonces: Nonces,
}

impl Verifier {
    /// Checks requests to `instance` against `secret`.
    pub(super) fn new(secret: &[u8], instance: InstanceId) -> Self {
        Verifier { secret: secret.to_vec(), instance, nonces: Nonces::new(MAX_NONCES) }
    }

    /// Whether `request` is call `rpc`, unchanged since a holder of the tier's secret signed it, within
    /// [`MAX_SKEW_MS`] of now, for this instance (or, see [`Recipient::Unnamed`], for none) and never taken
    /// before; its nonce is remembered when it is taken.
    ///
    /// # Errors
    /// Why it is refused.
    pub(super) fn check<M: Message>(&self, request: &tonic::Request<M>, rpc: &str) -> Result<Recipient, Refused> {
        let header = request.metadata().get(SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).ok_or(Refused::Unsigned)?;
        let parts: Vec<&str> = header.split(':').collect();
        let [at, nonce_hex, to, presented] = parts[..] else { return Err(Refused::Unsigned) };
        let at_ms = at.parse::<i64>().map_err(|_| Refused::Unsigned)?;
        let nonce = parse_nonce(nonce_hex).ok_or(Refused::Unsigned)?;
        let presented = hex::decode(presented).map_err(|_| Refused::Unsigned)?;
        // abs_diff: a made-up time (i64::MIN) must not overflow.
        if Epoch::now().as_millis().abs_diff(at_ms) > MAX_SKEW_MS.unsigned_abs() {
            return Err(Refused::OutOfTime);
        }
        let recipient = match to {
            "" => Recipient::Unnamed,
            to if to == self.instance.as_str() => Recipient::This,
            _ => return Err(Refused::NotForMe),
        };
        let encoded = request.get_ref().encode_to_vec();
        let mac = mac_of(&self.secret, rpc, at_ms, nonce_hex, to, &encoded).ok_or(Refused::Unsigned)?;
        mac.verify_slice(&presented).map_err(|_| Refused::Unsigned)?;
        // Only a request the secret signed gets this far: without the secret, nobody fills the nonces.
        self.nonces.take(nonce, Instant::now())?;
        Ok(recipient)
    }
}

fn parse_nonce(hex: &str) -> Option<u128> {
    (hex.len() == 32).then(|| u128::from_str_radix(hex, 16).ok()).flatten()
}

/// The nonces of the requests taken within the last [`REMEMBERED_FOR`], at most `max` of them.
///
/// Full, it refuses every new request until the oldest nonces are forgotten (fail closed), rather than forget
/// one early: a nonce forgotten while its signature is still in time could be replayed. That costs no safety,
/// only the excess requests: the sending instance takes the refusal as "unreachable" (an ACK then goes to the
/// broker with the lease its handle carries, anything else is answered "try again"), and only requests signed
/// with the secret count towards the bound, so a stranger cannot fill it. (A cache that evicts under pressure,
/// such as moka's, forgets early by design, and so is not used here.)
struct Nonces {
    max: usize,
    /// The nonces in the order they came (when, which): the front is the first to be forgotten.
    taken: Mutex<Taken>,
}

#[derive(Default)]
struct Taken {
    seen: HashSet<u128>,
    order: VecDeque<(Instant, u128)>,
}

impl Nonces {
    fn new(max: usize) -> Self {
        Nonces { max, taken: Mutex::new(Taken::default()) }
    }

    /// Takes `nonce`, which came at `now`.
    ///
    /// # Errors
    /// [`Refused::Replayed`] when it was taken within [`REMEMBERED_FOR`]; [`Refused::TooMany`] when `max`
    /// nonces were.
    fn take(&self, nonce: u128, now: Instant) -> Result<(), Refused> {
        let mut taken = self.taken.lock();
        while let Some(&(at, old)) = taken.order.front() {
            if now.saturating_duration_since(at) < REMEMBERED_FOR {
                break;
            }
            taken.order.pop_front();
            taken.seen.remove(&old);
        }
        if taken.seen.contains(&nonce) {
            return Err(Refused::Replayed);
        }
        if taken.seen.len() >= self.max {
            return Err(Refused::TooMany);
        }
        taken.seen.insert(nonce);
        taken.order.push_back((now, nonce));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::proto as pb;
    use super::*;

    const SECRET: &[u8] = b"tier-secret-0123456789";

    fn verifier() -> Verifier {
        Verifier::new(SECRET, InstanceId::parse("popgate-1").expect("id"))
    }

    fn settle_request() -> pb::SettleRequest {
        pb::SettleRequest {
            caller: "app".into(),
            source_ip: "10.1.2.3".into(),
            delivery_id: "popgate-1~ab".into(),
            hand_out: Some(2),
            group: Some("g".into()),
            action: Some(pb::settle_request::Action::Ack(pb::Ack {})),
        }
    }

    fn end_request() -> pb::EndRequest {
        pb::EndRequest {
            caller: "app".into(),
            source_ip: "10.1.2.3".into(),
            transaction_id: "C0A8".into(),
            topic: Some("t".into()),
            commit: false,
            from_check: false,
            answer_within_ms: Some(2_000),
        }
    }

    /// `message` signed for `rpc` to `to`, then changed by `change` (as a stranger on the wire would).
    fn signed<M: Message>(message: M, rpc: &str, to: &str, change: impl FnOnce(&mut M)) -> tonic::Request<M> {
        let mut request = tonic::Request::new(message);
        sign_request(&mut request, SECRET, rpc, to);
        change(request.get_mut());
        request
    }

    #[test]
    fn a_request_changed_in_any_field_after_signing_is_refused() {
        let verifier = verifier();
        assert_eq!(
            verifier.check(&signed(settle_request(), "settle", "popgate-1", |_| {}), "settle"),
            Ok(Recipient::This)
        );
        let settles: [fn(&mut pb::SettleRequest); 6] = [
            |r| r.caller = "admin".into(),
            |r| r.source_ip = "192.168.0.1".into(),
            |r| r.source_ip.clear(),
            |r| r.hand_out = None,
            |r| r.group = Some("h".into()),
            |r| r.action = Some(pb::settle_request::Action::Term(pb::Term { reason: "gone".into() })),
        ];
        for change in settles {
            let request = signed(settle_request(), "settle", "popgate-1", change);
            assert_eq!(verifier.check(&request, "settle"), Err(Refused::Unsigned), "{:?}", request.get_ref());
        }
        assert_eq!(verifier.check(&signed(end_request(), "end", "popgate-1", |_| {}), "end"), Ok(Recipient::This));
        let ends: [fn(&mut pb::EndRequest); 5] = [
            |r| r.commit = true,
            |r| r.answer_within_ms = Some(u64::MAX),
            |r| r.caller = "admin".into(),
            |r| r.from_check = true,
            |r| r.topic = None,
        ];
        for change in ends {
            let request = signed(end_request(), "end", "popgate-1", change);
            assert_eq!(verifier.check(&request, "end"), Err(Refused::Unsigned), "{:?}", request.get_ref());
        }
        let asked = |asker: &str| pb::IdentifyRequest { asker: asker.into() };
        let request = signed(asked("popgate-0"), "identify", "popgate-1", |r| r.asker = "popgate-2".into());
        assert_eq!(verifier.check(&request, "identify"), Err(Refused::Unsigned), "another asker");
        let request = signed(settle_request(), "settle", "popgate-1", |_| {});
        assert_eq!(verifier.check(&request, "end"), Err(Refused::Unsigned), "another call");
        let mut request = tonic::Request::new(settle_request());
        sign_request(&mut request, b"another-secret-0123456", "settle", "popgate-1");
        assert_eq!(verifier.check(&request, "settle"), Err(Refused::Unsigned), "another secret");
        assert_eq!(verifier.check(&tonic::Request::new(settle_request()), "settle"), Err(Refused::Unsigned));
    }

    #[test]
    fn a_request_taken_once_is_refused_when_it_comes_again() {
        let verifier = verifier();
        let request = signed(settle_request(), "settle", "popgate-1", |_| {});
        let mut again = tonic::Request::new(request.get_ref().clone());
        *again.metadata_mut() = request.metadata().clone();
        assert_eq!(verifier.check(&request, "settle"), Ok(Recipient::This));
        assert_eq!(verifier.check(&again, "settle"), Err(Refused::Replayed));
        assert_eq!(verifier.check(&request, "settle"), Err(Refused::Replayed), "and again");
        // The same message signed anew is another request.
        assert_eq!(
            verifier.check(&signed(settle_request(), "settle", "popgate-1", |_| {}), "settle"),
            Ok(Recipient::This)
        );
    }

    #[test]
    fn a_request_signed_for_another_instance_or_out_of_time_is_refused() {
        let verifier = verifier();
        let request = signed(settle_request(), "settle", "popgate-2", |_| {});
        assert_eq!(verifier.check(&request, "settle"), Err(Refused::NotForMe));
        let request = signed(pb::IdentifyRequest { asker: "popgate-0".into() }, "identify", "", |_| {});
        assert_eq!(verifier.check(&request, "identify"), Ok(Recipient::Unnamed), "the server decides what it tells");
        for at_ms in
            [Epoch::now().as_millis() - 2 * MAX_SKEW_MS, Epoch::now().as_millis() + 2 * MAX_SKEW_MS, i64::MIN, i64::MAX]
        {
            let message = settle_request();
            let nonce = format!("{:032x}", rand::random::<u128>());
            let mac = mac_of(SECRET, "settle", at_ms, &nonce, "popgate-1", &message.encode_to_vec()).expect("mac");
            let header = format!("{at_ms}:{nonce}:popgate-1:{}", hex::encode(mac.finalize().into_bytes()));
            let mut request = tonic::Request::new(message);
            request.metadata_mut().insert(SIGNATURE_HEADER, header.parse().expect("ascii"));
            assert_eq!(verifier.check(&request, "settle"), Err(Refused::OutOfTime), "{at_ms}");
        }
        for malformed in ["", "1:2", "x:y:z:w", "1:00:popgate-1:00", "1:a:b:c:d"] {
            let mut request = tonic::Request::new(settle_request());
            request.metadata_mut().insert(SIGNATURE_HEADER, malformed.parse().expect("ascii"));
            assert_eq!(verifier.check(&request, "settle"), Err(Refused::Unsigned), "{malformed}");
        }
    }

    #[test]
    fn nonces_are_forgotten_after_their_window_and_refused_past_the_bound_until_then() {
        let nonces = Nonces::new(2);
        let start = Instant::now();
        assert_eq!(nonces.take(1, start), Ok(()));
        assert_eq!(nonces.take(2, start + Duration::from_secs(1)), Ok(()));
        assert_eq!(nonces.take(3, start + Duration::from_secs(2)), Err(Refused::TooMany), "full: none forgotten early");
        assert_eq!(nonces.take(1, start + REMEMBERED_FOR - Duration::from_millis(1)), Err(Refused::Replayed));
        assert_eq!(nonces.take(3, start + REMEMBERED_FOR), Ok(()), "the first forgotten, room for one");
        assert_eq!(nonces.take(2, start + REMEMBERED_FOR), Err(Refused::Replayed), "the second not yet");
    }
}
