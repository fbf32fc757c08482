//! A delivery's broker lease, sealed into the handles popgate issues, so that another instance of a tier can ACK
//! the message at the broker when the instance that handed it out cannot be reached (issue #35, "owner gone").
//!
//! The token carries what a broker ACK needs (the broker, the `POP_CK` extra info, the queue and offset) and
//! the delivery's group and topic, so the instance that uses it checks the caller's rights as the owner would.
//! It is sealed with the tier's shared secret (HMAC-SHA256): a client cannot make one up to ACK a message it was
//! never handed. It is the lease *at the hand-out*: the owner renews the lease with half of it left, and a
//! renewal replaces the broker's checkpoint, after which an ACK with the sealed one changes nothing at the
//! broker (the owner, once back, ACKs with the current one when it learns of the settlement).
//!
//! Within a handle the token follows the delivery id after [`LEASE_SEPARATOR`]:
//! `<delivery id>!<token>`, e.g. an HTTP `deliveryId`, or the id part of `pg2:<id>.<hand-out>`.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};

use super::record::DeliveryRecord;
use crate::broker::consumer::ReceiptHandle;
use crate::clock::Epoch;

/// Between a delivery id and its sealed lease: a character no delivery id, instance id or base64url text has.
const LEASE_SEPARATOR: char = '!';
/// Between the token's content and its MAC.
const MAC_SEPARATOR: char = '.';
/// The MAC's bytes kept in a token: 128 bits, as much as a delivery id's randomness.
const MAC_BYTES: usize = 16;
/// The longest token opened: bounds the work an unauthenticated text can cause.
const MAX_TOKEN_LEN: usize = 2048;

/// A delivery's broker lease, as sealed into its handles.
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    /// The consumer group it was popped for.
    pub group: String,
    /// The subscribed topic (what the caller must be allowed to read).
    pub topic: String,
    /// The broker lease at the hand-out.
    pub handle: ReceiptHandle,
}

/// Seals and opens lease tokens with a tier's shared secret.
#[derive(Clone)]
pub struct LeaseSeal {
    secret: Vec<u8>,
}

impl std::fmt::Debug for LeaseSeal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LeaseSeal(..)")
    }
}

/// The token's content: a JSON array, shorter than an object (it travels in every handle).
type Sealed = (String, String, String, String, String, String, i32, i64, i64, i64, i64);

impl LeaseSeal {
    /// A seal keyed by `secret` (the tier's, at least 16 characters by config validation).
    pub fn new(secret: &[u8]) -> LeaseSeal {
        LeaseSeal { secret: secret.to_vec() }
    }

    /// The token of `record`'s current lease.
    pub fn seal(&self, record: &DeliveryRecord) -> Option<String> {
        let h = &record.handle;
        let sealed: Sealed = (
            record.group.to_string(),
            record.topic.to_string(),
            h.broker_name.to_string(),
            h.broker_addr.to_string(),
            h.extra_info.clone(),
            h.ack_topic.to_string(),
            h.queue_id,
            h.queue_offset,
            h.pop_time_ms,
            h.invisible_ms,
            h.lease_until_ms.as_millis(),
        );
        let content = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&sealed).ok()?);
        let mac = URL_SAFE_NO_PAD.encode(self.mac(&record.id, &content)?.finalize().into_bytes().get(..MAC_BYTES)?);
        Some(format!("{content}{MAC_SEPARATOR}{mac}"))
    }

    /// The lease `token` carries, when this seal sealed it for delivery `id`.
    pub fn open(&self, id: &str, token: &str) -> Option<Lease> {
        if token.len() > MAX_TOKEN_LEN {
            return None;
        }
        let (content, mac) = token.split_once(MAC_SEPARATOR)?;
        let presented = URL_SAFE_NO_PAD.decode(mac).ok()?;
        if presented.len() != MAC_BYTES {
            return None;
        }
        self.mac(id, content)?.verify_truncated_left(&presented).ok()?;
        let sealed: Sealed = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(content).ok()?).ok()?;
        let (group, topic, broker_name, broker_addr, extra_info, ack_topic, queue_id, queue_offset, pop, inv, until) =
            sealed;
        let handle = ReceiptHandle {
            broker_name: broker_name.into(),
            broker_addr: broker_addr.into(),
            extra_info,
            ack_topic: ack_topic.into(),
            queue_id,
            queue_offset,
            pop_time_ms: pop,
            invisible_ms: inv,
            lease_until_ms: Epoch::from_millis(until),
        };
        Some(Lease { group, topic, handle })
    }

    /// The MAC of a token's `content` for delivery `id`: binding the id keeps a client from pairing the lease
    /// of one delivery it was handed with the id of another (its owner would then be told of the wrong ACK).
    fn mac(&self, id: &str, content: &str) -> Option<Hmac<sha2::Sha256>> {
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&self.secret).ok()?;
        mac.update(id.as_bytes());
        mac.update(b"\n");
        mac.update(content.as_bytes());
        Some(mac)
    }
}

