//! Who may do what: bearer tokens from the config, each with the topics it may publish to, the consumer
//! groups it may consume as, and whether it may use the admin plane.
//!
//! Bearer tokens are kept as SHA-256 digests. A presented token is hashed and compared with every configured
//! digest in constant time (no early exit), so neither the comparison nor the table's order leaks which
//! bytes matched. The gRPC front's HMAC signatures need the secret itself, so the secret of each token given
//! as `token` is kept in memory for them. A token is never logged; only its configured `name` is.
//!
//! [`TokenBudget`] bounds how many calls of one kind each token has open at once (the fronts' long polls and
//! streams).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::AuthConfig;

/// What a request wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Publish to this topic.
    Publish(&'a str),
    /// Subscribe, poll, stream, ACK/NACK/TERM as this consumer group.
    Consume(&'a str),
    /// Use `/admin/*`.
    Admin,
}

/// The authenticated caller of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's configured name (`anonymous` when authentication is off).
    pub name: String,
    publish: Vec<Pattern>,
    consume: Vec<Pattern>,
    admin: bool,
    unrestricted: bool,
}

impl Caller {
    /// The caller when authentication is switched off: allowed everything.
    pub fn unrestricted() -> Caller {
        Caller { name: "anonymous".to_owned(), publish: vec![], consume: vec![], admin: true, unrestricted: true }
    }

    /// Whether this is the caller of a popgate whose authentication is off (allowed everything).
    pub fn is_unrestricted(&self) -> bool {
        self.unrestricted
    }

    /// Whether this caller may do `action`.
    pub fn may(&self, action: Action<'_>) -> bool {
        if self.unrestricted {
            return true;
        }
        match action {
            Action::Publish(topic) => self.publish.iter().any(|p| p.matches(topic)),
            Action::Consume(group) => self.consume.iter().any(|p| p.matches(group)),
            Action::Admin => self.admin,
        }
    }
}

/// The configured tokens, ready to check requests against.
#[derive(Debug, Clone)]
pub struct TokenTable {
    enabled: bool,
    entries: Vec<([u8; 32], Caller)>,
    /// Tokens configured with their secret (not only its digest), by name: the RocketMQ SDKs sign each call
    /// with an access key (the token's name) and an HMAC keyed by the secret, so only these can verify one.
    signing: Vec<(String, Vec<u8>, Caller)>,
}

impl TokenTable {
    /// Builds the table from a validated config.
    pub fn new(config: &AuthConfig) -> TokenTable {
        let entries = config
            .tokens
            .iter()
            .filter_map(|token| {
                let digest = match (&token.token, &token.sha256) {
                    (Some(secret), _) => digest(secret.as_bytes()),
                    (None, Some(hex_digest)) => hex::decode(hex_digest).ok()?.try_into().ok()?,
                    (None, None) => return None,
                };
                Some((digest, caller_of(config, &token.name)?))
            })
            .collect();
        let signing = config
            .tokens
            .iter()
            .filter_map(|token| {
                let secret = token.token.as_ref()?;
                let caller = caller_of(config, &token.name)?;
                Some((token.name.clone(), secret.as_bytes().to_vec(), caller))
            })
            .collect();
        TokenTable { enabled: config.enabled, entries, signing }
    }

    /// The caller a RocketMQ SDK signature stands for: `access_key` names a token configured with its
    /// secret, and `signature` is the HMAC-SHA1 of `signed` (the `x-mq-date-time` header) keyed by that
    /// secret, in hex of either case. Compared in constant time.
    pub fn authenticate_signature(&self, access_key: &str, signed: &str, signature: &str) -> Option<Caller> {
        use hmac::{Hmac, Mac};
        let presented = hex::decode(signature.to_ascii_lowercase()).ok()?;
        let (_, secret, caller) = self.signing.iter().find(|(name, _, _)| name == access_key)?;
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(secret).ok()?;
        mac.update(signed.as_bytes());
        mac.verify_slice(&presented).ok()?;
        Some(caller.clone())
    }

    /// The caller a RocketMQ remoting client's ACL signature stands for (`AclClientRPCHook`): `access_key`
    /// names a token configured with its secret, and `signature` is the base64 HMAC-SHA1 of `signed` keyed by
    /// that secret. Compared in constant time.
    pub fn authenticate_acl_signature(&self, access_key: &str, signed: &[u8], signature: &str) -> Option<Caller> {
        use base64::Engine;
        use hmac::{Hmac, Mac};
        let presented = base64::engine::general_purpose::STANDARD.decode(signature.trim()).ok()?;
        let (_, secret, caller) = self.signing.iter().find(|(name, _, _)| name == access_key)?;
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(secret).ok()?;
        mac.update(signed);
        mac.verify_slice(&presented).ok()?;
        Some(caller.clone())
    }

    /// Whether requests must carry a token.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The caller a presented token stands for, if any. Every entry is compared, whatever matches first.
    pub fn authenticate(&self, presented: &str) -> Option<Caller> {
        let presented = digest(presented.as_bytes());
        let mut found = None;
        for (expected, caller) in &self.entries {
            if bool::from(expected.ct_eq(&presented)) && found.is_none() {
                found = Some(caller.clone());
            }
        }
        found
    }
}

