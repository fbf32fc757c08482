//! Who may do what: bearer tokens from the config, each with what it may do in RocketMQ's ACL 2.0 model:
//! `Pub` and `Sub` on resources `Topic:…` and `Group:…` (literal, prefix, any), allowed or denied, optionally
//! only from some networks; and whether it may use the admin plane. A token's `publish`, `consume` and
//! `subscribe` lists are shorthand for allowing entries; its `acl` holds entries as `mqadmin createAcl` writes
//! them. Reading a topic as a group needs `Sub` on both.
//!
//! Bearer tokens are kept as SHA-256 digests. A presented token is hashed and compared with every configured
//! digest in constant time (no early exit), so neither the comparison nor the table's order leaks which
//! bytes matched. The gRPC front's HMAC signatures need the secret itself, so the secret of each token given
//! as `token` is kept in memory for them. A token is never logged; only its configured `name` is.
//!
//! With `auth.cluster_acl`, the users and ACLs of the cluster itself (ACL 2.0, as `mqadmin createUser` and
//! `createAcl` made them) are read too ([`cluster`]): a user's name and password sign remoting and gRPC
//! requests as a token's name and secret do, and its ACL's entries are its grants. A configured token of the
//! same name wins.
//!
//! [`TokenBudget`] bounds how many calls of one kind each token has open at once (the fronts' long polls and
//! streams).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub mod cluster;

use crate::config::names::{AclEntry, NamePattern, ResourceType};
use crate::config::{AuthConfig, TokenConfig};