/// `id` with its sealed lease `token` after it, when there is one: what a front hands its client.
pub fn with_lease(id: &str, token: Option<&str>) -> String {
    match token {
        Some(token) => format!("{id}{LEASE_SEPARATOR}{token}"),
        None => id.to_owned(),
    }
}

/// The delivery id and the sealed lease (if any) of an id a front handed out with [`with_lease`].
pub fn split_lease(text: &str) -> (&str, Option<&str>) {
    match text.split_once(LEASE_SEPARATOR) {
        Some((id, token)) => (id, Some(token)),
        None => (text, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::record::{DeliveryRecord, Phase};
    use crate::delivery::test_support::popped;

    fn record(id: &str) -> DeliveryRecord {
        let popped = popped("m-1", b"body", 0);
        DeliveryRecord {
            id: id.into(),
            group: "g".into(),
            topic: "t".into(),
            event: popped.event,
            handle: popped.handle,
            attempt: 1,
            phase: Phase::Ready { due_ms: Epoch::ZERO },
            last_failure: None,
            seq: 1,
            handouts: 0,
            body_apart: false,
        }
    }

    #[test]
    fn a_sealed_lease_opens_with_its_secret_only_and_unaltered() {
        let seal = LeaseSeal::new(b"tier-secret-0123456789");
        let record = record("popgate-0~ab12");
        let token = seal.seal(&record).expect("sealed");
        let lease = seal.open(&record.id, &token).expect("opens");
        assert_eq!((lease.group.as_str(), lease.topic.as_str()), (&*record.group, &*record.topic));
        assert_eq!(lease.handle, record.handle);
        assert!(!token.contains(LEASE_SEPARATOR) && !token.contains(' ') && !token.contains('~'), "{token}");

        assert_eq!(LeaseSeal::new(b"another-secret-0123456").open(&record.id, &token), None, "another tier's secret");
        assert_eq!(seal.open("popgate-0~cd34", &token), None, "another delivery's id");
        let (content, mac) = token.split_once(MAC_SEPARATOR).expect("two parts");
        let mut forged =
            serde_json::from_slice::<Sealed>(&URL_SAFE_NO_PAD.decode(content).expect("b64")).expect("json");
        forged.7 += 1;
        let forged = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&forged).expect("json"));
        assert_eq!(seal.open(&record.id, &format!("{forged}.{mac}")), None, "another offset under the same MAC");
        assert_eq!(seal.open(&record.id, &format!("{content}.{}", &mac[..4])), None, "a cut MAC");
        assert_eq!(seal.open(&record.id, "garbage"), None);
        assert_eq!(seal.open(&record.id, &"a".repeat(MAX_TOKEN_LEN + 1)), None);
    }

    #[test]
    fn an_id_carries_its_lease_after_the_separator() {
        let text = with_lease("popgate-0~ab12", Some("tok.mac"));
        assert_eq!(split_lease(&text), ("popgate-0~ab12", Some("tok.mac")));
        assert_eq!(split_lease("popgate-0~ab12"), ("popgate-0~ab12", None));
        assert_eq!(with_lease("ab12", None), "ab12");
    }
}
