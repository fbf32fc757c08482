//! Who sent a request: the ACL signature Apache's remoting client adds when it is given an `AclClientRPCHook`
//! (an access key and a secret key), checked against popgate's token table. The access key is a token's
//! name and the secret key the token itself, as for the gRPC front's signatures, so one token serves an app
//! on every front, with the same scopes.
//!
//! The client signs every request: the values of all its header fields (its `AccessKey` among them) in the
//! order of their names, then the body, HMAC-SHA1 keyed by the secret key, base64 in the `Signature` field.

use std::collections::BTreeMap;

use metrics::counter;
use rocketmq_protocol::protocol::remoting_command::RemotingCommand;

use super::codes;
use super::service::{field, Refusal};
use crate::auth::{Caller, TokenTable};
use crate::metrics as m;

const ACCESS_KEY: &str = "AccessKey";
const SIGNATURE: &str = "Signature";

/// The caller of `request`, or the answer refusing it.
pub(super) fn caller(tokens: &TokenTable, request: &RemotingCommand) -> Result<Caller, Refusal> {
    if !tokens.enabled() {
        return Ok(Caller::unrestricted());
    }
    let refuse = |remark: &str| {
        counter!(m::REQUESTS_REJECTED, "reason" => "unauthenticated").increment(1);
        Err(Refusal::new(codes::NO_PERMISSION, remark))
    };
    let Some(access_key) = field(request, ACCESS_KEY) else {
        return refuse("no AccessKey: popgate requires an ACL signature (give the client an AclClientRPCHook)");
    };
    let Some(signature) = field(request, SIGNATURE) else {
        return refuse("no Signature: popgate requires an ACL signature (give the client an AclClientRPCHook)");
    };
    match tokens.authenticate_acl_signature(access_key, &signed_content(request), signature) {
        Some(caller) => Ok(caller),
        None => refuse("Signature does not match the AccessKey's secret key (or the AccessKey is unknown)"),
    }
}

/// What the client signed: every header field's value but the signature's, by field name, then the body.
fn signed_content(request: &RemotingCommand) -> Vec<u8> {
    let sorted: BTreeMap<&str, &str> = request
        .ext_fields()
        .into_iter()
        .flatten()
        .filter(|(name, _)| name.as_str() != SIGNATURE)
        .map(|(name, value)| (name.as_str(), value.as_str()))
        .collect();
    let mut content: Vec<u8> = sorted.values().flat_map(|v| v.as_bytes().iter().copied()).collect();
    if let Some(body) = request.body() {
        content.extend_from_slice(body);
    }
    content
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signed_content_is_the_field_values_by_name_then_the_body() {
        let mut request = RemotingCommand::create_remoting_command(10).set_body(bytes::Bytes::from_static(b"BODY"));
        request.add_ext_field("topic", "T");
        request.add_ext_field(ACCESS_KEY, "app");
        request.add_ext_field(SIGNATURE, "ignored");
        request.add_ext_field("b", "2");
        // AccessKey < Signature < b < topic: "app", then "2", then "T".
        assert_eq!(signed_content(&request), b"app2TBODY".to_vec());
    }
}
