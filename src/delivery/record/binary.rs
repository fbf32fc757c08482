//! The stored form of a [`DeliveryRecord`]: a version byte, then the fields in a fixed order.
//!
//! Boot recovery decodes every in-flight record, a million of them on a busy instance, and the JSON form
//! cost one text parse per record (field names, base64, number parsing): most of the boot. This form is read
//! by walking the bytes once. It is written by hand rather than through serde because the record's serde
//! shape is JSON's (a flattened, internally tagged phase; a base64 body), which the compact serde formats
//! (postcard, bincode) cannot express; a mirror struct for them would be as long as this file.
//!
//! ```text
//! record   = 0x01 id group topic event handle attempt phase last_failure seq handouts body_apart
//! event    = id topic tags:opt<str> keys:list<str> properties:list<str str> body:bytes born_timestamp:i
//!            reconsume_times:u retry_topic:opt<str> message_group:opt<str> stored
//! stored   = born_host store_host store_timestamp:i queue_id:i queue_offset:i system:list<str str>
//!            commit_log_offset:i flag:i
//! handle   = broker_name broker_addr extra_info ack_topic queue_id:i queue_offset:i pop_time_ms:i
//!            invisible_ms:i lease_until_ms:i
//! phase    = 0x00 due_ms:i                                       Ready
//!          | 0x01 deadline_ms:i dispatched_ms:i holder:opt<h>     AwaitingAck, h = client_id flags:u8
//!          | 0x02                                                Acked        (flags: 1 auto_renew, 2 written)
//!          | 0x03 reason:str                                     DeadLetter
//! u        = unsigned LEB128 varint;  i = zigzag, then u;  str, bytes = u length, then the bytes (UTF-8)
//! opt<x>   = 0x00 | 0x01 x;  list<x> = u count, then each x;  bool = 0x00 | 0x01
//! ```
//!
//! Times are the [`Epoch`]'s epoch milliseconds. A record that starts with `{` is the JSON form every
//! popgate before this one wrote: it still decodes, and is written back in this form at its next change.
//! A later format takes the next version byte; this one decodes nothing but `0x01` and JSON.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{DeliveryRecord, Event, Holder, Phase, ReceiptHandle};
use crate::broker::consumer::StoredFacts;
use crate::clock::Epoch;

/// The first byte of the current stored form.
const VERSION_1: u8 = 0x01;

/// Why a stored delivery record does not decode. The record is then corrupt, or from a popgate newer than
/// this one; recovery retires it without a broker ACK either way.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// No byte at all.
    #[error("empty record")]
    Empty,
    /// A first byte that is neither a known version nor the `{` of JSON.
    #[error("unknown record version {0:#04x}")]
    UnknownVersion(u8),
    /// The bytes end inside a field, a length runs past them, or bytes are left after the last field.
    #[error("record truncated or overlong")]
    Length,
    /// A varint longer than its type, or out of its type's range.
    #[error("malformed number")]
    Number,
    /// A string that is not UTF-8.
    #[error("malformed text")]
    Text,
    /// An unknown phase or option tag.
    #[error("unknown tag {0:#04x}")]
    Tag(u8),
    /// The JSON form of earlier versions did not parse.
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

impl DeliveryRecord {
    /// The record as the store keeps it (this version's form).
    pub fn encode(&self) -> Vec<u8> {
        // Destructured so that a field added to the record cannot be left out here without a compile error.
        let DeliveryRecord { id, group, topic, event, handle, attempt, phase, last_failure, seq, handouts, body_apart } =
            self;
        let mut out = Writer(Vec::with_capacity(160 + event.body.len() + handle.extra_info.len()));
        out.0.push(VERSION_1);
        out.str(id);
        out.str(group);
        out.str(topic);
        out.event(event);
        out.handle(handle);
        out.unsigned(u64::from(*attempt));
        match phase {
            Phase::Ready { due_ms } => {
                out.0.push(0);
                out.epoch(*due_ms);
            }
            Phase::AwaitingAck { deadline_ms, dispatched_ms, holder } => {
                out.0.push(1);
                out.epoch(*deadline_ms);
                out.epoch(*dispatched_ms);
                match holder {
                    None => out.0.push(0),
                    Some(Holder { client_id, auto_renew, written }) => {
                        out.0.push(1);
                        out.str(client_id);
                        out.0.push(u8::from(*auto_renew) | u8::from(*written) << 1);
                    }
                }
            }
            Phase::Acked => out.0.push(2),
            Phase::DeadLetter { reason } => {
                out.0.push(3);
                out.str(reason);
            }
        }
        out.opt_str(last_failure.as_deref());
        out.unsigned(*seq);
        out.unsigned(u64::from(*handouts));
        out.0.push(u8::from(*body_apart));
        out.0
    }