/// The caller of the token named `name`, as [`TokenTable::new`] builds it.
fn caller_of(config: &AuthConfig, name: &str) -> Option<Caller> {
    let token = config.tokens.iter().find(|t| t.name == name)?;
    Some(Caller {
        name: token.name.clone(),
        publish: token.publish.iter().map(|p| Pattern::new(p)).collect(),
        consume: token.consume.iter().map(|p| Pattern::new(p)).collect(),
        admin: token.admin,
        unrestricted: false,
    })
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A topic or group name where `*` matches any run of characters (none included).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    /// The text split at its stars: one part means no star (an exact name).
    parts: Vec<String>,
}

impl Pattern {
    fn new(text: &str) -> Pattern {
        Pattern { parts: text.split('*').map(str::to_owned).collect() }
    }

    fn matches(&self, name: &str) -> bool {
        let (first, last) = match self.parts.as_slice() {
            [exact] => return name == exact,
            [first, .., last] => (first.as_str(), last.as_str()),
            [] => return false,
        };
        if name.len() < first.len() + last.len() || !name.starts_with(first) || !name.ends_with(last) {
            return false;
        }
        // The parts between the stars must appear in order, without overlapping the ends.
        let mut middle = &name[first.len()..name.len() - last.len()];
        for part in &self.parts[1..self.parts.len() - 1] {
            match middle.find(part.as_str()) {
                Some(at) => middle = &middle[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

pub use crate::config::names::is_valid_pattern;

/// How many calls of one kind (long polls, streams, …) each token may have open at once.
#[derive(Debug)]
pub struct TokenBudget {
    max_per_token: usize,
    open: Mutex<HashMap<String, usize>>,
}

/// One open call of a token; dropping it gives its place back.
#[derive(Debug)]
pub struct BudgetSlot {
    budget: Arc<TokenBudget>,
    token: String,
}

impl TokenBudget {
    /// At most `max_per_token` open calls per token.
    pub fn new(max_per_token: usize) -> Arc<TokenBudget> {
        Arc::new(TokenBudget { max_per_token, open: Mutex::new(HashMap::new()) })
    }

    /// The most a token may have open.
    pub fn max_per_token(&self) -> usize {
        self.max_per_token
    }

    /// A place for one more call of `caller`, or `None` when its token has used them all.
    pub fn take(self: &Arc<Self>, caller: &Caller) -> Option<BudgetSlot> {
        let mut open = self.open.lock();
        let count = open.entry(caller.name.clone()).or_insert(0);
        if *count >= self.max_per_token {
            return None;
        }
        *count += 1;
        Some(BudgetSlot { budget: Arc::clone(self), token: caller.name.clone() })
    }
}

impl Drop for BudgetSlot {
    fn drop(&mut self) {
        let mut open = self.budget.open.lock();
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
    use crate::config::TokenConfig;

    #[test]
    fn patterns_match_names_with_stars_anywhere() {
        let cases = [
            ("orders", "orders", true),
            ("orders", "orders2", false),
            ("orders", "xorders", false),
            ("orders-*", "orders-eu", true),
            ("orders-*", "orders-", true),
            ("orders-*", "order", false),
            ("*-dlq", "x-dlq", true),
            ("*-dlq", "x-dlqy", false),
            ("a*b*c", "abc", true),
            ("a*b*c", "axxbyyc", true),
            ("a*b*c", "axxbyy", false),
            ("*", "anything", true),
            ("*mid*", "a-mid-b", true),
            ("*mid*", "a-mad-b", false),
            ("ab*ab", "ab", false),
        ];
        for (pattern, name, expected) in cases {
            assert_eq!(Pattern::new(pattern).matches(name), expected, "{pattern} vs {name}");
        }
    }

    #[test]
    fn a_token_grants_exactly_its_actions() {
        let config = AuthConfig {
            enabled: true,
            tokens: vec![
                TokenConfig {
                    name: "app".into(),
                    token: Some("app-secret-0123456789".into()),
                    publish: vec!["orders".into()],
                    consume: vec!["billing-*".into()],
                    ..TokenConfig::default()
                },
                TokenConfig {
                    name: "ops".into(),
                    sha256: Some(hex::encode(digest(b"ops-secret-0123456789"))),
                    admin: true,
                    ..TokenConfig::default()
                },
            ],
            ..AuthConfig::default()
        };
        let table = TokenTable::new(&config);
        let app = table.authenticate("app-secret-0123456789").expect("known token");
        assert_eq!(app.name, "app");
        assert!(app.may(Action::Publish("orders")));
        assert!(!app.may(Action::Publish("payments")));
        assert!(app.may(Action::Consume("billing-eu")));
        assert!(!app.may(Action::Consume("orders")));
        assert!(!app.may(Action::Admin));
        let ops = table.authenticate("ops-secret-0123456789").expect("hashed token");
        assert!(ops.may(Action::Admin) && !ops.may(Action::Publish("orders")));
        assert!(table.authenticate("app-secret-012345678").is_none());
        assert!(table.authenticate("").is_none());
        assert!(Caller::unrestricted().may(Action::Consume("anything")));
    }

    #[test]
    fn pattern_syntax() {
        assert!(is_valid_pattern("orders-*") && is_valid_pattern("*") && is_valid_pattern("%DLQ%g"));
        assert!(!is_valid_pattern("") && !is_valid_pattern("orders.*") && !is_valid_pattern("a b"));
    }
}
