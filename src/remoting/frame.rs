//! Reading a frame as real clients write it. The rocketmq-rust decoder wants every header field Apache's Java
//! client writes, each of the type Java writes. Other clients differ where RocketMQ's servers do not mind: the Go
//! client (`rocketmq-client-go` v2) leaves `serializeTypeCurrentRPC` out of its JSON header; a client may leave
//! out its `language` or name one the decoder does not know, or write a number where Java writes a string (the
//! servers' JSON reader, fastjson, converts such scalars). Such a header is completed before the frame is
//! decoded, so the client is answered instead of having its connection closed. A Java client's frame is
//! decoded as it is, with no copy.
//!
//! A whole frame whose header names its request (`opaque`) but cannot be read as a request (a `code` that is
//! not a number, header fields that are not a map of scalars) is refused with an answer to that request, and
//! the connection is kept: its bounds are known, so the next frame is read as usual. Apache's broker and proxy
//! close the connection there, and the client waits out its timeout.

use bytes::{BufMut, BytesMut};
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;
use serde_json::{Map, Value};

/// The header field the Go client leaves out, and the value it would have.
const SERIALIZE_TYPE_FIELD: &str = "serializeTypeCurrentRPC";
const JSON_SERIALIZE_TYPE: &str = "JSON";
/// The length prefix and the header-length word before a frame's header.
const PREFIX: usize = 8;
/// The largest header length the header-length word can carry (its top byte is the serialize type).
const MAX_HEADER: usize = 0x00FF_FFFF;
/// The language codes the decoder reads (RocketMQ's `LanguageCode`); a header naming none of them is read as
/// `OTHER`, as fastjson reads an unknown name as none.
const LANGUAGES: [&str; 14] = [
    "JAVA", "CPP", "DOTNET", "PYTHON", "DELPHI", "ERLANG", "RUBY", "OTHER", "HTTP", "GO", "PHP", "OMS", "RUST",
    "NODE_JS",
];

/// The next whole frame of a connection.
pub(super) enum Frame {
    /// A command that decodes.
    Command(RemotingCommand),
    /// A request whose header cannot be read as one: to be answered with an error saying `why`.
    Refused { opaque: i32, why: String },
}

/// Decodes the next whole frame of `buffer` (`None` while it is incomplete), as
/// `RemotingCommand::decode_with_max_frame_bytes` does, a JSON header completed first (see the module's words).
///
/// # Errors
/// As `RemotingCommand::decode_with_max_frame_bytes`: a frame over `max_frame` bytes, or one that does not decode
/// and names no request to answer.
pub(super) fn decode(buffer: &mut BytesMut, max_frame: usize) -> rocketmq_error::Result<Option<Frame>> {
    let command = match review(buffer, max_frame) {
        Review::AsItIs => RemotingCommand::decode_with_max_frame_bytes(buffer, max_frame),
        // The completed header may be a few bytes longer than the one the client sent.
        Review::Completed(mut frame) => {
            RemotingCommand::decode_with_max_frame_bytes(&mut frame, max_frame.saturating_add(64))
        }
        Review::Refused { opaque, why } => return Ok(Some(Frame::Refused { opaque, why })),
    };
    command.map(|command| command.map(Frame::Command))
}

/// What [`review`] made of the next frame.
enum Review {
    /// Left to the decoder as it is: incomplete, not a JSON header, or one it reads.
    AsItIs,
    /// Taken out of the buffer with its header completed.
    Completed(BytesMut),
    /// Taken out of the buffer: a request whose header cannot be read.
    Refused { opaque: i32, why: String },
}