    /// A stored record, in this version's form or the JSON form of earlier ones.
    ///
    /// # Errors
    /// [`DecodeError`] when it is neither.
    pub fn decode(bytes: &[u8]) -> Result<DeliveryRecord, DecodeError> {
        match bytes.first() {
            None => Err(DecodeError::Empty),
            Some(&VERSION_1) => {
                let mut reader = Reader(&bytes[1..]);
                let record = reader.record()?;
                if !reader.0.is_empty() {
                    return Err(DecodeError::Length);
                }
                Ok(record)
            }
            Some(b'{') => Ok(serde_json::from_slice(bytes)?),
            Some(&other) => Err(DecodeError::UnknownVersion(other)),
        }
    }

    /// Whether `bytes` are the JSON form of earlier versions (rewritten at the record's next change).
    pub fn is_legacy_json(bytes: &[u8]) -> bool {
        bytes.first() == Some(&b'{')
    }
}

// === impl Writer ===

struct Writer(Vec<u8>);

impl Writer {
    fn unsigned(&mut self, mut value: u64) {
        while value >= 0x80 {
            self.0.push((value as u8 & 0x7f) | 0x80);
            value >>= 7;
        }
        self.0.push(value as u8);
    }

    fn signed(&mut self, value: i64) {
        self.unsigned(((value << 1) ^ (value >> 63)) as u64);
    }

    fn epoch(&mut self, at: Epoch) {
        self.signed(at.as_millis());
    }

    fn bytes(&mut self, bytes: &[u8]) {
        self.unsigned(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    fn str(&mut self, text: &str) {
        self.bytes(text.as_bytes());
    }

    fn opt_str(&mut self, text: Option<&str>) {
        match text {
            None => self.0.push(0),
            Some(text) => {
                self.0.push(1);
                self.str(text);
            }
        }
    }

    fn map(&mut self, map: &BTreeMap<String, String>) {
        self.unsigned(map.len() as u64);
        for (key, value) in map {
            self.str(key);
            self.str(value);
        }
    }

    fn event(&mut self, event: &Event) {
        let Event {
            id,
            topic,
            tags,
            keys,
            properties,
            body,
            born_timestamp,
            reconsume_times,
            retry_topic,
            message_group,
            stored,
        } = event;
        self.str(id);
        self.str(topic);
        self.opt_str(tags.as_deref());
        self.unsigned(keys.len() as u64);
        for key in keys {
            self.str(key);
        }
        self.map(properties);
        self.bytes(body);
        self.signed(*born_timestamp);
        self.unsigned(u64::from(*reconsume_times));
        self.opt_str(retry_topic.as_deref());
        self.opt_str(message_group.as_deref());
        let StoredFacts {
            born_host,
            store_host,
            store_timestamp,
            queue_id,
            queue_offset,
            system,
            commit_log_offset,
            flag,
        } = stored;
        self.str(born_host);
        self.str(store_host);
        self.signed(*store_timestamp);
        self.signed(i64::from(*queue_id));
        self.signed(*queue_offset);
        self.map(system);
        self.signed(*commit_log_offset);
        self.signed(i64::from(*flag));
    }

    fn handle(&mut self, handle: &ReceiptHandle) {
        let ReceiptHandle {
            broker_name,
            broker_addr,
            extra_info,
            ack_topic,
            queue_id,
            queue_offset,
            pop_time_ms,
            invisible_ms,
            lease_until_ms,
        } = handle;
        self.str(broker_name);
        self.str(broker_addr);
        self.str(extra_info);
        self.str(ack_topic);
        self.signed(i64::from(*queue_id));
        self.signed(*queue_offset);
        self.signed(*pop_time_ms);
        self.signed(*invisible_ms);
        self.epoch(*lease_until_ms);
    }
}

// === impl Reader ===

/// The bytes not read yet.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Result<u8, DecodeError> {
        let (&first, rest) = self.0.split_first().ok_or(DecodeError::Length)?;
        self.0 = rest;
        Ok(first)
    }

    fn unsigned(&mut self) -> Result<u64, DecodeError> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = self.byte()?;
            let bits = u64::from(byte & 0x7f);
            // The tenth byte may carry one bit only: anything more does not fit in 64 bits.
            if shift == 63 && bits > 1 {
                return Err(DecodeError::Number);
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(DecodeError::Number)
    }

    fn signed(&mut self) -> Result<i64, DecodeError> {
        let raw = self.unsigned()?;
        Ok((raw >> 1) as i64 ^ -((raw & 1) as i64))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        u32::try_from(self.unsigned()?).map_err(|_| DecodeError::Number)
    }