/// What a request wants to do, in the terms of RocketMQ's ACL 2.0: an action on a resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action<'a> {
    /// Publish to this topic (`Pub` on `Topic:<name>`).
    Publish(&'a str),
    /// Subscribe, poll, stream, ACK/NACK/TERM as this consumer group (`Sub` on `Group:<name>`).
    Consume(&'a str),
    /// Read this topic (`Sub` on `Topic:<name>`); a group's `%RETRY%` topic is the group's (`Sub` on
    /// `Group:<group>`), as in Apache's ACLs. Reading needs this **and** [`Action::Consume`] of the group.
    Subscribe(&'a str),
    /// Use `/admin/*`.
    Admin,
}

/// The prefix of a consumer group's retry topic.
pub const RETRY_TOPIC_PREFIX: &str = "%RETRY%";

/// The authenticated caller of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's configured name (`anonymous` when authentication is off).
    pub name: String,
    grants: Arc<[Grant]>,
    admin: bool,
    unrestricted: bool,
    /// Where the request came from, for grants limited to source networks.
    source_ip: Option<IpAddr>,
}

impl Caller {
    /// The caller of a configured token named `name` that may publish to `publish` and consume as `consume`
    /// (patterns, as in `popgate.toml`), for unit tests.
    #[cfg(test)]
    pub fn of_test_token(name: &str, publish: &str, consume: &str) -> Caller {
        Caller::of_test_config(name, publish, consume, None)
    }

    /// The caller of a configured token named `name` that may publish to `publish`, consume as `consume` and read
    /// `subscribe` (patterns, as in `popgate.toml`), for unit tests.
    #[cfg(test)]
    pub fn of_scoped_test_token(name: &str, publish: &str, consume: &str, subscribe: &str) -> Caller {
        Caller::of_test_config(name, publish, consume, Some(vec![subscribe.into()]))
    }

    #[cfg(test)]
    fn of_test_config(name: &str, publish: &str, consume: &str, subscribe: Option<Vec<String>>) -> Caller {
        let config = AuthConfig {
            enabled: true,
            tokens: vec![crate::config::TokenConfig {
                name: name.into(),
                token: Some(format!("{name}-secret-0123456789")),
                publish: vec![publish.into()],
                consume: vec![consume.into()],
                subscribe,
                ..crate::config::TokenConfig::default()
            }],
            ..AuthConfig::default()
        };
        TokenTable::new(&config).authenticate(&format!("{name}-secret-0123456789")).expect("the token")
    }

    /// The caller when authentication is switched off: allowed everything.
    pub fn unrestricted() -> Caller {
        Caller { name: "anonymous".to_owned(), grants: Arc::new([]), admin: true, unrestricted: true, source_ip: None }
    }

    /// The same caller, its request come from `ip` (an IPv4 address mapped into IPv6 counts as IPv4). A grant
    /// limited to source networks applies only to callers whose address is known and inside one of them.
    #[must_use]
    pub(crate) fn with_address(mut self, ip: IpAddr) -> Caller {
        self.source_ip = Some(ip.to_canonical());
        self
    }

    /// Where the caller's request came from, when the front knows it.
    pub fn source_ip(&self) -> Option<IpAddr> {
        self.source_ip
    }

    /// Whether the caller may do everything (authentication is off).
    pub fn is_unrestricted(&self) -> bool {
        self.unrestricted
    }

    /// Whether this caller may do `action`: the most specific of its grants that cover the action decides
    /// ([`Grant::specificity`]); none covers it: no.
    pub fn may(&self, action: Action<'_>) -> bool {
        if self.unrestricted {
            return true;
        }
        let (resource_type, name, verb) = match action {
            Action::Publish(topic) => (ResourceType::Topic, topic, Verb::Pub),
            Action::Consume(group) => {
                (ResourceType::Group, group.strip_prefix(RETRY_TOPIC_PREFIX).unwrap_or(group), Verb::Sub)
            }
            Action::Subscribe(topic) => match topic.strip_prefix(RETRY_TOPIC_PREFIX) {
                Some(group) => (ResourceType::Group, group, Verb::Sub),
                None => (ResourceType::Topic, topic, Verb::Sub),
            },
            Action::Admin => return self.admin,
        };
        // A cluster ACL's `Default` policy speaks only where no entry of its `Custom` one covers the request.
        let decide = |fallback: bool| {
            self.grants
                .iter()
                .filter(|grant| grant.fallback == fallback)
                .filter(|grant| grant.covers(resource_type, name, verb) && grant.applies_from(self.source_ip))
                .max_by_key(|grant| (grant.specificity(), grant.deny))
                .map(|decisive| !decisive.deny)
        };
        decide(false).or_else(|| decide(true)).unwrap_or(false)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verb {
    Pub,
    Sub,
}

/// One policy entry of a token: an ACL 2.0 entry, or one of its `publish` / `consume` / `subscribe` patterns.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Grant {
    resource_type: ResourceType,
    names: Names,
    publish: bool,
    subscribe: bool,
    deny: bool,
    source_ips: Vec<ipnet::IpNet>,
    /// An entry of a cluster ACL's `Default` policy: it decides only where no other grant covers a request.
    fallback: bool,
}

/// The names a grant covers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Names {
    Any,
    Literal(String),
    Prefixed(String),
    /// A `publish` / `consume` / `subscribe` pattern with a `*` elsewhere than at its end.
    Wildcard(Pattern),
}

impl Grant {
    fn from_entry(entry: AclEntry) -> Grant {
        let names = match entry.names {
            NamePattern::Any => Names::Any,
            NamePattern::Literal(name) => Names::Literal(name),
            NamePattern::Prefixed(prefix) => Names::Prefixed(prefix),
        };
        let AclEntry { resource_type, publish, subscribe, deny, source_ips, .. } = entry;
        Grant { resource_type, names, publish, subscribe, deny, source_ips, fallback: false }
    }

    /// An allowing grant of one verb on the names a token pattern (`orders-*`, `*`, `a*b`) covers.
    fn from_pattern(resource_type: ResourceType, pattern: &str, verb: Verb) -> Grant {
        let names = match pattern.split_once('*') {
            None => Names::Literal(pattern.to_owned()),
            Some(("", "")) => Names::Any,
            Some((prefix, "")) => Names::Prefixed(prefix.to_owned()),
            Some(_) => Names::Wildcard(Pattern::new(pattern)),
        };
        let (publish, subscribe) = (verb == Verb::Pub, verb == Verb::Sub);
        Grant { resource_type, names, publish, subscribe, deny: false, source_ips: Vec::new(), fallback: false }
    }

    fn covers(&self, resource_type: ResourceType, name: &str, verb: Verb) -> bool {
        let verb_named = match verb {
            Verb::Pub => self.publish,
            Verb::Sub => self.subscribe,
        };
        let type_matches = self.resource_type == ResourceType::Any || self.resource_type == resource_type;
        let name_matches = match &self.names {
            Names::Any => true,
            Names::Literal(literal) => literal == name,
            Names::Prefixed(prefix) => name.starts_with(prefix.as_str()),
            Names::Wildcard(pattern) => pattern.matches(name),
        };
        verb_named && type_matches && name_matches
    }

    fn applies_from(&self, source_ip: Option<IpAddr>) -> bool {
        self.source_ips.is_empty() || source_ip.is_some_and(|ip| self.source_ips.iter().any(|net| net.contains(&ip)))
    }

    /// How specific the grant's resource is, as Apache's `AclAuthorizationHandler` orders entries: a literal
    /// name, then prefixes (the longer first), then every name of one type, then `*`.
    fn specificity(&self) -> (u8, usize) {
        if self.resource_type == ResourceType::Any {
            return (0, 0);
        }
        match &self.names {
            Names::Any => (1, 0),
            Names::Prefixed(prefix) => (2, prefix.len()),
            Names::Wildcard(pattern) => (2, pattern.fixed_len()),
            Names::Literal(_) => (3, 0),
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
    /// The cluster's users (`auth.cluster_acl`), replaced whole at each read.
    cluster: Arc<RwLock<Arc<cluster::ClusterUsers>>>,
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
        TokenTable { enabled: config.enabled, entries, signing, cluster: Arc::default() }
    }

    /// Replaces the cluster's users with a fresh read of them.
    pub fn set_cluster_users(&self, users: cluster::ClusterUsers) {
        *self.cluster.write() = Arc::new(users);
    }

    /// How many cluster users signatures are checked against.
    pub fn cluster_user_count(&self) -> usize {
        self.cluster.read().len()
    }

    /// The secret and caller of access key `access_key`: a configured token's, else a cluster user's.
    fn signer(&self, access_key: &str) -> Option<(Vec<u8>, Caller)> {
        if let Some((_, secret, caller)) = self.signing.iter().find(|(name, _, _)| name == access_key) {
            return Some((secret.clone(), caller.clone()));
        }
        let users = self.cluster.read().clone();
        users.get(access_key).map(|(secret, caller)| (secret.clone(), caller.clone()))
    }

    /// The caller a RocketMQ SDK signature stands for: `access_key` names a token configured with its
    /// secret, and `signature` is the HMAC-SHA1 of `signed` (the `x-mq-date-time` header) keyed by that
    /// secret, in hex of either case. Compared in constant time.
    pub fn authenticate_signature(&self, access_key: &str, signed: &str, signature: &str) -> Option<Caller> {
        use hmac::{Hmac, Mac};
        let presented = hex::decode(signature.to_ascii_lowercase()).ok()?;
        let (secret, caller) = self.signer(access_key)?;
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(&secret).ok()?;
        mac.update(signed.as_bytes());
        mac.verify_slice(&presented).ok()?;
        Some(caller)
    }

    /// The caller a RocketMQ remoting client's ACL signature stands for (`AclClientRPCHook`): `access_key`
    /// names a token configured with its secret, and `signature` is the base64 HMAC-SHA1 of `signed` keyed by
    /// that secret. Compared in constant time.
    pub fn authenticate_acl_signature(&self, access_key: &str, signed: &[u8], signature: &str) -> Option<Caller> {
        use base64::Engine;
        use hmac::{Hmac, Mac};
        let presented = base64::engine::general_purpose::STANDARD.decode(signature.trim()).ok()?;
        let (secret, caller) = self.signer(access_key)?;
        let mut mac = Hmac::<sha1::Sha1>::new_from_slice(&secret).ok()?;
        mac.update(signed);
        mac.verify_slice(&presented).ok()?;
        Some(caller)
    }

    /// The caller named `name` (a configured token's or a cluster user's), as another instance of the tier
    /// authenticated it; everyone when authentication is off here. `None` for a name this instance does not know.
    pub fn caller_named(&self, name: &str) -> Option<Caller> {
        if !self.enabled {
            return Some(Caller::unrestricted());
        }
        if let Some((_, caller)) = self.entries.iter().find(|(_, caller)| caller.name == name) {
            return Some(caller.clone());
        }
        let users = self.cluster.read().clone();
        users.get(name).map(|(_, caller)| caller.clone())
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
        grants: grants_of(token).into(),
        admin: token.admin,
        unrestricted: false,
        source_ip: None,
    })
}

/// What a token grants. A token without `subscribe` may read every topic (as the groups it may consume as):
/// what its `consume` meant before topics were scoped.
fn grants_of(token: &TokenConfig) -> Vec<Grant> {
    let patterns = |list: &[String], resource_type, verb| {
        list.iter().map(move |pattern| Grant::from_pattern(resource_type, pattern, verb)).collect::<Vec<_>>()
    };
    let mut grants = patterns(&token.publish, ResourceType::Topic, Verb::Pub);
    grants.extend(patterns(&token.consume, ResourceType::Group, Verb::Sub));
    match &token.subscribe {
        Some(topics) => grants.extend(patterns(topics, ResourceType::Topic, Verb::Sub)),
        None => grants.push(Grant::from_pattern(ResourceType::Topic, "*", Verb::Sub)),
    }
    grants.extend(token.acl.iter().filter_map(|entry| AclEntry::parse(entry).ok()).map(Grant::from_entry));
    grants
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

    /// How many characters of a matching name the pattern fixes (all but its stars).
    fn fixed_len(&self) -> usize {
        self.parts.iter().map(String::len).sum()
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
    use crate::config::AclEntryConfig;

    fn entry(resource: &str, actions: &str, decision: &str, source_ips: &[&str]) -> AclEntryConfig {
        AclEntryConfig {
            resource: resource.into(),
            actions: actions.split(',').map(str::to_owned).collect(),
            decision: Some(decision.into()),
            source_ips: source_ips.iter().map(|ip| ip.parse().expect("a network")).collect(),
        }
    }

    fn caller_with(token: TokenConfig) -> Caller {
        let config = AuthConfig { enabled: true, tokens: vec![token], ..AuthConfig::default() };
        let name = config.tokens[0].name.clone();
        caller_of(&config, &name).expect("the token")
    }

    #[test]
    fn the_most_specific_entry_decides_and_deny_wins_a_tie() {
        let caller = caller_with(TokenConfig {
            name: "reader".into(),
            consume: vec!["billing".into()],
            subscribe: Some(vec![]),
            acl: vec![
                entry("Topic:*", "Sub", "Allow", &[]),
                entry("Topic:secret-*", "Sub", "Deny", &[]),
                entry("Topic:secret-but-shared", "Sub", "Allow", &[]),
                entry("Topic:tie", "Sub", "Allow", &[]),
                entry("Topic:tie", "Sub", "Deny", &[]),
                entry("*", "All", "Deny", &[]),
            ],
            ..TokenConfig::default()
        });
        assert!(caller.may(Action::Subscribe("orders")), "Topic:* is more specific than *");
        assert!(!caller.may(Action::Subscribe("secret-payroll")), "a prefix is more specific than Topic:*");
        assert!(caller.may(Action::Subscribe("secret-but-shared")), "a literal is more specific than a prefix");
        assert!(!caller.may(Action::Subscribe("tie")), "deny wins at the same specificity");
        assert!(!caller.may(Action::Publish("orders")), "only `*` covers Pub, and it denies");
        assert!(caller.may(Action::Consume("billing")) && !caller.may(Action::Consume("other")));
        assert!(caller.may(Action::Subscribe("%RETRY%billing")), "a retry topic is its group's");
        assert!(!caller.may(Action::Subscribe("%RETRY%other")));
    }

    #[test]
    fn a_token_without_subscribe_reads_every_topic_and_with_it_only_those() {
        let legacy =
            caller_with(TokenConfig { name: "old".into(), consume: vec!["g".into()], ..TokenConfig::default() });
        assert!(legacy.may(Action::Subscribe("anything")));
        let scoped = caller_with(TokenConfig {
            name: "new".into(),
            consume: vec!["g".into()],
            subscribe: Some(vec!["orders-*".into()]),
            ..TokenConfig::default()
        });
        assert!(scoped.may(Action::Subscribe("orders-eu")) && !scoped.may(Action::Subscribe("payments")));
        assert!(!scoped.may(Action::Publish("orders-eu")));
    }

    #[test]
    fn a_source_network_entry_applies_only_to_callers_from_inside_it() {
        let caller = caller_with(TokenConfig {
            name: "office".into(),
            acl: vec![
                entry("Topic:orders", "Pub", "Allow", &["10.0.0.0/8"]),
                entry("Topic:audit", "Pub", "Deny", &["127.0.0.1/32"]),
            ],
            publish: vec!["audit".into()],
            ..TokenConfig::default()
        });
        let inside: IpAddr = "10.1.2.3".parse().expect("an address");
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().expect("an address");
        let outside: IpAddr = "192.168.0.1".parse().expect("an address");
        let local: IpAddr = "127.0.0.1".parse().expect("an address");
        assert!(!caller.may(Action::Publish("orders")), "no address known: a network entry does not apply");
        assert!(caller.clone().with_address(inside).may(Action::Publish("orders")));
        assert!(caller.clone().with_address(mapped).may(Action::Publish("orders")));
        assert!(!caller.clone().with_address(outside).may(Action::Publish("orders")));
        assert!(caller.clone().with_address(outside).may(Action::Publish("audit")));
        assert!(!caller.with_address(local).may(Action::Publish("audit")), "the literal deny from 127.0.0.1 wins");
    }

    #[test]
    fn acl_entries_are_checked_when_the_config_is() {
        let good = [("Topic:orders", "Pub"), ("Group:g-*", "sub"), ("*", "All"), ("topic:*", "Pub,Sub")];
        for (resource, actions) in good {
            assert!(AclEntry::parse(&entry(resource, actions, "Allow", &[])).is_ok(), "{resource} {actions}");
        }
        let bad =
            [("Topic:", "Pub"), ("Queue:q", "Pub"), ("Topic:a*b", "Pub"), ("Topic:a", "Get"), ("Topic:a b", "Sub")];
        for (resource, actions) in bad {
            assert!(AclEntry::parse(&entry(resource, actions, "Allow", &[])).is_err(), "{resource} {actions}");
        }
        assert!(AclEntry::parse(&entry("Topic:a", "Pub", "Maybe", &[])).is_err());
    }

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
        use crate::config::names::is_valid_pattern;
        assert!(is_valid_pattern("orders-*") && is_valid_pattern("*") && is_valid_pattern("%DLQ%g"));
        assert!(!is_valid_pattern("") && !is_valid_pattern("orders.*") && !is_valid_pattern("a b"));
    }
}