fn review(buffer: &mut BytesMut, max_frame: usize) -> Review {
    let word = |at: usize| -> Option<usize> {
        let bytes: [u8; 4] = buffer.get(at..at + 4)?.try_into().ok()?;
        usize::try_from(u32::from_be_bytes(bytes)).ok()
    };
    let (Some(total), Some(header_word)) = (word(0), word(4)) else { return Review::AsItIs };
    let Some(frame_len) = total.checked_add(4) else { return Review::AsItIs };
    // A length word under 4 cannot hold the header-length word: the decoder refuses it.
    let Some(room_for_header) = total.checked_sub(4) else { return Review::AsItIs };
    let (serialize_type, header_len) = (header_word >> 24, header_word & MAX_HEADER);
    if frame_len > max_frame || buffer.len() < frame_len || serialize_type != 0 || header_len > room_for_header {
        return Review::AsItIs;
    }
    let Ok(mut fields) = serde_json::from_slice::<Map<String, Value>>(&buffer[PREFIX..PREFIX + header_len]) else {
        return Review::AsItIs;
    };
    let completed = match complete(&mut fields) {
        Ok(completed) => completed,
        Err(Unreadable::Unanswerable) => return Review::AsItIs,
        Err(Unreadable::Refused { opaque, why }) => {
            let _ = buffer.split_to(frame_len);
            return Review::Refused { opaque, why };
        }
    };
    if !completed {
        return Review::AsItIs;
    }
    let Ok(header) = serde_json::to_vec(&fields) else { return Review::AsItIs };
    let (Ok(header_word), Ok(total)) =
        (u32::try_from(header.len()), u32::try_from(4 + header.len() + (frame_len - PREFIX - header_len)))
    else {
        return Review::AsItIs;
    };
    if header.len() > MAX_HEADER {
        return Review::AsItIs;
    }
    let frame = buffer.split_to(frame_len);
    let body = &frame[PREFIX + header_len..];
    let mut rebuilt = BytesMut::with_capacity(PREFIX + header.len() + body.len());
    rebuilt.put_u32(total);
    rebuilt.put_u32(header_word);
    rebuilt.extend_from_slice(&header);
    rebuilt.extend_from_slice(body);
    Review::Completed(rebuilt)
}

/// Why a JSON header cannot be completed.
enum Unreadable {
    /// It names no request to answer (its `opaque` is not a number): left to the decoder, which refuses it.
    Unanswerable,
    /// Request `opaque` cannot be read.
    Refused { opaque: i32, why: String },
}

/// Completes `fields` (a JSON header) as RocketMQ's servers read it; whether anything changed.
fn complete(fields: &mut Map<String, Value>) -> Result<bool, Unreadable> {
    let mut changed = false;
    let opaque = match fields.get("opaque") {
        None => {
            changed = true;
            fields.insert("opaque".to_owned(), 0.into());
            0
        }
        Some(value) => match as_i32(value) {
            Some(opaque) => {
                changed |= !value.is_i64();
                fields.insert("opaque".to_owned(), opaque.into());
                opaque
            }
            None => return Err(Unreadable::Unanswerable),
        },
    };
    let refuse = |why: String| Unreadable::Refused { opaque, why };
    for (name, required) in [("code", true), ("version", false), ("flag", false)] {
        match fields.get(name).map(|v| (as_i32(v), v.is_i64())) {
            Some((Some(_), true)) => {}
            Some((Some(number), false)) => {
                changed = true;
                fields.insert(name.to_owned(), number.into());
            }
            None if !required => {
                changed = true;
                fields.insert(name.to_owned(), 0.into());
            }
            _ => return Err(refuse(format!("the frame's header field `{name}` is not a 32-bit number"))),
        }
    }
    let known_language = fields.get("language").and_then(Value::as_str).is_some_and(|l| LANGUAGES.contains(&l));
    if !known_language {
        changed = true;
        fields.insert("language".to_owned(), "OTHER".into());
    }
    if fields.get(SERIALIZE_TYPE_FIELD).and_then(Value::as_str).is_none() {
        changed = true;
        fields.insert(SERIALIZE_TYPE_FIELD.to_owned(), JSON_SERIALIZE_TYPE.into());
    }
    match fields.get_mut("remark") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(remark) => match scalar_text(remark) {
            Some(text) => {
                changed = true;
                *remark = text.into();
            }
            None => return Err(refuse("the frame's header field `remark` is not text".to_owned())),
        },
    }
    match fields.get_mut("extFields") {
        None | Some(Value::Null) => {}
        Some(Value::Object(ext)) => {
            ext.retain(|_, value| !value.is_null());
            for (name, value) in ext.iter_mut() {
                if value.is_string() {
                    continue;
                }
                let Some(text) = scalar_text(value) else {
                    return Err(refuse(format!("the frame's header field `extFields.{name}` is not text")));
                };
                changed = true;
                *value = text.into();
            }
        }
        Some(_) => return Err(refuse("the frame's header field `extFields` is not a map".to_owned())),
    }
    Ok(changed)
}