    fn i32(&mut self) -> Result<i32, DecodeError> {
        i32::try_from(self.signed()?).map_err(|_| DecodeError::Number)
    }

    fn epoch(&mut self) -> Result<Epoch, DecodeError> {
        self.signed().map(Epoch::from_millis)
    }

    fn bool(&mut self) -> Result<bool, DecodeError> {
        match self.byte()? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(DecodeError::Tag(other)),
        }
    }

    fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let len = usize::try_from(self.unsigned()?).map_err(|_| DecodeError::Length)?;
        if len > self.0.len() {
            return Err(DecodeError::Length);
        }
        let (taken, rest) = self.0.split_at(len);
        self.0 = rest;
        Ok(taken)
    }

    fn str(&mut self) -> Result<&'a str, DecodeError> {
        std::str::from_utf8(self.bytes()?).map_err(|_| DecodeError::Text)
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        self.str().map(str::to_owned)
    }

    fn shared(&mut self) -> Result<Arc<str>, DecodeError> {
        self.str().map(Arc::from)
    }

    fn opt_string(&mut self) -> Result<Option<String>, DecodeError> {
        Ok(if self.bool()? { Some(self.string()?) } else { None })
    }

    /// A count of items that each take at least one byte: never more than the bytes left, so a corrupt count
    /// cannot make a huge allocation.
    fn count(&mut self) -> Result<usize, DecodeError> {
        let count = usize::try_from(self.unsigned()?).map_err(|_| DecodeError::Length)?;
        if count > self.0.len() {
            return Err(DecodeError::Length);
        }
        Ok(count)
    }

    fn map(&mut self) -> Result<BTreeMap<String, String>, DecodeError> {
        let count = self.count()?;
        let mut map = BTreeMap::new();
        for _ in 0..count {
            let key = self.string()?;
            map.insert(key, self.string()?);
        }
        Ok(map)
    }

    fn record(&mut self) -> Result<DeliveryRecord, DecodeError> {
        Ok(DeliveryRecord {
            id: self.shared()?,
            group: self.shared()?,
            topic: self.shared()?,
            event: self.event()?,
            handle: self.handle()?,
            attempt: self.u32()?,
            phase: self.phase()?,
            last_failure: self.opt_string()?,
            seq: self.unsigned()?,
            handouts: self.u32()?,
            body_apart: self.bool()?,
        })
    }

    fn event(&mut self) -> Result<Event, DecodeError> {
        Ok(Event {
            id: self.string()?,
            topic: self.shared()?,
            tags: self.opt_string()?,
            keys: {
                let count = self.count()?;
                (0..count).map(|_| self.string()).collect::<Result<_, _>>()?
            },
            properties: self.map()?,
            body: self.bytes()?.to_vec(),
            born_timestamp: self.signed()?,
            reconsume_times: self.u32()?,
            retry_topic: self.opt_string()?,
            message_group: self.opt_string()?,
            stored: StoredFacts {
                born_host: self.string()?,
                store_host: self.string()?,
                store_timestamp: self.signed()?,
                queue_id: self.i32()?,
                queue_offset: self.signed()?,
                system: self.map()?,
                commit_log_offset: self.signed()?,
                flag: self.i32()?,
            },
        })
    }

    fn handle(&mut self) -> Result<ReceiptHandle, DecodeError> {
        Ok(ReceiptHandle {
            broker_name: self.shared()?,
            broker_addr: self.shared()?,
            extra_info: self.string()?,
            ack_topic: self.shared()?,
            queue_id: self.i32()?,
            queue_offset: self.signed()?,
            pop_time_ms: self.signed()?,
            invisible_ms: self.signed()?,
            lease_until_ms: self.epoch()?,
        })
    }

    fn phase(&mut self) -> Result<Phase, DecodeError> {
        match self.byte()? {
            0 => Ok(Phase::Ready { due_ms: self.epoch()? }),
            1 => {
                let deadline_ms = self.epoch()?;
                let dispatched_ms = self.epoch()?;
                let holder = if self.bool()? {
                    let client_id = self.string()?;
                    let flags = self.byte()?;
                    if flags > 3 {
                        return Err(DecodeError::Tag(flags));
                    }
                    Some(Holder { client_id, auto_renew: flags & 1 != 0, written: flags & 2 != 0 })
                } else {
                    None
                };
                Ok(Phase::AwaitingAck { deadline_ms, dispatched_ms, holder })
            }
            2 => Ok(Phase::Acked),
            3 => Ok(Phase::DeadLetter { reason: self.string()? }),
            other => Err(DecodeError::Tag(other)),
        }
    }
}

#[cfg(test)]
mod tests;
