//! Reading a frame as real clients write it. The rocketmq-rust decoder wants every header field Apache's Java
//! client writes; the Go client (`rocketmq-client-go` v2) leaves `serializeTypeCurrentRPC` out of its JSON
//! header, which RocketMQ's name server, broker and proxy do not need. Such a header is completed before the
//! frame is decoded, so a Go app is answered instead of having its connection closed. A Java client's frame is
//! decoded as it is, with no copy.

use bytes::{BufMut, BytesMut};
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

/// The header field the Go client leaves out, and the value it would have.
const SERIALIZE_TYPE_FIELD: &str = "serializeTypeCurrentRPC";
const JSON_SERIALIZE_TYPE: &str = "JSON";
/// The length prefix and the header-length word before a frame's header.
const PREFIX: usize = 8;
/// The largest header length the header-length word can carry (its top byte is the serialize type).
const MAX_HEADER: usize = 0x00FF_FFFF;

/// Decodes the next whole frame of `buffer` (`None` while it is incomplete), as
/// `RemotingCommand::decode_with_max_frame_bytes` does, a JSON header without `serializeTypeCurrentRPC` included.
///
/// # Errors
/// As `RemotingCommand::decode_with_max_frame_bytes`: a frame over `max_frame` bytes, or one that does not decode.
pub(super) fn decode(buffer: &mut BytesMut, max_frame: usize) -> rocketmq_error::Result<Option<RemotingCommand>> {
    match completed(buffer, max_frame) {
        // The completed header is a few bytes longer than the one the client sent.
        Some(mut frame) => RemotingCommand::decode_with_max_frame_bytes(&mut frame, max_frame.saturating_add(64)),
        None => RemotingCommand::decode_with_max_frame_bytes(buffer, max_frame),
    }
}

/// The next frame of `buffer`, taken out of it with `serializeTypeCurrentRPC` added to its JSON header, when the
/// frame is whole and its header is a JSON object without that field; otherwise `None`, and `buffer` is as it was.
fn completed(buffer: &mut BytesMut, max_frame: usize) -> Option<BytesMut> {
    let word = |at: usize| -> Option<usize> {
        let bytes: [u8; 4] = buffer.get(at..at + 4)?.try_into().ok()?;
        usize::try_from(u32::from_be_bytes(bytes)).ok()
    };
    let total = word(0)?;
    let frame_len = total.checked_add(4)?;
    let header_word = word(4)?;
    let (serialize_type, header_len) = (header_word >> 24, header_word & MAX_HEADER);
    if frame_len > max_frame || buffer.len() < frame_len || serialize_type != 0 || header_len > total - 4 {
        return None;
    }
    let header = &buffer[PREFIX..PREFIX + header_len];
    if header.windows(SERIALIZE_TYPE_FIELD.len()).any(|w| w == SERIALIZE_TYPE_FIELD.as_bytes()) {
        return None;
    }
    let mut fields: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    fields.insert(SERIALIZE_TYPE_FIELD.to_owned(), JSON_SERIALIZE_TYPE.into());
    let header = serde_json::to_vec(&fields).ok()?;
    if header.len() > MAX_HEADER {
        return None;
    }
    let frame = buffer.split_to(frame_len);
    let body = &frame[PREFIX + header_len..];
    let mut rebuilt = BytesMut::with_capacity(PREFIX + header.len() + body.len());
    rebuilt.put_u32(u32::try_from(4 + header.len() + body.len()).ok()?);
    rebuilt.put_u32(u32::try_from(header.len()).ok()?);
    rebuilt.extend_from_slice(&header);
    rebuilt.extend_from_slice(body);
    Some(rebuilt)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame of `header` (JSON) and `body`, as a client writes it.
    fn frame(header: &str, body: &[u8]) -> BytesMut {
        let mut frame = BytesMut::new();
        frame.put_u32(u32::try_from(4 + header.len() + body.len()).expect("small"));
        frame.put_u32(u32::try_from(header.len()).expect("small"));
        frame.extend_from_slice(header.as_bytes());
        frame.extend_from_slice(body);
        frame
    }

    #[test]
    fn a_go_clients_header_without_its_serialize_type_is_read_and_a_java_one_as_it_is() {
        // What rocketmq-client-go v2 writes for a route query (no serializeTypeCurrentRPC), then a send's body.
        let go = r#"{"code":105,"language":"GO","version":317,"opaque":7,"flag":0,"remark":"","extFields":{"topic":"orders"}}"#;
        let mut buffer = frame(go, b"BODY");
        buffer.extend_from_slice(&[0, 0]);
        let command = decode(&mut buffer, 1 << 20).expect("decodes").expect("a whole frame");
        assert_eq!((command.code(), command.opaque()), (105, 7));
        assert_eq!(command.ext_fields().and_then(|f| f.get("topic")).map(|t| t.as_str()), Some("orders"));
        assert_eq!(command.body().map(|b| b.as_ref()), Some(&b"BODY"[..]));
        assert_eq!(&buffer[..], &[0, 0], "only that frame was taken");

        let java = r#"{"code":105,"language":"JAVA","version":475,"opaque":8,"flag":0,"extFields":{"topic":"t"},"serializeTypeCurrentRPC":"JSON"}"#;
        let mut buffer = frame(java, b"");
        assert!(completed(&mut buffer.clone(), 1 << 20).is_none(), "a complete header is not copied");
        let command = decode(&mut buffer, 1 << 20).expect("decodes").expect("a whole frame");
        assert_eq!(command.opaque(), 8);
    }

    #[test]
    fn an_incomplete_oversized_or_broken_frame_is_left_to_the_decoder() {
        let go = r#"{"code":105,"language":"GO","version":317,"opaque":7,"flag":0}"#;
        let whole = frame(go, b"");
        let mut half = BytesMut::from(&whole[..whole.len() - 3]);
        assert!(decode(&mut half, 1 << 20).expect("no error yet").is_none(), "waits for the rest");
        assert_eq!(half.len(), whole.len() - 3);
        assert!(decode(&mut whole.clone(), 16).is_err(), "over the limit");
        let mut broken = frame(r#"{"code":"#, b"");
        assert!(decode(&mut broken, 1 << 20).is_err(), "a header that is not JSON is still an error");
    }
}