/// A JSON number, or a string of one, that fits in 32 bits.
fn as_i32(value: &Value) -> Option<i32> {
    match value {
        Value::Number(number) => number.as_i64().and_then(|n| i32::try_from(n).ok()),
        Value::String(text) => text.trim().parse().ok(),
        _ => None,
    }
}

/// A number or a boolean as the text fastjson reads it as.
fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::Number(number) => Some(number.to_string()),
        Value::Bool(flag) => Some(flag.to_string()),
        _ => None,
    }
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

    /// The command `buffer`'s next frame decodes to.
    fn command(buffer: &mut BytesMut) -> RemotingCommand {
        match decode(buffer, 1 << 20).expect("decodes").expect("a whole frame") {
            Frame::Command(command) => command,
            Frame::Refused { why, .. } => panic!("refused: {why}"),
        }
    }

    #[test]
    fn a_go_clients_header_without_its_serialize_type_is_read_and_a_java_one_as_it_is() {
        // What rocketmq-client-go v2 writes for a route query (no serializeTypeCurrentRPC), then a send's body.
        let go = r#"{"code":105,"language":"GO","version":317,"opaque":7,"flag":0,"remark":"","extFields":{"topic":"orders"}}"#;
        let mut buffer = frame(go, b"BODY");
        buffer.extend_from_slice(&[0, 0]);
        let go_command = command(&mut buffer);
        assert_eq!((go_command.code(), go_command.opaque()), (105, 7));
        assert_eq!(go_command.ext_fields().and_then(|f| f.get("topic")).map(|t| t.as_str()), Some("orders"));
        assert_eq!(go_command.body().map(|b| b.as_ref()), Some(&b"BODY"[..]));
        assert_eq!(&buffer[..], &[0, 0], "only that frame was taken");

        let java = r#"{"code":105,"language":"JAVA","version":475,"opaque":8,"flag":0,"extFields":{"topic":"t"},"serializeTypeCurrentRPC":"JSON"}"#;
        let mut buffer = frame(java, b"");
        assert!(matches!(review(&mut buffer.clone(), 1 << 20), Review::AsItIs), "a complete header is not copied");
        assert_eq!(command(&mut buffer).opaque(), 8);
    }

    #[test]
    fn what_rocketmqs_servers_read_is_read_the_same_way() {
        let cases = [
            // No language, an unknown one, a number: read as OTHER, as fastjson reads an unknown name as none.
            (r#"{"code":105,"opaque":1,"extFields":{"topic":"t"}}"#, 105, "OTHER"),
            (r#"{"code":105,"language":"KLINGON","opaque":2,"flag":0,"version":1}"#, 105, "OTHER"),
            (r#"{"code":105,"language":7,"opaque":3}"#, 105, "OTHER"),
            (r#"{"code":105,"language":"NODE_JS","opaque":4}"#, 105, "NODE_JS"),
            // Numbers as strings, and scalars where Java writes strings: converted as fastjson converts them.
            (
                r#"{"code":"310","language":"CPP","version":"1","flag":"0","opaque":"5","extFields":{"queueId":3,"batch":false}}"#,
                310,
                "CPP",
            ),
            (r#"{"code":105,"language":"GO","opaque":6,"remark":42,"extFields":{"topic":"t","gone":null}}"#, 105, "GO"),
        ];
        for (opaque, (header, code, language)) in (1..).zip(cases) {
            let read = command(&mut frame(header, b""));
            assert_eq!((read.code(), read.opaque()), (code, opaque), "{header}");
            assert_eq!(format!("{:?}", read.language()), language, "{header}");
        }
        let read = command(&mut frame(cases[4].0, b""));
        let field = |name: &str| read.ext_fields().and_then(|f| f.get(name)).map(|v| v.to_string());
        assert_eq!((field("queueId").as_deref(), field("batch").as_deref()), (Some("3"), Some("false")));
    }

    #[test]
    fn a_request_whose_header_cannot_be_read_is_refused_by_its_opaque_and_only_its_frame_is_taken() {
        for (header, field) in [
            (r#"{"opaque":9,"language":"GO"}"#, "`code`"),
            (r#"{"code":"route","opaque":9}"#, "`code`"),
            (r#"{"code":105,"opaque":9,"flag":[1]}"#, "`flag`"),
            (r#"{"code":105,"opaque":9,"extFields":["topic"]}"#, "`extFields`"),
            (r#"{"code":105,"opaque":9,"extFields":{"topic":{"name":"t"}}}"#, "`extFields.topic`"),
            (r#"{"code":105,"opaque":9,"remark":{"a":1}}"#, "`remark`"),
        ] {
            let mut buffer = frame(header, b"BODY");
            buffer.extend_from_slice(b"next");
            match decode(&mut buffer, 1 << 20).expect("answerable").expect("a whole frame") {
                Frame::Refused { opaque, why } => {
                    assert_eq!(opaque, 9, "{header}");
                    assert!(why.contains(field), "{header}: {why}");
                }
                Frame::Command(read) => panic!("{header} was read as request {}", read.code()),
            }
            assert_eq!(&buffer[..], b"next", "{header}: the next frame is read as usual");
        }
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
        let mut nameless = frame(r#"{"code":105,"opaque":"seven"}"#, b"");
        assert!(decode(&mut nameless, 1 << 20).is_err(), "a request that cannot be answered is an error");
    }

    #[test]
    fn a_length_word_under_four_is_an_error_not_a_panic() {
        for total in 0u32..4 {
            let mut buffer = BytesMut::new();
            buffer.put_u32(total);
            buffer.put_u32(0);
            buffer.extend_from_slice(b"{}");
            assert!(decode(&mut buffer, 1 << 20).is_err(), "length word {total}");
        }
    }

    proptest::proptest! {
        /// Whatever bytes a client sends, a frame decodes, waits for more, is refused or is an error: never a
        /// panic. Runs as many times as `PROPTEST_CASES` says (256 by default); a seed that fails is a bug.
        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut buffer = BytesMut::from(&bytes[..]);
            let _ = decode(&mut buffer, 1 << 20);
        }

        /// A frame whose length words are right and whose header is arbitrary (JSON-like text or not).
        #[test]
        fn a_well_framed_arbitrary_header_never_panics_the_decoder(
            header in "[{}\\[\\]\":,a-zA-Z0-9 .-]{0,200}",
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let mut buffer = frame(&header, &body);
            while let Ok(Some(_)) = decode(&mut buffer, 1 << 20) {}
        }

        /// A real header with arbitrary field values: decoded, refused by its opaque, or an error.
        #[test]
        fn arbitrary_field_values_never_panic_the_decoder(
            code in "[0-9a-z\\-]{0,12}",
            opaque in "[0-9a-z\\-]{0,12}",
            topic in "\\PC{0,40}",
        ) {
            let header = serde_json::json!({"code": code, "opaque": opaque, "extFields": {"topic": topic}}).to_string();
            let _ = decode(&mut frame(&header, b""), 1 << 20);
        }
    }
}
